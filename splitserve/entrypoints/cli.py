"""`splitserve serve | generate | chat | bench` — the console script (also `python -m splitserve`)."""
from __future__ import annotations

import argparse
import logging
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .gguf file, or cached repo id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: from memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--attention-backend", default=None, choices=["torch_ref", "triton"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--random-weights", action="store_true", help="random weights from the config (benchmarks)")


def engine_args_from(args: argparse.Namespace):
    from splitserve.engine.llm_engine import EngineArgs
    return EngineArgs(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      block_size=args.block_size, num_blocks=args.num_blocks,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      enable_prefix_caching=args.enable_prefix_caching,
                      attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                      random_weights=args.random_weights,
                      served_model_name=getattr(args, "served_model_name", None))


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


def cmd_generate(args: argparse.Namespace) -> int:
    from splitserve.engine.llm import LLM
    llm = LLM(**vars(engine_args_from(args)))
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
    llm = LLM(**vars(engine_args_from(args)))
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


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="splitserve", description="Serve LLMs and VLMs, fast.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    from splitserve.entrypoints.openai.api_server import add_serve_args, run_server
    add_serve_args(serve)
    from splitserve.multimodal.media import add_media_args
    add_media_args(serve)
    serve.set_defaults(func=run_server)

    gen = sub.add_parser("generate", help="generate from prompts and print the outputs")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from splitserve.bench import cli as bench_cli, throughput
    bench_cli.register(bench_sub)
    throughput.register(bench_sub)

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
