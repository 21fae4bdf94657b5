"""Fields users bring to an accelerator, on the `jax.vmap` route: does every one run,
which path it takes, and does it match the loop; the neural ODE against diffrax;
matrix-product precision; the cost of `throw=True`'s check.

`python -m benchmarks.neural_matrix --out DIR [--budget SECONDS] [--quick]
[--parts neural,precision,throw,accuracy,matrix] [--diffrax-backsolve]
[--fields A:B]`

- `neural`: the 2-64-64-2 softplus MLP neural ODE (`jax.vmap` over `y0`, Tsit5, PID
  1e-3 / 1e-6, `SaveAt(ts=16 points)`, t in [0, 1]) at N = 4096: forward, the
  gradient w.r.t. the MLP (`eqx.filter_value_and_grad`, checkpointed) and with
  `BacksolveAdjoint` (diffrax's only with `--diffrax-backsolve`: on a TPU v5e at
  N = 4096 it had not finished after 400 s), solverkit's defaults against diffrax's,
  side by side; and the latent-ODE size (state 32, width 256, depth 3) at N = 1024.
- `precision`: the same 2-64-64-2 fit (value and gradient) under the default
  matrix precision and under "highest", each against a float32 reference solved on
  the host CPU at rtol = atol = 1e-8, with its time.
- `throw`: a jitted `y * 2` with and without a never-firing error check, in the
  forms a check can take (and with a callback that runs every call); the Lorenz
  ensemble (N = 4096, `jax.vmap`) jitted with `throw=False` and `throw=True`, and
  called eagerly with `throw=True` (checked on the host).
- `accuracy`: the forward values of kernel cells (MLP 2-16-1 and 2-16-2, heat 64,
  pytree; N = 4096) on the kernel and on the loop, each against a reference solved on
  the host CPU at rtol = atol = 1e-8, in units of the tolerance, and the largest
  absolute difference: which path is off where the two differ.
- `matrix`: MLP fields (widths 16-512, depth 1-4, state 2-64), method-of-lines heat
  fields (64-4096 points), a pytree state; forward, checkpointed gradient,
  `BacksolveAdjoint` gradient; N from 256 to 65,536. Each cell: the default path's
  program (`pallas_call` in it: "kernel", else "loop", with the route's reason),
  its time, and for a kernel cell the loop's (`_vmap.ENABLED = False`) values and
  gradients compared: `err` is the largest difference in units of the tolerance
  (`atol + rtol |loop|`), `ok` is `err <= 10`.

Writes `neural_matrix.json` and `neural_matrix.md` after every row; stops taking
new rows when `--budget` seconds have passed.
"""

import argparse
import contextlib
import functools
import json
import pathlib
import statistics
import time
import traceback

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import solverkit as sk
from solverkit._errors import UnsupportedError
from solverkit._kernel import _vmap

from .harness import timed


RTOL, ATOL = 1e-3, 1e-6
T1 = 1.0


def _timed(fn, *args, repeats: int = 3) -> tuple[float, float]:
    """`(first call s, median of `repeats` later calls s)`."""
    return timed(fn, *args, repeats=repeats)[1:]


def _mlp(size: int, width: int, depth: int, key=0):
    return eqx.nn.MLP(
        size, size, width, depth, activation=jax.nn.softplus, key=jax.random.key(key)
    )


class Field(eqx.Module):
    """A vector field `(t, y, args) -> dy/dt` with its parameters (differentiated)."""

    kind: str = eqx.field(static=True)
    params: object

    def __call__(self, t, y, args):
        if self.kind == "mlp":
            return self.params(y)  # pyright: ignore
        if self.kind == "heat":  # u'' by lines, fixed ends, diffusivity params
            pad = jnp.concatenate([y[:1] * 0, y, y[:1] * 0])
            return self.params * (pad[2:] - 2 * y + pad[:-2])
        drag = self.params  # a projectile with quadratic drag, dict state
        speed = jnp.sqrt(jnp.sum(y["v"] ** 2) + 1e-12)
        return {"x": y["v"], "v": jnp.array([0.0, -9.81]) - drag * speed * y["v"]}


