"""Compiles the attention backend's Triton kernels in child processes while the engine builds its model.

Triton compiles a kernel on its first launch, in the launching process, holding the GIL: on the
8B config the warm-up and decode-graph capture compiled ten attention kernel variants and their C
launchers one after another, ~9 s of a ~35 s cold start (H100, BENCHMARKS.md). Triton also keeps
every compiled kernel and launcher in its on-disk cache (TRITON_CACHE_DIR), keyed by the kernel's
source, its specialisation (argument dtypes, alignment, constexprs) and the compile options.

So at engine start, before the model is built, a few forked children run the engine's own attention
launches on `meta` tensors of the same shapes, strides and dtypes, with Triton switched to
compile-only: each launch compiles its kernel and launcher into the cache and runs nothing. Which
launches those are is the backend's knowledge (AttentionBackend.precompile_launches: the KV store,
the warm-up steps of model_runner.warm_up_layouts, every decode-graph batch size); this module only
forks, switches Triton to compile-only and shares the launches out. The children never touch CUDA
(a stand-in driver tells Triton the GPU's architecture, the spec its SM count), so forking after the
parent has initialised CUDA is safe. When the parent later launches the same kernels, Triton finds
them on disk.

Nothing depends on the children: if one fails, is slow, or the cache is off, the parent compiles
that kernel itself as before. tests/startup/test_kernel_precompile.py checks on CPU that kernels
compiled this way are cache hits for launches on real tensors.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
import warnings

import torch

from splitserve.attention.backend import AttentionKernelSpec
from splitserve.attention.registry import get_backend

logger = logging.getLogger(__name__)


def precompile_launches(spec: AttentionKernelSpec, device: torch.device = torch.device("meta")):
    """The backend's start-up launches for this spec, the warm-up steps' metadata laid out exactly as
    the engine's warm-up lays it out (model_runner.warm_up_batch)."""
    from splitserve.worker.model_runner import warm_up_batch, warm_up_layouts
    warm_up = [warm_up_batch(num_seqs, q_len, context, spec.block_size, device)[0]
               for num_seqs, q_len, context in warm_up_layouts(spec.budget, spec.block_size)]
    return get_backend(spec.backend).precompile_launches(spec, warm_up, device)


class _CompileOnlyDriver:
    """What Triton's launch path asks of its driver, answered without CUDA."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def compile_only_mode(capability: int) -> None:
    """Turns this process's Triton launches into compile-only calls for an sm_<capability> GPU: each
    launch compiles its kernel and C launcher into the on-disk cache and returns without running.
    Only for a throwaway process (the children here, or a test's subprocess)."""
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_CompileOnlyDriver(capability))
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        try:
            CudaLauncher(kernel.src, kernel.metadata)  # builds (and caches) the launcher the parent loads
        except Exception:  # noqa: BLE001 -- linking it needs libcuda (absent on CPU test machines)
            pass
        return kernel

    JITFunction.run = compile_only


def compile_launches(spec: AttentionKernelSpec, worker: int = 0, num_workers: int = 1,
                     device: torch.device = torch.device("meta")) -> None:
    """Compiles this worker's share of the start-up kernel variants (every num_workers-th launch)."""
    compile_only_mode(spec.capability)
    for i, launch in enumerate(precompile_launches(spec, device)):
        if i % num_workers == worker:
            launch()


def _child(spec: AttentionKernelSpec, worker: int, num_workers: int) -> None:
    try:
        if worker == 0:  # the driver's own helper module, which the parent builds on first use
            from triton.backends.nvidia.driver import CudaUtils
            try:
                CudaUtils()
            except Exception:  # noqa: BLE001 -- loading it may need a GPU; it is cached by then
                pass
        compile_launches(spec, worker, num_workers)
    except Exception as exc:  # noqa: BLE001 -- the parent compiles whatever is missing
        logger.debug("precompile worker %d failed: %r", worker, exc)
        sys.exit(1)


class AttentionPrecompile:
    """The running children; `finish` reaps them once the parent has launched every kernel."""

    def __init__(self, spec: AttentionKernelSpec, num_workers: int):
        self.start = time.perf_counter()
        ctx = multiprocessing.get_context("fork")
        self.procs = [ctx.Process(target=_child, args=(spec, i, num_workers), daemon=True,
                                  name=f"splitserve-precompile-{i}") for i in range(num_workers)]
        with warnings.catch_warnings():
            # Python warns on forking a process with threads (a second engine in one process, or
            # Inductor's pool): the children only compile, they need no lock another thread held.
            warnings.simplefilter("ignore", DeprecationWarning)
            for p in self.procs:
                p.start()

    def finish(self) -> None:
        for p in self.procs:
            p.join(timeout=0)
            if p.is_alive():
                p.terminate()
        codes = [p.exitcode for p in self.procs]
        logger.info("attention kernels precompiled by %d child processes (exit codes %s), %.1f s after start",
                    len(self.procs), codes, time.perf_counter() - self.start)


def t5_decoder_attention(text_config) -> tuple[int, int, int] | None:
    """(heads, KV heads, head size) of a T5-style decoder (T5 / Flan-T5, BLIP-2's T5, Pix2Struct's
    text model: `num_heads` and `d_kv`, self-attention with a relative position bias, cross-attention
    of the same shape); None for any other config."""
    heads, head_dim = getattr(text_config, "num_heads", None), getattr(text_config, "d_kv", None)
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        return None
    return heads, heads, head_dim


def start_attention_precompile(hf_config, dtype: torch.dtype, block_size: int, budget: int, max_model_len: int,
                               batch_sizes: list[int], backend: str = "triton",
                               kv_dtype: torch.dtype | None = None) -> AttentionPrecompile | None:
    """Starts the children for a CUDA engine with compiled graphs; None when the backend compiles no
    kernels on first launch, or the config's attention shape is not readable here (the parent then
    compiles as before). kv_dtype: the KV cache's dtype (None: dtype)."""
    from splitserve.models.families import decoder_spec
    if not get_backend(backend).jit_kernels:
        return None
    text = getattr(hf_config, "text_config", None) or hf_config
    pos_bias, cross_max_enc_len = False, 0
    try:
        # The attention shape and the layers' (window, soft cap) kinds, as the decoder reads them.
        shape = decoder_spec(text)
        num_heads, num_kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        rot_dim, variants = shape.rot_dim, shape.attn_variants
    except (AttributeError, ValueError):
        t5 = t5_decoder_attention(text)
        if t5 is None:
            return None
        num_heads, num_kv_heads, head_dim = t5
        rot_dim, variants, pos_bias = 0, ((None, None),), True
        # The front refuses encoder inputs longer than the budget less one; the cross graph state is
        # assumed to allow that many positions, in whole blocks.
        cross_max_enc_len = -(-max(1, budget - 1) // block_size) * block_size
    major, minor = torch.cuda.get_device_capability()
    # The SM count of the device the engine's launches will run on (the current one): the children
    # give it to the backend's launch heuristics instead of asking CUDA.
    num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    spec = AttentionKernelSpec(backend, num_heads, num_kv_heads, head_dim, dtype, block_size, budget, max_model_len,
                               tuple(batch_sizes), num_sms, major * 10 + minor, rot_dim, kv_dtype, variants,
                               pos_bias=pos_bias, cross_max_enc_len=cross_max_enc_len)
    try:
        return AttentionPrecompile(spec, num_workers=max(1, min(8, (os.cpu_count() or 2) // 2)))
    except (OSError, ValueError) as exc:  # no fork on this platform, or no processes left to start
        logger.warning("attention kernels compile in the engine process: %s", exc)
        return None
