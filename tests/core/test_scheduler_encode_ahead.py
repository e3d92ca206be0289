"""The scheduler's encoder budget (core/scheduler.py): while requests decode, a new request with images
is announced first (its tower runs beside that step) and admitted the step after; a burst of images is
announced in chunks of the budget's image tokens; an idle engine admits at once; budget 0 turns it off."""
import torch

from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.scheduler import Scheduler
from splitserve.protocol.mm_inputs import ImageItem
from tests.core.test_scheduler import req, step

IMAGE_TOKENS = 6


def image_req(rid: str):
    item = ImageItem(f"h-{rid}", torch.zeros(1, 3, 4, 4), (4, 4), num_tokens=IMAGE_TOKENS, offset=1)
    r = req(rid, 12)
    r.mm_items = (item,)
    return r


def make(budget_tokens: int):
    return Scheduler(SchedulerConfig(10, 200, mm_encoder_budget=budget_tokens), KVCacheManager(100, 4, False))


def new_ids(out):
    return sorted(n.req_id for n in out.new_requests)


def test_images_arriving_during_decodes_are_encoded_ahead_within_the_budget():
    sched = make(2 * IMAGE_TOKENS)
    sched.add_request(req("t", 8))
    step(sched)                                   # t prefills: from now on it decodes
    for rid in "abc":
        sched.add_request(image_req(rid))
    sched.add_request(req("u", 5))                # text behind them is not held up
    out = step(sched)
    assert new_ids(out) == ["u"] and sorted(out.mm_prefetch) == ["a", "b"]  # c: over the budget
    out = step(sched)
    assert new_ids(out) == ["a", "b"] and list(out.mm_prefetch) == ["c"]
    assert all(n.mm_prefetched for n in out.new_requests)
    out = step(sched)
    assert new_ids(out) == ["c"] and not out.mm_prefetch


def test_an_idle_engine_admits_images_at_once():
    sched = make(2 * IMAGE_TOKENS)
    for rid in "ab":
        sched.add_request(image_req(rid))
    out = step(sched)
    assert new_ids(out) == ["a", "b"] and not out.mm_prefetch


def test_budget_zero_encodes_every_image_in_its_admitting_step():
    sched = make(0)
    sched.add_request(req("t", 8))
    step(sched)
    sched.add_request(image_req("a"))
    out = step(sched)
    assert new_ids(out) == ["a"] and not out.mm_prefetch and not out.new_requests[0].mm_prefetched