def field_of(spec: tuple):
    kind = spec[0]
    if kind == "mlp":
        return Field("mlp", _mlp(*spec[1:]))
    if kind == "heat":
        return Field("heat", jnp.asarray(0.4))
    return Field("pytree", jnp.asarray(0.1))


def y0_of(spec: tuple, n: int):
    key = jax.random.key(1)
    if spec[0] == "mlp":
        return 0.5 * jax.random.normal(key, (n, spec[1]))
    if spec[0] == "heat":
        x = jnp.linspace(0, jnp.pi, spec[1] + 2)[1:-1]
        amp = 1 + jax.random.uniform(key, (n, 1))
        return amp * jnp.sin(x)[None]
    v = jnp.stack([10 + jax.random.uniform(key, (n,)), 10 * jnp.ones(n)], 1)
    return {"x": jnp.zeros((n, 2)), "v": v}


def _solve(lib, field, y0, adjoint=None, ts=None):
    ts = jnp.linspace(0, T1, 16) if ts is None else ts
    kw = dict(adjoint=adjoint) if adjoint is not None else {}
    # throw=False: on a TPU a failed check does not raise but halts the program in
    # an endless loop (equinox's TPU behaviour); a failed trajectory shows as
    # `inf`/NaN in `ys` and so in the row's values instead.
    return lib.diffeqsolve(
        lib.ODETerm(field), lib.Tsit5(), 0.0, T1, None, y0,
        saveat=lib.SaveAt(ts=ts), stepsize_controller=lib.PIDController(
            rtol=RTOL, atol=ATOL), max_steps=4096, throw=False, **kw,
    ).ys  # fmt: skip


def programs(lib, field, y0, solve: str):
    """`(fn, args)`: the jitted forward (ys) or loss-and-gradient w.r.t. the field."""
    adjoint = None
    if solve == "backsolve":
        adjoint = lib.BacksolveAdjoint()

    def ys(field, y0):
        return jax.vmap(lambda y: _solve(lib, field, y, adjoint))(y0)

    if solve == "forward":
        return eqx.filter_jit(ys), (field, y0)

    def loss(field, y0):
        out = ys(field, y0)
        return sum(jnp.mean(x**2) for x in jax.tree_util.tree_leaves(out))

    return eqx.filter_jit(eqx.filter_value_and_grad(loss)), (field, y0)


def _leaves(x) -> list:
    return [
        np.asarray(v) for v in jax.tree_util.tree_leaves(eqx.filter(x, eqx.is_array))
    ]


def _err(got, want) -> float:
    """The largest difference in units of `atol + rtol |want|` (gradients: of
    `rtol max |want|`, leaf by leaf)."""
    worst = 0.0
    for a, b in zip(_leaves(got), _leaves(want)):
        scale = ATOL + RTOL * np.abs(b)
        if a.ndim == 0 or b.size < 2 or np.max(np.abs(b)) == 0:
            scale = ATOL + RTOL * max(float(np.max(np.abs(b))), 1e-30)
        worst = max(worst, float(np.max(np.abs(a - b) / scale)))
    return worst


def _reason(field, y0) -> str:
    """Why the kernel declines this field (the kernel path's own message)."""
    one = jax.tree_util.tree_map(lambda x: x[:8], y0)
    try:
        jax.eval_shape(
            lambda y: sk.ensemble_solve(
                sk.ODETerm(field), sk.Tsit5(), 0.0, T1, None, y,
                saveat=sk.SaveAt(ts=jnp.linspace(0, T1, 16)),
                stepsize_controller=sk.PIDController(rtol=RTOL, atol=ATOL),
                kernel=True, throw=False,
            ),
            one,
        )  # fmt: skip
    except UnsupportedError as e:
        return str(e).split("can't solve this: ")[-1][:200]
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:200]}"
    return "(the kernel path supports it: the route leaves this solve to the loop)"


