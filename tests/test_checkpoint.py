"""Checkpoint with Orbax, resume in a fresh process, finish bit for bit as if never stopped.

Two doors, one Linen model with BatchNorm and dropout:

* ``accumulate``: a ``TrainState`` whose ``tx`` is ``accum_jax.accumulate(adam,
  every_k=4)``, saved after 2 of the 4 calls of a window, with half a window in
  its accumulator; ``multisteps`` the same with ``accum_jax.MultiSteps(adam, 4)``,
  whose state is ``optax.MultiStepsState`` (unweighted calls: it takes no weight);
* ``value_and_grad``: a ``TrainState`` with plain Adam and BatchNorm statistics,
  stepped by ``accum_jax.value_and_grad`` over 4 microbatches. A call holds no
  state between its microbatches, so it is saved between steps.

Run as a script, this module is the fresh process, one for the three:
``python test_checkpoint.py DIRECTORY`` restores each door's checkpoint
``DIRECTORY/DOOR``, trains to the end and saves the final state's leaves in
``DIRECTORY/DOOR.npz``.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from linen_model import NET, TrainState, loss_fn

import accum_jax
import accum_jax.flax

EVERY_K = 4
NUM_MICROBATCHES = 4
MICROBATCH_SIZE = 8
# Calls made in all, and after how many the checkpoint is saved.
TOTAL_CALLS = {"accumulate": 2 * EVERY_K, "multisteps": 2 * EVERY_K, "value_and_grad": 4}
CHECKPOINT_AFTER = {"accumulate": EVERY_K // 2, "multisteps": EVERY_K // 2, "value_and_grad": 2}


# Built once: a TrainState's tx is static, and a new one would recompile.
OPTIMIZERS = {
    "accumulate": accum_jax.accumulate(optax.adam(1e-2), every_k=EVERY_K),
    "multisteps": accum_jax.MultiSteps(optax.adam(1e-2), every_k_schedule=EVERY_K),
    "value_and_grad": optax.adam(1e-2),
}


def make_state(door: str) -> TrainState:
  variables = NET.init(jax.random.key(0), jnp.ones((1, 5)), train=False)
  return TrainState.create(
      apply_fn=NET.apply,
      params=variables["params"],
      batch_stats=variables["batch_stats"],
      tx=OPTIMIZERS[door],
  )


def batch_for(door: str, call: int) -> dict[str, np.ndarray]:
  """The data of one call, the same in every process."""
  size = MICROBATCH_SIZE * (NUM_MICROBATCHES if door == "value_and_grad" else 1)
  rng = np.random.default_rng(call)
  return {
      "x": rng.standard_normal((size, 5)).astype(np.float32),
      "y": rng.integers(0, 3, size).astype(np.int32),
  }


@functools.partial(jax.jit, static_argnames="door")
def train_step(state: TrainState, batch: Any, door: str) -> TrainState:
  # The dropout key comes from the call count, which the checkpoint holds.
  key = jax.random.fold_in(jax.random.key(1), state.step)
  if door in ("accumulate", "multisteps"):
    (_, (batch_stats, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, state.batch_stats, batch, key
    )
    if door == "accumulate":
      # A weight that changes from call to call, so that the accumulated weight
      # is part of what must survive the restart.
      weight = 1.0 + state.step.astype(jnp.float32) % 3
      state = accum_jax.flax.apply_gradients(state, grads=grads, weight=weight)
    else:  # optax.MultiStepsState keeps no weight
      state = state.apply_gradients(grads=grads)
  else:
    vg = accum_jax.value_and_grad(
        loss_fn, NUM_MICROBATCHES, batch_argnums=2, state_argnums=1, rng_argnums=3, has_aux=True
    )
    (_, (batch_stats, _)), grads = vg(state.params, state.batch_stats, batch, key)
    state = state.apply_gradients(grads=grads)
  return state.replace(batch_stats=batch_stats)


def train(state: TrainState, door: str, calls: range) -> TrainState:
  for call in calls:
    state = train_step(state, batch_for(door, call), door)
  return state


def save(path: Path, state: TrainState) -> None:
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, state)


def restore(path: Path, door: str) -> TrainState:
  # The abstract state gives Orbax the tree to rebuild: the TrainState class, its
  # tx, and the AccumulationState (or optax.MultiStepsState) NamedTuple whose
  # properties and methods a dict would lose.
  abstract = jax.eval_shape(lambda: make_state(door))
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, abstract)


def resume(door: str, checkpoint: Path, output: Path) -> None:
  """In the fresh process: restore, check it is mid-run, train to the end, save leaves."""
  state = restore(checkpoint, door)
  assert type(state) is TrainState, type(state)
  assert int(state.step) == CHECKPOINT_AFTER[door], state.step
  if door == "accumulate":
    assert isinstance(state.opt_state, accum_jax.AccumulationState), type(state.opt_state)
    assert int(state.opt_state.mini_step) == CHECKPOINT_AFTER[door]
    assert int(accum_jax.optimizer_step(state)) == 0
  if door == "multisteps":
    assert type(state.opt_state) is optax.MultiStepsState, type(state.opt_state)
    assert int(state.opt_state.mini_step) == CHECKPOINT_AFTER[door]
    assert int(state.opt_state.gradient_step) == 0
  state = train(state, door, range(CHECKPOINT_AFTER[door], TOTAL_CALLS[door]))
  np.savez(output, *(np.asarray(x) for x in jax.tree.leaves(state)))


# ---------------------------------------------------------------------------
# The tests.


DOORS = tuple(OPTIMIZERS)


@pytest.fixture(scope="module")
def resumed_leaves(tmp_path_factory) -> dict[str, list[np.ndarray]]:
  """Each door's run stopped and saved here, then restored and trained to its end
  in one fresh process (one for all the doors: a process costs its imports):
  the final state's leaves, by door."""
  directory = tmp_path_factory.mktemp("fresh_process")
  for door in DOORS:
    save(directory / door, train(make_state(door), door, range(CHECKPOINT_AFTER[door])))
  subprocess.run([sys.executable, __file__, str(directory)], check=True)
  leaves = {}
  for door in DOORS:
    with np.load(directory / f"{door}.npz") as final:
      leaves[door] = [final[f"arr_{i}"] for i in range(len(final.files))]
  return leaves


