"""accumulate(..., layout="flat"): the window's sum as one vector per dtype.

Exact like the tree layout against a mean computed the plain way; a state that
checkpoints and resumes; a call whose work does not grow with the number of
leaves; refused, with the fix, where the tree layout is needed.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax

K = 3


def _params():
  """Leaves of three dtypes and several shapes, as a mixed-precision model has."""
  return {
      "embed": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(4, 3),
      "layer": {"w": jnp.full((3, 2), 0.5, jnp.bfloat16), "b": jnp.zeros(2, jnp.bfloat16)},
      "scale": jnp.ones((), jnp.float32),
  }


def _grads(call: int):
  """A different gradient for each call, finite."""
  return jax.tree.map(
      lambda p: (jnp.sin(jnp.arange(p.size, dtype=jnp.float32) + call).reshape(p.shape)
                 * (call + 1)).astype(p.dtype),
      _params())


@pytest.mark.parametrize("weighted", [False, True])
def test_each_window_applies_the_plain_weighted_mean_of_its_calls(weighted):
  params = _params()
  flat = accum_jax.accumulate(optax.sgd(1.0), every_k=K, layout="flat")
  state = flat.init(params)
  update = jax.jit(flat.update)
  weights = [2.0, 1.0, 5.0, 3.0, 1.0, 4.0]
  for call in range(2 * K):
    weight = weights[call] if weighted else None
    updates, state = update(_grads(call), state, params, weight=weight)
    if call % K < K - 1:
      tree_allclose(updates, jax.tree.map(jnp.zeros_like, params), rtol=0, atol=0)
      continue
    calls = range(call - K + 1, call + 1)
    w = [weights[c] if weighted else 1.0 for c in calls]
    mean = jax.tree.map(
        lambda *gs: sum(wi * g.astype(jnp.float32) for wi, g in zip(w, gs)) / sum(w),
        *[_grads(c) for c in calls])
    expected = jax.tree.map(lambda m, p: (-m).astype(p.dtype), mean, params)
    tree_allclose(updates, expected)
    assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(lambda p: p.dtype, params)
  assert int(accum_jax.optimizer_step(state)) == 2


def test_flat_and_tree_layouts_give_the_same_training_with_a_skip_and_a_flush():
  params = _params()
  runs = []
  for layout in ("tree", "flat"):
    opt = accum_jax.accumulate(optax.adamw(1e-2), every_k=K, layout=layout, skip_nonfinite="call")
    state, p = opt.init(params), params

    @jax.jit
    def step(p, state, grads, flush, opt=opt):
      updates, state = opt.update(grads, state, p, flush=flush)
      return optax.apply_updates(p, updates), state

    for call in range(6):
      grads = _grads(call)
      if call == 1:  # a NaN is skipped and counted, the window untouched
        grads = {**grads, "scale": jnp.array(jnp.nan, jnp.float32)}
      p, state = step(p, state, grads, call == 5)
    runs.append((p, state))
  (tree_params, tree_state), (flat_params, flat_state) = runs
  tree_allclose(flat_params, tree_params)
  assert int(flat_state.num_skipped) == int(tree_state.num_skipped) == 1
  # Calls 0, 2 and 3 make a window; 4 and 5 a partial one, flushed.
  assert int(accum_jax.optimizer_step(flat_state)) == 2
  tree_allclose(flat_state.acc_grads, tree_state.acc_grads)


def test_a_flat_state_checkpoints_and_resumes_bit_for_bit(tmp_path):
  params = _params()
  opt = accum_jax.accumulate(optax.adam(1e-2), every_k=K, layout="flat")
  update = jax.jit(opt.update)
  state = opt.init(params)
  for call in range(K + 1):  # one window applied, one call into the next
    _, state = update(_grads(call), state, params)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  target = accum_jax.checkpoint.abstract_state(opt, params)
  restored = checkpointer.restore(tmp_path / "state", target)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  finals = []
  for s in (state, restored):
    for call in range(K + 1, 2 * K):
      updates, s = update(_grads(call), s, params)
    finals.append((updates, s))
  assert bool(accum_jax.has_updated(finals[1][1]))
  tree_allclose(finals[1], finals[0], rtol=0, atol=0)


def _update_reductions(layout: str, num_leaves: int, skip_nonfinite: str = "call") -> int:
  """Reductions traced in one update of ``num_leaves`` leaves, outside its conditional."""
  params = {f"p{i}": jnp.ones(4) for i in range(num_leaves)}
  opt = accum_jax.accumulate(
      optax.adam(1e-3), every_k=K, layout=layout, skip_nonfinite=skip_nonfinite)
  jaxpr = jax.make_jaxpr(opt.update)(params, opt.init(params), params).jaxpr
  return _reductions_outside_cond(jaxpr)


def _reductions_outside_cond(jaxpr: Any) -> int:
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "reduce_sum":
      count += 1
    elif eqn.primitive.name != "cond":  # jit's and custom_jvp's bodies are looked into
      for value in eqn.params.values():
        sub = getattr(value, "jaxpr", value)
        if hasattr(sub, "eqns"):
          count += _reductions_outside_cond(sub)
  return count


def test_a_flat_call_checks_its_gradient_with_as_many_reductions_whatever_the_leaves():
  assert _update_reductions("flat", 4) == _update_reductions("flat", 40) >= 1
  # The tree layout, for contrast, packs its check too (one reduction per dtype).
  assert _update_reductions("tree", 4) == _update_reductions("tree", 40)


@pytest.mark.parametrize("layout", ["tree", "flat"])
def test_by_default_a_call_that_only_accumulates_reduces_nothing(layout):
  # The default judges the window once, inside the conditional that applies it.
  assert _update_reductions(layout, 40, skip_nonfinite="window") == 0


def test_layout_must_be_tree_or_flat():
  with pytest.raises(ValueError, match=re.escape("layout='vector' is not one of ('tree', 'flat')")):
    accum_jax.accumulate(optax.sgd(1.0), every_k=2, layout="vector")


def test_flat_refuses_parameters_sharded_over_a_mesh_axis():
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  params = {"w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data"))),
            "b": jnp.zeros(4)}
  opt = accum_jax.accumulate(optax.sgd(1.0), every_k=2, layout="flat")
  with pytest.raises(ValueError, match=r"layout='flat' cannot hold the leaf at \['w'\]: it is"
                                       r" sharded .*Use layout='tree'"):
    opt.init(params)
  replicated = jax.device_put(params, NamedSharding(mesh, P()))
  opt.init(replicated)  # replicated parameters are fine


def test_flat_refuses_statistics_leaves():
  opt = accum_jax.accumulate(optax.sgd(1.0), every_k=2, layout="flat",
                             reduction={"w": "mean", "amax": "max"})
  with pytest.raises(ValueError, match=r"combines by 'max' .*Use layout='tree'"):
    opt.init({"w": jnp.ones(3), "amax": jnp.ones(3)})


def test_flat_gradients_must_have_the_parameters_tree():
  opt = accum_jax.accumulate(optax.sgd(1.0), every_k=2, layout="flat")
  state = opt.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match="differs from the parameters'"):
    opt.update({"v": jnp.ones(3)}, state)
  with pytest.raises(ValueError, match=r"has shape \(4,\) but the parameter has shape \(3,\)"):
    opt.update({"w": jnp.ones(4)}, state)


def test_np_arrays_and_python_scalars_pack_like_jax_arrays():
  opt = accum_jax.accumulate(optax.sgd(1.0), every_k=1, layout="flat")
  params = {"a": np.ones(2, np.float32), "b": 1.0}
  updates, _ = opt.update({"a": np.full(2, 2.0, np.float32), "b": 3.0}, opt.init(params))
  tree_allclose(updates, {"a": np.full(2, -2.0, np.float32), "b": np.float32(-3.0)})
