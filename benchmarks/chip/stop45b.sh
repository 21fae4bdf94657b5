#!/usr/bin/env bash
# Stop 45, chip run B: Rodas5P in the whole-solve kernel (kernel5) against the
# vmapped solve (block rows 64, the default at 16,384, and 32); the lockstep
# ensemble (now jax.vmap of the single solve's loop) against the vmapped BDF solve;
# first calls of the vmap path's gradients after firstcall5 (every loop carry
# batched), beside diffrax.
# Usage on the device: bash benchmarks/chip/stop45b.sh "$OUT"
set -u
out="$1/b"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=5 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
p=rodas5p-vmap:16384:1e-6:50,rodas5p-kernel:16384:1e-6:70,rodas5p-kernel@32:16384:1e-6:50
step 175 python -m benchmarks.stiff_ensemble --dtype float32 --plan "$p" --repeats 3 \
    --budget 170 --out "$out/kernel"
p=bdf-vmap:16384:1e-5:40,bdf-ensemble:16384:1e-5:40
step 90 python -m benchmarks.stiff_ensemble --dtype float32 --plan "$p" --repeats 3 \
    --budget 85 --out "$out/lockstep"
step 200 python -m benchmarks.first_call --dtype float32 --repeats 2 --budget 170 \
    --only lotka_volterra/grad-checkpoint,lorenz/adaptive-grad,lotka_volterra/grad-backsolve,lotka_volterra/forward \
    --peers solverkit,solverkit-ensemble,diffrax --out "$out/first_call"
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/b.tgz" b && rm -rf "$out"
