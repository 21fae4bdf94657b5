#!/usr/bin/env bash
# Stop 48, chip run B: first calls of the vmap path and of `ensemble_solve`
# beside diffrax's (stop 46 last measured the ensemble path: its LV forward 0.51),
# and Rodas5P's vmapped solve with the small solves' slices on TPUs (stop 47's
# `_linalg._SLICE_BACKENDS`; the measured variant was 108.4 ms).
# Usage on the device: bash benchmarks/chip/stop48b.sh "$OUT"
set -u
out="$1/b"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=5 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
step 250 python -m benchmarks.first_call --dtype float32 --repeats 2 --budget 230 \
    --only lotka_volterra/grad-checkpoint,lorenz/adaptive-grad,lotka_volterra/grad-backsolve,lotka_volterra/forward \
    --peers solverkit,solverkit-ensemble,diffrax --out "$out/first_call"
step 50 python -m benchmarks.stiff_ensemble --dtype float32 \
    --plan rodas5p-vmap:16384:1e-6:40 --repeats 3
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/b.tgz" b && rm -rf "$out"
