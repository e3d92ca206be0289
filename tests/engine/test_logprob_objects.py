"""Logprobs as vLLM's Logprob objects (logprob, rank, decoded_token): the sampler's rank of the sampled
token and the ranks of the top k, against a full sort of the distribution. CPU, no model."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from splitserve.engine.output_processor import OutputProcessor, RequestState
from splitserve.protocol.core_messages import EngineCoreOutput
from splitserve.layers.sampler import Sampler, SamplingMetadata
from splitserve.logprobs import Logprob, ranked
from splitserve.sampling_params import SamplingParams


def reference_rank(logprobs: torch.Tensor, token: int) -> int:
    """1 + the number of tokens strictly likelier than `token`, by a full descending sort."""
    order = torch.sort(logprobs, descending=True, stable=True)
    value = logprobs[token]
    return int((order.values > value).sum()) + 1


def test_logprob_is_the_float_and_carries_rank_and_text():
    lp = Logprob(-0.25, rank=3, decoded_token=" the")
    assert lp == -0.25 and lp.logprob == -0.25 and type(lp.logprob) is float
    assert lp.rank == 3 and lp.decoded_token == " the"
    assert lp + 1 == pytest.approx(0.75) and lp < 0 and str(lp) == "-0.25" and f"{lp:.1f}" == "-0.2"
    assert pytest.approx(-0.25) == lp
    back = pickle.loads(pickle.dumps(lp))
    assert (back, back.rank, back.decoded_token) == (-0.25, 3, " the")
    assert "rank=3" in repr(lp)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_sampler_ranks_the_sampled_token_among_all(k):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=g) * 3
    meta = SamplingMetadata(6, False, max_num_logprobs=k)
    meta.greedy = np.zeros(6, dtype=bool)
    meta.temperature = np.full(6, 2.0)  # hot: sampled tokens land far down the ranking
    meta.top_k = np.zeros(6, dtype=np.int64)
    meta.top_p = np.ones(6)
    meta.min_p = np.zeros(6)
    with torch.random.fork_rng():  # unseeded rows draw from the global RNG: leave it as it was
        torch.manual_seed(0)
        out = Sampler()(logits, meta)
    ref = torch.log_softmax(logits.float(), -1)
    for row in range(6):
        token = int(out.token_ids[row])
        assert int(out.logprob_ranks[row]) == reference_rank(ref[row], token)
    assert max(int(r) for r in out.logprob_ranks) > k + 1  # some sampled token was outside the top k


def test_ranks_of_an_engine_entry_match_a_full_sort():
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        lp = torch.log_softmax(torch.randn(100, generator=g), -1)
        k = trial % 6
        sampled = int(torch.randint(100, (1,), generator=g))
        # the entry as the worker builds it: the sampled token first, then the top k not already in
        entry = {sampled: float(lp[sampled])}
        for t in lp.topk(k).indices.tolist():
            entry.setdefault(t, float(lp[t]))
        got = ranked(entry, reference_rank(lp, sampled))
        assert list(got) == list(entry)
        for token, value in got.items():
            assert value.rank == reference_rank(lp, token), (trial, token)
            assert value.logprob == entry[token]


def test_output_processor_hands_out_ranked_logprobs():
    from splitserve.loading.resolve import load_tokenizer
    tok = load_tokenizer(None)
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=2, logprobs=1)
    proc.add_request(RequestState("r", None, [1, 2], params, (0,), 0.0, tok))
    outs, _ = proc.process([EngineCoreOutput("r", [7], [{7: -2.0, 9: -0.5}], new_logprob_ranks=[4])], 0.0)
    entry = outs[0].outputs[0].logprobs[0]
    assert entry[7] == -2.0 and entry[7].rank == 4  # the sampled token: the engine's rank
    assert entry[9] == -0.5 and entry[9].rank == 1
