"""Shared by the export tests: what the graphs hold, the engine's own prefill logits, prompt sets."""
from __future__ import annotations

import random

import numpy as np
import onnx
import torch

from splitserve.loading.onnx_export import OP_DOMAIN, OP_TYPE


def check_all(directory: str, names: list[str]) -> None:
    for name in names:
        onnx.checker.check_model(f"{directory}/{name}", full_check=True)


def graph_ops(path: str) -> list[tuple[str, str]]:
    model = onnx.load(path, load_external_data=False)
    return [(n.domain, n.op_type) for n in model.graph.node]


def assert_one_cut_per_layer(path: str, num_layers: int) -> None:
    """Exactly one BatchlessAttention node per layer (layer_idx 0..n-1) and no attention maths outside
    the op's function body."""
    model = onnx.load(path, load_external_data=False)
    cuts = [n for n in model.graph.node if (n.domain, n.op_type) == (OP_DOMAIN, OP_TYPE)]
    layer_idx = sorted(next(a.i for a in n.attribute if a.name == "layer_idx") for n in cuts)
    assert layer_idx == list(range(num_layers))
    ops = {op for _, op in graph_ops(path)}
    assert not ops & {"Softmax", "Attention", "MultiHeadAttention", "GroupQueryAttention"}
    assert [(f.domain, f.name) for f in model.functions] == [(OP_DOMAIN, OP_TYPE)]
    assert "Softmax" in {n.op_type for n in model.functions[0].node}


def inlined_session(path: str):
    """ONNX Runtime on the batchful graph with its local function inlined: no plugin anywhere."""
    import onnxruntime as ort
    from onnx.inliner import inline_local_functions
    model = inline_local_functions(onnx.load(path))
    assert not any(n.domain == OP_DOMAIN for n in model.graph.node)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run_prefill(session, embeds: torch.Tensor) -> np.ndarray:
    T = embeds.shape[0]
    logits, = session.run(None, {"inputs_embeds": embeds.numpy(), "positions": np.arange(T),
                                 "logits_indices": np.arange(T)})
    return logits


@torch.inference_mode()
def engine_prefill_logits(llm, ids: list[int]) -> torch.Tensor:
    """The torch engine's logits for every token of one prompt: its model and attention backend on
    the step layout of one fresh sequence (blocks 0.. of its pool, which is idle)."""
    from splitserve.attention.backend import AttentionMetadata
    from splitserve.attention.layer import ForwardContext, forward_context
    runner = llm.engine.runner
    T, bs = len(ids), runner.block_size
    nblocks = -(-T // bs)
    meta = AttentionMetadata(torch.arange(T), torch.tensor([0, T], dtype=torch.int32),
                             torch.tensor([T], dtype=torch.int32),
                             torch.arange(nblocks, dtype=torch.int32)[None], T, T,
                             torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32))
    with forward_context(ForwardContext(meta, runner.backend)):
        hidden = runner.model(torch.tensor(ids), torch.arange(T))
    return runner.model.compute_logits(hidden).float()


def shared_prefix_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """n prompts of 3..60 random tokens, half of them after one shared 40-token prefix (prefix hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(40)]
    return [(prefix if i % 2 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 60))]
            for i in range(n)]
