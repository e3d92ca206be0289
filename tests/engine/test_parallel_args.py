"""The parallelism options: -tp / -pp spellings, torchrun's environment variables, and the clear errors
for sizes that do not fit together. No model, no process."""
from __future__ import annotations

import argparse

import pytest

from splitserve.fault_injection import parse_rank_fault
from splitserve.engine.args import EngineArgs
from splitserve.entrypoints import cli

TORCHRUN_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


def parse_serve(argv):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return EngineArgs.from_namespace(sub.choices["serve"].parse_args(argv))


def test_short_and_long_flags():
    a = parse_serve(["-tp", "3", "-pp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                     "--master-port", "29500", "--step-timeout-s", "30"])
    assert (a.tensor_parallel_size, a.pipeline_parallel_size, a.world_size) == (3, 2, 6)
    assert (a.nnodes, a.node_rank, a.master_addr, a.master_port, a.step_timeout_s) == (2, 1, "10.0.0.1", 29500, 30.0)
    b = parse_serve(["--tensor-parallel-size", "2", "--pipeline-parallel-size", "1"])
    assert (b.world_size, b.nnodes, b.node_rank, b.master_addr, b.master_port) == (2, 1, 0, "127.0.0.1", None)


def test_torchrun_environment_fills_what_flags_leave_unset(monkeypatch):
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "1234")
    a = EngineArgs(pipeline_parallel_size=2)
    assert (a.nnodes, a.node_rank, a.master_addr, a.master_port) == (2, 1, "node0", 1234)
    b = EngineArgs(pipeline_parallel_size=2, node_rank=0, master_port=999)  # flags win
    assert (b.node_rank, b.master_port) == (0, 999)
    monkeypatch.setenv("MASTER_PORT", "abc")
    with pytest.raises(ValueError, match="MASTER_PORT must be an integer"):
        EngineArgs(pipeline_parallel_size=2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(pipeline_parallel_size=-1), "pipeline_parallel_size must be an integer >= 1"),
    (dict(nnodes=2, tensor_parallel_size=3, master_port=1000), r"3 ranks do not divide evenly over nnodes=2"),
    (dict(nnodes=2, node_rank=2, tensor_parallel_size=2, master_port=1000), r"node_rank must be in \[0, nnodes\) = \[0, 2\)"),
    (dict(nnodes=2, tensor_parallel_size=2), "needs --master-port"),
    (dict(master_port=65535), "master_port must be in"),
    (dict(step_timeout_s=0), "step_timeout_s must be > 0"),
])
def test_bad_combinations_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_cli_reports_a_bad_combination_in_one_line(capsys):
    assert cli.main(["generate", "--prompt", "x", "--nnodes", "3", "-tp", "2"]) == 2
    assert "do not divide evenly" in capsys.readouterr().err


def test_rank_fault_spec():
    assert parse_rank_fault("rank=1,step=3,kind=hang") == (1, 3, "hang")
    assert parse_rank_fault("rank=0,kind=startup_oom") == (0, 1, "startup_oom")
    for bad in ("rank=1", "rank=x,kind=exit", "rank=1,kind=explode", "rank=1,step=0,kind=exit"):
        with pytest.raises(ValueError, match="SPLITSERVE_INJECT_RANK_FAULT"):
            parse_rank_fault(bad)
