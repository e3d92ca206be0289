"""The scheduler and KV manager with a KV connector (a scripted one here): receiving requests wait
without holding anyone up, loaded prompts compute one token, failures follow the policy, producers
hold blocks until released, and the pool is whole after every path."""
import pytest

from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.request import Request, RequestStatus
from splitserve.core.scheduler import Scheduler
from splitserve.kv_transfer.base import KVConnector, LoadDone
from splitserve.sampling_params import SamplingParams

from tests.core.test_scheduler import plan, step

BS = 4


class ScriptedConnector(KVConnector):
    """Every do_remote_prefill request's blocks exist remotely; loads finish when the test says."""

    def __init__(self):
        super().__init__(None, None)
        self.loads, self.cancelled, self.saved, self.released, self.discarded = {}, [], {}, [], []
        self.done: list[LoadDone] = []
        self.to_release: list[str] = []

    def lookup(self, rid, params, num_prompt_tokens, num_local_blocks):
        return -(-num_prompt_tokens // BS) - num_local_blocks

    def load_async(self, rid, params, block_ids, first_block, num_prompt_tokens):
        self.loads[rid] = (list(block_ids), first_block)

    def poll(self):
        done, self.done = self.done, []
        rel, self.to_release = self.to_release, []
        return done, rel

    def cancel(self, rid):
        self.cancelled.append(rid)

    def discard(self, rid, params):
        self.discarded.append(rid)

    def save(self, rid, params, block_ids, num_prompt_tokens):
        if not params.get("do_remote_decode"):
            return None
        self.saved[rid] = list(block_ids)
        return {"remote_request_id": rid, "remote_block_ids": list(block_ids)}

    def release(self, rid):
        self.released.append(rid)


def make(policy="recompute", num_blocks=40, caching=True, budget=100):
    kv = KVCacheManager(num_blocks, BS, caching)
    conn = ScriptedConnector()
    return Scheduler(SchedulerConfig(8, budget), kv, connector=conn, kv_load_failure_policy=policy), kv, conn


def req(rid, n_prompt, start=10, max_tokens=3, **kv_params):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=(2,), max_total_tokens=1000, kv_transfer_params=kv_params or None)


def run_to_end(sched):
    for _ in range(50):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("did not finish")


def test_receiving_request_waits_without_blocking_others_then_computes_one_token():
    sched, kv, conn = make()
    sched.add_request(req("remote", 10, do_remote_prefill=True))
    sched.add_request(req("local", 6, start=100))
    out = step(sched)
    assert plan(out) == [("local", 6)]                      # the receiving one holds no one up
    r = sched.receiving["remote"]
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and len(r.block_ids) == 3
    assert conn.loads["remote"] == (r.block_ids, 0)
    assert plan(step(sched)) == [("local", 1)]              # still loading
    conn.done.append(LoadDone("remote", True, num_tokens=12))
    out = step(sched)
    assert plan(out) == [("local", 1), ("remote", 1)]       # only the last prompt token runs
    assert r.num_cached_tokens == 9 and r.output_token_ids == [7]
    assert sched.num_prompt_tokens_computed == 6 + 1
    run_to_end(sched)
    assert kv.pool.is_whole() and not sched.receiving


def test_local_prefix_hits_are_not_loaded_again():
    sched, kv, conn = make()
    sched.add_request(req("warm", 9))
    run_to_end(sched)
    sched.add_request(req("remote", 10, do_remote_prefill=True))
    step(sched)
    block_ids, first = conn.loads["remote"]
    assert first == 2 and len(block_ids) == 3                # two blocks hit here, one comes from remote
    conn.done.append(LoadDone("remote", True, num_tokens=12))
    run_to_end(sched)
    assert kv.pool.is_whole()


def test_abort_while_receiving_frees_everything():
    sched, kv, conn = make()
    sched.add_request(req("remote", 10, do_remote_prefill=True))
    step(sched)
    assert not kv.pool.is_whole()
    sched.finish_requests(["remote"], RequestStatus.FINISHED_ABORTED)
    assert conn.cancelled == ["remote"] and not sched.receiving and not sched.has_unfinished()
    conn.done.append(LoadDone("remote", True, num_tokens=12))  # late completion: ignored
    sched.schedule()
    assert kv.pool.is_whole()


