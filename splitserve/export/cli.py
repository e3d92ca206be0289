"""`splitserve export [MODEL] --output DIR`: the parser and the command (entrypoints/cli.py registers it)."""
from __future__ import annotations

import argparse

from splitserve.loading.onnx_export import PARTS


def register(sub) -> None:
    p = sub.add_parser("export", help="export the model to ONNX: the batchful part with the batchless cut as "
                                      "one ai.splitserve::BatchlessAttention node per layer")
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .gguf file or cached repo id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--output", "-o", required=True, help="directory to write the graphs, tokenizer and manifest to")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="weights and activations of the graphs (default: float32)")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset of the graphs (default: 18)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts to write (default: all of {','.join(PARTS)}; visual_encoder "
                        f"only for vision-language models)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights from the model's config (benchmarks of full-size shapes)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from splitserve.export.exporter import export_model, parse_parts
    manifest = export_model(args.model, args.output, args.dtype, args.opset, parse_parts(args.parts),
                            args.random_weights)
    print(f"wrote {', '.join(g['file'] for g in manifest['graphs'].values())} and {len(manifest['layers'])} "
          f"layers' manifest to {args.output}; serve it with `splitserve serve {args.output}`")
    return 0
