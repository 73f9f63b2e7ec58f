"""What the inside-step door adds to the hand-written loop, counted, not timed.

The machine is shared, so compile and step times are left to
``bench/bench_many_leaves.py``; what sets them is counted here: how many times
``fun`` is traced per trace of the step, and the fusions the default's step
runs after the loop beside ``skip_nonfinite=False``'s (the one check of the
sums), on a model of many small leaves.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import accum_jax

LAYERS, WIDTH, BATCH, N = 24, 8, 16, 4


def _params():
  keys = jax.random.split(jax.random.key(0), LAYERS)
  return [{"w": jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH, "b": jnp.zeros(WIDTH)}
          for k in keys]


def _loss(params, x):
  for layer in params:
    x = jnp.tanh(x @ layer["w"] + layer["b"])
  return jnp.mean(x ** 2)


def _top_level_fusions(step, *args) -> int:
  text = jax.jit(step).lower(*args).compile().as_text()
  entry = text[text.index("ENTRY"):]
  return len(re.findall(r" fusion\(", entry[: entry.index("\n}")]))


@pytest.fixture(scope="module")
def fusions():
  args = (_params(), jnp.ones((BATCH, WIDTH)))
  return {
      mode: _top_level_fusions(accum_jax.value_and_grad(_loss, N, **kwargs), *args)
      for mode, kwargs in (("default", {}), ("no skip", {"skip_nonfinite": False}))
  }


def test_the_step_check_after_the_loop_is_a_few_fusions_not_one_per_leaf(fusions):
  # 48 leaves: a reduction each would add 48 fusions or more (two each where
  # XLA:CPU splits them); packed, the check is a copy and a reduction.
  assert fusions["default"] - fusions["no skip"] <= 8, fusions
