#!/usr/bin/env bash
# Data parallelism and the router on ONE GPU (#37): random 1024/128 at RATE req/s, two seeds each, for
#   one   : one engine (--gpu-memory-utilization 0.9, the usual server)
#   dp2   : --data-parallel-size 2, both replicas on the one GPU at 0.45 each
#   direct: two one-engine servers at 0.45 each, each driven at RATE/2 by its own client at once
#   router: the same two servers behind `splitserve router` (vllm-router, round_robin), driven at RATE
# "router" against "direct" is the router's own cost (same servers, same load on each).
#   usage: [RATE=16] [NUM=200] [SEED=7100] [CFG=benchmarks/configs/llama3-8b] benchmarks/dp_router_bench.sh
# Results (bench serve JSON, server logs) go to ${OUT:-.}; a table of medians is printed last.
set -u
out=${OUT:-.}; rate=${RATE:-16}; n=${NUM:-200}; seed0=${SEED:-7100}
cfg=${CFG:-benchmarks/configs/llama3-8b}
serve() {  # port, log, extra args...; sets PID
  local port=$1 log=$2; shift 2
  python -m splitserve serve $cfg --random-weights --dtype bfloat16 --max-model-len 4096 --port $port \
      --disable-access-log ${SERVER_ARGS:-} "$@" >"$out/$log" 2>&1 &
  PID=$!
}
wait_up() {
  for _ in $(seq 400); do curl -sf http://127.0.0.1:$1/health >/dev/null && return 0; sleep 1; done
  echo "port $1 never became healthy"; tail -30 "$out"/*.log; return 1
}
bench() {  # port, rate, seed, name
  python -m splitserve bench serve --base-url http://127.0.0.1:$1 --tokenizer $cfg --ignore-eos --disable-tqdm \
      --dataset random --random-input-len 1024 --random-output-len 128 --num-prompts $5 \
      --request-rate $2 --seed $3 --save-result "$out/$4.json" >"$out/$4.txt" 2>&1
}
half=$((n / 2)); hrate=$(python -c "print($rate / 2)")

if [ "${ONLY:-}" != router ]; then
serve 8011 one.log; wait_up 8011 || exit 1
for s in 1 2; do bench 8011 $rate $((seed0 + s)) one_$s $n; done
kill -TERM $PID; wait $PID

serve 8011 dp2.log --data-parallel-size 2 --gpu-memory-utilization 0.45; wait_up 8011 || exit 1
grep -E "KV cache|ready" "$out/dp2.log" | head -6
for s in 1 2; do bench 8011 $rate $((seed0 + s)) dp2_$s $n; done
kill -TERM $PID; wait $PID
fi

serve 8011 a.log --gpu-memory-utilization 0.45; a=$PID
serve 8012 b.log --gpu-memory-utilization 0.45; b=$PID
wait_up 8011 || exit 1; wait_up 8012 || exit 1
for policy in ${POLICIES:-round_robin}; do
python -m splitserve router --worker-urls http://127.0.0.1:8011 http://127.0.0.1:8012 --policy $policy \
    --port 8020 --metrics-port 8021 >"$out/router_$policy.log" 2>&1 &
router=$!
up=0
for _ in $(seq 60); do curl -sf http://127.0.0.1:8020/health >/dev/null && { up=1; break; }; sleep 1; done
[ $up = 1 ] || { echo "the router did not come up:"; tail -20 "$out/router_$policy.log"; }
for s in 1 2; do
  bench 8011 $hrate $((seed0 + 10 + s)) directA_$s $half & p1=$!
  bench 8012 $hrate $((seed0 + 20 + s)) directB_$s $half & p2=$!
  wait $p1 $p2  # (a bare `wait` would wait for the servers too)
  bench 8020 $rate $((seed0 + s)) router_${policy}_$s $n
done
kill -TERM $router; wait $router
done
kill -TERM $a $b; wait $a $b

python - "$out" <<'EOF'
import json, sys, os
out = sys.argv[1]
def row(name):
    m = json.load(open(os.path.join(out, name + ".json")))["metrics"]
    ms = lambda d, k: 1e3 * d[k] if d[k] is not None else float("nan")
    return (ms(m["ttft"], "median"), ms(m["tpot"], "median"), ms(m["itl"], "median"), ms(m["ttft"], "p99"),
            ms(m["itl"], "p99"), m["completed"])
print("| run | median TTFT | median TPOT | median ITL | P99 TTFT | P99 ITL | completed |")
print("|---|---|---|---|---|---|---|")
names = sorted(f[:-5] for f in os.listdir(out) if f.endswith(".json"))
for name in names:
    try:
        r = row(name)
        print(f"| {name} | " + " | ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in r) + " |")
    except Exception as e:
        print(f"| {name} | missing ({e}) |")
EOF
