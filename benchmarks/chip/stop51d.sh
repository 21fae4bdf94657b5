#!/usr/bin/env bash
# Stop 51, chip run D (#38): the accelerator suite's vmap rows (steps 1-4: Lorenz at
# 4096, 65,536 and 2^20, Lotka-Volterra) after reverse mode of a vmapped solve went
# onto the kernel too (`_kernel/_vmap.py`'s "gradient" mode: forward sensitivities).
# Usage on the device: bash benchmarks/chip/stop51d.sh "$OUT"
set -u
out="$1/d"; mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ ACCEL_STEPS=1,2,3,4 ACCEL_SECONDS=330 timeout 350 bash benchmarks/accel.sh --out "$out/accel"
  echo "== accel.sh steps 1-4 exit $? after $SECONDS s"; } > "$out/run.log" 2>&1
