"""The machine's fp32 matmul peak, measured robustly, for every benchmark's MFU.

A single peak measurement taken while the machine is busy (another process, a
compile, a frequency dip) comes out low, and MFU divided by it can pass 100%.
So the benchmarks sample the peak many times in the same run, alternated with
what they time (`sample()` in each worker before and after its timing runs),
and divide by the best sample of the whole run (`Peak.value`). `Peak.mfu`
refuses a ratio above 1: that would mean the peak was never measured at full
speed, and the run's MFU figures are not to be trusted.
"""

from __future__ import annotations

import time

N = 2048  # a 2048^3 float32 matmul: compute bound, large enough for all cores


def sample(repeats: int = 3) -> list[float]:
    """FLOP/s of `repeats` timed 2048^3 float32 matmuls in jax and in numpy each.

    Both, because either library's GEMM can be the faster one on a given CPU;
    the peak is the best of all.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jax.random.normal(jax.random.PRNGKey(0), (N, N), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (N, N), jnp.float32)
    flops = []
    runs = ((jax.jit(jnp.matmul), (a, b)), (np.matmul, (np.asarray(a), np.asarray(b))))
    for matmul, args in runs:
        jax.block_until_ready(matmul(*args))  # warm-up (and compile)
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(matmul(*args))
            flops.append(2 * N**3 / (time.perf_counter() - start))
    return flops


class Peak:
    """The best of all peak samples of one run."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def add(self, samples: list[float]) -> None:
        self.samples.extend(samples)

    @property
    def value(self) -> float:
        if not self.samples:
            raise ValueError("no matmul peak was measured in this run")
        return max(self.samples)

    def describe(self) -> str:
        return (f"fp32 matmul peak {self.value / 1e9:.0f} GFLOP/s (best of {len(self.samples)} "
                f"2048^3 samples alternated with the runs; worst {min(self.samples) / 1e9:.0f})")

    def mfu(self, flops_per_s: float) -> float:
        """flops_per_s / peak, refusing a value above 1 (an unreliable peak)."""
        ratio = flops_per_s / self.value
        if ratio > 1.0:
            raise ValueError(f"{flops_per_s / 1e9:.0f} GFLOP/s is above the measured peak "
                             f"{self.value / 1e9:.0f} GFLOP/s: the peak was never measured at "
                             "full speed (was the machine busy?); rerun on an idle machine")
        return ratio
