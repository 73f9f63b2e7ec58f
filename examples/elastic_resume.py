"""Elastic resume: save on 8 devices in the middle of a window, finish on 4.

A small Flax Linen MLP trains in a ``TrainState`` whose optimizer is
``accum_jax.accumulate(optax.adam(...), every_k=4)``, with its parameters sharded
over a mesh of 8 fake CPU devices, fully sharded data parallel (FSDP) style: each
parameter's largest axis is split over the devices, and so is each batch.

  1. This process (8 devices) trains 12 calls without a break: the reference. Then,
     from the same start, it trains 6 calls (1 window and 2 of the next 4 calls)
     and saves the ``TrainState`` with Orbax.
  2. A fresh process with 4 devices builds the restore target for its own mesh with
     ``accum_jax.checkpoint.abstract_tree`` (each parameter, its Adam moments and its leaf of
     the window's total sharded like the parameter; counters replicated), restores,
     makes its ``accum_jax.HostSchedule`` from the restored state (which reads where
     the window stopped), and trains the last 6 calls.

Each call passes ``apply`` from the ``HostSchedule``, static in the jitted step, through
``accum_jax.flax.apply_gradients``: the calls that only add compile to the gradient
and one add.

It prints where the restored state lives and how far the final parameters are from
the reference: float32 round-off, since 4 devices sum the batch in another order.

  python examples/elastic_resume.py      # a few seconds on a laptop CPU
"""

# ruff: noqa: E402  (the device count must be set before jax is imported)

from __future__ import annotations

import os
import subprocess
import sys

