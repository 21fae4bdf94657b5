"""`SaveAt(steps=True)` under `vmap` with the row written as `dynamic_update_slice`
(`_save.with_row`, a scatter over (batch, row, column) under `vmap`) against
`buf.at[row].set` (a scatter over (batch, row), as diffrax writes it).

`python -m benchmarks.chip.row_forms [--sizes 4096]`
"""

import argparse

import jax

from benchmarks.chip import steps_saves as S
from solverkit import _save


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4096")
    a = parser.parse_args()
    import jax.numpy as jnp
    import numpy as np

    import solverkit as sk

    forms = {
        "dynamic_update_slice": (_save.with_row, _save.row_of),
        "at-set": (lambda b, r, v: b.at[r].set(v), lambda b, r: b[r]),
    }
    for n in (int(s) for s in a.sizes.split(",")):
        rho = jnp.asarray(np.linspace(20.0, 30.0, n), jnp.float32)
        for name, (put, get) in forms.items():
            _save.with_row, _save.row_of = put, get
            jax.clear_caches()
            run = S._time(S._solver(sk, lambda lib: lib.SaveAt(steps=True)), rho)
            print(f"| {name} | {n} | {run:.4f} |", flush=True)


if __name__ == "__main__":
    main()
