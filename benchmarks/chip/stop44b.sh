#!/usr/bin/env bash
# Stop 44, chip run B: the save-time gradient (one-hot rows on a TPU) and the stiff
# ensembles (BDF's element-wise step). Usage on the device: bash benchmarks/chip/stop44b.sh "$OUT"
set -u
out="$1/b"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
step 170 python -m benchmarks.ts_grad --out "$out/ts_grad" --sizes 4096,65536 \
    --methods ens_lock,ens_lock@index,vmap,vmap@index,ens_t1,diffrax --repeats 3 --micro
step 280 python -m benchmarks.stiff_ensemble --dtype float32 --plan chip --repeats 2 \
    --budget 200 --out "$out/stiff_ensemble"
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/b.tgz" b && rm -rf "$out"
