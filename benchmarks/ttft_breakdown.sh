#!/usr/bin/env bash
# Where the P99 TTFT goes (issue 40): `splitserve serve` (Llama-3-8B shape, random bf16 weights) with
# the per-request TTFT log on (SPLITSERVE_TTFT_LOG, ttft_trace.py), driven by `splitserve bench
# serve` random 1024/128 (ignore_eos; IN_LEN / OUT_LEN) at each rate, two seeds each; per run the log's breakdown
# (benchmarks/ttft_breakdown.py), and last one table: per rate and seed the client's median / P99
# TTFT, median TPOT, median / P99 ITL, and where the slowest 1% of first tokens spent their time.
#   usage: [RATES='4 16 24'] [SEEDS='1 2'] [N='4:240 16:400 24:480'] [AB=1] [SERVER_ARGS=...] [CFG=dir]
#          [IN_LEN=1024] [OUT_LEN=128] [PORT=8011] [PYTHON=python] benchmarks/ttft_breakdown.sh
# N: prompts per run by rate (rate:count; a rate not named gets 200). AB=1: first a server with this
# branch's TTFT changes off (SPLITSERVE_TTFT_BASELINE=1: no prefill sharing, no gc.freeze in the
# front), then one with them on, same runs (halve N to stay in time). Results go to ${OUT:-.}.
# On a CPU: CFG= (the default model, no --random-weights) RATES=2 SEEDS=1 N=2:6 IN_LEN=64 OUT_LEN=4.
set -u
out=${OUT:-.}
py=${PYTHON:-python}
cfg=${CFG-benchmarks/configs/llama3-8b}
port=${PORT:-8011}
rates=${RATES:-4 16 24}
seeds=${SEEDS:-1 2}
counts=${N:-4:240 16:400 24:480}
in_len=${IN_LEN:-1024}
out_len=${OUT_LEN:-128}
if [ -n "$cfg" ]; then
  model_args="$cfg --random-weights --dtype bfloat16 --max-model-len 4096"
  tok="--tokenizer $cfg"
else
  model_args="--max-model-len 2048"
  tok=""
fi
count_for() { for c in $counts; do [ "${c%%:*}" = "$1" ] && { echo "${c#*:}"; return; }; done; echo 200; }
variants=on; [ "${AB:-0}" = 1 ] && variants="baseline on"
runs="$out/ttft_runs.txt"; : >"$runs"
for variant in $variants; do
  log="$out/ttft_$variant.jsonl"; : >"$log"
  env_extra=""; [ "$variant" = baseline ] && env_extra="SPLITSERVE_TTFT_BASELINE=1"
  env SPLITSERVE_TTFT_LOG="$log" $env_extra $py -m splitserve serve $model_args --port $port \
      --disable-access-log ${SERVER_ARGS:-} >"$out/server_$variant.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    curl -sf http://127.0.0.1:$port/health >/dev/null && break
    kill -0 $server 2>/dev/null || { tail -n 30 "$out/server_$variant.log"; exit 1; }
    sleep 1
  done
  grep -E "ready|captured" "$out/server_$variant.log"
  for rate in $rates; do
    for seed in $seeds; do
      n=$(count_for $rate)
      label="$variant ${rate}/s seed $seed"
      tag="${variant}_${rate}_${seed}"
      echo "=== $label: random $in_len/$out_len, $n prompts"
      from=$(wc -l <"$log")
      # a seed of its own per rate and seed (rate*100 + seed): no run hits another's prompts in the
      # prefix cache; the same ones per variant (each variant's server starts with an empty cache)
      $py -m splitserve bench serve --base-url http://127.0.0.1:$port $tok --ignore-eos --disable-tqdm \
          --dataset random --random-input-len $in_len --random-output-len $out_len --num-prompts $n \
          --request-rate $rate --seed $((${rate%.*} * 100 + seed)) --save-result "$out/bench_$tag.json" | grep -E "TTFT|TPOT|ITL|throughput"
      sleep 0.5  # the last lines of the log
      # (the bench client's test request is the first line of each run: left out)
      $py benchmarks/ttft_breakdown.py "$log" --lines $((from + 1)): --title "$label" --json "$out/ttft_$tag.json"
      echo "$label|$out/bench_$tag.json|$out/ttft_$tag.json" >>"$runs"
    done
  done
  echo "--- $variant: Triton compiles while serving $(grep -c "compiled while serving" "$out/server_$variant.log"),"\
       "GC pauses over 10 ms: front $(grep -c "server front: a garbage" "$out/server_$variant.log"),"\
       "core $(grep -c "engine core: a garbage" "$out/server_$variant.log")"
  grep -E "compiled while serving|a garbage collection" "$out/server_$variant.log" | tail -n 8
  kill -TERM $server; wait $server
done
echo "=== TTFT breakdown: client figures (ms); P99 requests: mean server TTFT of the slowest 1% and its largest parts"
$py - "$runs" <<'EOF'
import json, sys
sys.path.insert(0, "benchmarks")
from ttft_breakdown import table
runs = []
for line in open(sys.argv[1]):
    label, bench, ttft = line.strip().split("|")
    try:
        t = json.load(open(ttft))
    except (OSError, ValueError):
        t = None
    runs.append({"label": label, "bench": json.load(open(bench)), "ttft": t})
print(table(runs))
EOF
