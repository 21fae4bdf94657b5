"""Evaluation of a converted jaxpr inside `shard_map` with varying-manual-axes checks:
`evaluate` is how a `Closure` runs its jaxpr.

A jaxpr traced outside `shard_map` types every value as invariant across the mesh's
manual axes. Evaluated inside `shard_map(check_vma=True)` with a varying input,
each primitive would see mismatched types where JAX's own tracing would have cast
the invariant operand with `pvary`. So, when some input varies, the jaxpr is
interpreted: each primitive's operands are cast to the union of their varying axes
(what tracing inside the shard_map would have done), nested calls are inlined, and
loops, conds, checkpoints and custom_jvp rules are rebuilt through JAX's own API so
that their bodies are typed afresh. On JAX without these types, nothing changes.

This module imports nothing of solverkit but `_jaxpr_rewrite` (see `_convert.py`).
"""

import jax
import jax.core
import jax.extend.core as jex

from ._jaxpr_rewrite import is_dropped


def _eval_jaxpr(jaxpr, consts, *args):
    if hasattr(jax.core, "eval_jaxpr"):
        return jax.core.eval_jaxpr(jaxpr, consts, *args)
    return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, consts))(*args)  # pragma: no cover


_typeof = getattr(jax, "typeof", None) or jax.core.get_aval  # pyright: ignore


def _vma(x) -> frozenset:
    """The manual mesh axes `x` varies over (empty outside shard_map, or on old JAX)."""
    try:
        aval = _typeof(x)
    except TypeError:
        return frozenset()
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def varying_axes(x) -> frozenset:
    """The `shard_map` manual axes `x` varies over (empty outside, or on old JAX)."""
    return _vma(x)


def union_of_axes(tree) -> frozenset:
    """The manual axes any array leaf of `tree` varies over."""
    leaves = jax.tree_util.tree_leaves(tree)
    return frozenset().union(*(_vma(x) for x in leaves if isinstance(x, jax.Array)))


def vary(tree, axes: frozenset):
    """Every JAX array leaf of `tree` cast to vary over `axes` (no-op on the data):
    so that a backward pass's loops hold varying values from the start, and the
    autodiff inside them sums nothing across devices (which, with a trip count
    that differs between devices, would never meet)."""
    return jax.tree_util.tree_map(
        lambda x: _pvary(x, axes) if isinstance(x, jax.Array) else x, tree
    )


def match_varying(cotangent, axes: frozenset):
    """A cotangent summed over the manual axes it varies over beyond `axes`, those
    of its primal: the transpose of the implicit cast of an invariant primal to
    varying (what JAX's own autodiff does)."""
    extra = tuple(sorted(_vma(cotangent) - axes, key=str))
    if not extra:
        return cotangent
    return jax.lax.psum(cotangent, extra)


def _pvary(x, axes: frozenset):
    """`x` cast from invariant to varying over `axes` (a no-op on the data)."""
    missing = tuple(sorted(axes - _vma(x), key=str))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # pyright: ignore  # pragma: no cover


