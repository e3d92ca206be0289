"""Where engine start-up time goes: cProfile of building the 8B random-weights engine.

    python benchmarks/startup_profile.py     # run it twice: once cold (fresh caches), once warm
"""
import cProfile
import logging
import os
import pstats
import time

T0 = time.perf_counter()
import torch  # noqa: E402,F401

from splitserve import LLM  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
print(f"imports {time.perf_counter() - T0:.1f} s")
cfg = os.path.join(os.path.dirname(__file__), "configs", "llama3-8b")
pr = cProfile.Profile()
pr.enable()
llm = LLM(cfg, random_weights=True, dtype="bfloat16", max_model_len=4096, max_num_seqs=1024,
          max_num_batched_tokens=16384)
pr.disable()
print(f"process start -> engine ready {time.perf_counter() - T0:.1f} s")
pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
