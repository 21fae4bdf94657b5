#!/usr/bin/env bash
# Stop 44: the whole-solve kernel's block rows at small N (default_rows: 8 rows per
# 16,384 trajectories, so 4 blocks of 8 rows at N = 4096, run in sequence).
# Usage on the device: bash benchmarks/chip/stop44_rows.sh "$OUT"
set -u
out="$1/rows"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
step 70 python -m benchmarks.kernel --cases lorenz --controller constant --dt0 1e-3 \
    --sizes 4096,16384 --methods kernel@8,kernel@16,kernel@32,kernel@64 --repeats 5 --out "$out/fixed"
step 70 python -m benchmarks.kernel --cases lorenz --sizes 4096,16384 \
    --methods kernel@8,kernel@16,kernel@32,kernel@64 --repeats 5 --out "$out/adaptive"
step 60 python -m benchmarks.kernel --cases lorenz --t1 10 --sizes 4096,16384 \
    --methods kernel@8,kernel@16,kernel@32,kernel@64 --repeats 5 --out "$out/adaptive_t10"
step 90 python -m benchmarks.kernel --grad --cases lorenz_grad,lotka_volterra_grad --sizes 4096 \
    --methods kernel@8,kernel@16,kernel@32 --repeats 5 --out "$out/grad"
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/rows.tgz" rows && rm -rf "$out"
