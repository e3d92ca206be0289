"""Where engine start-up time goes when building the 8B random-weights engine.

    python benchmarks/startup_profile.py [STATS_FILE]   # run it twice: cold (fresh caches), then warm

It logs each start-up phase with timestamps, every Triton kernel compiled in this process (and every
C launcher built for one) with its duration, and dynamo's compile times. With STATS_FILE it also runs
under cProfile and saves the raw profile (pstats format), to be sorted and read elsewhere.
"""
import cProfile
import logging
import os
import pstats
import sys
import time

T0 = time.perf_counter()
import torch  # noqa: E402,F401

from splitserve import LLM  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(threadName)s %(name)s: %(message)s")
logging.getLogger("splitserve.worker.cuda_graphs").setLevel(logging.DEBUG)
logging.getLogger("splitserve.worker.model_runner").setLevel(logging.DEBUG)
print(f"imports {time.perf_counter() - T0:.1f} s")


def log_triton_compiles() -> None:
    """Wraps Triton's compile entry and launcher build to log what this process compiles itself."""
    import triton.backends.nvidia.driver as nv_driver
    import triton.compiler as tc
    import triton.compiler.compiler as tcc
    log = logging.getLogger("triton-compiles")

    def timed(fn, what):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            name = getattr(getattr(args[0], "fn", None), "__name__", "") if what == "kernel" else kwargs.get("name", "")
            log.info("%s %s %.2f s", what, name, time.perf_counter() - t)
            return out
        return wrapper
    tc.compile = tcc.compile = timed(tcc.compile, "kernel")
    nv_driver.compile_module_from_src = timed(nv_driver.compile_module_from_src, "launcher")


log_triton_compiles()
cfg = os.path.join(os.path.dirname(__file__), "configs", "llama3-8b")
pr = cProfile.Profile() if len(sys.argv) > 1 else None  # the profiler slows Python-heavy phases down
if pr:
    pr.enable()
llm = LLM(cfg, random_weights=True, dtype="bfloat16", max_model_len=4096, max_num_seqs=1024,
          max_num_batched_tokens=16384)
if pr:
    pr.disable()
print(f"process start -> engine ready {time.perf_counter() - T0:.1f} s")
print(torch._dynamo.utils.compile_times())
if pr:
    pr.dump_stats(sys.argv[1])
    pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
