"""The worker's per-step LoRA layout (lora/worker.py): written in place into the same static buffers
every step (what a captured CUDA graph reads), padding rows and tokens without an adapter never in
it, cleared once after the last step with adapters and then left alone, and the wrappers' flag set
from it. Expected layouts are computed here from the rows' adapter ids, not by the code under test."""
import numpy as np

from splitserve.kernels.lora.lora_add import TILE, LoRALayout
from splitserve.lora.layers import LoRAModel, LoRAState
from splitserve.lora.worker import LoRAWorker
from splitserve.protocol.lora import LoRASlotLoad

S, MAX_TOKENS = 4, 48


def make_worker():
    model = LoRAModel(LoRAState(), LoRALayout(MAX_TOKENS, S, "cpu"), [], S, 8)
    worker = LoRAWorker(model)
    # adapters 7, 9, 11 in slots 2, 0, 3
    worker.apply_loads([LoRASlotLoad(2, 7, "a"), LoRASlotLoad(0, 9, "b"), LoRASlotLoad(3, 11, "c")])
    return worker, model


def expected_groups(row_ids, counts, slot_of):
    """slot -> flat rows of its tokens, from the rows' adapter ids and token counts."""
    groups, row = {}, 0
    for lid, n in zip(row_ids, counts):
        if lid:
            groups.setdefault(slot_of[lid], []).extend(range(row, row + n))
        row += n
    return groups


def layout_groups(layout):
    n = int(layout.num_tiles.item())
    groups = {}
    for slot, rows in zip(layout.tile_slots[:n].tolist(), layout.token_rows[:n * TILE].view(n, TILE).tolist()):
        groups.setdefault(slot, []).extend(r for r in rows if r >= 0)
    return groups


def test_prepare_step_rewrites_the_same_buffers():
    worker, model = make_worker()
    layout = model.layout
    ptr = layout.buffer.data_ptr()
    slot_of = {7: 2, 9: 0, 11: 3}
    steps = [([7, 0, 9, 7], [5, 3, 1, 20]),     # prefill chunks and a decode row, one base row
             ([11, 9, 0], [1, 1, 1]),           # decode
             ([0, 11], [30, 17])]               # the largest step
    for row_ids, counts in steps:
        assert worker.prepare_step(np.array(row_ids), np.array(counts)) is True
        assert model.state.active and worker.active
        assert layout.buffer.data_ptr() == ptr  # in place: a replayed graph reads it
        T = sum(counts)
        want = expected_groups(row_ids, counts, slot_of)
        assert layout_groups(layout) == want
        slots = np.full(MAX_TOKENS, -1)
        for slot, rows in want.items():
            slots[rows] = slot
        assert layout.token_slots.tolist() == slots.tolist()  # rows past T (graph padding): -1
        assert (layout.token_slots[T:] == -1).all()


def test_step_without_adapters_clears_the_layout_once():
    worker, model = make_worker()
    layout = model.layout
    worker.prepare_step(np.array([7, 9]), np.array([3, 4]))
    assert worker.prepare_step(np.array([0, 0]), np.array([3, 4])) is False
    assert not model.state.active
    assert layout.num_tiles.item() == 0 and (layout.token_slots == -1).all()
    # Cleared: later steps without adapters write nothing (a marker survives).
    layout.tile_slots[0] = 123
    assert worker.prepare_step(np.array([0]), np.array([9])) is False
    assert layout.tile_slots[0].item() == 123


def test_a_new_adapter_in_a_slot_takes_the_slot_over():
    worker, model = make_worker()
    worker.apply_loads([LoRASlotLoad(2, 13, "d")])  # evicts adapter 7 from slot 2
    assert worker.slot_of == {9: 0, 11: 3, 13: 2}
    worker.prepare_step(np.array([13, 9]), np.array([2, 2]))
    assert layout_groups(model.layout) == {2: [0, 1], 0: [2, 3]}


def test_host_copies_alternate():
    """Two host buffers in turn, so a step's copy never overwrites one still in flight."""
    worker, _ = make_worker()
    seen = set()
    for i in range(4):
        worker.prepare_step(np.array([7]), np.array([i + 1]))
        seen.add(id(worker._host[worker._turn ^ 1]))
    assert len(seen) == 2
