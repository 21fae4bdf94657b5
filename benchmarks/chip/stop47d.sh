#!/usr/bin/env bash
# Stop 47, chip run D: first calls of the vmap path's gradients after firstcall7,
# beside diffrax; Rodas5P's vmapped solve at main against main without ca9c695
# (the small dense solves' unstack; ab_unstack/, carried untracked); and
# `SaveAt(steps=True)` under vmap (a per-trajectory row: a scatter every step).
# Usage on the device: bash benchmarks/chip/stop47d.sh "$OUT"
set -u
out="$1/d"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=5 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
step 200 python -m benchmarks.first_call --dtype float32 --repeats 2 --budget 190 \
    --only lotka_volterra/grad-checkpoint,lorenz/adaptive-grad,lotka_volterra/grad-backsolve,lotka_volterra/forward \
    --peers solverkit,diffrax --out "$out/first_call"
step 60 python -m benchmarks.chip.steps_saves --sizes 1024,4096
for tree in . ab_unstack .; do
  (cd "$tree" && PYTHONPATH="$PWD:${PYTHONPATH#*:}" step 45 python -m benchmarks.stiff_ensemble \
    --dtype float32 --plan rodas5p-vmap:16384:1e-6:40 --repeats 3)
done
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/d.tgz" d && rm -rf "$out"
