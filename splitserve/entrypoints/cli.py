"""`splitserve serve | generate | chat | bench` — the console script (also `python -m splitserve`)."""
from __future__ import annotations

import argparse
import logging
import sys

from splitserve.engine_args import EngineArgs


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def sampling_params_from(args: argparse.Namespace):
    from splitserve.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def cmd_serve(args: argparse.Namespace) -> int:
    from splitserve.entrypoints.openai.api_server import run_server
    return run_server(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from splitserve.engine.llm import LLM
    llm = LLM(**vars(EngineArgs.from_namespace(args)))
    params = sampling_params_from(args)
    prompts = args.prompt
    if args.chat:
        outs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from splitserve.engine.llm import LLM
    llm = LLM(**vars(EngineArgs.from_namespace(args)))
    params = sampling_params_from(args)
    history: list[dict] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("splitserve chat — empty line or /exit to quit, /clear to reset the conversation", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if line.strip() in ("", "/exit", "/quit"):
            break
        if line.strip() == "/clear":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        engine = llm.engine
        rid = engine.add_request(None, llm.apply_chat_template(history), params)
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    piece = out.outputs[0].delta_text
                    reply += piece
                    print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="Serve LLMs and VLMs, fast.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    # The options only: the web stack is imported when the server runs, not to parse or print --help.
    from splitserve.entrypoints.openai.server_args import ServerArgs
    from splitserve.multimodal.media import MediaArgs
    EngineArgs.add_cli_args(serve)
    ServerArgs.add_cli_args(serve)
    MediaArgs.add_cli_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate from prompts and print the outputs")
    EngineArgs.add_cli_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    EngineArgs.add_cli_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from splitserve.bench import cli as bench_cli, throughput
    bench_cli.register(bench_sub)
    throughput.register(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
