#!/usr/bin/env bash
# Stop 48, chip run A: the whole accelerator suite on the current tree (stop 43's
# was the last whole run), in one command inside the 10-minute limit.
# Usage on the device: bash benchmarks/chip/stop48a.sh "$OUT"
set -u
out="$1/a"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ git rev-parse HEAD 2>/dev/null; ACCEL_SECONDS=540 timeout 575 bash benchmarks/accel.sh --out "$out/accel"
  echo "== accel.sh exit $? after $SECONDS s"; } > "$out/run.log" 2>&1
tar -C "$1" -czf "$1/a.tgz" a && rm -rf "$out"
