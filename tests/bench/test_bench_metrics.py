"""Summary figures from hand-made request results with known answers."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from splitserve.bench.metrics import RequestResult, compute_metrics, format_table, peak_concurrency


def _ok(ttft, itl, out, start=0.0, prompt=10):
    e2e = ttft + sum(itl)
    return RequestResult(success=True, prompt_len=prompt, output_len=out, ttft=ttft, itl=list(itl), e2e=e2e, start=start)


def test_tpot_is_decode_time_per_token_after_the_first():
    r = _ok(0.5, [0.1, 0.1, 0.1, 0.1], 5)
    assert r.tpot == pytest.approx((0.9 - 0.5) / 4)
    # a chunk carrying several tokens: 2 gaps of 0.2 s for 5 tokens still gives 0.1 s/token
    r = _ok(0.5, [0.2, 0.2], 5)
    assert r.tpot == pytest.approx(0.1)
    assert _ok(0.5, [], 1).tpot is None                       # one token: no decode step to time
    assert RequestResult(success=False, output_len=5).tpot is None


def test_compute_metrics_known_values():
    results = [_ok(0.1, [0.01] * 9, 10, start=0.0), _ok(0.3, [0.03] * 9, 10, start=0.5),
               RequestResult(success=False, error="HTTP 500: boom", start=0.2, e2e=0.1),
               RequestResult(success=False, error="HTTP 500: boom", start=0.3, e2e=0.1),
               RequestResult(success=False, error="ReadTimeout", start=0.4, e2e=0.1)]
    m = compute_metrics(results, duration=2.0)
    assert (m.completed, m.failed) == (2, 3)
    assert m.total_input_tokens == 20 and m.total_output_tokens == 20  # failures do not count
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(10.0)
    assert m.total_token_throughput == pytest.approx(20.0)
    assert m.ttft.mean == pytest.approx(0.2) and m.ttft.median == pytest.approx(0.2)
    assert m.ttft.p90 == pytest.approx(np.percentile([0.1, 0.3], 90))
    assert m.tpot.mean == pytest.approx(0.02)
    assert m.itl.count == 18 and m.itl.median == pytest.approx(0.02)
    assert m.itl.p99 == pytest.approx(0.03)
    assert m.e2e.mean == pytest.approx((0.19 + 0.57) / 2)
    assert m.errors == {"HTTP 500: boom": 2, "ReadTimeout": 1}


def test_all_failed_gives_no_latency_and_valid_json():
    m = compute_metrics([RequestResult(error="x")], duration=1.0)
    assert m.completed == 0 and math.isnan(m.ttft.mean)
    d = m.to_dict()
    assert d["ttft"]["mean"] is None
    json.dumps(d, allow_nan=False)  # the saved file must be strict JSON
    assert "n/a" in format_table(m)


def test_peak_concurrency():
    rs = [RequestResult(start=0.0, e2e=1.0), RequestResult(start=0.5, e2e=1.0), RequestResult(start=1.0, e2e=1.0),
          RequestResult(start=3.0, e2e=0.5)]
    assert peak_concurrency(rs) == 2  # the first ends exactly when the third starts


def test_table_lists_every_figure_and_errors():
    m = compute_metrics([_ok(0.1, [0.01] * 3, 4), RequestResult(error="HTTP 404: model not found")], 1.0)
    table = format_table(m)
    for label in ("Successful requests:", "Failed requests:", "Benchmark duration (s):",
                  "Request throughput (req/s):", "Output token throughput (tok/s):", "Total token throughput (tok/s):"):
        assert label in table
    for metric in ("TTFT", "TPOT", "ITL", "E2E"):
        for stat in ("Mean", "Median", "P90", "P99"):
            assert f"{stat} {metric} (ms):" in table
    assert "1 x HTTP 404: model not found" in table
