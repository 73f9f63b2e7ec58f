"""What the inside-step door adds to the hand-written loop, counted, not timed.

The machine is shared, so compile and step times are left to the benchmarks; what
sets them is counted here: how many times ``fun`` is traced per trace of the step,
on a model of many small leaves, and the static memory of the step's check (that
imports point down through the door is tests/test_layout.py's). The fusions the
default's step runs after the loop beside
``on_nonfinite="unchecked"``'s (the one check of the sums) are XLA's choice, counted in
test_xla_facts.py.
"""

from __future__ import annotations

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


def _counting_loss(counter):
  def loss(params, batch, key):
    counter.append(1)
    noise = 1 + 0.01 * jax.random.normal(key, batch["x"].shape)
    value = _loss(params, batch["x"] * noise) * jnp.mean(batch["w"])
    return value, {"steps": 1, "rows": batch["x"][:, 0]}
  return loss


@pytest.mark.parametrize("options", [
    {},
    {"on_nonfinite": "unchecked"},
    {"on_nonfinite": "skip_microbatch"},
    {"weight_fn": lambda batch: jnp.sum(batch["w"]),
     "aux_reduction": {"steps": "sum", "rows": "concat"}},
], ids=["default", "no skip", "per microbatch", "weights and aux"])
def test_fun_is_traced_once_per_trace_of_the_step(options):
  # The microbatch bind traces for its shapes is the one the loop calls; the
  # per-example "rows" is named "concat" (left at the default it is refused).
  traces: list[int] = []
  options = {"aux_reduction": {"rows": "concat"}, **options}
  step = accum_jax.value_and_grad(_counting_loss(traces), N, has_aux=True, rng_argnums=2,
                                  **options)
  batch = {"x": jnp.ones((BATCH, WIDTH)), "w": jnp.ones(BATCH)}
  jax.jit(step).trace(_params(), batch, jax.random.key(0))
  assert len(traces) == 1


@pytest.mark.xla_fact
def test_the_step_check_keeps_the_static_memory_of_no_check():
  """XLA:CPU's static memory (temp + output) of the step checked and unchecked."""
  # Weights above the check's packing limit are checked where they lie: a packed
  # copy of them would be a second gradient after the loop.
  size = 72  # 72 x 72 = 5184 elements, above the limit of 4096
  params = [{"w": jnp.eye(size) / 2, "b": jnp.zeros(size)} for _ in range(3)]
  x = jnp.ones((16, size))

  def memory(**kwargs):
    compiled = jax.jit(accum_jax.value_and_grad(_loss, N, **kwargs)).lower(params, x).compile()
    analysis = compiled.memory_analysis()
    return analysis.temp_size_in_bytes + analysis.output_size_in_bytes

  assert memory() <= memory(on_nonfinite="unchecked") + 4096
