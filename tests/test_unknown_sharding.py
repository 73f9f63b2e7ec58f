"""The natural call under ``jax.jit`` with automatic mesh axes: warned, or right.

``jax.jit(accum_jax.value_and_grad(loss, N, data_parallel=DataParallel(mesh=mesh)))`` traces its
arguments without their shardings (automatic axes leave them out of the types, and
one trace serves every sharding), so it cannot tell FSDP parameters from replicated
ones. It must end one of two ways: a gradient sharded like the parameters within
10% of the per-device memory of the hand-written sharded scan, or an
``UnknownShardingWarning`` at trace time naming ``param_sharding=``. For each
layout (FSDP, HSDP, FSDP x tensor) and each door, the natural call warns, and the
calls its message recommends (``param_sharding=``, explicit axes) do not warn and
give sharded gradients within that memory (the exceptions are named where they
are checked). Data parallelism keeps its one all-reduce after the loop either way.
The reference is the scan MaxText writes: a ``lax.scan`` over strided microbatches,
``jax.value_and_grad`` inside, the carry ``jnp.zeros_like(params)`` constrained to
the parameters' shardings.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import normal, tree_allclose
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
import accum_jax.equinox
import accum_jax.flax
from accum_jax.testing import collectives

WIDTH, NUM_LAYERS, BATCH, N = 256, 4, 64, 4
# Per device, temp + output: the ceiling against the hand-written sharded scan.
MEMORY_RATIO = 1.10


class Layout(NamedTuple):
  shape: tuple[int, ...]
  names: tuple[str, ...]
  data_axis: Any  # the data_axis= option
  spec: P  # every weight's


LAYOUTS = {
    "fsdp": Layout((8,), ("data",), "data", P("data", None)),
    "hsdp": Layout((2, 4), ("replica", "fsdp"), ("replica", "fsdp"), P("fsdp", None)),
    "fsdp x tensor": Layout((4, 2), ("data", "model"), "data", P("data", "model")),
}
DOORS = ("value_and_grad", "grad", "nnx_value_and_grad", "filter_value_and_grad",
         "cached_value_and_grad")


def _mesh(layout: Layout, axis_type: AxisType = AxisType.Auto) -> jax.sharding.Mesh:
  return jax.make_mesh(layout.shape, layout.names, axis_types=(axis_type,) * len(layout.names))


def _data_axes(layout: Layout) -> tuple[str, ...]:
  return layout.data_axis if isinstance(layout.data_axis, tuple) else (layout.data_axis,)


def _host_problem() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  weights = {f"w{i}": normal(i, (WIDTH, WIDTH), 1 / WIDTH**0.5) for i in range(NUM_LAYERS)}
  batch = {"x": normal(10, (BATCH, WIDTH)), "y": normal(11, (BATCH, WIDTH))}
  return weights, batch


def _hidden(weights: Any, x: jax.Array) -> jax.Array:
  for i in range(NUM_LAYERS - 1):
    x = jnp.tanh(x @ weights[f"w{i}"])
  return x


def _head(weights: Any, hidden: jax.Array, batch: Any) -> jax.Array:
  return jnp.mean((hidden @ weights[f"w{NUM_LAYERS - 1}"] - batch["y"]) ** 2)


def loss_fn(weights: Any, batch: Any) -> jax.Array:
  return _head(weights, _hidden(weights, batch["x"]), batch)


class NnxMLP(nnx.Module):
  """The weights as ``nnx.Param`` without sharding metadata."""

  def __init__(self, weights: dict[str, jax.Array]):
    for name, w in weights.items():
      setattr(self, name, nnx.Param(w))

  def weights(self) -> dict[str, jax.Array]:
    return {f"w{i}": getattr(self, f"w{i}")[...] for i in range(NUM_LAYERS)}


class EqxMLP(eqx.Module):
  """The weights as an Equinox module's fields."""

  w0: jax.Array
  w1: jax.Array
  w2: jax.Array
  w3: jax.Array

  def weights(self) -> dict[str, jax.Array]:
    return {f"w{i}": getattr(self, f"w{i}") for i in range(NUM_LAYERS)}


