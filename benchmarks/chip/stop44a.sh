#!/usr/bin/env bash
# Stop 44, chip run A: what stop 43's accel run cut or left unmeasured.
# Usage on the device: bash benchmarks/chip/stop44a.sh "$OUT"
set -u
out="$1/a"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
step 150 python -m benchmarks.kernel --grad --cases lotka_volterra_grad --sizes 4096,65536 \
    --methods kernel,vmap,diffrax --repeats 3 --out "$out/lv_grad"
step 60 python -m benchmarks.kernel --cases lorenz --controller constant --dt0 1e-3 \
    --sizes 4096,65536 --methods kernel,vmap,diffrax --repeats 5 --out "$out/lorenz_fixed"
step 90 python -m benchmarks --cases neural_ode --sizes 256,4096 --throw false --dtype float32 \
    --deadline 70 --budget 40 --repeats 2 --repeat-budget 1 --out "$out/neural_ode"
step 40 python -m benchmarks.mosaic_probe --no-smoke
step 180 python -m benchmarks.first_call --dtype float32 --repeats 1 --budget 130 \
    --profile "$out/first_call_profile" --out "$out/first_call"
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/a.tgz" a && rm -rf "$out"
