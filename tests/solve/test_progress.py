"""Progress meters: `TextProgressMeter` and `TqdmProgressMeter` output, under jit,
vmap (one bar) and grad, as diffrax prints it."""

import contextlib
import io
import re

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import float64, full_matrix_only

import solverkit as sk


_PERCENT = re.compile(r"^(\d+\.\d\d)%$")


def _percentages(text):
    values = []
    for line in text.splitlines():
        match = _PERCENT.match(line.strip())
        if match:
            values.append(float(match.group(1)))
    return values


def _meter_solve(y0, meter):
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -y),
        sk.Euler(),
        0.0,
        1.0,
        0.01,
        y0,
        progress_meter=meter,
        max_steps=128,
    ).ys


@pytest.mark.usefixtures("x64")
def test_text_progress_meter(capsys):
    _meter_solve(jnp.array([1.0]), sk.TextProgressMeter()).block_until_ready()
    jax.effects_barrier()
    values = _percentages(capsys.readouterr().out)
    assert len(values) >= 3, values
    assert values == sorted(values)
    assert values[-1] == 100.0


@pytest.mark.usefixtures("x64")
def test_text_progress_meter_under_vmap_shows_one_bar(capsys):
    jax.jit(jax.vmap(lambda y: _meter_solve(y, sk.TextProgressMeter())))(
        jnp.ones((4, 1))
    ).block_until_ready()
    jax.effects_barrier()
    values = _percentages(capsys.readouterr().out)
    assert values.count(100.0) == 1, values
    assert values == sorted(values)


@pytest.mark.usefixtures("x64")
def test_text_progress_meter_under_jit_and_grad(capsys):
    grad = jax.jit(jax.grad(lambda y: _meter_solve(y, sk.TextProgressMeter()).sum()))(
        jnp.array([1.0])
    )
    jax.effects_barrier()
    np.testing.assert_allclose(grad, [0.99**100], rtol=1e-10)
    values = _percentages(capsys.readouterr().out)
    assert values and values[-1] == 100.0


@pytest.mark.usefixtures("x64")
def test_tqdm_progress_meter(capsys):
    pytest.importorskip("tqdm")
    out = _meter_solve(jnp.array([1.0]), sk.TqdmProgressMeter())
    jax.effects_barrier()
    np.testing.assert_allclose(out[-1], [0.99**100], rtol=1e-10)
    err = capsys.readouterr().err
    assert "100" in err


def _text_output(fn, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.block_until_ready(fn(*args))
        jax.effects_barrier()
    return out.getvalue()


# `SOLVERKIT_FULL_MATRIX=1` only: the text meter's lines as diffrax prints them are
# test_text_meter_prints_the_lines_diffrax_prints' (under vmap); under jit and grad
# test_text_progress_meter_under_jit_and_grad, under vmap one bar
# test_text_progress_meter_under_vmap_shows_one_bar.
@pytest.mark.slow
@full_matrix_only("test_text_meter_prints_the_lines_diffrax_prints")
def test_text_progress_meter_prints_as_diffrax():
    """Ten steps of 0.1: `0.00%`, then each 10%, as diffrax prints them; under
    vmap and grad too (one meter)."""

    def solve(lib, p):
        return lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: -y),
            lib.Dopri5(),
            0,
            1,
            0.1,
            p * jnp.array([2.0, 3.0]),
            progress_meter=lib.TextProgressMeter(),
        ).ys[-1, 0]

    expected = "".join(f"{10 * k:.2f}%\n" for k in range(11))
    for lib in (sk, diffrax):
        assert _text_output(lambda p: solve(lib, p), 1.0) == expected, lib
        grad = jax.jit(jax.grad(lambda p: solve(lib, p)))
        assert _text_output(grad, 1.0) == expected, lib
    vmapped = jax.vmap(lambda p: solve(sk, p))
    assert _text_output(vmapped, jnp.ones(3)) == expected
    with pytest.raises(ValueError, match="minimum_increase"):
        sk.TextProgressMeter(minimum_increase=0.0)


@pytest.mark.slow
def test_text_meter_prints_the_lines_diffrax_prints():
    # A new line once the progress has grown by more than `minimum_increase` since
    # the last line (not on a fixed grid): 0.00%, 10.20%, 20.40%, ... under vmap.
    def solve(lib, t0):
        return lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: -0.2 * y),
            lib.Dopri5(),
            t0,
            5.0,
            0.01,
            1.0,
            progress_meter=lib.TextProgressMeter(minimum_increase=0.1),
        ).ys

    with float64():
        outputs = [
            _text_output(jax.vmap(lambda t0: solve(lib, t0)), jnp.arange(3.0))
            for lib in (sk, diffrax)
        ]
    assert outputs[0] == outputs[1]
    assert outputs[0].split()[:3] == ["0.00%", "10.20%", "20.40%"]
    with pytest.raises(ValueError, match="minimum_increase"):
        sk.TextProgressMeter(minimum_increase=0.0)


@pytest.mark.slow
def test_tqdm_refreshes_as_diffrax_under_vmap(capfd):
    pytest.importorskip("tqdm")

    def solve(lib, t0):
        return lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: -0.2 * y),
            lib.Dopri5(),
            t0,
            5,
            0.01,
            1.0,
            saveat=lib.SaveAt(steps=True),
            progress_meter=lib.TqdmProgressMeter(refresh_steps=5),
        ).ys

    counts = {}
    for lib in (sk, diffrax):
        for name, fn in {
            "plain": lambda: solve(lib, 2.0),
            "vmap": lambda: jax.vmap(lambda t0: solve(lib, t0))(jnp.arange(3.0)),
        }.items():
            capfd.readouterr()
            jax.block_until_ready(fn())
            jax.effects_barrier()
            err = capfd.readouterr().err
            counts[lib.__name__, name] = (err.count("\r"), err.count("\n"))
    # diffrax's bar also prints when tqdm's `mininterval` (0.1 s) has passed between
    # its updates, so under load its count can grow by a line or two.
    for name in ("plain", "vmap"):
        ours, theirs = counts["solverkit", name], counts["diffrax", name]
        assert ours[1] == theirs[1] and abs(ours[0] - theirs[0]) <= 3, counts
