"""A decode graph of one sequence exists exactly when a linear layer's method costs less at one token
than at two (LinearMethod.cheaper_at_one_row: W4A16's GEMV, symmetric int4 on CUDA); every other model
keeps the sizes it had (a single sequence padded to 2). The attention precompile, which reads the
sizes before the model is built, needs no size 1: its kernel variants at 1 are those at 2."""
from dataclasses import replace

import pytest
import torch

from splitserve.attention.backend import AttentionKernelSpec
from splitserve.config import CompileConfig
from splitserve.layers.linear import Linear, cheaper_at_one_row
from splitserve.layers.quantization.fp8 import Fp8Config
from splitserve.layers.quantization.wna16 import WNA16LinearMethod, WNA16Scheme

DEFAULT = (2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def test_sizes_add_one_only_when_asked():
    c = CompileConfig()
    assert c.decode_graph_sizes(256) == list(DEFAULT)
    assert c.decode_graph_sizes(256, one_row=True) == [1, *DEFAULT]
    assert c.decode_graph_sizes(5) == [2, 4] and c.decode_graph_sizes(5, one_row=True) == [1, 2, 4]
    # One sequence at most: the smallest graph it pads to (no graph at all crashed the capture), or 1.
    assert c.decode_graph_sizes(1) == [2] and c.decode_graph_sizes(1, one_row=True) == [1]
    own = CompileConfig(cudagraph_batch_sizes=(8, 1, 4))
    assert own.decode_graph_sizes(8) == [1, 4, 8] == own.decode_graph_sizes(8, one_row=True)


def wna16_layer(bits=4, symmetric=True, fmt="gptq", kernel=True):
    layer = Linear(128, 64, method=WNA16LinearMethod(fmt, WNA16Scheme(fmt, bits, 32, symmetric=symmetric)))
    layer.method.init_random(layer, torch.Generator().manual_seed(0))
    layer.process_weights_after_loading()
    assert layer.wna16_kernel is False  # on CPU: the torch reference, no GEMV
    layer.wna16_kernel = kernel  # as on CUDA with 16-bit activations
    return layer


@pytest.mark.parametrize("kwargs, expected", [
    (dict(), True),                              # symmetric int4: the GEMV
    (dict(kernel=False), False),                 # CPU / fp32 activations: the reference
    (dict(symmetric=False), False),              # zero points: split-K, padded to 16 rows
    (dict(fmt="awq", symmetric=False), False),
    (dict(bits=8), False),                       # int8: split-K
])
def test_wna16_asks_for_one_row_when_it_runs_the_gemv(kwargs, expected):
    layer = wna16_layer(**kwargs)
    assert (layer.zeros is None) == (kwargs.get("symmetric", True))
    assert layer.method.cheaper_at_one_row(layer) is expected
    model = torch.nn.Sequential(torch.nn.Sequential(Linear(128, 128)), layer)  # found among any modules
    assert cheaper_at_one_row(model) is expected


def test_float_and_fp8_layers_never_ask():
    fp8 = Linear(128, 64, method=Fp8Config.online().linear_method(["x"]))
    fp8.weight.data.normal_()
    fp8.process_weights_after_loading()
    model = torch.nn.Sequential(Linear(128, 128), fp8)
    assert not cheaper_at_one_row(model)


def test_precompile_needs_no_size_one(monkeypatch):
    # core/engine_core.py starts the attention precompile with the sizes of decode_graph_sizes(max_num_seqs),
    # before the model (and so its methods) exists. The decode kernel's variant is (splits > 1), and
    # a graph of 1 gets at least the splits of the graph of 2, at the same block-table stride.
    pytest.importorskip("triton")
    from splitserve.kernels.attention import paged_attention
    from splitserve.startup.kernel_precompile import precompile_launches
    monkeypatch.setattr(paged_attention, "_num_sms", lambda index: pytest.fail("asked CUDA for the SM count"))

    def variants(sizes, max_model_len):
        spec = AttentionKernelSpec("triton", 32, 8, 128, torch.bfloat16, 16, 8192, max_model_len, (), 132, 90, 128)
        launches = precompile_launches(replace(spec, decode_batch_sizes=tuple(sizes)), torch.device("meta"))
        # What a launch compiles: its metadata's layout, split count, and the kernel's
        # constexprs; the batch size is only the decode kernel's grid.
        return [(launch.args[2].is_pure_decode, launch.args[2].block_tables.shape[1],
                 getattr(launch.args[2], "decode_num_splits", None)) for launch in launches[1:]]

    c = CompileConfig()
    for max_model_len in (256, 8192):  # decode without splits at every size, and with them
        assert variants(c.decode_graph_sizes(64, one_row=True), max_model_len) == \
            variants(c.decode_graph_sizes(64), max_model_len)
