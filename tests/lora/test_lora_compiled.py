"""The LoRA delta inside the compiled layer halves (Inductor on CPU, as compile_decoder_layers builds
them): the op reads the step layout from the static buffers, so new layouts, padded batches and new
slot weights run through the same compiled code without compiling again, and give what the eager
layer gives (the torch reference) — which the test also checks against a per-token definition."""
import numpy as np
import pytest
import torch
import transformers

from splitserve.lora.layers import attach_lora
from splitserve.lora.worker import LoRAWorker
from splitserve.models.decoder import DecoderForCausalLM

pytestmark = pytest.mark.slow  # Inductor compiles four graphs (~40 s on two cores)

S, R = 3, 8


def tiny_model(gen):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, vocab_size=100, max_position_embeddings=64)
    model = DecoderForCausalLM(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.1, generator=gen)
    lora = attach_lora(model, S, R, max_tokens=40)
    for w in lora.wrappers:
        w.lora_a.normal_(0, 0.1, generator=gen)
        w.lora_b.normal_(0, 0.1, generator=gen)
    return model, lora


def naive_qkv(layer, x, slots):
    """qkv_proj with each token's own adapter, token by token (float64)."""
    w = layer.self_attn.qkv_proj
    base = w.base(x).double()
    R_ = w.rank
    for t, s in enumerate(slots):
        if s < 0:
            continue
        col = 0
        for i, n in enumerate(w.shard_sizes):
            y = x[t].double() @ w.lora_a[s, i * R_:(i + 1) * R_].double().t()
            base[t, col:col + n] += y @ w.lora_b[s, col:col + n].double().t()
            col += n
    return base


def test_compiled_halves_follow_each_steps_layout_without_recompiling():
    from torch._dynamo.testing import CompileCounterWithBackend
    gen = torch.Generator().manual_seed(0)
    model, lora = tiny_model(gen)
    worker = LoRAWorker(lora)
    worker.slot_of = {5: 0, 6: 1, 7: 2}
    layer = model.layers[0]
    counter = CompileCounterWithBackend("inductor")
    halves = [(layer.attn_inputs, torch.compile(layer.attn_inputs, backend=counter, dynamic=True, fullgraph=True)),
              (layer.attn_outputs, torch.compile(layer.attn_outputs, backend=counter, dynamic=True, fullgraph=True))]
    # (row adapter ids, token counts, padding rows after the step's tokens)
    steps = [([5, 0, 6], [4, 3, 6], 0), ([7, 5], [1, 1], 6), ([6, 6, 0, 7], [9, 1, 1, 2], 3)]
    with torch.inference_mode():
        for k, (ids, counts, pad) in enumerate(steps):
            if k == 2:  # a new adapter in slot 1 between steps: copied in place, seen at once
                for w in lora.wrappers:
                    w.lora_b[1].normal_(0, 0.1, generator=gen)
            assert worker.prepare_step(np.array(ids), np.array(counts))
            T = sum(counts) + pad
            x, residual = (torch.randn(T, 64, generator=gen) for _ in range(2))
            for eager, compiled in halves:
                want, got = eager(x, residual), compiled(x, residual)
                for a, b in zip(want, got):
                    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            slots = np.repeat([worker.slot_of.get(i, -1) for i in ids], counts).tolist() + [-1] * pad
            normed, _ = layer.input_layernorm(x, residual)
            q, k_, v, _ = halves[0][1](x, residual)
            got_qkv = torch.cat([q, k_, v], dim=1).double()
            torch.testing.assert_close(got_qkv, naive_qkv(layer, normed, slots), rtol=1e-4, atol=1e-4)
        # Without adapters the flag is off: the variant without the op (one more compile each).
        assert not worker.prepare_step(np.array([0]), np.array([5]))
        x, residual = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
        q, k_, v, _ = halves[0][1](x, residual)
        normed, _ = layer.input_layernorm(x, residual)
        torch.testing.assert_close(torch.cat([q, k_, v], dim=1), layer.self_attn.qkv_proj.base(normed))
    # Each half compiled once with the delta for all three steps, attn_inputs once more without it.
    assert counter.frame_count == 3
