"""Shared by every test directory.

Without CUDA the Triton kernels run in the interpreter, which Triton decides when it is imported: set
it here, before any test module (the kernel tests under tests/attention/, but also tests that import
the kernels' modules) imports triton, so the outcome does not depend on which test runs first.

The slow tier is marked here by path rather than in each file: everything under tests/models/ (loads
models, compares with transformers) and tests/e2e/ (starts real servers) gets `slow`, and so do the
files below that start processes (rank workers, grammar processes, kernel-compile children) or run
Inductor; `pytest -m "not slow"` runs the rest (the fast tier) and `pytest tests` still runs everything.
(A few other files mark themselves slow with `pytestmark`.)"""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
SLOW_DIRS = ("models", "e2e")
SLOW_FILES = (
    "executor/test_tensor_parallel.py", "executor/test_tp_families.py", "executor/test_tp_lora.py",
    "executor/test_tp_one_row.py",                      # rank processes over gloo
    "structured_output/test_grammar_process.py",        # grammar processes, killed and restarted
    "startup/test_kernel_precompile.py", "startup/test_bytecode.py",  # compile in child processes
    "export/test_export_tiny.py", "export/test_export_default.py", "export/test_export_llava.py",  # export + serve models
    "worker/test_warm_up.py", "worker/test_compiled_quant_layer.py", "worker/test_compiled_families.py",  # Inductor
    "router/test_router_policies.py", "router/test_router_pd.py", "router/test_router_servers.py",  # routers, servers
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.path)).resolve()
        if not path.is_relative_to(TESTS):
            continue
        rel = path.relative_to(TESTS)
        if rel.parts[0] in SLOW_DIRS or rel.as_posix() in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
