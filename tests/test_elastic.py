"""Elastic resume: save on 8 devices in the middle of a window, restore on 4, finish.

The restore runs in a fresh process started with 4 CPU devices
(``elastic_worker.py``), into the target ``abstract_state`` builds for the new
mesh. The window it finishes must equal an uninterrupted run on 8 devices, and
each per-parameter leaf of the restored state must be sharded as its parameter.
The other tests check the targets themselves, in this process, for several
optimizers, a Flax ``TrainState`` and bad input.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import elastic_worker as worker
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from helpers import RTOL, tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
from accum_jax._across_calls._resume import abstract_state, abstract_tree

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300


def _sharded_params(layout: str, mesh: jax.sharding.Mesh) -> Any:
  return jax.device_put(worker.problem(), worker.param_shardings(layout, mesh))


def _fresh_process_env(num_devices: int) -> dict[str, str]:
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
  env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={num_devices}"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
  return env


@pytest.mark.parametrize("layout", worker.LAYOUTS)
def test_a_window_saved_on_8_devices_finishes_on_4_as_if_never_stopped(layout, tmp_path):
  mesh = worker.make_mesh(worker.SAVE_DEVICES)
  params = _sharded_params(layout, mesh)
  state = jax.jit(worker.optimizer().init)(params)
  uninterrupted = worker.train(params, state, range(worker.EVERY_K), mesh)
  assert int(accum_jax.optimizer_step(uninterrupted[1])) == 1

  saved = worker.train(params, state, range(worker.SAVED_AFTER), mesh)
  checkpoint = tmp_path / "checkpoint"
  ocp.v1.save(checkpoint, {"params": saved[0], "opt_state": saved[1]})

  result = subprocess.run(
      [sys.executable, worker.__file__, layout, str(checkpoint), str(tmp_path / "final.npz")],
      env=_fresh_process_env(worker.RESTORE_DEVICES),
      capture_output=True,
      text=True,
      timeout=SUBPROCESS_TIMEOUT_S,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  with np.load(tmp_path / "final.npz") as final:
    leaves = [final[f"arr_{i}"] for i in range(len(final.files))]
  treedef = jax.tree.structure(uninterrupted)
  assert len(leaves) == treedef.num_leaves
  tree_allclose(jax.tree.unflatten(treedef, leaves), uninterrupted, rtol=RTOL)


EXAMPLE = REPO_ROOT / "examples" / "elastic_resume.py"


def _number_after(label: str, stdout: str) -> float:
  match = re.search(rf"^{re.escape(label)}\s+(\S+)$", stdout, re.MULTILINE)
  assert match, f"no line starting {label!r} in the output:\n{stdout}"
  return float(match.group(1))


@pytest.mark.scripts
def test_the_elastic_resume_example_finishes_on_4_devices_as_if_never_stopped():
  result = subprocess.run(
      [sys.executable, str(EXAMPLE)],
      env=_fresh_process_env(worker.SAVE_DEVICES),
      capture_output=True,
      text=True,
      timeout=SUBPROCESS_TIMEOUT_S,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  out = result.stdout
  assert f"saved on {worker.SAVE_DEVICES} devices after call 6 of 12" in out, out
  assert f"restored on {worker.RESTORE_DEVICES} devices: call 6, window 2 of 4" in out, out
  assert "every per-parameter leaf sharded like its parameter: True" in out, out
  assert _number_after("Adam updates (accum_jax.optimizer_step):", out) == 3
  assert _number_after("max relative difference vs uninterrupted:", out) < RTOL


# ---------------------------------------------------------------------------
# The targets, checked in this process: restored on 4 of its 8 devices.


def _params_on_half_the_devices(layout: str) -> tuple[Any, Any]:
  mesh = worker.make_mesh(worker.RESTORE_DEVICES)
  shardings = worker.param_shardings(layout, mesh)
  params = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), worker.problem(), shardings
  )
  return params, shardings


def _param_subtrees(state: Any, params: Any) -> tuple[list[Any], list[Any]]:
  """The subtrees of ``state`` with the parameters' tree structure, and its other leaves."""
  treedef = jax.tree.structure(params)

  def is_params_like(x):
    return jax.tree.structure(x) == treedef

  nodes = jax.tree.leaves(state, is_leaf=is_params_like)
  subtrees = [x for x in nodes if is_params_like(x)]
  others = [x for x in nodes if not is_params_like(x)]
  return subtrees, others


OPTIMIZERS = {
    "accumulate(adam)": lambda: accum_jax.accumulate(optax.adam(1e-2), every_k=4),
    "MultiSteps(adamw)": lambda: accum_jax.MultiSteps(optax.adamw(1e-2), every_k_schedule=4),
    "optax.MultiSteps(sgd with momentum)": lambda: optax.MultiSteps(
        optax.sgd(0.1, momentum=0.9), every_k_schedule=4
    ),
    "accumulate(clip then adam)": lambda: accum_jax.accumulate(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), every_k=2
    ),
    "bare adam": lambda: optax.adam(1e-2),
}