@pytest.mark.parametrize("door", DOORS)
def test_a_run_resumed_mid_window_in_a_fresh_process_is_bitwise_equal(door, resumed_leaves):
  # accumulate and MultiSteps stop in mid-window; the value_and_grad loop between steps.
  uninterrupted = train(make_state(door), door, range(TOTAL_CALLS[door]))
  expected = jax.tree.leaves_with_path(uninterrupted)
  assert len(resumed_leaves[door]) == len(expected)
  for (path, x), y in zip(expected, resumed_leaves[door]):
    assert np.array_equal(np.asarray(x), y), f"at {jax.tree_util.keystr(path)}"


# ---------------------------------------------------------------------------
# The other layout, and accum_jax 0.1.0: convert and load.
#
# One optimizer in both layouts, the tiny tree of tests/data/make_v010_checkpoint.py
# (two float32 leaves, whose window holds a weighted sum, and a bfloat16 one, whose
# window holds the weighted mean), its gradients, weights and values.

DATA = Path(__file__).resolve().parent / "data"
_spec = importlib.util.spec_from_file_location("make_v010_checkpoint",
                                               DATA / "make_v010_checkpoint.py")
V010 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(V010)
LAYOUTS = ("packed", "tree")
LAYOUT_OPTIMIZERS = {
    layout: accum_jax.accumulate(optax.adam(1e-2), every_k=V010.EVERY_K, accumulator_dtype=None,
                                 layout=layout)
    for layout in LAYOUTS
}


@functools.partial(jax.jit, static_argnames=("layout", "apply"))
def _layout_step(train, call_grads, weight, value, layout, apply):
  updates, state = LAYOUT_OPTIMIZERS[layout].update(
      call_grads, train["opt_state"], train["params"], weight=weight, value=value, apply=apply)
  return {"params": optax.apply_updates(train["params"], updates), "opt_state": state}


def _fresh(layout: str) -> dict[str, Any]:
  params = V010.params()
  return {"params": params, "opt_state": LAYOUT_OPTIMIZERS[layout].init(params)}


def _target(layout: str) -> dict[str, Any]:
  params = V010.params()
  return {"params": params,
          "opt_state": accum_jax.checkpoint.abstract_state(LAYOUT_OPTIMIZERS[layout], params)}


