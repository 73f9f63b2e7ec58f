"""What the inside-step door adds to the hand-written loop, counted, not timed.

The machine is shared, so compile and step times are left to
``bench/bench_many_leaves.py``; what sets them is counted here: how many times
``fun`` is traced per trace of the step, on a model of many small leaves, and that
a call's data go one way through the door: bound once, then read, with nothing
below calling back up. The fusions the default's step runs after the loop beside
``on_nonfinite="unchecked"``'s (the one check of the sums) are XLA's choice, counted in
test_xla_facts.py.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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
    {"weight_fn": lambda batch: jnp.sum(batch["w"]), "aux_reduction": {"steps": "sum"}},
], ids=["default", "no skip", "per microbatch", "weights and aux"])
def test_fun_is_traced_once_per_trace_of_the_step(options):
  # The microbatch bind traces for its shapes is the one the loop calls.
  traces: list[int] = []
  step = accum_jax.value_and_grad(_counting_loss(traces), N, has_aux=True, rng_argnums=2,
                                  **options)
  batch = {"x": jnp.ones((BATCH, WIDTH)), "w": jnp.ones(BATCH)}
  jax.jit(step).trace(_params(), batch, jax.random.key(0))
  assert len(traces) == 1


def _calls_across(step, *args) -> dict[str, list[str]]:
  """Over one trace of ``step``: the calls into ``_options`` made from the door's
  loop and finalisation (``_microbatch``), and the calls from the modules below
  it (``_sharding``, ``_core``, ``_batching``) into ``_microbatch``'s functions."""
  below = {"accum_jax._sharding", "accum_jax._core", "accum_jax._batching"}
  found: dict[str, list[str]] = {"into options": [], "back up": []}

  def caller_module(frame):
    frame = frame.f_back
    while frame is not None and not frame.f_globals.get("__name__", "").startswith("accum_jax"):
      frame = frame.f_back
    return None if frame is None else frame.f_globals["__name__"]

  def profile(frame, event, arg):
    if event != "call":
      return
    callee, caller = frame.f_globals.get("__name__", ""), caller_module(frame)
    if callee == "accum_jax._options" and caller == "accum_jax._microbatch":
      found["into options"].append(frame.f_code.co_name)
    if callee == "accum_jax._microbatch" and caller in below:
      found["back up"].append(frame.f_code.co_name)

  sys.setprofile(profile)
  try:
    jax.jit(step).trace(*args)
  finally:
    sys.setprofile(None)
  return found


def test_after_bind_the_door_reads_the_call_and_never_goes_back():
  step = accum_jax.value_and_grad(_counting_loss([]), N, has_aux=True, rng_argnums=2,
                                  weight_fn=lambda batch: jnp.sum(batch["w"]))
  batch = {"x": jnp.ones((BATCH, WIDTH)), "w": jnp.ones(BATCH)}
  found = _calls_across(step, _params(), batch, jax.random.key(0))
  assert found == {"into options": [], "back up": []}


def test_under_a_mesh_only_the_per_device_loop_is_called_from_below():
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip("needs several devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  mesh = jax.make_mesh((len(devices),), ("data",))
  params = jax.device_put(_params(), NamedSharding(mesh, P()))
  batch = jax.device_put({"x": jnp.ones((BATCH * len(devices) // 2, WIDTH)),
                          "w": jnp.ones(BATCH * len(devices) // 2)}, NamedSharding(mesh, P("data")))
  step = accum_jax.value_and_grad(_counting_loss([]), 2, has_aux=True, rng_argnums=2,
                                  weight_fn=lambda batch: jnp.sum(batch["w"]),
                                      data_parallel=accum_jax.DataParallel(
                                          mesh=mesh, data_axis="data", param_sharding=P()))
  found = _calls_across(step, params, batch, jax.random.key(0))
  # shard_map runs the loop on each device: the one call from below is that body.
  assert found == {"into options": [], "back up": ["_local_sums"]}


def test_the_step_check_keeps_the_static_memory_of_no_check():
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
