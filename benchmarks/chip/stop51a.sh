#!/usr/bin/env bash
# Stop 51, chip run A (#38): `jax.vmap(diffeqsolve)` on the whole-solve kernel (the
# batching rule of `solverkit/_kernel/_vmap.py`): the accelerator suite's Lorenz rows
# at 4096 and 65,536 (step 1), Lotka-Volterra (step 4) and the vmapped Rodas5P on
# Van der Pol at 16,384 (step 7, that case only), single-shot first calls included.
# Usage on the device: bash benchmarks/chip/stop51a.sh "$OUT"
set -u
out="$1/a"; mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{ ACCEL_STEPS=1,4,7 ACCEL_SECONDS=330 STIFF_ARGS="--plan rodas5p-vmap:16384:1e-6:25 --repeats 1" \
    timeout 360 bash benchmarks/accel.sh --out "$out/accel"
  echo "== accel.sh steps 1,4,7 exit $? after $SECONDS s"; } > "$out/run.log" 2>&1