def _continue(train: dict[str, Any], layout: str, calls: range) -> dict[str, Any]:
  schedule = accum_jax.HostSchedule(train["opt_state"])
  for call in calls:
    train = _layout_step(train, V010.grads(call), jnp.float32(V010.WEIGHTS[call]),
                         jnp.float32(V010.VALUES[call]), layout, schedule.next())
  return train


def _assert_bitwise_equal(a: Any, b: Any) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)), (
        f"at {jax.tree_util.keystr(path)}")


def _assert_same_window(a: accum_jax.AccumulationState, b: accum_jax.AccumulationState) -> None:
  """The same window, counters and inner state, each state read in its own layout."""
  _assert_bitwise_equal(a.acc_grads, b.acc_grads)
  _assert_bitwise_equal(a.scalars, b.scalars)
  _assert_bitwise_equal(accum_jax._across_calls._layout.tree_of(a.inner_opt_state),
                        accum_jax._across_calls._layout.tree_of(b.inner_opt_state))


@pytest.mark.parametrize(("saved", "resumed"), [("packed", "tree"), ("tree", "packed")])
def test_convert_moves_a_window_between_layouts_and_it_finishes_bit_for_bit(saved, resumed):
  uninterrupted = _continue(_fresh(resumed), resumed, range(V010.EVERY_K))
  stopped = _continue(_fresh(saved), saved, range(V010.SAVED_AFTER))
  target = jax.eval_shape(lambda: _fresh(resumed))
  with jax.transfer_guard("disallow"):  # nothing goes through the host
    moved = accum_jax.checkpoint.convert(stopped, target)
  assert type(moved["opt_state"].window_total) is type(target["opt_state"].window_total)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(moved))
  _assert_same_window(moved["opt_state"], _continue(_fresh(resumed), resumed,
                                                    range(V010.SAVED_AFTER))["opt_state"])
  assert int(moved["opt_state"].mini_step) == V010.SAVED_AFTER
  finished = _continue(moved, resumed, range(V010.SAVED_AFTER, V010.EVERY_K))
  assert int(accum_jax.optimizer_step(finished["opt_state"])) == 1
  _assert_bitwise_equal(finished, uninterrupted)


def test_convert_there_and_back_gives_the_state_back_in_an_optax_chain():
  opt = optax.chain(optax.clip(1.0), LAYOUT_OPTIMIZERS["packed"])
  state = opt.init(V010.params())
  state = (state[0], _continue(_fresh("packed"), "packed", range(3))["opt_state"])
  tree = optax.chain(optax.clip(1.0), LAYOUT_OPTIMIZERS["tree"])
  there = accum_jax.checkpoint.convert(state, jax.eval_shape(tree.init, V010.params()))
  assert isinstance(there[1].window_total, dict) and isinstance(there[1].inner_opt_state, tuple)
  back = accum_jax.checkpoint.convert(there, jax.eval_shape(opt.init, V010.params()))
  _assert_bitwise_equal(back, state)


@pytest.mark.parametrize(("saved", "resumed"), [("packed", "tree"), ("tree", "packed")])
def test_a_mid_window_checkpoint_of_one_layout_loads_into_the_other(tmp_path, saved, resumed):
  uninterrupted = _continue(_fresh(resumed), resumed, range(V010.EVERY_K))
  ocp.v1.save(tmp_path / "checkpoint", _continue(_fresh(saved), saved, range(V010.SAVED_AFTER)))
  restored = accum_jax.checkpoint.load(tmp_path / "checkpoint", _target(resumed),
                                       params=V010.params())
  assert int(restored["opt_state"].mini_step) == V010.SAVED_AFTER
  finished = _continue(restored, resumed, range(V010.SAVED_AFTER, V010.EVERY_K))
  _assert_bitwise_equal(finished, uninterrupted)


def test_a_packed_checkpoint_of_one_device_loads_sharded_over_two(tmp_path):
  # Saved on one device (packed), resumed with the parameters sharded over the mesh
  # (tree): each parameter-shaped leaf comes back sharded like its parameter.
  stopped = _continue(_fresh("packed"), "packed", range(V010.SAVED_AFTER))
  ocp.v1.save(tmp_path / "checkpoint", stopped)
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  specs = {"b": P(), "s": P("data"), "w": P("data", None)}
  params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
            for k, v in V010.params().items()}
  target = {"params": params,
            "opt_state": accum_jax.checkpoint.abstract_state(LAYOUT_OPTIMIZERS["tree"], params)}
  restored = accum_jax.checkpoint.load(tmp_path / "checkpoint", target, params=params)
  state = restored["opt_state"]
  assert state.window_total["w"].sharding.spec == P("data", None)
  assert state.inner_opt_state[0].nu["s"].sharding.spec == P("data")
  assert state.scalars.sharding.spec == P() and len(state.scalars.sharding.device_set) == mesh.size
  _assert_same_window(state, stopped["opt_state"])
  _assert_bitwise_equal(restored["params"], stopped["params"])


