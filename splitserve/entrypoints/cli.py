"""`splitserve serve | generate | chat | bench | export` — the console script (also `python -m splitserve`)."""
from __future__ import annotations

import argparse
import logging
import sys

from splitserve.engine.args import EngineArgs


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    # --seed is an engine option (EngineArgs.seed); the requests use it too.
    g = p.add_argument_group("sampling options")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (default: 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0: off (default: 0)")


def sampling_params_from(args: argparse.Namespace):
    from splitserve.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def cmd_serve(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_namespace(args)
    if engine_args.node_rank > 0:  # another host of a multi-node model: its ranks only, no API
        from splitserve.executor.launcher import run_headless
        return run_headless(engine_args.create_engine_config())  # bad arguments fail here, before any process starts
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
    from splitserve.entrypoints.terminal_chat import chat_loop
    llm = LLM(**vars(EngineArgs.from_namespace(args)))
    return chat_loop(llm, sampling_params_from(args), args.system)


def build_parser() -> argparse.ArgumentParser:
    from splitserve import __version__
    parser = argparse.ArgumentParser(prog="splitserve", description="Serve LLMs and VLMs, fast.")
    parser.add_argument("--version", action="version", version=f"splitserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--version", action="version", version=f"splitserve {__version__}")
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
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template (default: off)")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    EngineArgs.add_cli_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    chat.set_defaults(func=cmd_chat)

    # Listed for --help only: main() hands `splitserve router ...` to the router's own parser, whose
    # unknown flags go on to vllm-router.
    sub.add_parser("router", add_help=False,
                   help="one endpoint in front of many servers (vLLM's router; `splitserve router --help`)")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from splitserve.bench import cli as bench_cli, throughput
    bench_cli.register(bench_sub)
    throughput.register(bench_sub)
    from splitserve.export import cli as export_cli
    export_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO (the bench client sends thousands).
    logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["router"]:  # a pure HTTP process: none of the engine's flags, no vLLM-flag check
        from splitserve.entrypoints.router.launcher import main as router_main
        return router_main(argv[1:])
    parser = build_parser()
    from splitserve.engine.vllm_flags import find_unsupported, leaf_parser, message
    unsupported = find_unsupported(parser, argv)
    if unsupported is not None:  # one line, not argparse's usage dump
        print(f"{leaf_parser(parser, argv).prog}: error: {message(unsupported)}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