class Writer:
    def __init__(self, out: pathlib.Path):
        self.out, self.rows = out, []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, row: dict):
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        rows = ",\n".join(json.dumps(r) for r in self.rows)  # a row a line
        (self.out / "neural_matrix.json").write_text(f"[\n{rows}\n]\n")
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in self.rows:
            cells = [r.get(k, "") for k in keys]
            lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
        (self.out / "neural_matrix.md").write_text("\n".join(lines) + "\n")


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x).replace("|", "/")


def neural(w: Writer, quick: bool, peer_backsolve: bool = False, deadline=None):
    import diffrax

    cases = [
        ((2, 64, 2), 64 if quick else 4096),
        ((32, 256, 3), 16 if quick else 1024),
    ]
    for (size, width, depth), n in cases:
        spec = ("mlp", size, width, depth)
        field, y0 = field_of(spec), y0_of(spec, n)
        for solve in ("forward", "gradient", "backsolve"):
            if deadline is not None and time.perf_counter() > deadline:
                return
            row = dict(part="neural", field=f"mlp {size}-{width}x{depth}", n=n)
            row["solve"] = solve
            for name, lib in (("solverkit", sk), ("diffrax", diffrax)):
                if name == "diffrax" and solve == "backsolve" and not peer_backsolve:
                    # At N = 4096 on a TPU v5e it had not finished after 400 s.
                    row["diffrax_ms"] = "not run (--diffrax-backsolve runs it)"
                    continue
                try:
                    fn, args = programs(lib, field, y0, solve)
                    first, t = _timed(fn, *args)
                    row[f"{name}_ms"], row[f"{name}_first_s"] = 1e3 * t, first
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_ms"] = f"{type(e).__name__}: {str(e)[:80]}"
            if isinstance(row.get("diffrax_ms"), float):
                row["ratio"] = row["solverkit_ms"] / row["diffrax_ms"]
            w.add(row)


@contextlib.contextmanager
def _route(enabled: bool):
    """`jax.vmap(diffeqsolve)` takes the kernel route (`True`) or the loop inside."""
    saved = _vmap.ENABLED
    _vmap.ENABLED = enabled
    try:
        yield
    finally:
        _vmap.ENABLED = saved


def _reference(field, y0, solve: str):
    """`programs(sk, ...)`'s output solved on the host CPU at rtol = atol = 1e-8."""
    global RTOL, ATOL
    cpu = jax.devices("cpu")[0]
    tolerances = RTOL, ATOL
    RTOL, ATOL = 1e-8, 1e-8
    try:
        with jax.default_device(cpu):
            put = lambda x: jax.device_put(x, cpu) if eqx.is_array(x) else x  # noqa: E731
            field, y0 = jax.tree_util.tree_map(put, (field, y0))
            fn, args = programs(sk, field, y0, solve)
            return fn(*args)
    finally:
        RTOL, ATOL = tolerances


def precision(w: Writer, quick: bool):
    n = 64 if quick else 4096
    spec = ("mlp", 2, 64, 2)
    field, y0 = field_of(spec), y0_of(spec, n)
    ref = _reference(field, y0, "gradient")
    for setting in ("default", "highest"):
        fn, args = programs(sk, field, y0, "gradient")
        with jax.default_matmul_precision(setting):
            first, t = _timed(fn, *args)
            got = fn(*args)
        value_err = abs(float(got[0]) - float(ref[0])) / abs(float(ref[0]))
        g, r = _leaves(got[1]), _leaves(ref[1])
        num = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(g, r)))
        den = np.sqrt(sum(float(np.sum(b**2)) for b in r))
        w.add(dict(part="precision", setting=setting, n=n, ms=1e3 * t,
                   value_rel_err=value_err, grad_rel_err=num / den))  # fmt: skip
    # The library's default (no setting: "highest" for the field's products).
    fn, args = programs(sk, field, y0, "gradient")
    first, t = _timed(fn, *args)
    w.add(dict(part="precision", setting="(solverkit's default)", n=n, ms=1e3 * t))


