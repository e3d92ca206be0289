"""Byte-compiles, in parallel child processes, the Python sources that compiling the model imports.

Images built with PYTHONDONTWRITEBYTECODE ship torch without .pyc files, and never write them, so
every process compiles each module's source as it imports it, on one core. Compiling the model
imports the compiler stack (dynamo, Inductor, FX, sympy, ...): ~2,300 modules, ~7 s of a cold
start on the device image (BENCHMARKS.md). So on such an environment, at engine start, forked
children byte-compile those packages into a bytecode cache directory (sys.pycache_prefix) while the
model is built, and this process reads its imports from there. Python checks each cached file
against its source's mtime and size, so a stale or half-done cache costs time, never correctness.
Environments that have bytecode next to their sources are left alone.
"""
from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import py_compile
import sys
import time
import warnings

logger = logging.getLogger(__name__)

# The compiler stack, roughly in the order importing it reaches them.
COMPILER_PACKAGES = (
    "torch/_dynamo", "torch/fx", "torch/_subclasses", "torch/utils/_sympy", "torch/_logging", "torch/_functorch",
    "torch/_higher_order_ops", "torch/_prims", "torch/_refs", "torch/_decomp", "torch/_library", "torch/_inductor",
    "torch/_export", "torch/export", "torch/distributed", "triton", "sympy",
)


def default_cache_dir() -> str:
    return os.environ.get("SPLITSERVE_PYCACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "splitserve", "pycache")


def sources_to_compile(site: str, packages=COMPILER_PACKAGES) -> list[str]:
    """The .py files under site/<package> whose modules this process has not imported yet."""
    files = []
    for rel in packages:
        for dirpath, dirnames, names in os.walk(os.path.join(site, rel)):
            dirnames.sort()
            for name in sorted(names):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                module = os.path.relpath(path, site)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                if module not in sys.modules:
                    files.append(path)
    return files


def _compile(files: list[str]) -> None:
    for path in files:
        try:
            py_compile.compile(path, cfile=importlib.util.cache_from_source(path), doraise=True)
        except Exception:  # noqa: BLE001 -- that module is compiled on import instead
            pass


class BytecodeWarmup:
    """Children byte-compiling `files` into sys.pycache_prefix; `wait` before importing them."""

    def __init__(self, files: list[str], num_workers: int):
        self.start = time.perf_counter()
        self.num_files = len(files)
        ctx = multiprocessing.get_context("fork")
        self.procs = [ctx.Process(target=_compile, args=(files[i::num_workers],), daemon=True,
                                  name=f"splitserve-bytecode-{i}") for i in range(num_workers)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # see kernel_precompile: fork with threads
            for p in self.procs:
                p.start()

    def wait(self, timeout: float) -> None:
        deadline = time.perf_counter() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.perf_counter()))
        logger.info("byte-compiled %d compiler sources in %d child processes, %.1f s after start",
                    self.num_files, len(self.procs), time.perf_counter() - self.start)


def start_bytecode_warmup(site: str | None = None, cache_dir: str | None = None,
                          packages=COMPILER_PACKAGES) -> BytecodeWarmup | None:
    """Starts the children when this environment keeps no bytecode for the compiler stack; from then
    on this process (and the Python subprocesses it starts, e.g. Inductor's compile workers) look for
    bytecode in the cache directory. None when there is nothing to do."""
    if sys.pycache_prefix is not None:
        return None  # the user chose where bytecode lives
    import torch
    site = site or os.path.dirname(os.path.dirname(torch.__file__))
    probe = os.path.join(site, packages[0], "__init__.py")
    if not os.path.exists(probe) or os.path.exists(importlib.util.cache_from_source(probe)):
        return None  # bytecode ships with the sources (or the layout is not the one expected)
    files = sources_to_compile(site, packages)
    if not files:
        return None
    cache_dir = cache_dir or default_cache_dir()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        sys.pycache_prefix = cache_dir  # before the fork: the children write where this process reads
        warmup = BytecodeWarmup(files, num_workers=max(1, min(8, (os.cpu_count() or 2) // 2)))
    except (OSError, ValueError) as exc:  # no cache directory, no fork, or no processes left to start
        sys.pycache_prefix = None
        logger.warning("compiler sources are compiled on import: %s", exc)
        return None
    os.environ["PYTHONPYCACHEPREFIX"] = cache_dir  # and Python subprocesses (Inductor's workers)
    return warmup
