"""Timing several compiled programs by turns in one process, and the attention inputs.

A ratio of two times measured minutes apart carries whatever else the machine
did in between. Timed by turns (a, b, c, a, b, c, ...) in one process, a busy
spell falls on all of them; each keeps its best run, since other load only
ever adds time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

HEADS, HEAD_DIM = 8, 64


def attention_inputs(n: int):
    """q, k, v: [1, n, 8, 64] float32, ready on the device."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    qkv = tuple(jax.random.normal(key, (1, n, HEADS, HEAD_DIM), jnp.float32) for key in keys)
    return jax.block_until_ready(qkv)


def compiled_grad(fn: Callable, qkv):
    """The AOT-compiled gradient of sum(fn(q, k, v)) w.r.t. q, k and v."""
    import jax
    import jax.numpy as jnp

    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))
    return step.lower(*qkv).compile()


def timed(f: Callable, *args) -> float:
    """Seconds of one call of f(*args), waited for."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - start


def best_by_turns(calls: Mapping[str, tuple[Callable, tuple]], turns: int,
                  calls_per_turn: int = 1) -> dict[str, float]:
    """Best seconds of each named f(*args), calling them by turns `turns` times."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(turns):
        for name, (f, args) in calls.items():
            for _ in range(calls_per_turn):
                best[name] = min(best[name], timed(f, *args))
    return best
