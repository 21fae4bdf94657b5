#!/usr/bin/env bash
# Stop 46, chip run C: the continuing-event forward solve in float32 at main 116b8ba
# (old46/: `git archive 116b8ba solverkit benchmarks tests/helpers.py | tar -x -C
# old46`, untracked, carried with the tree) and at d2545ea (events6 merged): both
# record wrong spike counts on the TPU; and the vmapped stiff solves after compile6.
# Usage on the device: bash benchmarks/chip/stop46c.sh "$OUT"
set -u
out="$1/c"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=5 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
echo "## old (116b8ba)"
(cd old46 && PYTHONPATH="$PWD:$PYTHONPATH" step 120 python -m benchmarks.events --dtype float32 --size 1024 --repeats 2 --variants forward)
echo "## new"
PYTHONPATH="$PWD:$PYTHONPATH" step 120 python -m benchmarks.events --dtype float32 --size 1024 --repeats 2 --variants forward
PYTHONPATH="$PWD:$PYTHONPATH" step 200 python -m benchmarks.stiff_ensemble --dtype float32 --plan bdf-vmap:16384:1e-5:40,rodas5p-vmap:16384:1e-6:40,kvaerno5-vmap:16384:1e-7:40 --repeats 3 --budget 190 --out "$out/stiff"
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/c.tgz" c && rm -rf "$out"
