"""The scheduler's waiting queue, by scheduling policy (`--scheduling-policy`, vLLM's names).

- `fcfs` (the default): a deque in arrival order; a preempted request goes back to the front.
- `priority`: a heap ordered by (priority, arrival time, insertion): a lower priority value is served
  first, equal values in arrival order, so a preempted request (earlier arrival) goes ahead of later
  ones of its priority. Iteration yields that order.

Both offer the same operations the scheduler uses: append, appendleft, extendleft, popleft, [0],
remove, membership, len, iteration.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque

from splitserve.config import SCHEDULING_POLICIES
from splitserve.core.request import Request


class PriorityRequestQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def append(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._order), request))

    # Position comes from the request's own key: "to the front" means nothing more here.
    appendleft = append

    def extendleft(self, requests) -> None:
        for r in requests:
            self.append(r)

    def popleft(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[-1]

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("a priority queue only exposes its head")
        if not self._heap:
            raise IndexError("the queue is empty")
        return self._heap[0][-1]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[-1] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError("request is not in the queue")

    def __contains__(self, request: object) -> bool:
        return any(entry[-1] is request for entry in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self):
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3]))


def make_waiting_queue(policy: str):
    if policy == "fcfs":
        return deque()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
