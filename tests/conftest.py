"""Shared by every test directory.

Without CUDA the Triton kernels run in the interpreter, which Triton decides when it is imported: set
it here, before any test module (the kernel tests under tests/attention/, but also tests that import
the kernels' modules) imports triton, so the outcome does not depend on which test runs first.

The slow tier is marked here by path rather than in each file: everything under tests/models/ (loads
models, compares with transformers) and tests/e2e/ (starts real servers) gets `slow`, so
`pytest -m "not slow"` runs the rest (the fast tier) and `pytest tests` still runs everything."""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
SLOW_DIRS = ("models", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.path)).resolve()
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)