def throw(w: Writer, quick: bool):
    del quick
    from jax.experimental import io_callback

    x = jnp.ones((4096, 2))

    def plain(x):
        return x * 2

    def eqx_check(x):
        return eqx.error_if(x * 2, jnp.any(x < -1), "never")

    def cond_debug(x):
        def fire():
            jax.debug.callback(lambda: None)

        jax.lax.cond(jnp.any(x < -1), fire, lambda: None)
        return x * 2

    def cond_io(x):
        bad = jnp.any(x < -1)
        out = jax.lax.cond(
            bad,
            lambda: io_callback(
                lambda: np.int32(0), jax.ShapeDtypeStruct((), jnp.int32)
            ),
            lambda: jnp.int32(0),
        )
        return x * 2 + out

    def always_pure(x):  # a callback that runs every call
        one = jax.pure_callback(
            lambda: np.float32(1), jax.ShapeDtypeStruct((), x.dtype)
        )
        return x * 2 * one

    def always_debug(x):
        jax.debug.callback(lambda: None)
        return x * 2

    forms = [
        ("plain", plain),
        ("eqx.error_if", eqx_check),
        ("cond+debug.callback", cond_debug),
        ("cond+io_callback", cond_io),
        ("pure_callback every call", always_pure),
        ("debug.callback every call", always_debug),
    ]
    for name, fn in forms:
        f = jax.jit(fn)
        _timed(f, x)
        ts = []
        for _ in range(50):
            s = time.perf_counter()
            f(x).block_until_ready()
            ts.append(time.perf_counter() - s)
        w.add(dict(part="throw", form=name, ms=1e3 * statistics.median(ts)))
    _throw_solves(w)


def _throw_solves(w: "Writer"):
    """Lorenz, N = 4096, `jax.vmap` (the route), jitted, with `throw=True` and
    `throw=False`, and eagerly with `throw=True` (checked on the host)."""

    def lorenz(t, y, args):
        a, b = y[0] * (28.0 - y[2]) - y[1], y[0] * y[1] - 8 / 3 * y[2]
        return jnp.stack([10.0 * (y[1] - y[0]), a, b])

    y0 = 1.0 + 0.1 * jax.random.normal(jax.random.key(0), (4096, 3))

    def solve(y0, throw):
        return sk.diffeqsolve(
            sk.ODETerm(lorenz), sk.Tsit5(), 0.0, 1.0, 0.01, y0,
            saveat=sk.SaveAt(ts=jnp.linspace(0, 1, 8)), throw=throw,
            stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-6),
        ).ys  # fmt: skip

    for throw_, jit in ((False, True), (True, True), (True, False)):
        fn = jax.vmap(lambda y: solve(y, throw_))
        fn = jax.jit(fn) if jit else fn
        first, t = _timed(fn, y0, repeats=20)
        form = f"lorenz N=4096 throw={throw_} {'jit' if jit else 'eager'}"
        w.add(dict(part="throw", form=form, ms=1e3 * t, first_s=first))


def accuracy(w: "Writer", quick: bool):
    """Kernel and loop forward values, each against a reference solved on the host
    CPU at rtol = atol = 1e-8: which path is off where the two differ."""
    n = 64 if quick else 4096
    specs = [("mlp", 2, 16, 1), ("mlp", 2, 16, 2), ("heat", 64), ("pytree",)]
    for spec in specs:
        field, y0 = field_of(spec), y0_of(spec, n)
        with _route(True):
            fn, args = programs(sk, field, y0, "forward")
            kernel = fn(*args)
        with _route(False):
            fn, args = programs(sk, field, y0, "forward")
            loop = fn(*args)
        ref = _reference(field, y0, "forward")
        row = dict(part="accuracy", field=" ".join(map(str, spec)), n=n)
        row["kernel_vs_loop"] = _err(kernel, loop)
        row["kernel_vs_ref"] = _err(kernel, ref)
        row["loop_vs_ref"] = _err(loop, ref)
        for name, got in (("kernel", kernel), ("loop", loop)):
            diffs = [np.max(np.abs(a - b)) for a, b in zip(_leaves(got), _leaves(ref))]
            row[f"{name}_abs_vs_ref"] = float(max(diffs))
        w.add(row)


