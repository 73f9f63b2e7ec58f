"""Where a GPU would wait on the host: every door, every option set.

On XLA:GPU a ``while`` loop whose trip count XLA cannot prove copies its
predicate to the host every iteration, and every ``conditional`` copies its
branch index each time it runs. Each door's compiled step must loop over the
microbatches with a known trip count and nothing of the kind inside. The default
(``on_nonfinite="propagate"``) judges the step after the loop with selects and runs
no conditional; ``on_nonfinite="skip_microbatch"`` runs at most one per step, the
recheck of a gradient that is NaN under a finite loss, after the loop.
``accumulate`` runs at most one per call. Read with
the public :func:`accum_jax.testing.host_syncs`, on the programs XLA compiled.
"""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import normal
from jax.sharding import PartitionSpec as P

import accum_jax
import accum_jax.equinox
import accum_jax.flax
from accum_jax.testing import assert_no_host_syncs_in_loops, host_syncs

N = 4
BATCH = 16


def params() -> dict[str, np.ndarray]:
  return {"w1": normal(0, (8, 16), 0.3), "b1": normal(1, (16,), 0.1),
          "w2": normal(2, (16, 8), 0.3), "b2": normal(3, (8,), 0.1)}


def batch() -> dict[str, np.ndarray]:
  mask = np.ones(BATCH, np.float32)
  mask[-3:] = 0
  return {"x": normal(4, (BATCH, 8)), "y": normal(5, (BATCH, 8)), "mask": mask}


def loss(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)


def weighted_loss(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  err = jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2, axis=-1)
  mean = jnp.sum(err * b["mask"]) / jnp.maximum(jnp.sum(b["mask"]), 1.0)
  return mean, {"per_example": err, "mean_err": jnp.mean(err), "count": jnp.sum(b["mask"])}


def stateful_loss(p, state, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  new_state = {"mean": 0.9 * state["mean"] + 0.1 * jnp.mean(h, axis=0)}
  return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2), (new_state, ())


def dropout_loss(p, key, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  h = h * jax.random.bernoulli(key, 0.9, h.shape) / 0.9
  return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)


def compiled(fun, *args):
  return jax.jit(fun).lower(*args).compile()


def check_step(program, num_microbatches: int = N, conditionals: int = 0) -> None:
  """Loops of known trip count only, nothing that waits inside them, the
  microbatch loop among them, and at most ``conditionals`` per run."""
  syncs = host_syncs(program)
  assert_no_host_syncs_in_loops(program)
  assert not syncs.unknown_trip_count, str(syncs)
  assert num_microbatches in [loop.trip_count for loop in syncs.loops], str(syncs)
  assert syncs.per_run is not None and syncs.per_run <= conditionals, str(syncs)


def weight(b):
  return b["mask"].sum()


# Each option set of value_and_grad, on one device: (fun, options, extra arguments).
OPTION_SETS = {
    "defaults": (loss, {}),
    "weights and aux kinds": (weighted_loss, {
        "weight_fn": weight, "has_aux": True,
        "aux_reduction": {"per_example": "concat", "mean_err": "mean", "count": "sum"},
    }),
    "state_argnums": (stateful_loss, {"state_argnums": 1, "batch_argnums": 2, "has_aux": True}),
    "rng_argnums": (dropout_loss, {"rng_argnums": 1, "batch_argnums": 2}),
    "gradient_noise": (loss, {"gradient_noise": True, "return_info": True}),
    "reduction": (loss, {"reduction": {"w1": "mean", "b1": "sum", "w2": "max",
                                                 "b2": "last"}}),
    "bfloat16 accumulator": (loss, {"accumulator_dtype": jnp.bfloat16}),
}


def arguments(fun) -> tuple[Any, ...]:
  if fun is stateful_loss:
    return params(), {"mean": np.zeros(16, np.float32)}, batch()
  if fun is dropout_loss:
    return params(), jax.random.key(0), batch()
  return params(), batch()


@pytest.mark.parametrize("skip", ["propagate", "skip_microbatch"],
                         ids=["default", "skip_microbatch"])
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_value_and_grad_loops_with_a_known_trip_count_and_nothing_inside(name, skip):
  fun, options = OPTION_SETS[name]
  args = arguments(fun)
  vg = accum_jax.value_and_grad(fun, N, on_nonfinite=skip, **options)
  # The default judges the step after the loop with selects: no conditional.
  check_step(compiled(vg, *args), conditionals=int(skip == "skip_microbatch"))


def test_unchecked_no_conditional_runs_at_all():
  program = compiled(accum_jax.value_and_grad(loss, N, on_nonfinite="unchecked"), params(), batch())
  check_step(program)
  assert host_syncs(program).per_run == 0


def test_grad_loops_with_a_known_trip_count_and_nothing_inside():
  check_step(compiled(accum_jax.grad(loss, N), params(), batch()))


