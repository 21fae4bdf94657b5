#!/usr/bin/env bash
# Stop 46, chip run B: diffrax v0.7.2's ODE tests against solverkit on the chip
# host's CPUs (13 cores), with a longer per-test limit than stop 45's (which cut
# test_adjoint::test_against and test_step_ts[False]).
# Usage on the device: bash benchmarks/chip/stop46b.sh "$OUT"
set -u
out="$1/b"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
echo "== diffrax tests"; t0=$SECONDS
JAX_PLATFORMS=cpu timeout --signal=INT --kill-after=5 520 python -m benchmarks.diffrax_tests \
    .dfx-test -n 12 --timeout 500 --out "$out"
echo "== exit $? after $((SECONDS - t0)) s"
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/b.tgz" b && rm -rf "$out"
