#!/usr/bin/env bash
# Stop 47, chip run A: the continuing-event forward solve in float32 after the
# accumulation fix (566e84d: stop 46's wrong spike counts), its search loops'
# iteration counts (why it ran 5x diffrax's restart loop on the chip), the event
# tests on the chip, and Rodas5P's vmapped solve at main against stop 45's tree
# (old45/, 116b8ba: 108 vs 116 ms in stop 46).
# Usage on the device: bash benchmarks/chip/stop47a.sh "$OUT"
set -u
out="$1/a"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { local s="$1"; shift; echo "== $* (limit $s s)"; local t0=$SECONDS
  timeout --signal=INT --kill-after=5 "$s" "$@"; echo "== exit $? after $((SECONDS - t0)) s"; }
{
step 100 python -m benchmarks.chip.event_loops --size 1024
step 200 python -m benchmarks.events --dtype float32 --size 1024 --repeats 3 \
    --json "$out/events_f32.json"
PYTEST_SECONDS=150 PYTEST_ARGS="tests/test_hybrid.py tests/test_hybrid_steps.py tests/test_events.py tests/test_event_search.py" \
    step 170 bash benchmarks/tpu_tests.sh --out "$out/tests"
for tree in . old45; do
  (cd "$tree" && PYTHONPATH="$PWD:${PYTHONPATH#*:}" step 60 python -m benchmarks.stiff_ensemble \
    --dtype float32 --plan rodas5p-vmap:16384:1e-6:40 --repeats 3)
done
} > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/a.tgz" a && rm -rf "$out"
