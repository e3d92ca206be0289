"""The adaptive draft count (core/spec_control.py): acceptance estimates (geometric, per request
over a global prior), the cost model's plan (drafts fall with acceptance and with the batch, to 0),
probing, the overridable constants, and the scheduler following the plan (proposals asked for only
when drafts pay; disable_by_batch_size still a hard cut)."""
from __future__ import annotations

import numpy as np
import pytest

from splitserve.config import SpeculativeConfig
from splitserve.core import spec_control as sc
from splitserve.core.spec_control import SpecController
from tests.core.test_scheduler_spec import make, req, run


def ctl(k=4, **kw) -> SpecController:
    return SpecController(SpeculativeConfig("ngram", k, **kw))


def with_global(c: SpecController, a: float) -> SpecController:
    c.global_s, c.global_t = a * 1e9, 1e9
    return c


def ids(b: int) -> list[str]:
    return [f"r{i}" for i in range(b)]


def expected_speedup(c: SpecController, a: float, drafts: list[int], base_tokens: int) -> float:
    """Tokens per cost of the plan over the plain step's, under the controller's own model."""
    b = len(drafts)
    tokens = sum((1 - a ** (d + 1)) / (1 - a) for d in drafts)
    cost = c.step_cost(base_tokens + sum(drafts), any(drafts))
    return (tokens / cost) / (b / c.step_cost(base_tokens, False))


def test_estimates_are_geometric_and_lean_on_the_global_prior():
    c = ctl()
    assert c.acceptance("x") == sc.INITIAL_ACCEPT
    c.observe("x", 4, 2)  # 2 successes in 3 tested positions (the 4th was never tested)
    p = sc.PRIOR_TRIALS
    gs, gt = sc.GLOBAL_DECAY * sc.INITIAL_ACCEPT * p + 2, sc.GLOBAL_DECAY * p + 3
    assert (c.global_s, c.global_t) == pytest.approx((gs, gt))
    assert c.acceptance("x") == pytest.approx((2 + sc.PRIOR_TRIALS * gs / gt) / (3 + sc.PRIOR_TRIALS))
    c.observe("x", 4, 4)  # all accepted: 4 trials, no failure
    assert c._req["x"] == pytest.approx([sc.REQUEST_DECAY * 2 + 4, sc.REQUEST_DECAY * 3 + 4])
    assert c.acceptance("new") == pytest.approx(c.global_s / c.global_t)
    c.forget("x")
    assert "x" not in c._req
    # unbiased where accepted/proposed is not: verifies of 4 drafts at a = 0.6
    rng = np.random.default_rng(0)
    c, acc, prop = ctl(), 0, 0
    for _ in range(3000):
        m = int(np.argmin(np.append(rng.random(4) < 0.6, False)))
        c.observe("y", 4, m)
        acc, prop = acc + m, prop + 4
    assert c.global_s / c.global_t == pytest.approx(0.6, abs=0.06)
    assert acc / prop < 0.5  # the naive ratio: biased low


def test_drafts_follow_acceptance_and_batch():
    c = with_global(ctl(), 0.73)  # acceptance length ~3.0 at k = 4 (1 + a + a^2 + a^3 + a^4)
    assert c.plan(["a"], 1, 1) == {"a": 4} and c.wants_proposals(["a"])
    plan = c.plan(ids(16), 16, 16)
    assert set(plan.values()) == {3}  # the 4th draft (0.28 tokens) no longer pays
    plan = c.plan(ids(64), 64, 64)
    assert set(plan.values()) == {1}
    assert expected_speedup(c, 0.73, list(plan.values()), 64) > 1.1
    assert c.plan(ids(256), 256, 256) == dict.fromkeys(ids(256), 0)  # it turns off
    assert not c.wants_proposals(ids(256)) and c.wants_proposals(ids(64))
    # a long prefill chunk in the same step: the step is slow anyway, drafts add little to it
    assert set(c.plan(ids(16), 16 + 2000, 16).values()) == {4}


def test_low_acceptance_at_batch_1_keeps_few_drafts_and_zero_turns_off():
    c = with_global(ctl(), 0.168)  # acceptance length 1.2 at k = 4
    assert c.plan(["a"], 1, 1) == {"a": 2} and c.wants_proposals(["a"])
    assert expected_speedup(c, 0.168, [2], 1) > 1.0
    c = with_global(ctl(), 0.0)
    assert c.plan(["a"], 1, 1) == {"a": 0} and not c.wants_proposals(["a"])
    # mixed: the request that copies its prompt speculates fully, the other one at most once (the
    # verify's overhead is paid for by the first)
    c = with_global(ctl(), 0.3)
    for _ in range(10):
        c.observe("good", 4, 4)
        c.observe("bad", 4, 0)
    plan = c.plan(["good", "bad"], 2, 2)
    assert plan["good"] == 4 and plan["bad"] <= 1
    assert c.acceptance("bad") < 0.25 < 0.9 < c.acceptance("good")


