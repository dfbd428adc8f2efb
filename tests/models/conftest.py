"""Test settings for models/: the unit tests compile many tiny programs on CPU."""

import jax
import pytest


@pytest.fixture(scope="module")
def fast_compilation():
    """Skips most XLA optimisation passes: compile time dominates these tests.

    Opt in per module with `pytestmark = pytest.mark.usefixtures("fast_compilation")`;
    the setting is restored afterwards, so other tests run with the default.
    """
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)
