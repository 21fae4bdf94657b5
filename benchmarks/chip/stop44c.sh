#!/usr/bin/env bash
# Stop 44, chip run D: the fixed-step Lorenz at N = 4096 with the new default block
# rows beside diffrax, and the save-time gradient at 65,536 (cut from run B).
# Usage on the device: bash benchmarks/chip/stop44c.sh "$OUT"
set -u
out="$1/d"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=5 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
step 45 python -m benchmarks.kernel --cases lorenz --controller constant --dt0 1e-3 \
    --sizes 4096 --methods kernel,diffrax --repeats 5 --out "$out/lorenz_fixed"
step 100 python -m benchmarks.ts_grad --out "$out/ts_grad" --sizes 65536 \
    --methods ens_lock,vmap,diffrax --repeats 3
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/d.tgz" d && rm -rf "$out"
