"""Ray is optional: the single-machine path never imports it, and the Ray options fail clearly at start-up.
(The Ray backend itself runs in test_ray_cluster.py, slow.)"""
from __future__ import annotations

import subprocess
import sys

import pytest

from splitserve.config import ParallelConfig
from splitserve.engine.args import EngineArgs

# What `splitserve serve` and `LLM(...)` import on their way to an engine, mp ranks included.
SERVE_PATHS = ("splitserve", "splitserve.entrypoints.cli", "splitserve.entrypoints.openai.api_server",
               "splitserve.engine.llm", "splitserve.engine.async_engine", "splitserve.engine.core_loop",
               "splitserve.executor", "splitserve.executor.multiproc", "splitserve.executor.rank_worker",
               "splitserve.executor.launcher", "splitserve.executor.in_process")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_serving_paths_do_not_import_ray():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in SERVE_PATHS) +
            "from splitserve.engine.args import EngineArgs\n"
            "EngineArgs(tensor_parallel_size=2)\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_ray_backend_without_ray_names_the_extra():
    """sys.modules['ray'] = None makes `import ray` fail as if it were not installed."""
    out = run_python("import sys; sys.modules['ray'] = None\n"
                     "from splitserve.executor.ray_ranks import connect\n"
                     "try:\n    connect(None)\nexcept ValueError as e:\n    print(e)\n")
    assert out.returncode == 0, out.stderr
    assert "pip install 'splitserve[ray]'" in out.stdout


def test_ray_options_are_checked_at_start_up():
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, ray"):
        EngineArgs(distributed_executor_backend="dask")
    with pytest.raises(ValueError, match="ray_bundle_resource must be NAME or NAME=AMOUNT"):
        EngineArgs(ray_bundle_resource="gpu_slot=lots")
    with pytest.raises(ValueError, match="ray_bundle_resource"):
        EngineArgs(ray_bundle_resource="=2")
    assert EngineArgs(ray_bundle_resource="slot").bundle_resource() == ("slot", 1.0)
    assert EngineArgs(ray_bundle_resource="slot=0.5").bundle_resource() == ("slot", 0.5)
    with pytest.raises(ValueError, match="drop --nnodes"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, master_port=29500, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="ray_placement_strategy must be one of"):
        ParallelConfig(distributed_executor_backend="ray", ray_placement_strategy="RANDOM")
