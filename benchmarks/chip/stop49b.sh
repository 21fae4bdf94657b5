#!/usr/bin/env bash
# Stop 49, chip run B: the whole accelerator suite (`benchmarks/accel.sh`'s default
# plan: steps 1-8, the neural ODE only on request; no matplotlib installed, the plots
# drawn afterwards by `python -m benchmarks.report`; each step's end logged), one
# command inside the 10-minute limit (ACCEL_SECONDS: its budget).
# Usage on the device: bash benchmarks/chip/stop49b.sh "$OUT"
set -u
out="$1/b"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ timeout $((${ACCEL_SECONDS:-545} + 35)) bash benchmarks/accel.sh --out "$out/accel"
  echo "== accel.sh exit $? after $SECONDS s"; } > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/b.tgz" b && rm -rf "$out"
