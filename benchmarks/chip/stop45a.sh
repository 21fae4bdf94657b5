#!/usr/bin/env bash
# Stop 45, chip run A: `ensemble_solve` as a user calls it (every default:
# kernel=None, the whole-solve kernel on a TPU) against the lockstep
# `jax.vmap(diffeqsolve)` on the Lorenz sweeps of #38 (rho <= 28 / <= 100, t <= 10),
# and the BDF / Rodas5P lockstep ensemble against the vmapped solve, measured twice
# in alternating order (stop 44 saw BDF at 1.20x, once).
# Usage on the device: bash benchmarks/chip/stop45a.sh "$OUT"
set -u
out="$1/a"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=5 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
step 150 python -m benchmarks.ensemble --dtype float32 --cases lorenz100,lorenz28 \
    --sizes 16384,65536 --lanes k,n --no-chunked --repeats 3 --out "$out/ensemble"
p=bdf-vmap:16384:1e-5,bdf-ensemble:16384:1e-5,bdf-vmap:16384:1e-5,bdf-ensemble:16384:1e-5
p=$p,rodas5p-vmap:16384:1e-6,rodas5p-ensemble:16384:1e-6
step 170 python -m benchmarks.stiff_ensemble --dtype float32 --plan "$p" --repeats 3 \
    --budget 160 --out "$out/stiff"
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/a.tgz" a && rm -rf "$out"