def test_a_packed_checkpoint_into_a_tree_target_without_params_says_to_pass_them(tmp_path):
  ocp.v1.save(tmp_path / "checkpoint", _continue(_fresh("packed"), "packed", range(1)))
  with pytest.raises(ValueError, match=re.escape(
      "holds, at ['opt_state'], accumulate's state in the packed layout (saved with"
      " layout='packed', or 'auto' on one device), target's is in the tree layout")) as error:
    accum_jax.checkpoint.load(tmp_path / "checkpoint", _target("tree"))
  assert "load(path, target, params=params)" in str(error.value)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_0_1_0_checkpoint_loads_and_finishes_its_window_as_0_1_0_did(layout):
  restored = accum_jax.checkpoint.load(DATA / "v010_checkpoint", _target(layout))
  state = restored["opt_state"]
  assert isinstance(state, accum_jax.AccumulationState)
  counters = (int(state.mini_step), int(state.optimizer_step), float(state.window_weight))
  assert counters == (2, 0, 3.0)
  # The window (a sum of the float32 leaves, the bfloat16 leaf's mean) is the one this
  # release makes from the same two calls, bit for bit.
  _assert_same_window(state, _continue(_fresh(layout), layout,
                                       range(V010.SAVED_AFTER))["opt_state"])
  finished = _continue(restored, layout, range(V010.SAVED_AFTER, V010.EVERY_K))
  assert int(accum_jax.optimizer_step(finished["opt_state"])) == 1
  with np.load(DATA / "v010_expected.npz") as expected:
    for name, value in finished["params"].items():
      assert np.array_equal(np.asarray(value, np.float32), expected[f"params/{name}"]), name


def test_a_state_of_another_optimizer_is_refused_naming_what_differs(tmp_path):
  sgd = accum_jax.accumulate(optax.sgd(0.1), every_k=V010.EVERY_K, accumulator_dtype=None,
                             layout="tree")
  with pytest.raises(ValueError, match=re.escape(
      "convert(state, target): the inner optimizer's state of state['opt_state'] is not the"
      " one target['opt_state'] holds: its tree is")):
    accum_jax.checkpoint.convert(_fresh("packed"), jax.eval_shape(
        lambda: {"params": V010.params(), "opt_state": sgd.init(V010.params())}))
  other_params = {**V010.params(), "w": jnp.zeros((3, 2))}
  with pytest.raises(ValueError, match=re.escape(
      "the window's sum of state['opt_state'] is not the one target['opt_state'] holds: its"
      " leaf at ['w'] is (2, 3) float32, target's (3, 2) float32")):
    accum_jax.checkpoint.convert(_fresh("packed"), jax.eval_shape(
        lambda: {"params": other_params,
                 "opt_state": LAYOUT_OPTIMIZERS["tree"].init(other_params)}))
  target = {"params": V010.params(),
            "opt_state": accum_jax.checkpoint.abstract_state(sgd, V010.params())}
  with pytest.raises(ValueError, match=re.escape(
      "holds, at ['opt_state'], accum_jax 0.1.0's state, not of target's optimizer and"
      " parameters: at .inner_opt_state[0].count it holds () int32 where target's would hold"
      " nothing")):
    accum_jax.checkpoint.load(DATA / "v010_checkpoint", target)
  ocp.v1.save(tmp_path / "checkpoint", _fresh("tree"))
  with pytest.raises(ValueError, match=re.escape(
      "holds, at ['opt_state'], accumulate's state in the tree layout, not of target's"
      " optimizer and parameters")):
    accum_jax.checkpoint.load(tmp_path / "checkpoint", target)


if __name__ == "__main__":  # the fresh process of `resumed_leaves`
  for door in DOORS:
    resume(door, Path(sys.argv[1]) / door, Path(sys.argv[1]) / f"{door}.npz")
