"""Dropout with a cheap counter-based mask generator (the portable default).

Why these masks and not jax.random.bernoulli (threefry) on every backend: they
are plain integer jnp ops (no custom rule, no platform branch), so grad, jvp,
vmap and export pass through them unchanged; they equal across meshes by
construction; and they cost a tenth of threefry's arithmetic. On the 2-core CPU
the training step's random-bit time fell from ~120 ms to a few ms
(benchmarks/README.md, "Training step"). On GPU both are cheap next to the
matmuls; `benchmarks/accelerator.py --sections dropout` measures the pair there.

On CPU most of dropout's cost is random-bit generation: threefry spends ~20
rounds of add/rotate/xor per 32-bit word. Here every element needs only 16
bits, and each 32-bit word is a keyed integer hash of its counter (two rounds
of the murmur3 finaliser, each keyed by one word of the threefry key that flax
derives for the layer and step), so a mask costs about 1/10 of threefry's work
(1/5 as computed: each element hashes its own word, which lets the mask fuse
into the select that applies it instead of being stored).

Properties (tests/models/test_dropout.py):
  * keep-probability: 16-bit draws give keep = round(p * 2^16) / 2^16 (0.1 ->
    0.899994); outputs are scaled by 1/keep of *that* value, so E[dropout(x)]
    = x exactly;
  * masks depend on (key, element index) only: equal on every mesh (the index
    is the global one under jit sharding) and independent across layers and
    steps, whose keys differ (flax folds in the module path, the loop the step).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

Array = Any

_BITS = 16
_MAX_ELEMENTS = 2 * 2**32  # two 16-bit draws per 32-bit counter


def _fmix32(x: Array) -> Array:
    """murmur3's 32-bit finaliser: a bijection with full avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _keyed_hash(counter: Array, k0: Array, k1: Array) -> Array:
    """The 32-bit word of each counter: two finaliser rounds keyed by k0 and k1."""
    return _fmix32(_fmix32(counter ^ k0) + k1)


def _key_words(rng: Array) -> tuple[Array, Array]:
    data = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
    words = jnp.asarray(data).astype(jnp.uint32).reshape(-1)
    return words[0], words[-1]


def keep_threshold(rate: float) -> int:
    """16-bit draws below this are kept: round((1 - rate) * 2^16)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    return round((1.0 - rate) * 2**_BITS)


def keep_probability(rate: float) -> float:
    """The exact probability that keep_mask keeps an element (16-bit quantised 1 - rate)."""
    return keep_threshold(rate) / 2**_BITS


def keep_mask(rng: Array, rate: float, shape: tuple[int, ...]) -> Array:
    """Boolean keep mask of `shape`, True with probability keep_threshold(rate) / 2^16.

    Args:
      rng: a PRNG key (typed or raw uint32 key data).
      rate: drop probability in [0, 1).
      shape: mask shape.
    """
    threshold = keep_threshold(rate)
    n = math.prod(shape)
    if n > _MAX_ELEMENTS:
        raise ValueError(f"keep_mask: {n} elements exceed the generator's {_MAX_ELEMENTS}")
    half = (n + 1) // 2
    k0, k1 = _key_words(rng)
    # The low and high halves of word i are elements i and half + i.
    if n > 2**32:  # element indices overflow uint32: hash once, concatenate the halves
        words = _keyed_hash(lax.iota(jnp.uint32, half), k0, k1)
        draws = jnp.concatenate([words & jnp.uint32(0xFFFF), words >> 16])[:n]
        return (draws < jnp.uint32(threshold)).reshape(shape)
    # Elementwise form of the same bits: each element hashes its own word, so the
    # mask fuses into its consumers instead of being materialised (XLA:CPU runs
    # concatenations slowly); hashing twice costs less than the memory traffic.
    index = lax.iota(jnp.uint32, n).reshape(shape)
    low = index < jnp.uint32(half)
    words = _keyed_hash(jnp.where(low, index, index - jnp.uint32(half)), k0, k1)
    draws = jnp.where(low, words & jnp.uint32(0xFFFF), words >> 16)
    return draws < jnp.uint32(threshold)


def dropout(x: Array, rate: float, rng: Array) -> Array:
    """Inverted dropout: x * mask / keep, with keep the mask's exact probability."""
    if rate == 0.0:
        return x
    mask = keep_mask(rng, rate, x.shape)
    scale = jnp.asarray(1.0 / keep_probability(rate), x.dtype)
    return jnp.where(mask, x * scale, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """nn.Dropout's interface (rate, `deterministic`, 'dropout' rng) on keep_mask.

    Attributes:
      rate: drop probability in [0, 1]; 1 drops everything.
    """

    rate: float

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool) -> Array:
        if deterministic or self.rate == 0.0:
            return x
        if self.rate == 1.0:
            return jnp.zeros_like(x)
        return dropout(x, self.rate, self.make_rng("dropout"))
