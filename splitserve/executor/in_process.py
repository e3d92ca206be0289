"""World size 1: the model and its ModelRunner in the engine core's own process.

It builds what the runner needs (the model, LoRA's worker side, the KV cache, the compiled fast path),
overlapping start-up work in forked children (bytecode warm-up, attention kernel precompile), and then
is the runner the core steps: launch / sample / collect / update_states come straight from it."""
from __future__ import annotations

import logging
import time

from splitserve.attention.layer import kv_free_window
from splitserve.config import EngineConfig, resolve_kv_cache_dtype
from splitserve.executor.seeding import seed_everything
from splitserve.models.loader import load_model
from splitserve.startup.bytecode import start_bytecode_warmup
from splitserve.startup.kernel_precompile import start_attention_precompile
from splitserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class InProcessExecutor:
    def __init__(self, config: EngineConfig):
        device, m = config.device, config.model
        # The ONNX Runtime backend compiles nothing of torch's and loads no torch weights.
        compiles = device.startswith("cuda") and not config.compile.enforce_eager and config.onnx is None
        # The compiler stack's Python sources and the attention kernels compile in forked children
        # while the model is built; forked before any thread of ours starts.
        bytecode = start_bytecode_warmup() if compiles else None
        precompile = None
        if compiles:  # None for a backend that compiles no kernels on first launch
            sched = config.scheduler
            precompile = start_attention_precompile(
                m.hf_config, m.dtype, config.cache.block_size, sched.max_num_batched_tokens, m.max_model_len,
                config.compile.decode_graph_sizes(sched.max_num_seqs), config.attention_backend,
                kv_dtype=resolve_kv_cache_dtype(config.cache.kv_cache_dtype, m.dtype))
        try:
            t0 = time.perf_counter()
            self.lora, lora_worker = None, None  # LoRAManager (the core's) / LoRAWorker with --enable-lora
            draft = None  # speculative decoding's draft model (draft_model method)
            if config.onnx is not None:  # an exported directory in ONNX Runtime (worker/onnx_runner.py)
                from splitserve.worker.onnx_runner import OnnxModelRunner
                self.runner = OnnxModelRunner(config)
                model = self.runner.model  # the architecture without weights: the KV layout
            else:
                _, model = load_model(config.load.source, m.hf_config, m.dtype, device, config.load.random_weights,
                                      m.quant_config, m.max_model_len)
            logger.info("model built in %.1f s", time.perf_counter() - t0)
            if config.lora is not None:  # the two sides meet only through the step message's slot loads
                from splitserve.lora.manager import build_manager
                from splitserve.lora.worker import build_worker
                self.lora = build_manager(config, pin_memory=next(model.parameters()).is_cuda)
                lora_worker = build_worker(config, model)
            if config.onnx is None:
                spec = config.speculative
                if spec is not None and spec.method == "draft_model":  # a second model in this worker
                    _, draft = load_model(spec.draft_source, spec.draft_hf_config, m.dtype, device,
                                          config.load.random_weights, None, m.max_model_len)
                elif spec is not None and spec.method in ("eagle", "eagle3"):  # a head over the target's features
                    from splitserve.models.eagle import build_head
                    draft = build_head(spec.draft_hf_config, model, m.dtype, device, m.max_model_len,
                                       config.load.random_weights)
                self.runner = ModelRunner(config, model, lora_worker, draft)
            self.num_blocks = self.runner.determine_num_blocks()
            self.runner.allocate_kv_cache(self.num_blocks)
            if bytecode is not None:
                bytecode.wait(timeout=10.0)  # compiling the model imports what they compile
            self.runner.setup_fast_path()
        finally:
            if precompile is not None:
                precompile.finish()
        self.model = model
        self.kv_caches = self.runner.kv_caches  # for a KV connector (kv_transfer/)
        # Blocks every layer's window has passed go back to the pool (None: some layer sees everything).
        self.kv_free_window = kv_free_window(model)
        if draft is not None and self.kv_free_window is not None:  # the draft reads the same blocks
            draft_window = kv_free_window(draft)
            self.kv_free_window = None if draft_window is None else max(self.kv_free_window, draft_window)
        if config.seed is not None:  # after warm-up: the same seed gives the same draws whatever it ran
            seed_everything(config.seed)

    # The runner's step interface. Looked up per call, not bound once: a test may wrap the runner's
    # launch after start-up (fault_injection.install_step_faults).
    def launch(self, sched, inflight=None):
        return self.runner.launch(sched, inflight)

    def sample(self, launched, bitmask) -> None:
        self.runner.sample(launched, bitmask)

    def collect(self, launched):
        return self.runner.collect(launched)

    def update_states(self, sched) -> None:
        self.runner.update_states(sched)

    def check_alive(self) -> None:
        """Nothing to watch: a failure here is an exception in the core's own thread."""

    def shutdown(self) -> None:
        """Nothing to stop: the model goes with the process."""
