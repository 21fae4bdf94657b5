"""The test suite's own machinery (conftest.py, helpers.py): compile counting stays
right with the persistent compilation cache on."""

import jax
import jax.numpy as jnp
import pytest
from helpers import count_compiles


def test_count_compiles_counts_persistent_cache_reads():
    # A program read back from the persistent cache after `jax.clear_caches()` is a
    # jit-cache miss: the "compiles once" tests must see it. JAX reports the
    # backend-compile event for a cache read too (0.10); this pins that.
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("the persistent compilation cache is off")
    f = jax.jit(lambda x: jnp.sin(x) * 3.25 - jnp.cos(x) ** 3)
    x, y = jnp.float32(1.0), jnp.float32(2.0)
    f(x).block_until_ready()
    jax.clear_caches()
    with count_compiles() as counter:
        f(x).block_until_ready()
    assert counter.count == 1
    with count_compiles() as counter:
        f(y).block_until_ready()
    assert counter.count == 0
