"""An exported directory (`splitserve export`): its file names and manifest, read without onnx.

The manifest (`splitserve_export.json`) says what each graph takes and returns, the layer count, the
head layout, the rotary table and the dtype. export/exporter.py writes it; worker/onnx_runner.py reads
it; the engine's config builder recognises an exported directory by it. Here, below both, so the
runner (below export/) and the writer share one definition."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

MANIFEST = "splitserve_export.json"
FORMAT = "splitserve-onnx-export"
VERSION = 1
BATCHFUL, EMBED_TOKENS, VISUAL_ENCODER = "batchful.onnx", "embed_tokens.onnx", "visual_encoder.onnx"
BATCHLESS_PREFILL, BATCHLESS_DECODE = "batchless_prefill.onnx", "batchless_decode.onnx"
# The op at the cut (export/attention_graph.py defines it in plain ONNX; attention/onnx_plugin.py serves it)
OP_DOMAIN, OP_TYPE, OP_VERSION = "ai.splitserve", "BatchlessAttention", 1
PARTS = ("batchful", "batchless", "embed_tokens", "visual_encoder")


@dataclass(frozen=True)
class ExportManifest:
    directory: str
    dtype: str                 # "float32", "float16" or "bfloat16": every graph's activations
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    windows: tuple[int, ...]   # each layer's sliding window (0: none)
    files: dict                # part -> file name, for the parts exported
    raw: dict                  # the whole manifest

    def path(self, part: str) -> str | None:
        name = self.files.get(part)
        return None if name is None else os.path.join(self.directory, name)


def is_export_dir(directory: str | None) -> bool:
    return bool(directory) and os.path.isfile(os.path.join(directory, MANIFEST))


def read_manifest(directory: str) -> ExportManifest:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable splitserve export manifest ({e})") from None
    if raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise ValueError(f"{path}: format {raw.get('format')!r} version {raw.get('version')!r}; this splitserve "
                         f"reads {FORMAT!r} version {VERSION}: export the model again")
    heads = raw["heads"]
    files = {part: g["file"] for part, g in raw["graphs"].items()}
    for part, name in files.items():
        if not os.path.isfile(os.path.join(directory, name)):
            raise ValueError(f"{directory}: the manifest lists {name} ({part}) but the file is missing")
    if "batchful" not in files or "embed_tokens" not in files:
        raise ValueError(f"{directory}: serving needs the batchful and embed_tokens graphs; export them "
                         f"(--parts batchful,embed_tokens)")
    return ExportManifest(os.path.abspath(directory), raw["dtype"], raw["num_layers"], heads["num_heads"],
                          heads["num_kv_heads"], heads["head_dim"], raw["hidden_size"], raw["vocab_size"],
                          tuple(layer["sliding_window"] for layer in raw["layers"]), files, raw)
