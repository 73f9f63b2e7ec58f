"""FSDP-style sharded parameters on a mesh of 8 CPU devices.

Each parameter is sharded over the mesh's one axis along its largest dimension, as
fully sharded data parallelism stores it. The accumulators must keep that sharding (a
replicated accumulator would cost every device the full model), and the two reduction
modes of value_and_grad must show in the compiled code where their collectives run.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import jit_traced_at_most, tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
from accum_jax.testing import collective_counts, collectives

NUM_DEVICES = 8
BATCH_SIZE = 32
NUM_MICROBATCHES = 2


def _mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _fsdp_sharding(mesh: jax.sharding.Mesh, x: np.ndarray) -> NamedSharding:
  spec = [None] * x.ndim
  spec[int(np.argmax(x.shape))] = "data"
  return NamedSharding(mesh, P(*spec))


def _params() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
      "hidden": {
          "w": rng.standard_normal((16, 32)).astype(np.float32) / 4,
          "b": rng.standard_normal(32).astype(np.float32) / 4,
      },
      "out": {
          "w": rng.standard_normal((32, 8)).astype(np.float32) / 4,
          "b": np.zeros(8, np.float32),
      },
  }


def _batch() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(1)
  return {
      "x": rng.standard_normal((BATCH_SIZE, 16)).astype(np.float32),
      "y": rng.standard_normal((BATCH_SIZE, 8)).astype(np.float32),
  }


def _loss(params: Any, batch: Any) -> jax.Array:
  hidden = jnp.tanh(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"])
  return jnp.mean((hidden @ params["out"]["w"] + params["out"]["b"] - batch["y"]) ** 2)


def _sharded(mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
  params = _params()
  sharded_params = jax.device_put(params, jax.tree.map(lambda x: _fsdp_sharding(mesh, x), params))
  sharded_batch = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
  return sharded_params, sharded_batch


def _assert_sharded_like(tree: Any, like: Any) -> None:
  for (path, x), p in zip(jax.tree.leaves_with_path(tree), jax.tree.leaves(like)):
    assert x.sharding.is_equivalent_to(p.sharding, x.ndim), (
        f"at {jax.tree_util.keystr(path)}: {x.sharding} is not {p.sharding}"
    )
    assert x.addressable_shards[0].data.size == p.size // NUM_DEVICES


def test_init_keeps_the_parameters_sharding_for_the_accumulator_eagerly_and_under_jit():
  params, _ = _sharded(_mesh())
  opt = accum_jax.accumulate(optax.adam(1e-2), every_k=2)
  _assert_sharded_like(opt.init(params).acc_grads, params)
  _assert_sharded_like(jax.jit(opt.init)(params).acc_grads, params)


def test_jitted_update_keeps_the_parameters_sharding_for_the_accumulator_and_the_updates():
  params, _ = _sharded(_mesh())
  grads = jax.tree.map(lambda x: 0.5 * x - 0.1, params)
  opt = accum_jax.accumulate(optax.adam(1e-2), every_k=2)
  update = jax.jit(opt.update)
  state = jax.jit(opt.init)(params)
  for emits in (False, True):
    updates, state = update(grads, state, params)
    assert bool(accum_jax.has_updated(state)) == emits
    _assert_sharded_like(state.acc_grads, params)
    _assert_sharded_like(updates, params)
  # Adam's first update on the mean of two equal gradients g: -lr * g / (|g| + eps).
  expected = jax.tree.map(lambda g: -1e-2 * np.asarray(g) / (np.abs(np.asarray(g)) + 1e-8), grads)
  tree_allclose(updates, expected)


def _assert_state_sharded_like_params(state: Any, params: Any) -> None:
  """Every leaf of ``state`` with a parameter's shape holds 1/8 of it per device.

  The parameters' shapes are all different, so a leaf's shape names its parameter.
  """
  by_shape = {p.shape: p for p in jax.tree.leaves(params)}
  assert len(by_shape) == len(jax.tree.leaves(params))
  checked = 0
  for path, x in jax.tree.leaves_with_path(state):
    p = by_shape.get(x.shape)
    if p is None or path[-1] == jax.tree_util.GetAttrKey("scalars"):
      continue  # the state's counters, not a parameter's statistic
    shard = x.addressable_shards[0].data.size
    assert shard == p.size // NUM_DEVICES, (
        f"state{jax.tree_util.keystr(path)} holds {shard} of its {x.size} elements on one"
        f" device, not {p.size // NUM_DEVICES}: {x.sharding}"
    )
    checked += 1
  # The accumulator and Adam's two moments: three per parameter.
  assert checked == 3 * len(by_shape), checked


@pytest.mark.parametrize("jit_init", [False, True], ids=["eager init", "jitted init"])
@pytest.mark.parametrize(
    "axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit],
    ids=["auto axes", "explicit axes"],
)
def test_every_parameter_shaped_leaf_of_the_state_is_sharded_like_its_parameter(
    axis_type, jit_init
):
  # Under jax.jit with automatic axes, an optimizer's zeros_like moments have no
  # sharding of their own: XLA replicated Adam's mu and nu, the whole model on every
  # device. (With explicit axes, jit needs the mesh set, as it does for optax alone.)
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(axis_type,))
  params = jax.device_put(_params(), jax.tree.map(lambda x: _fsdp_sharding(mesh, x), _params()))
  grads = jax.tree.map(lambda x: 0.5 * x - 0.1, params)
  opt = accum_jax.accumulate(optax.adam(1e-2), every_k=2)
  context = jax.set_mesh(mesh) if axis_type == jax.sharding.AxisType.Explicit else (
      contextlib.nullcontext()
  )
  with context:
    state = jax.jit(opt.init)(params) if jit_init else opt.init(params)
    _assert_state_sharded_like_params(state, params)
    update = jax.jit(opt.update)
    for emits in (False, True):
      updates, state = update(grads, state, params)
      assert bool(accum_jax.has_updated(state)) == emits
      _assert_state_sharded_like_params(state, params)
      _assert_sharded_like(updates, params)


def test_value_and_grad_without_a_mesh_reduces_in_the_loop_and_keeps_the_fsdp_sharding():
  params, batch = _sharded(_mesh())
  vg = accum_jax.value_and_grad(_loss, NUM_MICROBATCHES)
  compiled = jax.jit(vg).lower(params, batch).compile()
  value, grads = compiled(params, batch)
  expected_value, expected_grads = jax.value_and_grad(_loss)(_params(), _batch())
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)
  # Per-microbatch reduction: each device holds 1/8 of the accumulator, and the
  # gradient is reduce-scattered to it in every iteration.
  _assert_sharded_like(grads, params)
  counts = collective_counts(compiled.as_text())
  assert counts.in_loop > 0, counts


def test_value_and_grad_with_a_mesh_reduces_once_after_the_loop_into_replicated_gradients():
  mesh = _mesh()
  params, batch = _sharded(mesh)
  vg = accum_jax.value_and_grad(_loss, NUM_MICROBATCHES,
      data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis="data"))
  # Under jax.jit with automatic axes the FSDP shardings cannot be seen: the
  # parameters are taken as replicated, and a warning says so.
  with pytest.warns(accum_jax.UnknownShardingWarning, match=re.escape("param_sharding=")):
    compiled = jax.jit(vg).lower(params, batch).compile()
  value, grads = compiled(params, batch)
  expected_value, expected_grads = jax.value_and_grad(_loss)(_params(), _batch())
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)
  # One reduction per call: every device holds a full-size gradient.
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
    assert g.sharding.is_fully_replicated
    assert g.addressable_shards[0].data.shape == p.shape
  counts = collective_counts(compiled.as_text())
  assert counts.in_loop == 0, counts
  assert counts.outside_loop > 0, counts


def test_a_strided_split_keeps_a_sharded_batch_data_parallel_without_a_mesh():
  # Replicated parameters, batch sharded over 8 devices, no mesh=: with consecutive
  # rows a microbatch sits on 8 / N devices, so XLA gathers the batch and every device
  # computes every microbatch; with the strided split each device works on its own rows.
  mesh = _mesh()
  batch = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
  flops, gathers = {}, {}
  for split in ("contiguous", "strided"):
    vg = accum_jax.value_and_grad(_loss, NUM_DEVICES // 2,
        data_parallel=accum_jax.DataParallel(split=split))
    compiled = jax.jit(vg).lower(_params(), batch).compile()
    value, grads = compiled(_params(), batch)
    expected_value, expected_grads = jax.value_and_grad(_loss)(_params(), _batch())
    tree_allclose(value, expected_value)
    tree_allclose(grads, expected_grads)
    flops[split] = compiled.cost_analysis()["flops"]
    gathers[split] = sum(c.kind == "all-gather" for c in collectives(compiled.as_text()))
  assert gathers["contiguous"] > 0 and gathers["strided"] == 0, gathers
  # XLA counts one iteration of the loop (its trip count is known only at run time).
  assert flops["strided"] * 1.5 < flops["contiguous"], flops


def test_accumulate_works_under_an_explicit_sharding_mesh_and_compiles_once():
  # Under explicit sharding an array's type carries its sharding, so the zeros of a
  # call that only accumulates must carry the sharding of the update they stand for.
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  params = jax.device_put(_params(), jax.tree.map(lambda x: _fsdp_sharding(mesh, x), _params()))
  opt = accum_jax.accumulate(optax.adam(1e-2), every_k=2)
  with jax.set_mesh(mesh):
    state = jax.jit(opt.init)(params)
    update = jit_traced_at_most(opt.update)
    for _ in range(3):
      updates, state = update(params, state, params)
  _assert_sharded_like(updates, params)
  _assert_sharded_like(state.acc_grads, params)