def _module_loss(model: Any, batch: Any) -> jax.Array:
  return loss_fn(model.weights(), batch)


def _place(layout: Layout, mesh: jax.sharding.Mesh, spec: P) -> tuple[Any, Any]:
  weights, batch = _host_problem()
  weights = jax.device_put(weights, NamedSharding(mesh, spec))
  batch = jax.device_put(batch, NamedSharding(mesh, P(_data_axes(layout))))
  return weights, batch


class Door(NamedTuple):
  jit: Any  # jax.jit, nnx.jit or eqx.filter_jit
  make: Any  # a DataParallel -> the function the door returns
  args: Any  # (weights, batch) -> its arguments
  grads: Any  # its output -> the gradient as a dict of weights


def _door(name: str) -> Door:
  if name == "value_and_grad":
    return Door(jax.jit, lambda o: accum_jax.value_and_grad(loss_fn, N, data_parallel=o),
                lambda w, b: (w, b), lambda out: out[1])
  if name == "grad":
    return Door(jax.jit, lambda o: accum_jax.grad(loss_fn, N, data_parallel=o), lambda w, b: (w, b),
                lambda out: out)
  if name == "nnx_value_and_grad":
    return Door(nnx.jit,
                lambda o: accum_jax.flax.nnx_value_and_grad(_module_loss, N, data_parallel=o),
                lambda w, b: (NnxMLP(w), b), lambda out: nnx.to_pure_dict(out[1]))
  if name == "filter_value_and_grad":
    return Door(eqx.filter_jit,
                lambda o: accum_jax.equinox.filter_value_and_grad(_module_loss, N, data_parallel=o),
                lambda w, b: (EqxMLP(**w), b), lambda out: out[1].weights())
  assert name == "cached_value_and_grad"
  return Door(jax.jit,
              lambda o: accum_jax.cached_value_and_grad(
                  lambda w, b: _hidden(w, b["x"]), _head, N, data_parallel=o),
              lambda w, b: (w, b), lambda out: out[1])


def _compiled(jitted: Any, args: tuple[Any, ...]) -> jax.stages.Compiled:
  compiled = jitted.lower(*args).compile()
  return getattr(compiled, "compiled", compiled)  # jax's, under Equinox's wrapper


def _per_device_bytes(compiled: jax.stages.Compiled) -> int:
  stats = compiled.memory_analysis()
  return stats.temp_size_in_bytes + stats.output_size_in_bytes


@functools.cache
def _scan_bytes(layout_name: str) -> int:
  """Per device, temp + output, of the hand-written sharded scan (as MaxText writes it)."""
  layout = LAYOUTS[layout_name]
  mesh = _mesh(layout)
  weights, batch = _place(layout, mesh, layout.spec)
  shardings = jax.tree.map(lambda w: w.sharding, weights)

  def step(weights, batch):
    def split(x):  # microbatch i: rows i, i + N, ...: a slice of every device's rows
      return x.reshape(x.shape[0] // N, N, *x.shape[1:]).swapaxes(0, 1)

    def body(carry, microbatch):
      total, acc = carry
      value, g = jax.value_and_grad(loss_fn)(weights, microbatch)
      return (total + value, jax.tree.map(jnp.add, acc, g)), None

    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, weights), shardings)
    (total, acc), _ = jax.lax.scan(body, (jnp.float32(0), zeros), jax.tree.map(split, batch))
    acc = jax.lax.with_sharding_constraint(acc, shardings)
    return total / N, jax.tree.map(lambda g: g / N, acc)

  return _per_device_bytes(jax.jit(step).lower(weights, batch).compile())


@functools.cache
def _reference() -> Any:
  return jax.grad(loss_fn)(*_host_problem())


