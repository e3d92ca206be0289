#!/usr/bin/env bash
# Prefill/decode disaggregation on ONE GPU over the NixlConnector (#38): a prefill server (kv_producer)
# and a decode server (kv_consumer) at --gpu-memory-utilization 0.45 each, Llama-3-8B shape with random
# bf16 weights (seed 0 on both, so the same model), behind `splitserve router --pd`; random 1024/128 at
# RATE req/s, two seeds; then one colocated server (COLO_UTIL, default 0.45: the decode side's pool) at
# the same rate and seeds. Greedy parity: PARITY prompts (~1,000 tokens, 32 greedy tokens) through the
# router against the colocated server, both plain and with the prompt already in its prefix cache (the
# decode side computes only the last prompt token, as a prefix hit does). Prints a table last.
#   usage: [RATE=16] [NUM=200] [SEED=7200] [PARITY=16] [COLO_UTIL=0.45] [CFG=benchmarks/configs/llama3-8b]
#          [PORT=8011 (prefill; decode +1, router +9, its metrics +10)] [KV_PORT=14579] benchmarks/pd_bench.sh
# Needs NIXL (pip install nixl-cu13). On the device the nixl-cu13 wheel (59 MB) and the server's wheels
# (fastapi, uvicorn, httptools, pydantic, msgspec, pyzmq, typing_extensions, vllm-router: ~27 MB) do not
# fit one call's 64 MiB: install them in two calls into ignored folders (e.g. build/site_nixl, then
# build/site_srv: ignored outputs stay on a warm machine), then run this with both on PYTHONPATH.
# CFG needs a tokenizer beside config.json on the device (ab_same_lease.sh prepare makes .devcarry/llama3-8b).
# UCX's CUDA transports load only with the CUDA runtime on LD_LIBRARY_PATH (torch's nvidia/cu13/lib),
# set here before the servers start; UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y is set by splitserve itself.
# Results (bench serve JSON, logs, parity texts) go to ${OUT:-.}.
set -u
out=${OUT:-.}; rate=${RATE:-16}; n=${NUM:-200}; seed0=${SEED:-7200}; parity=${PARITY:-16}
pp=${PORT:-8011}; dp=$((pp + 1)); rp=$((pp + 9)); kvp=${KV_PORT:-14579}
cfg=${CFG:-benchmarks/configs/llama3-8b}
cudalib=$(python -c "import nvidia, os; print(':'.join(p for d in nvidia.__path__ for p in (os.path.join(d, 'cu13', 'lib'), os.path.join(d, 'cuda_runtime', 'lib')) if os.path.isdir(p)))" 2>/dev/null)
export LD_LIBRARY_PATH="${cudalib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
pids=
serve() {  # port, log, extra args...; sets PID
  local port=$1 log=$2; shift 2
  python -m splitserve serve $cfg --random-weights --dtype bfloat16 --max-model-len 4096 --port $port \
      --disable-access-log ${SERVER_ARGS:-} "$@" >"$out/$log" 2>&1 &
  PID=$!; pids="$pids $PID"
}
wait_up() {  # port, pid
  for _ in $(seq 400); do
    curl -sf http://127.0.0.1:$1/health >/dev/null && return 0
    kill -0 $2 2>/dev/null || break
    sleep 1
  done
  echo "port $1 never became healthy"; tail -30 "$out"/*.log; kill -TERM $pids 2>/dev/null; return 1
}
bench() {  # port, seed, name
  python -m splitserve bench serve --base-url http://127.0.0.1:$1 --tokenizer $cfg --ignore-eos --disable-tqdm \
      --dataset random --random-input-len 1024 --random-output-len 128 --num-prompts $n \
      --request-rate $rate --seed $2 --save-result "$out/$3.json" >"$out/$3.txt" 2>&1
}
greedy() {  # port, file, warm (1: send each prompt once with max_tokens 1 first: a prefix-cache hit after)
  python - "$1" "$2" "$3" "$parity" <<'EOF'
import json, random, sys, httpx
port, path, warm, count = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
words = "the of and to in is was for on that with as by at from his her an were are which this be or".split()
model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
texts = []
for i in range(count):
    rng = random.Random(1000 + i)
    prompt = f"Document {i}: " + " ".join(rng.choice(words) for _ in range(900))
    body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    url = f"http://127.0.0.1:{port}/v1/completions"
    if warm:
        httpx.post(url, json=dict(body, max_tokens=1), timeout=300).raise_for_status()
    r = httpx.post(url, json=body, timeout=300)
    r.raise_for_status()
    texts.append(r.json()["choices"][0]["text"])
json.dump(texts, open(path, "w"))
EOF
}
metrics() {  # port, file
  curl -sf http://127.0.0.1:$1/metrics > "$out/$2" || true
}

# --- disaggregated: prefill (kv_port KV_PORT), decode, router
serve $pp prefill.log --gpu-memory-utilization 0.45 \
    --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_producer\",\"kv_port\":$kvp}"; p=$PID
wait_up $pp $p || exit 1  # one at a time: both profile the free GPU memory at start-up
serve $dp decode.log --gpu-memory-utilization 0.45 \
    --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'; d=$PID
wait_up $dp $d || exit 1
grep -E "KV cache|ready|NIXL|UCX" "$out/prefill.log" "$out/decode.log" | head -12
python -m splitserve router --pd --prefill http://127.0.0.1:$pp --decode http://127.0.0.1:$dp \
    --port $rp --metrics-port $((rp + 1)) >"$out/router.log" 2>&1 &
router=$!; pids="$pids $router"
wait_up $rp $router || exit 1
greedy $rp "$out/parity_pd.json" 0
metrics $dp decode_after_parity.prom
for s in 1 2; do bench $rp $((seed0 + s)) pd_$s; done
metrics $dp decode.prom; metrics $pp prefill.prom
kill -TERM $router $d $p; wait $router $d $p 2>/dev/null

# --- colocated: one server at COLO_UTIL
serve $pp colocated.log --gpu-memory-utilization ${COLO_UTIL:-0.45}; c=$PID
wait_up $pp $c || exit 1
greedy $pp "$out/parity_colo.json" 0
greedy $pp "$out/parity_colo_cached.json" 1
for s in 1 2; do bench $pp $((seed0 + s)) colo_$s; done
kill -TERM $c; wait $c 2>/dev/null

python - "$out" <<'EOF'
import json, os, re, sys
out = sys.argv[1]
def row(name):
    m = json.load(open(os.path.join(out, name + ".json")))["metrics"]
    ms = lambda d, k: 1e3 * d[k] if d.get(k) is not None else float("nan")
    return [ms(m["ttft"], "median"), ms(m["ttft"], "p99"), ms(m["tpot"], "median"), ms(m["itl"], "median"),
            ms(m["itl"], "p99"), m["completed"]]
def metric(path, name):
    try:
        text = open(os.path.join(out, path)).read()
    except OSError:
        return float("nan")
    vals = [float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if re.match(re.escape(name) + r"(\{| )", l)]
    return sum(vals) if vals else float("nan")
print("| run | median TTFT | P99 TTFT | median TPOT | median ITL | P99 ITL | completed |")
print("|---|---|---|---|---|---|---|")
for name in ["pd_1", "pd_2", "colo_1", "colo_2"]:
    try:
        print(f"| {name} | " + " | ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in row(name)) + " |")
    except Exception as e:
        print(f"| {name} | missing ({e}) |")
for s in (1, 2):
    try:
        d = row(f"pd_{s}")[0] - row(f"colo_{s}")[0]
        print(f"seed {s}: median TTFT through the router (prefill + transfer + decode's first step) minus colocated: {d:+.2f} ms")
    except Exception:
        pass
cnt = metric("decode.prom", "splitserve:kv_transfer_time_seconds_count")
tot = metric("decode.prom", "splitserve:kv_transfer_time_seconds_sum")
print(f"decode side: {cnt:.0f} loads, mean load time {1e3 * tot / cnt if cnt else float('nan'):.2f} ms (load_async to DONE seen by poll), "
      f"{metric('decode.prom', 'splitserve:kv_transfer_received_bytes_total') / 2**30:.2f} GiB received, "
      f"{metric('decode.prom', 'splitserve:kv_transfer_failed_total'):.0f} failed; prompt tokens computed there: "
      f"{metric('decode.prom', 'splitserve:prompt_tokens_computed_total'):.0f} "
      f"(received {metric('decode.prom', 'splitserve:kv_transfer_received_tokens_total'):.0f})")
try:
    pd, colo, cached = (json.load(open(os.path.join(out, f))) for f in ("parity_pd.json", "parity_colo.json", "parity_colo_cached.json"))
    same = lambda a, b: sum(x == y for x, y in zip(a, b))
    print(f"greedy parity (32 tokens): PD = colocated {same(pd, colo)}/{len(pd)}; PD = colocated with a prefix hit "
          f"{same(pd, cached)}/{len(pd)}; colocated = colocated with a prefix hit {same(colo, cached)}/{len(colo)}")
    # Random bf16 weights leave near-ties in the logits: texts from different batch shapes part after a few
    # tokens even without a transfer. The mean common prefix (characters) puts PD beside that noise floor.
    common = lambda a, b: sum(len(os.path.commonprefix([x, y])) for x, y in zip(a, b)) / max(len(a), 1)
    print(f"mean common prefix (chars of ~{sum(map(len, colo)) / max(len(colo), 1):.0f}): PD vs colocated "
          f"{common(pd, colo):.1f}, PD vs colocated with a prefix hit {common(pd, cached):.1f}, colocated vs "
          f"colocated with a prefix hit {common(colo, cached):.1f}")
except Exception as e:
    print(f"greedy parity: missing ({e})")
EOF
