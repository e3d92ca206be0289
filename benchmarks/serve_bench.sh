#!/usr/bin/env bash
# Serving benchmark on the device: `splitserve serve` (Llama-3-8B shape, random bf16 weights) driven by
# `splitserve bench serve` with the random dataset (1024 in / 128 out, ignore_eos) at fixed rates and
# inf, a fresh seed per run, then a synthetic-sharegpt sweep. Results go to ${OUT:-.}.
#   usage: [SERVER_ARGS="--quantization fp8"] [CLIENT_ARGS="--lora-modules a0"] [RATES='4 16 24 inf'] [SWEEP=1]
#          [CFG=dir] [PROFILE_RATE=16] benchmarks/serve_bench.sh [NUM_PROMPTS]
# CFG: the model directory (config.json, and a tokenizer beside it or the default model's).
# PROFILE_RATE: while that rate runs, py-spy samples the server and its children (the engine core
# process) into $OUT/profile_<rate>.txt (collapsed stacks, one line per stack with its sample count).
# ROUTER=N: N servers (ports PORT+1..PORT+N, each with SERVER_ARGS, e.g. --gpu-memory-utilization 0.45)
# behind `splitserve router --policy ${ROUTER_POLICY:-cache_aware}` on PORT; the client drives the router,
# server_breakdown.py reads the first server (the router forwards /metrics to one worker).
set -u
out=${OUT:-.}
n=${1:-200}
cfg=${CFG:-benchmarks/configs/llama3-8b}
port=${PORT:-8011}
nserv=${ROUTER:-0}
sport=$port; [ "$nserv" -gt 0 ] && sport=$((port + 1))  # the (first) server's port
servers=
for i in $(seq 0 $(( nserv > 0 ? nserv - 1 : 0 ))); do
  log="$out/server.log"; [ "$nserv" -gt 0 ] && log="$out/server$i.log"
  python -m splitserve serve $cfg --random-weights --dtype bfloat16 --max-model-len 4096 --port $((sport + i)) \
      --disable-access-log ${SERVER_ARGS:-} >"$log" 2>&1 &
  servers="$servers $!"
done
server=$(echo $servers | cut -d" " -f1)  # the (first) server: py-spy and the liveness check
for i in $(seq 0 $(( nserv > 0 ? nserv - 1 : 0 ))); do
  for _ in $(seq 300); do curl -sf http://127.0.0.1:$((sport + i))/health >/dev/null && break; kill -0 $server 2>/dev/null || { tail -n 20 "$out"/server*.log; exit 1; }; sleep 1; done
done
grep -E "ready|fast path|captured" "$out"/server*.log
if [ "$nserv" -gt 0 ]; then
  python -m splitserve router --port $port --metrics-port $((port + nserv + 1)) --policy ${ROUTER_POLICY:-cache_aware} \
      --worker-urls $(for i in $(seq 0 $((nserv - 1))); do printf 'http://127.0.0.1:%d ' $((sport + i)); done) >"$out/router.log" 2>&1 &
  servers="$servers $!"
  for _ in $(seq 60); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
fi
common="--base-url http://127.0.0.1:$port --tokenizer $cfg --ignore-eos --disable-tqdm ${CLIENT_ARGS:-}"
seed=${SEED:-$RANDOM}
for rate in ${RATES:-4 16 inf}; do
  seed=$((seed + 1))
  echo "=== random 1024/128 at $rate req/s (seed $seed)"
  spy=
  if [ "${PROFILE_RATE:-}" = "$rate" ]; then
    py-spy record --pid $server --subprocesses --rate 250 --format raw --nonblocking -o "$out/profile_$rate.txt" >/dev/null 2>&1 &
    spy=$!
  fi
  python benchmarks/server_breakdown.py http://127.0.0.1:$sport --save "$out/metrics_before.prom"
  python -m splitserve bench serve $common --dataset random --random-input-len 1024 --random-output-len 128 \
      --num-prompts $n --request-rate $rate --seed $seed --save-result "$out/random_$rate.json"
  [ -n "$spy" ] && { kill -INT $spy; wait $spy; }
  echo "--- the server's histograms for this rate (benchmarks/server_breakdown.py)"
  python benchmarks/server_breakdown.py http://127.0.0.1:$sport --since "$out/metrics_before.prom"
done
[ "${SWEEP:-1}" = 1 ] && echo "=== synthetic-sharegpt sweep" && python -m splitserve bench sweep $common --dataset synthetic-sharegpt --num-prompts $n --seed $((seed + 1)) \
    --request-rates 4,16,64,inf --plot "$out/sharegpt_sweep.png" --save-result "$out/sharegpt_sweep.json"
kill -TERM $servers; wait $servers