def test_failed_load_recomputes_by_default():
    sched, kv, conn = make()
    sched.add_request(req("remote", 10, do_remote_prefill=True))
    step(sched)
    conn.done.append(LoadDone("remote", False, error="prefill engine gone"))
    out = step(sched)
    assert plan(out) == [("remote", 10)]                     # prefills here, and does not try again
    assert not conn.loads.keys() - {"remote"} and len(conn.loads) == 1
    run_to_end(sched)
    assert kv.pool.is_whole()


@pytest.mark.parametrize("policy,recoverable", [("fail", True), ("recompute", False)])
def test_failed_load_fails_the_request_under_fail_policy_or_a_mismatch(policy, recoverable):
    sched, kv, conn = make(policy)
    sched.add_request(req("remote", 10, do_remote_prefill=True))
    step(sched)
    conn.done.append(LoadDone("remote", False, error="layout differs", recoverable=recoverable))
    out = sched.schedule()
    assert out.is_empty
    [failed] = sched.kv_failed
    assert failed.status == RequestStatus.FINISHED_ERROR and failed.stop_reason == "layout differs"
    assert kv.pool.is_whole() and not sched.has_unfinished()


def test_producer_holds_blocks_until_released():
    sched, kv, conn = make()
    sched.add_request(req("p", 10, max_tokens=1, do_remote_decode=True))
    sched.add_request(req("plain", 10, start=50, max_tokens=1))
    run_to_end(sched)
    p_blocks = conn.saved["p"]
    assert len(p_blocks) == 3 and kv.num_held == 1
    assert kv.pool.num_free_blocks == 40 - 3                 # only p's blocks stay taken
    assert sched.requests == {}                              # the request itself is gone
    conn.to_release.append("p")
    sched.schedule()
    assert kv.num_held == 0 and kv.pool.is_whole()


def test_producer_abort_before_finish_holds_nothing():
    sched, kv, conn = make()
    sched.add_request(req("p", 10, max_tokens=1, do_remote_decode=True))
    sched.schedule()  # admitted, step not done
    sched.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert not conn.saved and kv.num_held == 0
    sched.forget_steps()
    assert kv.pool.is_whole()


def test_loaded_request_preempted_recomputes_without_loading_again():
    sched, kv, conn = make(num_blocks=6, caching=False)
    sched.add_request(req("remote", 10, do_remote_prefill=True, max_tokens=8))
    step(sched)
    conn.done.append(LoadDone("remote", True, num_tokens=12))
    step(sched)
    sched.add_request(req("other", 10, start=200, max_tokens=8))
    run_to_end(sched)
    assert sched.num_preemptions >= 1 and sched.requests == {}
    assert len(conn.loads) == 1 and kv.pool.is_whole()


def test_remote_blocks_never_read_are_discarded_at_once():
    """A request that will not read its remote blocks (aborted before its load began, or its own
    prefix cache has them all) tells the connector once, so the producer need not wait for the lease."""
    sched, kv, conn = make(num_blocks=3)
    sched.add_request(req("big", 11, start=300))  # takes every block: the remote one must wait
    step(sched)
    sched.add_request(req("remote", 10, do_remote_prefill=True))
    step(sched)
    assert "remote" not in sched.receiving and not conn.loads
    sched.finish_requests(["remote", "big"], RequestStatus.FINISHED_ABORTED)
    assert conn.discarded == ["remote"] and not conn.cancelled
    sched.forget_steps()
    assert kv.pool.is_whole()

    class AllLocal(ScriptedConnector):
        def lookup(self, rid, params, num_prompt_tokens, num_local_blocks):
            return 0
    sched = Scheduler(SchedulerConfig(8, 100), kv, connector=(conn := AllLocal()))
    sched.add_request(req("hit", 10, do_remote_prefill=True))
    run_to_end(sched)
    assert conn.discarded == ["hit"] and not conn.loads     # once, though it is finished after
    assert kv.pool.is_whole()
