#!/usr/bin/env bash
# Multi-LoRA serving at fixed rates (issue "Multi-LoRA"): benchmarks/serve_bench.sh (Llama-3-8B shape,
# random bf16 weights, random 1024 in / 128 out, ignore_eos) for four servers one after the other:
# LoRA disabled; enabled (16 slots, rank 16, 32 adapters registered) but unused; every request naming
# adapter a0; requests naming a0..a31 round robin (32 adapters over 16 slots). Adapters: rank 16 on
# all seven projections, written by benchmarks/lora_bench.py. Each server's output goes to $OUT/<config>.
#   usage: [RATES='16'] benchmarks/lora_serve.sh [NUM_PROMPTS]
set -u
out=${OUT:-.}
dir=/tmp/splitserve-lora-bench
python benchmarks/lora_bench.py --cfg-only --adapters-dir $dir >/dev/null || exit 1
mods=""; names=""
for i in $(seq 0 31); do mods="$mods a$i=$dir/a$i"; names="$names a$i"; done
lora="--enable-lora --max-loras 16 --max-lora-rank 16 --max-cpu-loras 32 --lora-modules$mods"
for cfg in disabled unused one many; do
  case $cfg in
    disabled) s=""; c="";;
    unused) s="$lora"; c="";;
    one) s="$lora"; c="--lora-modules a0";;
    many) s="$lora"; c="--lora-modules$names";;
  esac
  echo "##### $cfg"
  mkdir -p "$out/$cfg"
  OUT="$out/$cfg" SERVER_ARGS="$s" CLIENT_ARGS="$c" RATES="${RATES:-16}" SWEEP=0 benchmarks/serve_bench.sh "${1:-300}"
done