def _assert_sharded_like_and_right(grads: Any, weights: Any) -> None:
  for name, g in grads.items():
    assert g.sharding.is_equivalent_to(weights[name].sharding, g.ndim), (
        name, g.sharding.spec, weights[name].sharding.spec)
  tree_allclose(grads, _reference())


# Pairs over the ceiling, with or without the warning; the check fails when one is
# fixed, to take it off this list. The grad door on FSDP x tensor was one (1.38 to
# 1.47 times the scan while the per-microbatch skip was the default); with the
# whole-step default it is at 0.85, as value_and_grad of the same call.
OVER_THE_SCANS_MEMORY: set[tuple[str, str]] = set()


# On JAX 0.11 and later XLA lays out every door's FSDP x tensor step with 1.4 to 1.5
# times the scan's memory (inside shard_map a collective over "data" first gathers
# its operand over the automatic "model" axis; the benchmarks page measures the same
# on the bench's layout). The memory bound holds there on the JAX this project is
# developed with; the sharding and the values are checked on every JAX.
_TENSOR_AXES_LAID_OUT_WIDE = tuple(map(int, jax.__version__.split(".")[:2])) >= (0, 11)


def _check_memory(compiled: jax.stages.Compiled, layout_name: str, door_name: str) -> None:
  ratio = _per_device_bytes(compiled) / _scan_bytes(layout_name)
  if layout_name == "fsdp x tensor" and _TENSOR_AXES_LAID_OUT_WIDE:
    return
  if (layout_name, door_name) in OVER_THE_SCANS_MEMORY:
    assert ratio > MEMORY_RATIO, f"{ratio:.2f}: remove it from OVER_THE_SCANS_MEMORY"
    return
  assert ratio <= MEMORY_RATIO, f"{ratio:.2f} x the hand-written scan's temp + output"


@pytest.mark.parametrize("door_name", DOORS)
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_the_natural_call_warns_and_the_fixes_it_names_shard_within_the_scans_memory(
    layout_name, door_name
):
  layout, door = LAYOUTS[layout_name], _door(door_name)
  mesh = _mesh(layout)
  weights, batch = _place(layout, mesh, layout.spec)
  args = door.args(weights, batch)
  options = {"mesh": mesh, "data_axis": layout.data_axis}
  # The natural call: warned at trace time, naming the option that fixes it.
  with pytest.warns(accum_jax.UnknownShardingWarning, match=re.escape("param_sharding=")):
    door.jit(door.make(accum_jax.DataParallel(**options))).lower(*args)
  # Following the advice: no warning, gradients sharded like the weights, and no
  # more memory per device than the hand-written sharded scan (within 10%).
  with warnings.catch_warnings():
    warnings.simplefilter("error", accum_jax.UnknownShardingWarning)
    jitted = door.jit(door.make(accum_jax.DataParallel(**options, param_sharding=layout.spec)))
    compiled = _compiled(jitted, args)
    grads = door.grads(jitted(*args))
  _assert_sharded_like_and_right(grads, weights)
  _check_memory(compiled, layout_name, door_name)
  if layout_name == "fsdp x tensor":
    # Explicit axes with a tensor axis fail in JAX 0.10's lowering of the
    # reduce-scatter (AssertionError (0, P(None, 'model'))), with or without this.
    return
  # Or explicit axes: the natural call itself sees the shardings.
  explicit = _mesh(layout, AxisType.Explicit)
  weights, batch = _place(layout, explicit, layout.spec)
  args = door.args(weights, batch)
  with warnings.catch_warnings(), jax.set_mesh(explicit):
    warnings.simplefilter("error", accum_jax.UnknownShardingWarning)
    jitted = door.jit(door.make(accum_jax.DataParallel(explicit, layout.data_axis)))
    compiled = _compiled(jitted, args)
    grads = door.grads(jitted(*args))
  _assert_sharded_like_and_right(grads, weights)
  _check_memory(compiled, layout_name, door_name)


