"""The engine core's view of adapters: which are in host memory, which GPU slot each occupies, and
which the running requests hold.

- Host memory: an LRU of up to --max-cpu-loras loaded adapters. A request whose adapter is not there
  starts its load on a loader thread and waits in the queue (the scheduler passes over it, keeping its
  place); nobody else waits. Loads that fail fail their requests (`take_failed`).
- GPU slots: --max-loras of them. Admitting a request pins its adapter's slot until the request
  leaves the running batch (finished or preempted), so the distinct adapters of a step never exceed
  the slots. An adapter not in a slot takes a free one or evicts the least recently used one that no
  running request holds; the step message then carries the load (`LoRASlotLoad`) with the adapter's
  weights, and the worker copies them in before the step runs (stream-ordered after the steps still
  in flight, which never use an unpinned slot).

The weights travel in the message, never by a call from the worker into this manager: the same
message goes to a runner in this process and, encoded once, to every rank process (tensor and
pipeline parallel), and the core is the only place that reads adapters from disk. A slot load is
made when its request is admitted, with the adapter in host memory (`can_admit` asked just before).
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from splitserve.config import EngineConfig
from splitserve.lora.adapter import LoRAAdapter, LoRATargets, load_adapter
from splitserve.protocol.lora import LoRARequest, LoRASlotLoad

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, targets: LoRATargets, max_loras: int, max_rank: int, max_cpu_loras: int | None = None,
                 dtype: torch.dtype = torch.float32, pin_memory: bool = False):
        self.targets = targets
        self.pin_memory = pin_memory  # host copies in page-locked memory (the model is on a GPU)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.dtype = dtype
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._loading: dict[int, Future] = {}
        self._failed: dict[int, str] = {}
        self._failed_new: list[tuple[int, str]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="splitserve-lora-load")
        self.slots: list[int | None] = [None] * max_loras   # adapter id per slot
        self._slot_of: dict[int, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self.pins: Counter[int] = Counter()                  # adapter id -> running requests
        self._loads: list[LoRASlotLoad] = []
        self.requests_total: Counter[str] = Counter()        # adapter name -> requests admitted
        self.num_slot_loads = 0                              # adapters put into a slot (evictions + first loads)

    # -- host memory ------------------------------------------------------------------------------
    def _load(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = load_adapter(lora.lora_int_id, lora.lora_name, lora.lora_path, self.targets, self.max_rank, self.dtype)
        return adapter.pin_memory() if self.pin_memory else adapter

    def _poll(self) -> None:
        for lid, fut in list(self._loading.items()):
            if not fut.done():
                continue
            del self._loading[lid]
            try:
                adapter = fut.result()
            except Exception as e:  # noqa: BLE001 (any load error fails its requests, not the engine)
                reason = f"loading LoRA adapter {lid} failed: {e}"
                logger.error(reason)
                self._failed[lid] = reason
                self._failed_new.append((lid, reason))
                continue
            self._host[lid] = adapter
            self._host.move_to_end(lid)
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)

    def is_loaded(self, lora: LoRARequest) -> bool:
        """Whether its weights are in host memory; if not, starts loading them (once)."""
        lid = lora.lora_int_id
        if lid in self._host or lid in self._slot_of:
            return True
        self._poll()
        if lid in self._host:
            return True
        if lid not in self._loading and lid not in self._failed:
            self._loading[lid] = self._pool.submit(self._load, lora)
        return False

    def loads_pending(self) -> bool:
        return bool(self._loading)

    def wait_for_loads(self, timeout: float) -> None:
        from concurrent.futures import FIRST_COMPLETED, wait
        if self._loading:
            wait(list(self._loading.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def take_failed(self) -> list[tuple[int, str]]:
        """Adapters whose load failed since the last call: (id, reason)."""
        self._poll()
        out, self._failed_new = self._failed_new, []
        return out

    def host_adapter(self, lora_int_id: int, path: str) -> LoRAAdapter:
        adapter = self._host.get(lora_int_id)
        if adapter is None:  # not expected (can_admit loaded it just before); read it again rather than fail
            adapter = load_adapter(lora_int_id, "", path, self.targets, self.max_rank, self.dtype)
        return adapter

    def forget(self, lora_int_id: int) -> None:
        """Drops an unloaded adapter from host memory (its slot goes when it is needed)."""
        self._host.pop(lora_int_id, None)
        self._failed.pop(lora_int_id, None)

    # -- slots ----------------------------------------------------------------------------------
    def can_admit(self, lora: LoRARequest) -> bool:
        if not self.is_loaded(lora):
            return False
        if lora.lora_int_id in self._slot_of:
            return True
        return any(self.slots[s] is None or self.pins[self.slots[s]] == 0 for s in self._slot_lru)

    def pin(self, request) -> None:
        """A request with an adapter is admitted (can_admit said yes): its adapter gets a slot, held
        until `unpin`."""
        lora = request.lora_request
        lid = lora.lora_int_id
        slot = self._slot_of.get(lid)
        if slot is None:
            slot = next(s for s in self._slot_lru if self.slots[s] is None or self.pins[self.slots[s]] == 0)
            old = self.slots[slot]
            if old is not None:
                del self._slot_of[old]
                self.pins.pop(old, None)
            self.slots[slot] = lid
            self._slot_of[lid] = slot
            self._loads.append(LoRASlotLoad(slot, lid, lora.lora_path, self.host_adapter(lid, lora.lora_path).modules()))
            self.num_slot_loads += 1
        self._slot_lru.move_to_end(slot)
        if lid in self._host:
            self._host.move_to_end(lid)
        self.pins[lid] += 1
        request.lora_pinned = True
        if request.num_preemptions == 0:
            self.requests_total[lora.lora_name] += 1

    def unpin(self, request) -> None:
        if getattr(request, "lora_pinned", False):
            request.lora_pinned = False
            self.pins[request.lora_request.lora_int_id] -= 1

    def take_loads(self) -> list[LoRASlotLoad]:
        out, self._loads = self._loads, []
        return out

    def restore_loads(self, loads: list[LoRASlotLoad]) -> None:
        """The slot loads of a message that never reached the worker (its launch failed): sent again
        with the next message, where their slot still holds that adapter; otherwise the worker would
        run a later request of the adapter with whatever the slot held before."""
        self._loads[:0] = [x for x in loads if self.slots[x.slot] == x.lora_int_id]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def build_manager(config: EngineConfig, pin_memory: bool) -> LoRAManager:
    """With --enable-lora: the core's manager. pin_memory: host copies in page-locked memory (a runner
    in this process on a GPU copies them into the slots straight from the message)."""
    lora, m = config.lora, config.model
    return LoRAManager(LoRATargets.from_hf_config(m.hf_config), lora.max_loras, lora.max_rank,
                       lora.max_cpu_loras, m.dtype, pin_memory=pin_memory)