@pytest.mark.parametrize("layout", worker.LAYOUTS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_target_shards_each_per_parameter_subtree_like_the_parameters(name, layout):
  params, shardings = _params_on_half_the_devices(layout)
  opt = OPTIMIZERS[name]()
  target = abstract_state(opt, params)

  expected = jax.eval_shape(opt.init, params)
  assert jax.tree.structure(target) == jax.tree.structure(expected)
  for x, y in zip(jax.tree.leaves(target), jax.tree.leaves(expected)):
    assert (x.shape, x.dtype) == (y.shape, y.dtype)
  subtrees, others = _param_subtrees(target, params)
  # The accumulator's sum and the inner optimizer's statistics (Adam: mu and nu).
  assert len(subtrees) >= (1 if name == "bare adam" else 2)
  for subtree in subtrees:
    for (path, x), s in zip(jax.tree.leaves_with_path(subtree), jax.tree.leaves(shardings)):
      assert x.sharding.is_equivalent_to(s, x.ndim), f"{name}{jax.tree_util.keystr(path)}"
  mesh = worker.make_mesh(worker.RESTORE_DEVICES)
  for x in others:
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, P()), x.ndim), x


def test_a_masked_inner_optimizer_keeps_the_sharding_of_the_parameters_it_updates():
  params, shardings = _params_on_half_the_devices("fsdp")
  mask = {"hidden": {"w": True, "b": False}, "out": {"w": True, "b": False}}
  opt = accum_jax.accumulate(optax.masked(optax.adam(1e-2), mask), every_k=4)
  target = abstract_state(opt, params)
  mu = target.inner_opt_state.inner_state[0].mu
  assert mu["hidden"]["w"].sharding.is_equivalent_to(shardings["hidden"]["w"], 2)
  assert mu["hidden"]["w"].sharding.spec == P(None, "data")


def test_the_restored_state_takes_the_next_update_on_the_new_mesh():
  # Saved on 8 devices, restored on 4 of them: the jitted update accepts the state.
  mesh8 = worker.make_mesh(worker.SAVE_DEVICES)
  params8 = _sharded_params("fsdp", mesh8)
  opt = worker.optimizer()
  _, state8 = worker.train(params8, jax.jit(opt.init)(params8), range(1), mesh8)
  params4, _ = _params_on_half_the_devices("fsdp")
  target = abstract_state(opt, params4)
  state4 = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), state8, target)
  params4 = jax.device_put(worker.problem(), jax.tree.map(lambda t: t.sharding, params4))
  _, state4 = worker.train(params4, state4, range(1, 2), worker.make_mesh(worker.RESTORE_DEVICES))
  assert int(state4.mini_step) == 2


def test_a_flax_train_state_target_shards_params_and_opt_state_and_replicates_the_rest():
  params, shardings = _params_on_half_the_devices("fsdp")
  tx = worker.optimizer()

  class TrainState(train_state.TrainState):
    batch_stats: Any

  def create_state():
    return TrainState.create(
        apply_fn=None,
        params=worker.problem(),
        tx=tx,
        batch_stats={"hidden": {"mean": jnp.zeros(16)}},
    )

  target = abstract_tree(jax.eval_shape(create_state), params)
  assert type(target) is TrainState and target.tx is tx
  opt_state = target.opt_state
  for tree in (target.params, opt_state.window_total, opt_state.inner_opt_state[0].nu):
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
      assert x.sharding.is_equivalent_to(s, x.ndim)
  assert target.params["hidden"]["w"].sharding.spec == P(None, "data")
  assert target.step.sharding.spec == P()
  # Shaped like hidden.b, but not hidden.b's: BatchNorm's mean stays replicated.
  assert target.batch_stats["hidden"]["mean"].sharding.spec == P()


# ---------------------------------------------------------------------------
# Errors.


def test_parameters_without_a_sharding_are_refused():
  params = {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32)}
  with pytest.raises(ValueError, match=re.escape("params['w'] is a ShapeDtypeStruct without")):
    abstract_state(worker.optimizer(), params)
  with pytest.raises(ValueError, match=re.escape("params['w'] is a ndarray without a sharding")):
    abstract_state(worker.optimizer(), {"w": np.zeros((8, 2), np.float32)})


def test_parameters_on_two_sets_of_devices_are_refused():
  devices = jax.devices()
  params = {
      "a": jax.device_put(jnp.zeros(4), devices[0]),
      "b": jax.device_put(jnp.zeros(4), devices[1]),
  }
  message = "params['b'] and params['a'] live on different sets of devices (1 and 1 devices)"
  with pytest.raises(ValueError, match=re.escape(message)):
    abstract_state(optax.adam(1e-2), params)


def test_empty_parameters_and_an_optimizer_without_init_are_refused():
  with pytest.raises(ValueError, match=re.escape("params holds no arrays (got {})")):
    abstract_state(optax.adam(1e-2), {})
  params, _ = _params_on_half_the_devices("fsdp")
  with pytest.raises(ValueError, match=re.escape("has no init method")):
    abstract_state(optax.adam, params)
  with pytest.raises(ValueError, match=re.escape("tree['step'] is a str, not an array")):
    abstract_tree({"step": "0"}, params)


def test_traced_parameters_and_an_abstract_mesh_are_refused():
  params, _ = _params_on_half_the_devices("fsdp")
  concrete = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), params)
  with pytest.raises(ValueError, match=re.escape("is a traced value: build the restore target")):
    jax.jit(lambda p: abstract_state(optax.adam(1e-2), p))(concrete)
  mesh = jax.sharding.AbstractMesh((4,), ("data",))
  abstract = {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("data")))}
  with pytest.raises(ValueError, match=re.escape("params['w'] has a sharding on an abstract mesh")):
    abstract_state(optax.adam(1e-2), abstract)
