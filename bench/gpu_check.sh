#!/usr/bin/env bash
# The prepared device check (bench/gpu_check.py says what each step checks):
#
#   bash bench/gpu_check.sh [--cpu] [--out DIR] [--step-timeout SECONDS] [--only "STEP ..."|STEP,STEP]
#
# Every step runs in its own process under its own timeout; a step that fails or overruns is a
# FAIL line and a record in DIR/gpu_check.json, and the next step still runs. Exit status: the
# number of failed steps (0: all ok). On a GPU it needs no vLLM and downloads nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
cpu="" out="${OUT:-bench/results}/gpu_check" limit=""
steps="versions cuda kernels merge_bitwise engine_weights probe fsdp2 train speed depth7b best7b one_gpu7b"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu="--cpu" ;;
    --out) out="$2"; shift ;;
    --step-timeout) limit="$2"; shift ;;
    --only) steps="${2//,/ }"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 64 ;;
  esac
  shift
done
mkdir -p "$out" && rm -f "$out/gpu_check.json"
n=$(wc -w <<< "$steps")
# Seconds per step: train runs train.py (a warm-up and 3 updates), speed two train.py runs of 8
# updates, depth7b two processes of a 7B's updates (each under 4 minutes), best7b four processes of
# one 7B update each (or a skip), one_gpu7b train.py's 7b-random with its engine, 3 updates; the
# others a minute or two. On an H100/H200 the check up to depth7b takes about 6 minutes
# (bench/README.md's table says each step's); best7b and one_gpu7b are planned at about 4 more.
declare -A seconds=([versions]=60 [cuda]=60 [kernels]=90 [merge_bitwise]=90 [engine_weights]=60 [probe]=120
                    [fsdp2]=90 [train]=150 [speed]=235 [depth7b]=235 [best7b]=170 [one_gpu7b]=150)
failed=0
for step in $steps; do
  t="${limit:-${seconds[$step]}}"
  STEP_TIMEOUT="$((t - 10))" timeout -k 5 "$t" python bench/gpu_check.py "$step" $cpu --out "$out"
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    python bench/gpu_check.py --fail "$step" "no end within $t s (killed)" --out "$out"
  fi
  [ $rc -ne 0 ] && failed=$((failed + 1))
done
echo "gpu_check: $failed of $n steps failed; records in $out/gpu_check.json"
exit $failed
