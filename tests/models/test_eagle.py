"""EAGLE and EAGLE-3 heads (models/eagle.py, worker/eagle_head.py) on a tiny random Llama target, fp32.

The heads are random and written by the test in the layouts the public checkpoints ship in
(config.json + pytorch_model.bin or model.safetensors with the public tensor names; EAGLE-3 with a
draft vocabulary half the target's and its d2t / t2d maps). Checked:
- greedy tokens equal speculation off for several concurrent prompts (the verification's job), the
  mean acceptance printed (random heads accept little);
- every draft the engine proposes equals an independent reference's: transformers' target gives the
  features (hidden_states), a plain-torch head recomputes the whole sequence without a cache and
  extends it k times (this checks the features, the shift by one, the head's cache after rejections,
  and the draft-vocabulary map);
- a head whose drafts are the target's own greedy tokens (its drafting replaced by a replay) is
  accepted in full, so the machinery accepts what matches;
- sampling at temperature 1 runs with q over the mapped vocabulary (outputs well formed);
- bad head directories are a ValueError at start-up.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from splitserve.engine.llm import LLM
from splitserve.loading.resolve import load_tokenizer
from splitserve.sampling_params import SamplingParams
from tests.hf_reference import make_tiny_llama_dir

VOCAB, H, HEADS, KV_HEADS, INTER, LAYERS = 96, 64, 4, 2, 128, 6
K = 3
TINY = dict(max_model_len=128, cpu_kv_cache_gib=0.05, max_num_seqs=8, tokenizer=None, seed=0, dtype="float32")
PROMPTS = [[1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], [9, 9, 9, 9, 4, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
           [3, 30, 31, 32, 30, 31]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def head_config(method: str, draft_vocab: int | None = None) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM" if method == "eagle" else "LlamaForCausalLMEagle3"],
           "model_type": "llama", "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
           "max_position_embeddings": 64, "hidden_act": "silu", "rope_theta": 10000.0, "torch_dtype": "float32"}
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = draft_vocab
    return cfg


def head_tensors(method: str, seed: int, draft_ids: np.ndarray | None = None, embed: bool = False) -> dict:
    """Random tensors under the public names (scaled so that the layer matters)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.15):
        return torch.randn(*shape, generator=g) * scale

    hd = H // HEADS
    attn_in = H if method == "eagle" else 2 * H
    p = "layers.0." if method == "eagle" else "midlayer."
    t = {p + "self_attn.q_proj.weight": r(HEADS * hd, attn_in),
         p + "self_attn.k_proj.weight": r(KV_HEADS * hd, attn_in),
         p + "self_attn.v_proj.weight": r(KV_HEADS * hd, attn_in), p + "self_attn.o_proj.weight": r(H, HEADS * hd),
         p + "mlp.gate_proj.weight": r(INTER, H), p + "mlp.up_proj.weight": r(INTER, H),
         p + "mlp.down_proj.weight": r(H, INTER), p + "post_attention_layernorm.weight": 1 + r(H, scale=0.2)}
    if method == "eagle":
        t["fc.weight"], t["fc.bias"] = r(H, 2 * H), r(H, scale=0.1)
    else:
        t["fc.weight"] = r(H, 3 * H, scale=0.1)
        t[p + "input_layernorm.weight"] = 1 + r(H, scale=0.2)
        t[p + "hidden_norm.weight"] = 1 + r(H, scale=0.2)
        t["norm.weight"] = 1 + r(H, scale=0.2)
        t["lm_head.weight"] = r(len(draft_ids), H, scale=1.0)
        t["d2t"] = torch.from_numpy(draft_ids - np.arange(len(draft_ids))).long()
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[torch.from_numpy(draft_ids)] = True
        t["t2d"] = t2d
    if embed:
        t["embed_tokens.weight"] = r(VOCAB, H, scale=1.0)
    return t


