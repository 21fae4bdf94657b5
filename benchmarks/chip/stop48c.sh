#!/usr/bin/env bash
# Stop 48, chip run C: the whole accelerator suite with its plan trimmed so that
# every step ends by itself inside its limit (stop48a: four steps cut at their
# limits), one command inside the 10-minute limit (ACCEL_SECONDS: its budget).
# Usage on the device: bash benchmarks/chip/stop48c.sh "$OUT"
set -u
out="$1/c"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ timeout $((${ACCEL_SECONDS:-545} + 35)) bash benchmarks/accel.sh --out "$out/accel"
  echo "== accel.sh exit $? after $SECONDS s"; } > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/c.tgz" c && rm -rf "$out"
