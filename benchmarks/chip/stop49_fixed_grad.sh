#!/usr/bin/env bash
# Stop 49 (#38): the vmapped fixed-step Lorenz gradient (Tsit5, 1000 steps of 1e-3,
# float32) at N = 4096 and 65,536 on five solverkit trees side by side in one
# process (benchmarks/fixed_grad_ab.py): its run time, first call (trace + lower +
# compile), the row operations and kernels of each loop of the chip's optimized HLO
# (N = 64), and the gradient against the first tree's. The trees: stop 43
# (db97c35: 13.5 ms at 4096), before and at the firstcall6 merge (9d2ba23 =
# b0a2282^1, b0a2282), main before #38's fix (fdfa543: 19.7 ms at stop 48's
# 762e61e), and this tree.
# Before carrying the tree to the chip, in the repository (untracked copies; never
# commit them):
#   for c in db97c35 9d2ba23 b0a2282 fdfa543; do mkdir -p benchmarks/ab_old/$c &&
#     git archive $c solverkit | tar -x -C benchmarks/ab_old/$c; done
# Usage on the device: bash benchmarks/chip/stop49_fixed_grad.sh "$OUT"
# (a try on the CPU: FG_SIZES=64 FG_REPEATS=2 bash benchmarks/chip/stop49_fixed_grad.sh /tmp/x)
set -u
out="$1/fixed_grad"; mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
. benchmarks/common.sh
bench_packages > "$out/run.log" 2>&1 || exit 1
old=()
for c in db97c35 9d2ba23 b0a2282 fdfa543; do
    [ -d "benchmarks/ab_old/$c/solverkit" ] && old+=(--old "benchmarks/ab_old/$c")
done
{ timeout --signal=INT --kill-after=20 280 "$PYTHON" -m benchmarks.fixed_grad_ab \
    "${old[@]}" --sizes "${FG_SIZES:-4096,65536}" --repeats "${FG_REPEATS:-10}" \
    --first-calls 2 --out "$out"
  echo "== fixed_grad_ab exit $? after $SECONDS s"; } >> "$out/run.log" 2>&1