def _data_parallel_collectives(compiled: jax.stages.Compiled, mesh: Any) -> list[Any]:
  """The collectives a step runs each time (not in the recheck's rare branch)."""
  return [c for c in collectives(compiled.as_text(), mesh) if not c.in_branch]


def test_data_parallel_warns_unless_param_sharding_is_p_and_keeps_one_all_reduce():
  layout = LAYOUTS["fsdp"]
  mesh = _mesh(layout)
  weights, batch = _place(layout, mesh, P())  # replicated: data parallel
  grad_bytes = sum(w.nbytes for w in jax.tree.leaves(weights))
  natural_dp = accum_jax.DataParallel(mesh, "data")
  with pytest.warns(accum_jax.UnknownShardingWarning, match=re.escape("param_sharding=P()")):
    natural = jax.jit(accum_jax.value_and_grad(loss_fn, N, data_parallel=natural_dp))
    natural = natural.lower(weights, batch)
  with warnings.catch_warnings():
    warnings.simplefilter("error", accum_jax.UnknownShardingWarning)
    said = jax.jit(accum_jax.value_and_grad(
        loss_fn, N, data_parallel=accum_jax.DataParallel(mesh, "data", param_sharding=P())))
    said = said.lower(weights, batch)
  for lowered in (natural, said):
    found = _data_parallel_collectives(lowered.compile(), mesh)
    assert [c for c in found if c.in_loop] == [], found
    # One all-reduce after the loop carries the whole gradient (and the scalars).
    gradient = [c for c in found if c.result_bytes >= grad_bytes]
    assert [(c.kind, c.axes) for c in gradient] == [("all-reduce", ("data",))], found


def test_the_warning_names_the_leaves_and_their_cost_once_per_trace_at_the_callers_line():
  layout = LAYOUTS["fsdp"]
  mesh = _mesh(layout)
  weights, batch = _place(layout, mesh, layout.spec)
  # A scalar cannot be sharded: it is not named. Two differentiated arguments.
  params = {"w": weights["w0"], "t": jax.device_put(jnp.float32(1.0), NamedSharding(mesh, P()))}

  def loss(params, batch, extra):
    return params["t"] * loss_fn({**weights, "w0": params["w"]}, batch) + jnp.sum(extra)

  extra = jax.device_put(jnp.ones(WIDTH), NamedSharding(mesh, P("data")))
  step = jax.jit(accum_jax.value_and_grad(loss, N, argnums=(0, 2), batch_argnums=1,
      data_parallel=accum_jax.DataParallel(mesh=mesh)))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step(params, batch, extra)
    step(params, batch, extra)  # the same trace: no second warning
  assert [c.category for c in caught] == [accum_jax.UnknownShardingWarning]
  message = str(caught[0].message)
  assert caught[0].filename == __file__, caught[0].filename
  kib = (WIDTH * WIDTH + WIDTH) * 4 / 2**10
  for part in (
      "accum_jax cannot see how 2 differentiated leaves of argument 0 (['w']) and argument 2"
      " are sharded", "taken as replicated over the data axes ('data',)",
      f"a full-size float32 accumulator of them ({kib:.1f} KiB here, where a sharded one"
      " holds as little as 1/8 of that)", "the gradient comes back replicated",
      "param_sharding=P() for replicated parameters, which also silences this warning",
      "DataParallel(param_sharding=...)", "explicit mesh axes (AxisType.Explicit)",
      "call the step eagerly",
  ):
    assert part in message, (part, message)
  # A new trace (another batch size) warns again; an eager call sees the arrays.
  with pytest.warns(accum_jax.UnknownShardingWarning):
    step(params, jax.tree.map(lambda x: x[: BATCH // 2], batch), extra)
  with warnings.catch_warnings():
    warnings.simplefilter("error", accum_jax.UnknownShardingWarning)
    accum_jax.value_and_grad(loss, N, argnums=(0, 2), batch_argnums=1,
        data_parallel=accum_jax.DataParallel(mesh=mesh))(
        params, batch, extra)
