"""A batch sharded over several devices, solved by each device on its own shard.

The kernel is a `pallas_call`, which XLA's partitioner can't split: given a batch
sharded over devices, it would gather the whole batch onto every device and solve
all of it there. `over_batch` wraps the kernel path's per-batch function in
`custom_partitioning`: the partitioner sees that every batched input and every
output share the batch axis (their first), so each device runs the function on its
own shard (its own kernel, its own lane layout), and the shared inputs are
replicated. With one device the function is inlined: the program is the same as
without the wrapper. Under a further `vmap` (which `custom_partitioning` can't
batch) the function is vmapped as it is.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec


try:  # Shardy's sharding rules (newer JAX); without them a sharded batch is gathered
    from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule
except ImportError:  # pragma: no cover - an older JAX
    ArrayMapping = SdyShardingRule = None


def over_batch(fn: Callable, shared, batched):
    """`fn(shared, batched)`, each device solving its shard of a sharded batch.

    **Arguments:**

    - `fn`: `(shared, batched) -> outputs`; every array leaf of `batched` and of the
        outputs has the batch as its first axis, and `fn` treats the trajectories
        independently (so that a shard of the batch gives the shard of the outputs).
    - `shared`: a pytree (its arrays are replicated on every device).
    - `batched`: a pytree of arrays with a leading batch axis.

    **Returns:**

    `fn(shared, batched)`.
    """
    if jax.device_count() == 1 or SdyShardingRule is None:
        return fn(shared, batched)
    dynamic, static = eqx.partition(shared, eqx.is_array)
    s_leaves, s_tree = jtu.tree_flatten(dynamic)
    b_leaves, b_tree = jtu.tree_flatten(batched)
    num_shared = len(s_leaves)

    def body(*leaves):
        shared = eqx.combine(jtu.tree_unflatten(s_tree, leaves[:num_shared]), static)
        return fn(shared, jtu.tree_unflatten(b_tree, leaves[num_shared:]))

    split = custom_partitioning(body)
    split.def_partition(
        partition=lambda mesh, args, result: _partition(
            body, num_shared, mesh, args, result
        ),
        sharding_rule=lambda mesh, ins, outs: _rule(num_shared, ins, outs),
    )
    run = custom_vmap(lambda *leaves: split(*leaves))

    @run.def_vmap
    def _vmapped(axis_size, in_batched, *leaves):
        axes = [0 if b else None for b in in_batched]
        out = jax.vmap(body, in_axes=axes, axis_size=axis_size)(*leaves)
        return out, jtu.tree_map(lambda _: True, out)

    return run(*s_leaves, *b_leaves)


def _rule(num_shared: int, ins, outs):
    """The batch (`b`): the first axis of the batched inputs and of the outputs;
    every other axis its own factor."""
    array_mapping, sharding_rule = ArrayMapping, SdyShardingRule
    assert array_mapping is not None and sharding_rule is not None  # `over_batch`

    def mapping(kind: str, i: int, value, batch: bool):
        rank = len(value.shape)  # an MLIR ranked tensor type
        own = [f"{kind}{i}_{d}" for d in range(rank)]
        return array_mapping(*(["b", *own[1:]] if batch else own))

    operands = tuple(mapping("i", i, v, i >= num_shared) for i, v in enumerate(ins))
    results = tuple(mapping("o", i, v, True) for i, v in enumerate(outs))
    return sharding_rule(operands, results)


def _partition(body, num_shared: int, mesh, args, result):
    """Each device runs `body` on its shard: the batched inputs and the outputs
    sharded on their first axis as the first batched input is (if evenly), the
    shared inputs replicated."""
    axis = None
    first = args[num_shared]
    sharding = first.sharding
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > 0:
        axis = sharding.spec[0]
    if axis is not None:
        names = axis if isinstance(axis, tuple) else (axis,)
        parts = 1
        for name in names:
            parts *= mesh.shape[name]
        if first.shape[0] % parts:
            axis = None
    along = NamedSharding(mesh, PartitionSpec(axis))
    whole = NamedSharding(mesh, PartitionSpec())
    arg_shardings = tuple(whole if i < num_shared else along for i in range(len(args)))
    result_shardings = jtu.tree_map(lambda _: along, result)
    return mesh, body, result_shardings, arg_shardings
