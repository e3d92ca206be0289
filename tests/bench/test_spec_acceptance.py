"""The bench client's mean acceptance length, read from a server's spec_decode counters (splitserve's or
vLLM's names)."""
from __future__ import annotations

import httpx

from splitserve.bench import serve


def _fake_metrics(monkeypatch, text: str):
    monkeypatch.setattr(serve.httpx, "get", lambda *a, **k: httpx.Response(200, text=text))


def test_acceptance_length_from_either_prefix(monkeypatch):
    _fake_metrics(monkeypatch, 'splitserve:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
                               'splitserve:spec_decode_num_accepted_tokens_total{model_name="m"} 15.0\n'
                               'splitserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0\n')
    before = serve.spec_decode_counters("http://x")
    assert before == (10.0, 15.0)
    _fake_metrics(monkeypatch, 'vllm:spec_decode_num_drafts_total{model_name="m"} 30.0\n'
                               'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 55.0\n')
    after = serve.spec_decode_counters("http://x")
    assert serve.acceptance_length(before, after) == 3.0
    _fake_metrics(monkeypatch, "splitserve:num_preemptions_total 0.0\n")
    assert serve.spec_decode_counters("http://x") is None
    assert serve.acceptance_length(None, after) is None and serve.acceptance_length(after, after) is None
