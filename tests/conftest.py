"""Strict settings for the whole suite: implicit rank promotion (broadcasting arrays
of different ranks) raises, so the library must be written without it."""

import jax


jax.config.update("jax_numpy_rank_promotion", "raise")
