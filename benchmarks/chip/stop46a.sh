#!/usr/bin/env bash
# Stop 46, chip run A: first calls of the vmap path's gradients after firstcall6
# (the step traced once for the forward loop and `_invariant`, once for the
# recomputation and the pullback; SaveAt(t1) rows built directly; row reads without
# an inner jit), beside diffrax; and the continuing-event forward solve (events6: the
# in-step search evaluates the step's dense output by Horner's rule) against
# diffrax's restart loop, float32.
# Usage on the device: bash benchmarks/chip/stop46a.sh "$OUT"
set -u
out="$1/a"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=5 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
step 250 python -m benchmarks.first_call --dtype float32 --repeats 2 --budget 230 \
    --only lotka_volterra/grad-checkpoint,lorenz/adaptive-grad,lotka_volterra/grad-backsolve,lotka_volterra/forward \
    --peers solverkit,solverkit-ensemble,diffrax --out "$out/first_call"
step 270 python -m benchmarks.events --dtype float32 --size 1024 --repeats 5 \
    --variants forward --json "$out/events_f32.json"
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/a.tgz" a && rm -rf "$out"