def test_probes_after_idle_steps_while_drafts_could_pay():
    c = with_global(ctl(), 0.0)
    for _ in range(sc.PROBE_EVERY - 1):
        assert c.plan(["a", "b"], 2, 2) == {"a": 0, "b": 0} and not c.wants_proposals(["a", "b"])
    assert c.plan(["a", "b"], 2, 2) == {"a": 0, "b": 0} and c.wants_proposals(["a", "b"])  # asked for
    assert c.plan(["a", "b"], 2, 2) == {"a": sc.PROBE_DRAFTS, "b": sc.PROBE_DRAFTS}  # and verified
    assert not c.wants_proposals(["a", "b"])
    for _ in range(sc.PROBE_EVERY - 1):  # the next probe: PROBE_EVERY steps later
        assert c.plan(["a", "b"], 2, 2) == {"a": 0, "b": 0} and not c.wants_proposals(["a", "b"])
    assert c.plan(["a", "b"], 2, 2) == {"a": 0, "b": 0} and c.wants_proposals(["a", "b"])
    big = with_global(ctl(), 0.0)
    for _ in range(3 * sc.PROBE_EVERY):  # a batch where even PROBE_ACCEPT would not pay: never probed
        big.plan(ids(512), 512, 512)
        assert not big.wants_proposals(ids(512))


def test_constants_overridable_and_not_adaptive():
    a = 0.168
    assert with_global(ctl(adaptive_verify_overhead=0.5), a).plan(["a"], 1, 1) == {"a": 0}
    assert with_global(ctl(adaptive_verify_overhead=0.0, adaptive_knee_tokens=4096), a).plan(["a"], 1, 1) == {"a": 4}
    assert set(with_global(ctl(adaptive_knee_tokens=4096), 0.73).plan(ids(256), 256, 256).values()) == {4}
    fixed = ctl(adaptive=False)
    assert fixed.plan(ids(300), 300, 300) == dict.fromkeys(ids(300), 4) and fixed.wants_proposals(ids(300))
    for bad in ({"adaptive": 1}, {"adaptive_knee_tokens": 0}, {"adaptive_verify_overhead": -1}):
        with pytest.raises(ValueError, match="adaptive"):
            SpeculativeConfig("ngram", 4, **bad)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": false}').adaptive is False


def test_scheduler_follows_the_plan():
    sched, _ = make(k=4, adaptive=True)
    a = req("a", 6)
    sched.add_request(a)
    out = run(sched, {"a": [7]}, {"a": [20, 21, 22, 23]})  # prefill: proposals asked for right after it
    assert out.spec_propose and not out.spec_token_ids
    out = run(sched, {"a": [20, 21, 22, 23, 24]}, {"a": [1, 1, 1, 1]})  # prior 0.5 at batch 1: all 4
    assert out.spec_token_ids == {"a": [20, 21, 22, 23]} and out.spec_propose
    for _ in range(30):  # everything rejected from now on: the plan backs off to plain decode
        out = run(sched, {"a": [5]}, {"a": [1, 1, 1, 1]})
    assert not out.spec_token_ids and not out.spec_propose
    assert sched.spec_control.acceptance("a") < 0.3
    sched.finish_requests("a", sc_status())
    assert "a" not in sched.spec_control._req
    # disable_by_batch_size stays a hard cut with the adaptive plan
    sched, _ = make(k=4, adaptive=True, disable_by_batch_size=2)
    for r in ("x", "y"):
        sched.add_request(req(r, 4))
    run(sched, {"x": [7], "y": [7]}, {"x": [1, 1], "y": [1, 1]})
    out = run(sched, {"x": [7], "y": [7]}, {"x": [1, 1], "y": [1, 1]})
    assert not out.spec_token_ids and not out.spec_propose


def sc_status():
    from splitserve.core.request import RequestStatus
    return RequestStatus.FINISHED_ABORTED


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_prefix_hit_prefill_is_the_same_step_as_without_speculation(method):
    """No TTFT tax with prefix caching: a request whose prompt starts with a cached prefix is given
    the same tokens in its first step with speculation on as off (the prompt's uncached tail), and
    verifies nothing in it: speculation starts after the prompt."""
    from splitserve.config import SchedulerConfig
    from splitserve.core.kv_cache_manager import KVCacheManager
    from splitserve.core.scheduler import Scheduler

    def first_step(spec):
        kv = KVCacheManager(100, 4, True)
        sched = Scheduler(SchedulerConfig(10, 100), kv, spec=spec)
        a = req("a", 13)
        sched.add_request(a)
        run(sched, {"a": [7]}, {"a": [1, 2]})
        for t in (8, 9):  # a decodes (and verifies, with speculation) while b is not there yet
            run(sched, {"a": [t]}, {"a": [1, 2]})
        b = req("b", 13)
        b.prompt_token_ids = a.prompt_token_ids[:12] + [99, 98, 97]
        sched.add_request(b)
        out = sched.schedule()
        return out.num_scheduled_tokens["b"], "b" in out.spec_token_ids, b.num_cached_tokens

    off = first_step(None)
    assert off == (3, False, 12)
    cfg = SpeculativeConfig(method, 2, model="draft" if method == "draft_model" else None)
    assert first_step(cfg) == off
