#!/usr/bin/env bash
# Cold-start pieces on the device: Python import times of what the engine pulls in (fresh caches).
set -u
python -X importtime -c "import splitserve.engine.llm" 2> /tmp/imp.txt; sort -t'|' -k2 -n /tmp/imp.txt | tail -12
python - <<'PY'
import time; t=time.perf_counter()
import torch; a=time.perf_counter(); torch.zeros(1, device="cuda"); b=time.perf_counter()
import transformers; from transformers import AutoTokenizer; c=time.perf_counter()
import torch._dynamo, torch._inductor.compile_fx; d=time.perf_counter()
print(f"torch {a-t:.1f} s, CUDA context {b-a:.1f} s, transformers {c-b:.1f} s, dynamo+inductor {d-c:.1f} s")
PY