def _matrix_fields(quick: bool) -> list:
    if quick:
        return [(("mlp", 2, 4, 1), (8,)), (("heat", 8), (8,)), (("pytree",), (8,))]
    return [
        (("mlp", 2, 16, 1), (4096, 65536)),
        (("mlp", 2, 16, 2), (4096,)),
        (("heat", 64), (4096, 65536)),
        (("pytree",), (4096,)),
        (("mlp", 2, 64, 2), (256, 4096)),
        (("heat", 256), (4096,)),
        (("mlp", 8, 32, 2), (4096,)),
        (("mlp", 2, 128, 3), (1024,)),
        (("heat", 1024), (1024,)),
        (("mlp", 64, 64, 4), (1024,)),
        (("mlp", 2, 512, 1), (1024,)),
        (("heat", 4096), (256,)),
        (("mlp", 32, 256, 3), (1024,)),
        (("mlp", 2, 16, 4), (256,)),
        (("heat", 64), (256,)),
    ]


def _cell(w: Writer, spec, n: int, solve: str):
    field, y0 = field_of(spec), y0_of(spec, n)
    row = dict(part="matrix", field=" ".join(map(str, spec)), n=n, solve=solve)
    fn, args = programs(sk, field, y0, solve)
    text = str(eqx.filter_make_jaxpr(fn)(*args)[0])
    row["path"] = "kernel" if "pallas_call" in text else "loop"
    first, t = _timed(fn, *args, repeats=2)
    row["ms"], row["first_s"] = 1e3 * t, first
    if row["path"] == "loop":
        row["reason"] = _reason(field, y0)
        row["ok"] = True  # the default is the loop itself
    else:
        got = fn(*args)
        with _route(False):
            loop, largs = programs(sk, field, y0, solve)
            first, t = _timed(loop, *largs, repeats=2)
            row["loop_ms"], row["loop_first_s"] = 1e3 * t, first
            want = loop(*largs)
        row["err"] = _err(got, want)
        row["ok"] = row["err"] <= 10
    w.add(row)


def matrix(w: Writer, quick: bool, deadline: float, fields: slice = slice(None)):
    for spec, sizes in _matrix_fields(quick)[fields]:
        for n in sizes:
            for solve in ("forward", "gradient", "backsolve"):
                if time.perf_counter() > deadline:
                    return
                try:
                    _cell(w, spec, n, solve)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    error = f"{type(e).__name__}: {str(e)[:300]}"
                    field = " ".join(map(str, spec))
                    row = dict(part="matrix", field=field, n=n, solve=solve)
                    w.add(dict(row, ok=False, error=error))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=400)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default="neural,precision,throw,accuracy,matrix")
    parser.add_argument("--diffrax-backsolve", action="store_true")
    parser.add_argument(
        "--fields", default=":", help="the matrix's fields to run, a slice: 6: or 0:3"
    )
    a = parser.parse_args()
    deadline = time.perf_counter() + a.budget
    w = Writer(pathlib.Path(a.out))
    w.add(dict(part="device", kind=jax.devices()[0].device_kind, jax=jax.__version__))
    parts = a.parts.split(",")
    neural_ = functools.partial(
        neural, peer_backsolve=a.diffrax_backsolve, deadline=deadline
    )
    runs = (("neural", neural_), ("precision", precision), ("throw", throw))
    runs += (("accuracy", accuracy),)
    for name, run in runs:
        if name in parts and time.perf_counter() < deadline:
            try:
                run(w, a.quick)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                w.add(dict(part=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
    if "matrix" in parts:
        start, _, stop = a.fields.partition(":")
        fields = slice(int(start) if start else None, int(stop) if stop else None)
        matrix(w, a.quick, deadline, fields)


if __name__ == "__main__":
    main()
