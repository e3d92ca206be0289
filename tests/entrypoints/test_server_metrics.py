"""Server metrics from known timestamps and counts: request phases, step sizes, n, the cache's
configuration, the `vllm:` names, and the periodic stats line. No model, no server."""
from __future__ import annotations

import pytest

from splitserve.engine.async_engine import RequestStream
from splitserve.protocol.core_messages import SchedulerStats
from splitserve.engine.output_processor import CompletionOutput, RequestOutput
from splitserve.metrics import ServerMetrics, StatsLogger

CACHE = {"block_size": "16", "num_gpu_blocks": "100", "enable_prefix_caching": "True",
         "gpu_memory_utilization": "0.9", "cache_dtype": "auto"}


def sample(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series, _, label_text = head.partition("{")
        if series == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    return None


def output(rid, prompt_len, tokens: list[list[int]], finished=False, reason=None, queue_time=None):
    outs = [CompletionOutput(index=i, token_ids=list(t), delta_token_ids=list(t[-1:]) if t else [],
                             finish_reason=reason if finished else None) for i, t in enumerate(tokens)]
    return RequestOutput(rid, None, list(range(prompt_len)), outs, finished, queue_time=queue_time)


def run_request(m: ServerMetrics):
    """Arrives at 100.0, scheduled at 100.5 (queue 0.5), first token at 101.25, last at 103.0; n=2."""
    stream = RequestStream("r", 100.0)
    m.on_output(stream, output("r", 7, [[5], [6]], queue_time=0.5), 101.25)
    m.on_output(stream, output("r", 7, [[5, 8], [6, 9]]), 102.0)
    m.on_output(stream, output("r", 7, [[5, 8, 1], [6, 9, 2]], finished=True, reason="length"), 103.0)


def test_request_phases_and_counts():
    m = ServerMetrics("m", SchedulerStats, max_model_len=512, cache_info=CACHE)
    run_request(m)
    m.on_step_tokens([7, 7, 2, 2])
    text = m.render().decode()
    for name, total in [("queue_time", 0.5), ("prefill_time", 0.75), ("decode_time", 1.75),
                        ("inference_time", 2.5)]:
        assert sample(text, f"splitserve:request_{name}_seconds_count", model_name="m") == 1, name
        assert sample(text, f"splitserve:request_{name}_seconds_sum", model_name="m") == pytest.approx(total), name
    assert sample(text, "splitserve:e2e_request_latency_seconds_sum") == pytest.approx(3.0)
    assert sample(text, "splitserve:request_params_n_sum") == 2
    assert sample(text, "splitserve:request_params_n_bucket", le="1.0") == 0
    assert sample(text, "splitserve:request_params_n_bucket", le="2.0") == 1
    assert sample(text, "splitserve:request_prompt_tokens_sum") == 7
    assert sample(text, "splitserve:request_generation_tokens_sum") == 6
    assert sample(text, "splitserve:iteration_tokens_total_count") == 4
    assert sample(text, "splitserve:iteration_tokens_total_sum") == 18
    assert sample(text, "splitserve:iteration_tokens_total_bucket", le="1.0") == 0
    assert sample(text, "splitserve:iteration_tokens_total_bucket", le="8.0") == 4
    assert sample(text, "splitserve:request_success_total", finished_reason="length") == 1
    assert sample(text, "splitserve:generation_tokens_total") == 6
    assert sample(text, "splitserve:cache_config_info", **CACHE) == 1
    # token-count buckets stop at the context length
    assert 'le="500.0"' in text and 'le="1000.0"' not in text


def test_vllm_names_answer_the_same_values_only_when_asked():
    stats = SchedulerStats(num_running=3, num_waiting=1, kv_usage=0.25, prefix_queries=10, prefix_hits=4,
                           num_preemptions=2)
    plain = ServerMetrics("m", lambda: stats, cache_info=CACHE)
    compat = ServerMetrics("m", lambda: stats, cache_info=CACHE, compat="vllm")
    for m in (plain, compat):
        run_request(m)
        m.on_step_tokens([5])
    assert "vllm:" not in plain.render().decode()
    text = compat.render().decode()
    ours = [line for line in text.splitlines() if line.startswith("splitserve:")]
    assert len(ours) > 50
    for line in ours:
        if "_created" in line:  # creation timestamps differ by construction
            continue
        assert "vllm:" + line[len("splitserve:"):] in text, line
    for name, value in [("vllm:num_preemptions_total", 2), ("vllm:prefix_cache_queries_total", 10),
                        ("vllm:prefix_cache_hits_total", 4), ("vllm:num_requests_running", 3),
                        ("vllm:kv_cache_usage_perc", 0.25), ("vllm:gpu_cache_usage_perc", 0.25),
                        ("vllm:iteration_tokens_total_sum", 5)]:
        assert sample(text, name, model_name="m") == value, name
    assert sample(text, "vllm:time_per_output_token_seconds_count") == 2  # the older name of ITL
    assert sample(text, "vllm:request_success_total", finished_reason="length") == 1


def test_stats_line_while_busy_and_quiet_when_idle():
    stats = SchedulerStats()
    m = ServerMetrics("m", lambda: stats)
    log = StatsLogger(m, lambda: stats)
    log._last = (0.0, 0, 0, 0, 0)
    assert log.line(now=5.0) is None  # nothing happened
    run_request(m)  # 7 prompt tokens, 6 generated
    stats = SchedulerStats(num_running=2, num_waiting=1, kv_usage=0.125, prefix_queries=40, prefix_hits=10)
    line = log.line(now=7.0)
    assert line == ("Avg prompt throughput: 3.5 tokens/s, Avg generation throughput: 3.0 tokens/s, Running: 2 reqs, "
                    "Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%")
    assert "0.0 tokens/s" in log.line(now=9.0)  # still running: reported even without new tokens
    stats = SchedulerStats(prefix_queries=40, prefix_hits=10)
    assert log.line(now=11.0) is None  # idle


def test_kv_transfer_counters_and_histogram():
    from splitserve.kv_transfer.base import KVTransferStats
    from splitserve.protocol.core_messages import KVTransferCounters
    t = KVTransferStats(sent_tokens=30, sent_bytes=3000, recv_tokens=20, recv_bytes=2000, failed=1)
    for seconds in (0.002, 0.004, 3.0):
        t.observe_time(seconds)
    stats = SchedulerStats(prompt_tokens_computed=2, num_held=1, kv_transfer=KVTransferCounters(
        t.sent_tokens, t.sent_bytes, t.recv_tokens, t.recv_bytes, t.failed, t.time_buckets, t.time_sum, 4, 32))
    text = ServerMetrics("m", lambda: stats, cache_info=CACHE).render().decode()
    for name, value in [("splitserve:kv_transfer_sent_tokens_total", 30), ("splitserve:kv_transfer_received_bytes_total",
                        2000), ("splitserve:kv_transfer_failed_total", 1), ("splitserve:kv_transfer_held_requests", 1),
                        ("splitserve:kv_transfer_offload_hit_tokens_total", 32),
                        ("splitserve:prompt_tokens_computed_total", 2)]:
        assert sample(text, name, model_name="m") == value, name
    assert sample(text, "splitserve:kv_transfer_time_seconds_bucket", le="0.0025") == 1
    assert sample(text, "splitserve:kv_transfer_time_seconds_bucket", le="0.005") == 2
    assert sample(text, "splitserve:kv_transfer_time_seconds_bucket", le="+Inf") == 3
    assert sample(text, "splitserve:kv_transfer_time_seconds_count") == 3
    plain = ServerMetrics("m", lambda: SchedulerStats(), cache_info=CACHE).render().decode()
    assert "kv_transfer_sent" not in plain  # no connector: no KV-transfer families


def test_spec_decode_counters_under_both_names():
    stats = SchedulerStats(spec_num_drafts=5, spec_num_draft_tokens=20, spec_num_accepted_tokens=9,
                           spec_accepted_per_pos=[4, 3, 2, 0])
    text = ServerMetrics("m", lambda: stats, cache_info=CACHE, compat="vllm").render().decode()
    for prefix in ("splitserve:", "vllm:"):
        assert sample(text, prefix + "spec_decode_num_drafts_total", model_name="m") == 5
        assert sample(text, prefix + "spec_decode_num_draft_tokens_total", model_name="m") == 20
        assert sample(text, prefix + "spec_decode_num_accepted_tokens_total", model_name="m") == 9
        assert sample(text, prefix + "spec_decode_num_accepted_tokens_per_pos_total", model_name="m",
                      position="1") == 3
    # without speculation the families are absent
    assert "spec_decode" not in ServerMetrics("m", SchedulerStats, cache_info=CACHE).render().decode()
