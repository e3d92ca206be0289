"""Each image's pixels cross the scheduler -> worker seam once: images announced ahead of admission
(SchedulerOutput.mm_prefetch) are not sent again with the request's NewRequestData; the worker's
persistent batch takes the items it kept. Images of a request admitted without an announcement travel
with NewRequestData. Scheduler and InputBatch only, messages encoded and decoded as for worker processes."""
from __future__ import annotations

from collections import Counter

import torch

from splitserve.config import SchedulerConfig
from splitserve.core.kv_cache_manager import KVCacheManager
from splitserve.core.request import Request, RequestStatus
from splitserve.core.scheduler import Scheduler
from splitserve.protocol import core_messages
from splitserve.protocol.mm_inputs import ImageItem
from splitserve.protocol.sched_output import SchedulerOutput
from splitserve.sampling_params import SamplingParams
from splitserve.worker.input_batch import InputBatch


def image_request(rid: str, seed: int) -> Request:
    pixels = torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    item = ImageItem(f"h-{rid}", pixels, (4, 4), num_tokens=6, offset=2)
    return Request(rid, list(range(10, 22)), SamplingParams(max_tokens=2, temperature=0), eos_token_ids=(2,),
                   max_total_tokens=100, mm_items=(item,))


class Seam:
    """Encodes each step message as the core does for worker processes, counting the image tensors in
    it by the image's hash, and applies the decoded message to a worker's persistent batch."""

    def __init__(self, monkeypatch, requests):
        self.sent = Counter()
        by_tensor = {id(it.pixel_values): it.hash for r in requests for it in r.mm_items}
        hook = core_messages._enc_hook

        def counting(obj):
            if isinstance(obj, torch.Tensor) and id(obj) in by_tensor:
                self.sent[by_tensor[id(obj)]] += 1
            return hook(obj)
        monkeypatch.setattr(core_messages, "_enc_hook", counting)
        self.codec = core_messages.Codec(SchedulerOutput)
        self.batch = InputBatch(8, 64, 16)
        self.images = {}  # request id -> the images its worker state took when it arrived as new

    def send(self, out: SchedulerOutput) -> SchedulerOutput:
        got = self.codec.decode(self.codec.encode(out))
        self.batch.update(got)
        self.images.update({n.req_id: self.batch.states[n.req_id].mm_items for n in got.new_requests})
        return got


def run_step(sched: Scheduler, seam: Seam) -> SchedulerOutput:
    out = sched.schedule()
    if out.is_empty and not out.has_removals:
        return out  # the core sends no message
    seam.send(out)
    samplers = [rid for rid, n in out.num_scheduled_tokens.items()
                if sched.requests[rid].num_computed_tokens + n == sched.requests[rid].num_tokens]
    sched.advance(out)
    sched.update(out, {rid: 7 for rid in samplers})
    return out


def test_each_image_crosses_once_and_the_worker_keeps_it(monkeypatch):
    sched = Scheduler(SchedulerConfig(1, 100), KVCacheManager(50, 4, False))  # one runs, the next waits
    requests = [image_request(r, i) for i, r in enumerate("abc")]
    seam = Seam(monkeypatch, requests)
    for r in requests:
        sched.add_request(r)
    new_data = {}
    for _ in range(20):
        if not sched.has_unfinished():
            break
        out = run_step(sched, seam)
        new_data.update({n.req_id: n for n in out.new_requests})
    assert not sched.has_unfinished()
    # a was admitted at once (its pixels with NewRequestData); b and c were announced while waiting
    assert [(rid, n.mm_prefetched, len(n.mm_items)) for rid, n in sorted(new_data.items())] == [
        ("a", False, 1), ("b", True, 0), ("c", True, 0)]
    assert seam.sent == {"h-a": 1, "h-b": 1, "h-c": 1}
    for r in requests:  # the worker's state holds each request's images, pixels and placement intact
        [item] = seam.images[r.request_id]
        [want] = r.mm_items
        assert (item.hash, item.offset, item.num_tokens) == (want.hash, want.offset, want.num_tokens)
        assert torch.equal(item.pixel_values, want.pixel_values)
    run_step(sched, seam)  # the removals of the last ones
    assert not seam.batch.states and not seam.batch.announced_mm


def test_announced_images_go_when_their_request_ends_waiting(monkeypatch):
    sched = Scheduler(SchedulerConfig(1, 100), KVCacheManager(50, 4, False))
    a, b = image_request("a", 0), image_request("b", 1)
    seam = Seam(monkeypatch, [a, b])
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, seam)
    assert list(seam.batch.announced_mm) == ["b"]
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)  # aborted while waiting
    run_step(sched, seam)
    assert not seam.batch.announced_mm and seam.sent == {"h-a": 1, "h-b": 1}


def test_announcements_only_in_messages_the_worker_gets_and_again_after_a_lost_one():
    sched = Scheduler(SchedulerConfig(1, 100), KVCacheManager(50, 4, False))
    a, b = image_request("a", 0), image_request("b", 1)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert list(out.mm_prefetch) == ["b"] and b.mm_announced
    sched.fail_step(out, RequestStatus.FINISHED_ERROR, launched=False)  # never reached the worker
    assert not b.mm_announced
    out = sched.schedule()  # b is admitted now: its images, never received, travel with it
    assert out.finished_req_ids == ["a"] and [(n.req_id, n.mm_prefetched, n.mm_items) for n in out.new_requests] \
        == [("b", False, b.mm_items)]
    # A step that runs nothing and removes nothing is not sent: it announces nothing either.
    c = image_request("c", 2)
    idle = Scheduler(SchedulerConfig(1, 100), KVCacheManager(2, 4, False))  # too few blocks: c waits
    idle.add_request(c)
    out = idle.schedule()
    assert out.is_empty and not out.has_removals and not out.mm_prefetch and not c.mm_announced
