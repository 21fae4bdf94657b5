#!/usr/bin/env bash
# Stop 45, chip run B: Rodas5P in the whole-solve kernel (kernel5) against the
# vmapped solve, with block rows 64 (default at 16,384), 32 and 8; the lockstep
# ensemble (now jax.vmap of the single solve's loop) against the vmapped BDF and
# Rodas5P solves, alternating; the Rodas5P ensemble as a user calls it.
# Usage on the device: bash benchmarks/chip/stop45b.sh "$OUT"
set -u
out="$1/b"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=5 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
p=rodas5p-vmap:16384:1e-6:60,rodas5p-kernel:16384:1e-6:90,rodas5p-kernel@32:16384:1e-6:60
p=$p,rodas5p-kernel@8:16384:1e-6:60,rodas5p-kernel:16384:1e-5:60,rodas5p-vmap:16384:1e-5:40
step 300 python -m benchmarks.stiff_ensemble --dtype float32 --plan "$p" --repeats 3 \
    --budget 290 --out "$out/kernel"
p=bdf-vmap:16384:1e-5,bdf-ensemble:16384:1e-5,bdf-vmap:16384:1e-5,bdf-ensemble:16384:1e-5
step 130 python -m benchmarks.stiff_ensemble --dtype float32 --plan "$p" --repeats 3 \
    --budget 120 --out "$out/lockstep"
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/b.tgz" b && rm -rf "$out"
