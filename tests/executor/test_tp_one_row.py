"""Tensor-parallel ranks agree on the one-sequence decode graph: their graphs hold collectives, so a
rank whose layers do not ask for it (StageRunner.one_row_graph) still captures it when another asks."""
import torch

from tests.tp_harness import run_ranks


def _rank_asks(rank: int, asking: tuple[int, ...]) -> bool:
    from splitserve.parallel.parallel_state import tp_group
    from splitserve.executor.rank_worker import StageRunner
    from splitserve.layers.linear import Linear
    from splitserve.layers.quantization.wna16 import WNA16LinearMethod, WNA16Scheme
    layer = Linear(128, 64, method=WNA16LinearMethod("gptq", WNA16Scheme("gptq", 4, 32)))
    layer.method.init_random(layer, torch.Generator().manual_seed(rank))
    layer.process_weights_after_loading()
    layer.wna16_kernel = rank in asking  # the GEMV on this rank (symmetric int4 on CUDA)
    runner = StageRunner.__new__(StageRunner)  # only what one_row_graph reads
    runner.model, runner.tp, runner.device = torch.nn.Sequential(layer), tp_group(), torch.device("cpu")
    return runner.one_row_graph()


def test_ranks_agree_on_the_one_row_graph():
    assert run_ranks(_rank_asks, 2, 1, (1,)) == [True, True]
    assert run_ranks(_rank_asks, 2, 1, ()) == [False, False]