# Under a mesh of 8: data parallel, FSDP, HSDP, ZeRO-1 (gather once), FSDP x tensor.
MESHES = {
    "data parallel": ((8,), ("data",), "data", {"param_sharding": P()}),
    "fsdp": ((8,), ("data",), "data", {"param_sharding": {
        "w1": P(None, "data"), "b1": P("data"), "w2": P("data", None), "b2": P("data")}}),
    "fsdp, gather once": ((8,), ("data",), "data", {"gather": "once", "param_sharding": {
        "w1": P(None, "data"), "b1": P("data"), "w2": P("data", None), "b2": P("data")}}),
    "hsdp": ((2, 4), ("replica", "fsdp"), ("replica", "fsdp"), {"param_sharding": {
        "w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P()}}),
    "fsdp x tensor": ((4, 2), ("data", "model"), "data", {"param_sharding": {
        "w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data"), "b2": P()}}),
}


@functools.cache
def mesh_of(shape, axes):
  return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


@pytest.mark.parametrize("name", list(MESHES))
def test_every_reduction_mode_loops_with_a_known_trip_count_and_nothing_inside(name):
  shape, axes, data_axis, options = MESHES[name]
  mesh = mesh_of(shape, axes)
  # Two microbatches per device: 16 rows over the data axes' devices.
  num_microbatches = 2
  vg = accum_jax.value_and_grad(
      weighted_loss, num_microbatches, weight_fn=weight, has_aux=True, gradient_noise=True,
      return_info=True, aux_reduction={"per_example": "concat"},
      data_parallel=accum_jax.DataParallel(mesh, data_axis, **options),
  )
  check_step(compiled(vg, params(), batch()), num_microbatches)


class NnxMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(8, 16, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(jnp.tanh(self.hidden(x))))


def nnx_loss(model, b):
  return jnp.mean((model(b["x"]) - b["y"]) ** 2)


def test_the_nnx_door_loops_with_a_known_trip_count_and_nothing_inside():
  graphdef, state = nnx.split(NnxMLP(nnx.Rngs(0)))
  vg = accum_jax.flax.nnx_value_and_grad(nnx_loss, N)

  def step(state, b):
    model = nnx.merge(graphdef, state)
    value, grads = vg(model, b)
    return value, grads, nnx.state(model)

  check_step(compiled(step, state, batch()))


class EqxMLP(eqx.Module):
  hidden: eqx.nn.Linear
  out: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.hidden = eqx.nn.Linear(8, 16, key=k1)
    self.out = eqx.nn.Linear(16, 8, key=k2)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


def eqx_loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def test_the_equinox_door_loops_with_a_known_trip_count_and_nothing_inside():
  model = EqxMLP(jax.random.key(0))
  arrays, static = eqx.partition(model, eqx.is_array)
  vg = accum_jax.equinox.filter_value_and_grad(eqx_loss, N)
  b = batch()
  check_step(compiled(lambda a, x, y: vg(eqx.combine(a, static), x, y), arrays, b["x"], b["y"]))


def embed(p, b):
  return jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"]


def contrastive(p, z, b):
  logits = z @ z.T / 8.0
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.diag(logits)) + 0.0 * p["b2"].sum()


@pytest.mark.parametrize("on_mesh", [False, True], ids=["one device", "mesh of 8"])
def test_the_cached_door_loops_with_a_known_trip_count_and_nothing_inside(on_mesh):
  options = ({"data_parallel": accum_jax.DataParallel(mesh_of((8,), ("data",)), "data", P())}
             if on_mesh else {})
  num_microbatches = 2 if on_mesh else N
  vg = accum_jax.cached_value_and_grad(embed, contrastive, num_microbatches, **options)
  program = compiled(vg, params(), batch())
  check_step(program, num_microbatches)
  # No chunk of a coupled loss can be dropped: nothing to recheck, no conditional.
  assert host_syncs(program).per_run == 0, str(host_syncs(program))


@pytest.mark.parametrize("options", [{}, {"gradient_noise": True}, {"on_nonfinite": "unchecked"},
                                     {"on_nonfinite": "skip_microbatch"}],
                         ids=["defaults", "gradient_noise", "on_nonfinite='unchecked'",
                              "on_nonfinite='skip_microbatch'"])
def test_accumulate_runs_one_conditional_per_call_and_none_when_the_host_decides(options):
  tx = accum_jax.accumulate(optax.adam(1e-3), every_k=N, **options)
  p = params()
  state = tx.init(p)
  device = host_syncs(compiled(lambda g, s, q: tx.update(g, s, q), p, state, p))
  top = [c for c in device.conditionals if not c.in_branch]
  nested = [c for c in device.conditionals if c.in_branch]
  assert not device.loops and len(top) == 1, str(device)
  # The default judges the window in the applying branch: once more on that call only.
  assert len(nested) == (options.get("on_nonfinite", "skip_window") == "skip_window"), str(device)
  for apply in (False, True):
    host = host_syncs(compiled(lambda g, s, q, a=apply: tx.update(g, s, q, apply=a), p, state, p))
    assert not host.loops and host.per_run == 0, (apply, str(host))
