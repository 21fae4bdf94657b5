"""Small pytree operations used across the engine."""

from typing import TypeVar

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._select import where


_T = TypeVar("_T")


def tree_where(pred, a: PyTree, b: PyTree) -> PyTree:
    """`a` where `pred` else `b`, leaf by leaf."""
    return jtu.tree_map(lambda x, y: where(pred, x, y), a, b)


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    """`a + b`, leaf by leaf."""
    return jtu.tree_map(jnp.add, a, b)


def nograd(tree: _T) -> _T:
    """`tree` with `stop_gradient` on every floating-point array (other leaves, such
    as integers and static fields, unchanged)."""
    dynamic, static = eqx.partition(tree, eqx.is_inexact_array)
    return eqx.combine(lax.stop_gradient(dynamic), static)


def moving_with(tree: PyTree, t, rate: PyTree) -> PyTree:
    """`tree`, unchanged in value, with derivative `rate` with respect to the time
    `t` (`tree + (t - stop_gradient(t)) * rate`, in `tree`'s dtypes): a value taken
    at `t0` that moves with its time as the solution would."""
    shift = t - lax.stop_gradient(t)
    move = lambda x, r: x + (shift.astype(x.dtype) * r).astype(x.dtype)  # noqa: E731
    return jtu.tree_map(move, tree, rate)
