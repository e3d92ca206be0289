"""One EAGLE-3 head step vs one target decode step, batch 1 (issue 36: a head step <= 0.08x a target step).

    python benchmarks/eagle_head_step.py            # GPU: Llama-3-8B shape, bf16, random weights
    python benchmarks/eagle_head_step.py --tiny     # CPU smoke run: tiny shapes, fp32

Target: the engine built from benchmarks/configs/llama3-8b with random weights (LLM(...,
random_weights=True)), its decode step as the engine runs it (the batch-1 decode CUDA graph when the
fast path has one, else the model eagerly) over a context of --context tokens. Head: a random EAGLE-3
head of the public shape (one layer with attention over 2 x hidden, fc over 3 x hidden, its own
LM head over a 32000-token draft vocabulary mapped to the target's), built by models/eagle.build_head
on the target, its layer halves compiled as the engine compiles them, its own paged cache. A head
step is what each of the k - 1 proposal forwards does: one token through the layer, the draft-vocab
logits, the argmax and the map to target ids. Timed eagerly and as the engine runs it (the head's
decode graphs, worker/eagle_head.HeadGraphs, padded to 2 like every batch-1 graph of the engine;
eager buffers on the CPU). Also the head's fill over 1 + k tokens (the collect-time forward after a
verify step that accepted everything).
Prints ms per call (back to back, synchronised at the end) and the ratio to the target step.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

CONFIG_8B = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "llama3-8b")
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}


def head_info(target_cfg, draft_vocab: int):
    """The HeadInfo of a random EAGLE-3 head of the public layout for this target (no files)."""
    from transformers import LlamaConfig

    from splitserve.models.eagle import HeadInfo
    c = target_cfg
    cfg = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=1,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      vocab_size=c.vocab_size, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      draft_vocab_size=draft_vocab)
    L = c.num_hidden_layers
    return HeadInfo("eagle3", "(random)", (), cfg, "midlayer.", (2, L // 2, L - 3), draft_vocab, has_embed=False,
                    has_lm_head=True, fc_bias=False, input_norm=False, has_d2t=True, norm_before_residual=False)


def decode_meta(positions: list[int], block_size: int, num_blocks: int, dev):
    """Metadata of one token per sequence at `positions` (sequence i's blocks: i * per, ...)."""
    from splitserve.attention.backend import AttentionMetadata
    S = len(positions)
    per = num_blocks // S
    pos = np.array(positions, dtype=np.int64)
    tables = (np.arange(S)[:, None] * per + np.arange(per)[None]).astype(np.int32)
    slots = tables[np.arange(S), pos // block_size].astype(np.int64) * block_size + pos % block_size
    qsl = torch.arange(S + 1, dtype=torch.int32)
    lens = torch.from_numpy((pos + 1).astype(np.int32))
    return AttentionMetadata(slot_mapping=torch.from_numpy(slots).to(dev), query_start_loc=qsl.to(dev),
                             seq_lens=lens.to(dev), block_tables=torch.from_numpy(tables).to(dev), max_query_len=1,
                             max_seq_len=int(lens.max()), query_start_loc_cpu=qsl, seq_lens_cpu=lens)


def fill_meta(start: int, n: int, block_size: int, num_blocks: int, dev):
    from splitserve.attention.backend import AttentionMetadata
    pos = np.arange(start, start + n)
    tables = np.arange(num_blocks, dtype=np.int32)[None]
    slots = tables[0, pos // block_size].astype(np.int64) * block_size + pos % block_size
    qsl = torch.tensor([0, n], dtype=torch.int32)
    lens = torch.tensor([start + n], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.from_numpy(slots).to(dev), query_start_loc=qsl.to(dev),
                             seq_lens=lens.to(dev), block_tables=torch.from_numpy(tables).to(dev), max_query_len=n,
                             max_seq_len=start + n, query_start_loc_cpu=qsl, seq_lens_cpu=lens), pos


def per_call_ms(fn, iters: int, sync) -> float:
    for _ in range(5):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke run of the script)")
    ap.add_argument("--context", type=int, default=512, help="tokens before the decoded one")
    ap.add_argument("--k", type=int, default=4, help="drafts per step (the fill runs 1 + k tokens)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()

    from splitserve import LLM
    from splitserve.attention.layer import ForwardContext, forward_context
    from splitserve.models.eagle import build_head
    from splitserve.worker.eagle_head import HeadGraphs
    from splitserve.worker.model_runner import compile_decoder_layers

    if args.tiny:
        tmp = tempfile.mkdtemp(prefix="eagle-bench-")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(TINY, f)
        config, dtype, draft_vocab, iters = tmp, "float32", 256, min(args.iters, 20)
        kw = dict(device="cpu", cpu_kv_cache_gib=0.05)
    else:
        config, dtype, draft_vocab, iters = CONFIG_8B, "bfloat16", args.draft_vocab, args.iters
        kw = dict(gpu_memory_utilization=0.85)
    t0 = time.perf_counter()
    llm = LLM(config, random_weights=True, dtype=dtype, max_model_len=max(2048, args.context + 64), max_num_seqs=16,
              **kw)
    core = getattr(llm.engine, "core", None)
    runner = core.executor.runner if core is not None else llm.engine.runner
    print(f"target engine built in {time.perf_counter() - t0:.1f} s")
    model, dev, bs = runner.model, runner.device, runner.block_size
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tdtype = getattr(torch, dtype)

    # -- the target's decode step, as the engine runs it ----------------------------------------------
    num_blocks = runner.kv_caches[0].shape[0]
    need = -(-(args.context + args.k + 2) // bs)
    assert num_blocks >= need, f"KV cache of {num_blocks} blocks < {need}"
    meta = decode_meta([args.context], bs, need, dev)
    ids = torch.tensor([1000 % TINY["vocab_size"] if args.tiny else 1000], device=dev)
    pos = torch.tensor([args.context], device=dev)
    if runner.graphs is not None and runner.graphs.padded_size(1) is not None:
        target_kind = f"decode CUDA graph (padded to {runner.graphs.padded_size(1)})"

        def target_step():
            return runner.graphs.run(1, ids, pos, meta)
    else:
        target_kind = "eager"

        def target_step():
            with forward_context(ForwardContext(meta, runner.backend)):
                return model.compute_logits(model(ids, pos))
    with torch.inference_mode():
        target_ms = per_call_ms(target_step, iters, sync)

    # -- the head ------------------------------------------------------------------------------------
    info = head_info(model.config, draft_vocab)
    head = build_head(info, model, tdtype, dev, runner.config.model.max_model_len, random_weights=True)
    attn = head.layers[0].self_attn.attn
    attn.kv_cache = torch.zeros(need, 2, bs, attn.num_kv_heads, attn.head_dim, dtype=runner.kv_cache_dtype, device=dev)
    if cuda:
        compile_decoder_layers(head)
    H = model.config.hidden_size
    gen = torch.Generator(device=dev).manual_seed(0)
    feature = torch.randn(1, H, device=dev, dtype=tdtype, generator=gen)
    aux = torch.randn(1 + args.k, 3 * H, device=dev, dtype=tdtype, generator=gen)
    tok = torch.tensor([5], device=dev)

    def head_step():
        with forward_context(ForwardContext(meta, runner.backend)):
            x, fed = head(tok, pos, feature)
        return head.draft_to_target[head.compute_logits(x).argmax(dim=-1)], fed

    fmeta, fpos = fill_meta(args.context - args.k, 1 + args.k, bs, need, dev)
    ftok = torch.full((1 + args.k,), 5, device=dev)
    fpos_t = torch.from_numpy(fpos).to(dev)

    def head_fill():
        with forward_context(ForwardContext(fmeta, runner.backend)):
            x, fed = head(ftok, fpos_t, aux)
        return head.draft_to_target[head.compute_logits(x[-1:]).argmax(dim=-1)], fed

    rows = [("target decode step", target_kind, target_ms)]
    with torch.inference_mode():
        rows.append(("head step", "eager" + (", compiled layer halves" if cuda else ""),
                     per_call_ms(head_step, iters, sync)))
        rows.append((f"head fill of {1 + args.k} tokens", "eager", per_call_ms(head_fill, iters, sync)))
        graphs = HeadGraphs(head, runner.backend, [2], runner.max_blocks_per_seq, runner.config.model.max_model_len,
                            attn.num_kv_heads, dev, use_graphs=cuda)
        if cuda:
            graphs.capture(torch.cuda.graph_pool_handle(), torch.cuda.Stream())

        def head_step_graph():
            logits, fed = graphs.run_head(1, tok, pos, meta, feature)
            return head.draft_to_target[logits.argmax(dim=-1)], fed
        rows.append(("head step", "engine: HeadGraphs" + (" (CUDA graph of 2)" if cuda else " (eager buffers)"),
                     per_call_ms(head_step_graph, iters, sync)))
    name = "tiny (CPU smoke)" if args.tiny else "Llama-3-8B shape, bf16, random weights"
    print(f"\n{name}; batch 1, context {args.context}; EAGLE-3 head hidden {H}, draft vocab {draft_vocab}")
    print(f"{'what':24s} {'how':40s} {'ms/call':>9s} {'x target':>9s}")
    for what, how, ms in rows:
        print(f"{what:24s} {how:40s} {ms:9.3f} {ms / target_ms:9.3f}")
    print("\nissue 36's bar: a head step <= 0.08 x a target step")


if __name__ == "__main__":
    main()
