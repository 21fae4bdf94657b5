#!/usr/bin/env bash
# One device session, as one command: a smoke test, the GPU benchmarks (gpu.sh with
# shorter per-case deadlines), then the quick test suite on the GPU. Everything it
# writes goes to $OUT (default: benchmarks/results/gpu-session/):
#
#   OUT=... bash benchmarks/gpu_session.sh
#
# Budget: about 9 minutes on one H200 (smoke < 30 s, benchmarks < 5 min, tests
# cut at 200 s), so that it fits one 10-minute device call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu-session}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"

echo "== smoke" | tee "$OUT/session.log"
"$PYTHON" - <<'PY' 2>&1 | tee -a "$OUT/session.log" || exit 1
import jax, jax.numpy as jnp, equinox, diffrax, solverkit as sk
print("jax", jax.__version__, "equinox", equinox.__version__, "diffrax",
      diffrax.__version__, jax.devices())
sol = sk.diffeqsolve(sk.ODETerm(lambda t, y, a: -a * y), sk.Tsit5(), 0.0, 1.0, 0.1,
                     jnp.ones(3), 2.0, stepsize_controller=sk.PIDController(1e-6, 1e-8))
print("smoke:", sol.ys[-1], float(jnp.exp(-2.0)))
PY

echo "== benchmarks" | tee -a "$OUT/session.log"
GPU_EXTRAS=0 timeout 320 bash benchmarks/gpu.sh --deadline lorenz=110,lotka_volterra=70,neural_ode=50 \
    --out "$OUT/bench" 2>&1 | tail -40 | tee -a "$OUT/session.log"

echo "== tests (not slow, cut at 200 s)" | tee -a "$OUT/session.log"
timeout 200 "$PYTHON" -m pytest -q -m "not slow" -p no:cacheprovider -x \
    --durations=10 > "$OUT/tests.log" 2>&1
echo "pytest rc=$? (124: cut by the timeout)" | tee -a "$OUT/session.log"
tail -25 "$OUT/tests.log"