def _interpret(jaxpr, consts, *args):
    """`eval_jaxpr` that casts operands to matching varying axes (see the module
    docstring)."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        rule = _RULES.get(eqn.primitive.name)
        if rule is not None:
            outs = rule(ins, **eqn.params)
        else:
            union = frozenset().union(*(_vma(x) for x in ins))
            outs = _bind(eqn.primitive, eqn.params, [_pvary(x, union) for x in ins])
        for v, o in zip(eqn.outvars, outs):
            if not is_dropped(v):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _bind(primitive, params, ins, subfuns=None):
    """Bind as `eval_jaxpr` does (whichever form of `get_bind_params` this JAX has),
    optionally with other sub-functions; always a list of outputs."""
    bind_params = primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        old_subfuns, bind_params = bind_params
        outs = primitive.bind(*(subfuns or old_subfuns), *ins, **bind_params)
    else:
        if subfuns is not None:
            bind_params = {**bind_params, "subfuns": tuple(subfuns)}
        outs = primitive.bind(*ins, **bind_params)
    return outs if primitive.multiple_results else [outs]


def _as_fn(closed):
    """A ClosedJaxpr as a function of its flat inputs, interpreted."""
    return lambda *xs: _interpret(closed.jaxpr, closed.consts, *xs)


def _call_rule(ins, *, jaxpr, **_):
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return _interpret(jaxpr.jaxpr, jaxpr.consts, *ins)
    return _interpret(jaxpr, (), *ins)


def _call_jaxpr_rule(ins, *, call_jaxpr, **_):
    return _call_rule(ins, jaxpr=call_jaxpr)


def _scan_rule(ins, *, jaxpr, length, reverse, unroll, **params):
    if "ft_in" in params:  # JAX >= 0.11: the operands' grouping as a flat tree
        consts, init, xs = (list(g) for g in params["ft_in"].update(ins).unpack())
        num_carry = len(init)
    else:
        num_consts, num_carry = params["num_consts"], params["num_carry"]
        consts, init, xs = (
            ins[:num_consts],
            ins[num_consts : num_consts + num_carry],
            ins[num_consts + num_carry :],
        )
    body = _as_fn(jaxpr)
    # The carry must keep its type: make it vary wherever any input does (a sound
    # over-approximation of what the body may make it).
    union = frozenset().union(*(_vma(x) for x in ins))
    init = [_pvary(x, union) for x in init]

    def step(carry, x):
        out = body(*consts, *carry, *x)
        return out[:num_carry], out[num_carry:]

    carry, ys = jax.lax.scan(
        step, init, xs, length=length, reverse=reverse, unroll=unroll
    )
    return [*carry, *ys]


def _while_rule(ins, *, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts, **_):
    cond_consts, body_consts = ins[:cond_nconsts], ins[cond_nconsts:][:body_nconsts]
    init = ins[cond_nconsts + body_nconsts :]
    cond, body = _as_fn(cond_jaxpr), _as_fn(body_jaxpr)
    union = frozenset().union(*(_vma(x) for x in ins))  # as for scan
    init = [_pvary(x, union) for x in init]
    return jax.lax.while_loop(
        lambda c: cond(*cond_consts, *c)[0], lambda c: body(*body_consts, *c), init
    )


def _cond_rule(ins, *, branches, **_):
    index, *ops = ins
    return jax.lax.switch(index, [_as_fn(b) for b in branches], *ops)


def _remat_rule(ins, *, jaxpr, prevent_cse, policy, **_):
    fn = lambda *xs: _call_rule(xs, jaxpr=jaxpr)
    return jax.checkpoint(fn, prevent_cse=prevent_cse, policy=policy)(*ins)


def _custom_jvp_rule(ins, **params):
    """The custom_jvp call again, with its primal and JVP jaxprs interpreted."""
    from jax._src import custom_derivatives as cd, linear_util as lu  # noqa: PLC0415

    # JAX >= 0.11 leaves `num_consts` out where it is 0.
    call_jaxpr, num_consts = params["call_jaxpr"], params.get("num_consts", 0)
    jvp_jaxpr_fun = params["jvp_jaxpr_fun"]

    def jvp(*xs):
        half = len(xs) // 2
        primals, tangents = xs[num_consts:half], xs[half + num_consts :]
        zeros = [type(t) is cd.SymbolicZero for t in tangents]
        jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*zeros)
        nonzero = [t for t in tangents if type(t) is not cd.SymbolicZero]
        out = _interpret(jvp_jaxpr, jvp_consts, *primals, *nonzero)
        out_primals, it = out[: len(out_zeros)], iter(out[len(out_zeros) :])
        out_tangents = [
            cd.SymbolicZero(_typeof(p).to_tangent_aval()) if z else next(it)
            for p, z in zip(out_primals, out_zeros)
        ]
        return [*out_primals, *out_tangents]

    union = frozenset().union(*(_vma(x) for x in ins))
    subfuns = (
        lu.wrap_init(_as_fn(call_jaxpr), debug_info=call_jaxpr.jaxpr.debug_info),
        lu.wrap_init(jvp, debug_info=jvp_jaxpr_fun.debug_info),
    )
    ins = [_pvary(x, union) for x in ins]
    return _bind(cd.custom_jvp_call_p, params, ins, subfuns)


def _pvary_rule(ins, *, axes, **_):
    # A jaxpr traced inside shard_map casts where a value was invariant then; it may
    # vary by now (say, a loop's time): cast only the axes it does not vary over yet.
    return [_pvary(x, frozenset(axes)) for x in ins]


_RULES = {
    "pvary": _pvary_rule,
    "pjit": _call_rule,
    "jit": _call_rule,
    "closed_call": _call_jaxpr_rule,
    "core_call": _call_jaxpr_rule,
    "scan": _scan_rule,
    "while": _while_rule,
    "cond": _cond_rule,
    "checkpoint": _remat_rule,
    "remat2": _remat_rule,
    "custom_jvp_call": _custom_jvp_rule,
}


def evaluate(jaxpr, consts, args):
    """The jaxpr's outputs; interpreted when a value varies over shard_map axes."""
    if any(_vma(x) for x in (*consts, *args)):
        return _interpret(jaxpr, consts, *args)
    return _eval_jaxpr(jaxpr, consts, *args)