SAVE_DEVICES, RESTORE_DEVICES = 8, 4
RESUMING = len(sys.argv) == 3 and sys.argv[1] == "--resume"
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
_count = RESTORE_DEVICES if RESUMING else SAVE_DEVICES
os.environ["XLA_FLAGS"] = " ".join([*_flags, f"--xla_force_host_platform_device_count={_count}"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools
import tempfile
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
import accum_jax.flax

EVERY_K = 4
TOTAL_CALLS = 12
SAVE_AFTER = 6  # one window, then 2 of the next 4 calls
BATCH_SIZE = 32


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    hidden = nn.relu(nn.Dense(64)(x))
    return nn.Dense(1)(hidden)[:, 0]


# Built once: a TrainState's apply_fn and tx are static, and new ones would recompile.
# layout="tree" (the default on several devices, named here): a buffer per leaf, placed
# like its parameter. A checkpoint restores only into a target of the layout it was
# saved in, so a run that may resume on another number of devices names its layout.
MODEL = MLP()
TX = accum_jax.accumulate(optax.adam(1e-2), every_k=EVERY_K, layout="tree")


def make_mesh(num_devices: int) -> jax.sharding.Mesh:
  return jax.make_mesh((num_devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def fsdp_sharding(mesh: jax.sharding.Mesh, x: Any) -> NamedSharding:
  """Shard a parameter's largest axis over the mesh when it divides evenly."""
  spec: list[Any] = [None] * len(x.shape)
  if x.shape and max(x.shape) % mesh.size == 0:
    spec[int(np.argmax(x.shape))] = "data"
  return NamedSharding(mesh, P(*spec))


def abstract_params(mesh: jax.sharding.Mesh) -> Any:
  """The model's parameters as shapes, dtypes and FSDP shardings on ``mesh``."""
  shapes = jax.eval_shape(MODEL.init, jax.random.key(0), jnp.zeros((1, 8)))["params"]
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fsdp_sharding(mesh, x)), shapes
  )


def create_state(params: Any) -> TrainState:
  return TrainState.create(apply_fn=MODEL.apply, params=params, tx=TX)


def batch_for(call: int, mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
  """Call ``call``'s batch, the same in both processes, split over the devices."""
  rng = np.random.default_rng(call)
  x = rng.standard_normal((BATCH_SIZE, 8)).astype(np.float32)
  y = np.sin(x.sum(axis=1)).astype(np.float32)
  return jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P("data")))


@functools.partial(jax.jit, static_argnames="apply")
def train_step(state: TrainState, batch: dict[str, jax.Array], apply: bool) -> TrainState:
  def loss(params):
    return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

  # On 3 calls of 4 only the add; on the 4th, Adam's step on the window's mean.
  return accum_jax.flax.apply_gradients(state, grads=jax.grad(loss)(state.params), apply=apply)


def train(state: TrainState, calls: range, mesh: jax.sharding.Mesh) -> TrainState:
  schedule = accum_jax.HostSchedule(state)  # from the state it starts from, new or restored
  for call in calls:
    state = train_step(state, batch_for(call, mesh), schedule.next())
  return state


def save_phase(directory: Path) -> None:
  mesh = make_mesh(SAVE_DEVICES)
  target = abstract_params(mesh)
  variables = MODEL.init(jax.random.key(0), jnp.zeros((1, 8)))
  params = jax.device_put(variables["params"], jax.tree.map(lambda t: t.sharding, target))
  # The same helper gives the initial state its shardings: Adam's moments and the
  # window's total sharded like the parameters, counters replicated.
  layout = accum_jax.checkpoint.abstract_tree(jax.eval_shape(create_state, params), params)
  init = jax.jit(create_state, out_shardings=jax.tree.map(lambda t: t.sharding, layout))

  uninterrupted = train(init(params), range(TOTAL_CALLS), mesh)
  np.savez(directory / "reference.npz", *map(np.asarray, jax.tree.leaves(uninterrupted.params)))

  state = train(init(params), range(SAVE_AFTER), mesh)
  ocp.v1.save(directory / "checkpoint", state)
  print(f"saved on {SAVE_DEVICES} devices after call {SAVE_AFTER} of {TOTAL_CALLS}: the window"
        f" holds {int(state.opt_state.mini_step)} of {EVERY_K} gradients,"
        f" {int(accum_jax.optimizer_step(state))} Adam update so far")


def _sharded_like(tree: Any, like: Any) -> bool:
  return all(
      x.sharding.is_equivalent_to(p.sharding, x.ndim)
      for x, p in zip(jax.tree.leaves(tree), jax.tree.leaves(like))
  )


def resume_phase(directory: Path) -> None:
  mesh = make_mesh(RESTORE_DEVICES)
  params = abstract_params(mesh)
  # jax.eval_shape gives back the TrainState class, its tx and the AccumulationState;
  # abstract_tree gives every leaf a sharding on this process's 4 devices.
  target = accum_jax.checkpoint.abstract_tree(jax.eval_shape(create_state, params), params)
  state = ocp.v1.load(directory / "checkpoint", target)

  adam = state.opt_state.inner_opt_state[0]
  kernel = state.params["Dense_0"]["kernel"]
  print(f"restored on {len(jax.devices())} devices: call {int(state.step)}, window"
        f" {int(state.opt_state.mini_step)} of {EVERY_K}")
  print(f"Dense_0 kernel {kernel.shape}: parameter {kernel.sharding.spec}, Adam's mu"
        f" {adam.mu['Dense_0']['kernel'].sharding.spec}, acc_grads"
        f" {state.opt_state.acc_grads['Dense_0']['kernel'].sharding.spec}")
  per_parameter = (state.params, adam.mu, adam.nu, state.opt_state.acc_grads)
  print("every per-parameter leaf sharded like its parameter:",
        all(_sharded_like(tree, params) for tree in per_parameter))

  state = train(state, range(SAVE_AFTER, TOTAL_CALLS), mesh)
  with np.load(directory / "reference.npz") as saved:
    reference = [saved[f"arr_{i}"] for i in range(len(saved.files))]
  final = [np.asarray(x) for x in jax.tree.leaves(state.params)]
  abs_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(final, reference))
  rel_diff = max(
      float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(final, reference)
  )
  print(f"Adam updates (accum_jax.optimizer_step): {int(accum_jax.optimizer_step(state))}")
  print(f"max abs difference vs uninterrupted: {abs_diff:.3g}")
  print(f"max relative difference vs uninterrupted: {rel_diff:.3g}")


def main() -> None:
  if RESUMING:
    resume_phase(Path(sys.argv[2]))
    return
  with tempfile.TemporaryDirectory() as tmp:
    save_phase(Path(tmp))
    # A fresh process: the device count is fixed when jax starts.
    subprocess.run([sys.executable, __file__, "--resume", tmp], check=True)


if __name__ == "__main__":
  main()