def draft_ids(seed: int) -> np.ndarray:
    """A draft vocabulary of half the target's tokens (sorted ids, as the public maps have them)."""
    return np.sort(np.random.default_rng(seed).choice(VOCAB, VOCAB // 2, replace=False))


def write_head(path, method: str, seed: int = 7, fmt: str = "bin", embed: bool = False) -> str:
    os.makedirs(path, exist_ok=True)
    ids = draft_ids(seed) if method == "eagle3" else None
    tensors = head_tensors(method, seed, ids, embed)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(head_config(method, None if ids is None else len(ids)), f)
    if fmt == "bin":
        torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("eagle-target"), load_tokenizer(None), num_kv_heads=2,
                               tie=False, seed=3, vocab_size=VOCAB, num_hidden_layers=LAYERS, initializer_range=0.1)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-heads")
    return {"eagle": write_head(root / "eagle1", "eagle", fmt="bin"),
            "eagle3": write_head(root / "eagle3", "eagle3", fmt="safetensors")}


@pytest.fixture(scope="module")
def off(target_dir):
    outs = LLM(target_dir, **TINY).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# -- an independent reference: transformers' target, a plain-torch head without a cache ---------------
def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def reference_head(t: dict, method: str, embed, lm_head, tokens, feats):
    """Outputs (logits' input, fed back) at every position of a whole sequence: tokens[p] is token
    p + 1, feats[p] the feature of position p (causal attention over all of it, no cache)."""
    p = "layers.0." if method == "eagle" else "midlayer."
    e = embed[tokens]
    hd = H // HEADS
    if method == "eagle":
        x = torch.cat([e, feats], -1) @ t["fc.weight"].T + t["fc.bias"]
        a, residual = x, x
    else:
        f = feats if feats.shape[-1] == H else feats @ t["fc.weight"].T
        a = torch.cat([_rms(e, t[p + "input_layernorm.weight"]), _rms(f, t[p + "hidden_norm.weight"])], -1)
        residual = f
    n = len(tokens)
    pos = torch.arange(n)
    q = _rope((a @ t[p + "self_attn.q_proj.weight"].T).view(n, HEADS, hd), pos)
    k = _rope((a @ t[p + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, hd), pos)
    v = (a @ t[p + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, hd)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * hd) @ t[p + "self_attn.o_proj.weight"].T
    h = residual + o
    m = _rms(h, t[p + "post_attention_layernorm.weight"])
    h = h + (torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
        @ t[p + "mlp.down_proj.weight"].T
    if method == "eagle":
        return h @ lm_head.T, h
    return _rms(h, t["norm.weight"]) @ t["lm_head.weight"].T, h


def reference_drafts(hf, t: dict, method: str, seq: list[int], k: int) -> list[int]:
    """The k greedy drafts after `seq` (its tokens known, the target's features of all but the last)."""
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_hidden_states=True)
        hs = out.hidden_states
        if method == "eagle":
            feats = hs[-1][0, :-1]
        else:
            L = LAYERS
            feats = torch.cat([hs[i][0, :-1] for i in (2, L // 2, L - 3)], -1)
        embed, lm_head = t.get("embed_tokens.weight", hf.model.embed_tokens.weight), hf.lm_head.weight
        tokens = list(seq[1:])
        d2t = t.get("d2t")
        drafts = []
        for _ in range(k):
            logits, fed = reference_head(t, method, embed, lm_head, torch.tensor(tokens), feats)
            d = int(logits[-1].argmax())
            d = d + int(d2t[d]) if d2t is not None else d
            drafts.append(d)
            tokens.append(d)
            feats = torch.cat([feats if method == "eagle" or feats.shape[-1] == H else
                               feats @ t["fc.weight"].T, fed[-1:]], 0)
        return drafts


def _record_proposals(llm, oracle: dict | None = None):
    """Wraps the head's fill_and_propose: logs (the sequence's known tokens, the head's drafts) per
    proposal. With `oracle` ({prompt: greedy output tokens}) the drafts verified are the target's own
    continuation instead, every third one made wrong: runs of accepted drafts exercise the head's
    fill over several positions, while its own drafts are still logged."""
    runner = llm.engine.core.executor.runner
    drafter, log = runner.drafter, []
    orig = drafter.fill_and_propose
    counter = [0]

    def wrapped(ib, step, propose):
        drafts = orig(ib, step, propose)
        for state in step.sample_requests:
            if state.req_id not in drafts:
                continue
            row = state.row
            seq = ib.token_ids[row, :ib.num_known[row]].tolist()
            log.append((seq, drafts[state.req_id]))
            if oracle is not None:
                out = oracle[tuple(state.prompt_token_ids)]
                done = len(seq) - len(state.prompt_token_ids)
                replay = list(out[done:done + K])
                for j in range(len(replay)):
                    counter[0] += 1
                    if counter[0] % 3 == 0:
                        replay[j] = (replay[j] + 1) % VOCAB
                if replay:
                    drafts[state.req_id] = replay
                else:
                    del drafts[state.req_id]
        return drafts
    drafter.fill_and_propose = wrapped
    return log


def _spec(method, path, **kw) -> dict:
    """The speculative config; an adaptive draft count (where the engine has one) is off: these tests
    check the head's machinery at every step, whatever it accepts."""
    from splitserve.config import _SPECULATIVE_KEYS
    cfg = {"method": method, "model": str(path), "num_speculative_tokens": K, **kw}
    if "adaptive" in _SPECULATIVE_KEYS:
        cfg["adaptive"] = False
    return cfg


def _acceptance(llm) -> tuple[int, int]:
    s = llm.engine.core.scheduler
    return s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def _graph_paths(llm) -> None:
    """The runner's decode and piecewise graphs as the CUDA fast path sets them up (for EAGLE: the
    features kept by the graphs), run eagerly on their static buffers (use_graphs=False)."""
    from splitserve.worker.cuda_graphs import DecodeGraphs, PiecewiseGraphs
    r = llm.engine.core.executor.runner
    r.graphs = DecodeGraphs(r.model, r.backend, [1, 2, 4, 8], r.max_blocks_per_seq, TINY["max_model_len"],
                            r.kv_layout()[1], r.device, use_graphs=False, block_size=r.block_size,
                            features=r.drafter.graph_features)
    r.piecewise = PiecewiseGraphs(r.model, [16, 32, 64, 128], r.device, use_graphs=False,
                                  aux_layers=r.drafter.aux_layers)
    r.drafter.setup_graphs([2, 4], TINY["max_model_len"], use_graphs=False)  # the head's proposal forwards


@pytest.mark.parametrize("variant", ["plain", "oracle", "async_preempt", "graphs"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_equals_speculation_off_and_drafts_equal_the_reference(target_dir, heads, off, method, variant):
    from transformers import AutoModelForCausalLM
    kw = dict(TINY)
    if variant == "async_preempt":  # a pool small enough for preemptions (the head's cache refilled)
        del kw["cpu_kv_cache_gib"]
        kw.update(async_scheduling=True, num_blocks=7, block_size=8, max_num_batched_tokens=10)  # chunked prompts
    spec = _spec(method, heads[method])
    params, want = GREEDY, off
    if variant == "graphs":  # 4 running: no drafts (pure decode steps, decode graphs); 2 left: drafts
        spec["disable_by_batch_size"] = 3
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 12, 24, 24)]
        want = [o[:n] for o, n in zip(off, (8, 12, 24, 24))]
    llm = LLM(target_dir, speculative_config=spec, **kw)
    if variant == "graphs":
        _graph_paths(llm)
    oracle = {tuple(p): o for p, o in zip(PROMPTS, off)} if variant == "oracle" else None
    log = _record_proposals(llm, oracle)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted, accepted = _acceptance(llm)
    print(f"\n{method} {variant}: {accepted}/{drafted} drafts accepted, mean acceptance length "
          f"{1 + accepted / max(1, drafted / K):.2f}")
    assert drafted > 0 and len(log) > (4 if variant == "graphs" else 10)
    if variant == "oracle":
        assert accepted > drafted // 3
    if variant == "async_preempt":
        assert llm.engine.core.scheduler.num_preemptions > 0
    if variant == "graphs":
        paths = llm.engine.core.executor.runner.steps_by_path
        assert paths["decode_graph"] > 5 and paths["piecewise"] > 5 and paths["eager"] == 0, paths
        assert llm.engine.core.executor.runner.drafter.graphs.logits is not None  # the head's graphs ran
    assert llm.engine.kv_manager.pool.is_whole()
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    t = head_tensors(method, 7, draft_ids(7) if method == "eagle3" else None)
    for seq, drafts in log[:: max(1, len(log) // 12)]:
        assert drafts == reference_drafts(hf, t, method, seq, K), seq


def test_sampling_with_the_mapped_draft_vocabulary(target_dir, heads):
    """Temperature 1 with an EAGLE-3 head: each sampled draft has q > 0 in q's row (q over the
    target's vocabulary, zero outside the draft vocabulary), rows sum to 1, and outputs are whole."""
    llm = LLM(target_dir, speculative_config=_spec("eagle3", heads["eagle3"]), **TINY)
    drafter = llm.engine.core.executor.runner.drafter
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[torch.from_numpy(draft_ids(7))] = False
    checked = [0]
    orig = drafter.draft_probs

    def draft_probs(states, drafts, layout, vocab):
        q = orig(states, drafts, layout, vocab)
        if q is not None:
            for d, start in zip(drafts, layout.row_start.tolist()):
                for j, tok in enumerate(d):
                    row = q[start + j]
                    assert abs(float(row.sum()) - 1) < 1e-4 and float(row[tok]) > 0 and float(row[outside].sum()) == 0
                    checked[0] += 1
        return q
    drafter.draft_probs = draft_probs
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=4, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert all(len(o.token_ids) == 12 and all(0 <= t < VOCAB for t in o.token_ids) for r in outs for o in r.outputs)
    assert checked[0] > 20
    assert llm.engine.kv_manager.pool.is_whole()




@pytest.mark.parametrize("case", ["no_config", "wrong_method", "hidden", "extra_tensor", "missing_tensor", "no_d2t",
                                  "aux_layers", "arch"])
def test_bad_head_directories_fail_at_start_up(target_dir, tmp_path, case):
    from safetensors.torch import load_file, save_file
    method = "eagle3"
    path = write_head(tmp_path / "head", "eagle3", fmt="safetensors")
    cfg_path, w_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    cfg, tensors = json.load(open(cfg_path)), load_file(w_path)
    expect = {"no_config": "no config.json", "wrong_method": "use method 'eagle3'", "hidden": "hidden_size",
              "extra_tensor": "unexpected tensors", "missing_tensor": "missing tensors", "no_d2t": "needs d2t",
              "aux_layers": "auxiliary target layers", "arch": "not a known"}[case]
    if case == "no_config":
        os.remove(cfg_path)
    elif case == "wrong_method":
        method = "eagle"
        cfg["architectures"] = ["LlamaForCausalLM"]
    elif case == "hidden":
        cfg["hidden_size"] = 2 * H
    elif case == "extra_tensor":
        tensors["layers.1.mlp.down_proj.weight"] = tensors["midlayer.mlp.down_proj.weight"].clone()
    elif case == "missing_tensor":
        del tensors["midlayer.hidden_norm.weight"], tensors["midlayer.mlp.up_proj.weight"]
        tensors["midlayer.other_norm.weight"] = tensors["norm.weight"].clone()  # still recognisably EAGLE-3: fc over 3H
    elif case == "no_d2t":
        del tensors["d2t"]
    elif case == "aux_layers":
        cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, LAYERS]
    elif case == "arch":
        cfg["architectures"] = ["MistralForCausalLM"]
    if case != "no_config":
        json.dump(cfg, open(cfg_path, "w"))
    save_file(tensors, w_path)
    with pytest.raises(ValueError, match=expect):
        LLM(target_dir, speculative_config=_spec(method, path), **TINY)


def test_eagle_head_with_its_own_embedding_and_lm_head(target_dir, tmp_path, off):
    """An EAGLE head in safetensors with embed_tokens and lm_head (as vLLM's conversion writes it:
    the target's LM head copied in): loaded as the head's own; greedy and drafts as the reference."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    path = write_head(tmp_path / "head", "eagle", seed=9, fmt="safetensors", embed=True)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["lm_head.weight"] = hf.lm_head.weight.detach().clone()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    llm = LLM(target_dir, speculative_config=_spec("eagle", path), **TINY)
    assert llm.engine.core.executor.runner.drafter.head.embed_tokens is not None
    log = _record_proposals(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == off[:2]
    t = head_tensors("eagle", 9, embed=True)
    for seq, drafts in log[:: max(1, len(log) // 6)]:
        assert drafts == reference_drafts(hf, t, "eagle", seq, K), seq
