#!/usr/bin/env bash
# The multi-GPU runs of issue 25 ("Tensor parallelism measured on two H200s"), on nvidia-h200-x2:
#   1. offline figures (benchmarks/gpu_suite.py) at TP=1 and TP=$TP on the same lease, same model shape;
#   2. serving at fixed rates with -tp $TP (benchmarks/serve_bench.sh, random 1024/128);
#   3. a rank killed mid-serving: the stream errors, /health 503, every process exits, no GPU process left.
# usage: [TP=2] [CFG=benchmarks/configs/llama3-8b] [BENCH=decode,prefill,tp128,tp1024] [REPEATS=3]
#        [SKIP_TP1=0] [RATES='4 16 inf'] [SERVER_ARGS=...] [STEPS='offline serve kill'] benchmarks/tp_bench.sh [NUM_PROMPTS]
# The 70B shape does not fit one GPU in bf16: CFG=benchmarks/configs/llama3-70b SKIP_TP1=1 BENCH=decode RATES=4;
# its FP8 run: SERVER_ARGS="--quantization fp8" and QUANT=fp8 (offline). Results go to ${OUT:-.}.
set -u
out=${OUT:-.}
n=${1:-200}
tp=${TP:-2}
cfg=${CFG:-benchmarks/configs/llama3-8b}
bench=${BENCH:-decode,prefill,tp128,tp1024}
steps=${STEPS:-offline serve kill}
quant=${QUANT:+--quantization $QUANT}
port=${PORT:-8012}
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv

if [[ " $steps " == *" offline "* ]]; then
  if [ "${SKIP_TP1:-0}" != 1 ]; then
    echo "=== offline, TP=1 ($cfg)"
    python benchmarks/gpu_suite.py --bench "$bench" --repeats ${REPEATS:-3} --config "$cfg" $quant \
        --tensor-parallel-size 1 2>"$out/offline_tp1.log" | tee "$out/offline_tp1.txt"
  fi
  echo "=== offline, TP=$tp ($cfg)"
  python benchmarks/gpu_suite.py --bench "$bench" --repeats ${REPEATS:-3} --config "$cfg" $quant \
      --tensor-parallel-size $tp 2>"$out/offline_tp$tp.log" | tee "$out/offline_tp$tp.txt"
fi

if [[ " $steps " == *" serve "* ]]; then
  echo "=== serving, -tp $tp ($cfg)"
  mkdir -p "$out/serve_tp$tp"
  OUT="$out/serve_tp$tp" CFG="$cfg" PORT=$port SWEEP=0 RATES="${RATES:-4 16 inf}" \
      SERVER_ARGS="-tp $tp ${SERVER_ARGS:-}" benchmarks/serve_bench.sh $n
fi

if [[ " $steps " == *" kill "* ]]; then
  echo "=== a rank killed mid-serving (-tp $tp)"
  python -m splitserve serve "$cfg" --random-weights --dtype bfloat16 --max-model-len 4096 --port $port \
      --disable-access-log -tp $tp ${SERVER_ARGS:-} >"$out/kill_server.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; kill -0 $server 2>/dev/null || { tail -20 "$out/kill_server.log"; exit 1; }; sleep 1; done
  # the engine core is the server's spawned child; the ranks are the core's spawned children
  core=$(pgrep -P $server -f spawn_main | head -1)
  ranks=$(pgrep -P "$core" -f spawn_main | tr '\n' ' ')
  echo "server $server, core $core, ranks $ranks"
  curl -sN http://127.0.0.1:$port/v1/completions -H 'Content-Type: application/json' \
      -d '{"prompt": [1000, 2000, 3000], "max_tokens": 2000, "ignore_eos": true, "stream": true}' >"$out/kill_stream.txt" &
  stream=$!
  sleep 3
  victim=$(echo $ranks | awk '{print $NF}')
  echo "killing rank process $victim"; kill -9 "$victim"
  sleep 0.5
  echo "health: $(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$port/health) (want 503)"
  wait $stream
  echo "stream's last events:"; tail -c 400 "$out/kill_stream.txt"; echo
  wait $server; echo "server exit status: $? (want 1)"
  sleep 5
  left=$(ps -o pid= -p $core $ranks 2>/dev/null | tr -d ' ' | tr '\n' ' ')
  echo "processes left of core+ranks: '${left}' (want none)"
  echo "GPU processes left: '$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr '\n' ' ')' (want none)"
fi
