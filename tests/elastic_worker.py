"""The fresh process of tests/test_elastic.py (not a test itself), and the problem both share.

``python elastic_worker.py LAYOUT CHECKPOINT OUTPUT_NPZ`` starts jax on
``RESTORE_DEVICES`` CPU devices (fewer than the 8 that saved the checkpoint),
restores the state saved after ``SAVED_AFTER`` of the ``EVERY_K`` calls of a
window into the target ``accum_jax.checkpoint.abstract_state`` builds for the new mesh,
checks that each parameter and each per-parameter leaf of the state (the
accumulator's sum, Adam's moments) has its parameter's new sharding, finishes
the window and saves the final leaves.

jax is imported inside the functions: the test process imports the problem for
its reference, and this process must set its device count before importing jax.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

SAVE_DEVICES = 8
RESTORE_DEVICES = 4
EVERY_K = 4
SAVED_AFTER = 2  # calls into the window when the checkpoint is taken
BATCH_SIZE = 16
LAYOUTS = ("fsdp", "data_parallel")


def problem() -> dict[str, Any]:
  """A tiny two-layer regression's parameters, the same in every process."""
  rng = np.random.default_rng(0)
  return {
      "hidden": {
          "w": rng.standard_normal((4, 16)).astype(np.float32) / 2,
          "b": rng.standard_normal(16).astype(np.float32) / 4,
      },
      "out": {
          "w": rng.standard_normal((16, 2)).astype(np.float32) / 4,
          # Too small to shard over 8 devices: FSDP keeps it replicated.
          "b": np.zeros(2, np.float32),
      },
  }


def batch_for(call: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(100 + call)
  return {
      "x": rng.standard_normal((BATCH_SIZE, 4)).astype(np.float32),
      "y": rng.standard_normal((BATCH_SIZE, 2)).astype(np.float32),
  }


def weight_for(call: int) -> np.float32:
  # Weights that differ between calls, so the window's weight must survive too.
  return np.float32(1 + call % 3)


def spec_for(layout: str, shape: tuple[int, ...]) -> tuple[Any, ...]:
  """The parameter's partition spec: FSDP shards its largest axis when it divides evenly."""
  spec: list[Any] = [None] * len(shape)
  if layout == "fsdp" and shape and max(shape) % SAVE_DEVICES == 0:
    spec[int(np.argmax(shape))] = "data"
  return tuple(spec)


def make_mesh(num_devices: int):
  import jax

  return jax.make_mesh(
      (num_devices,),
      ("data",),
      axis_types=(jax.sharding.AxisType.Auto,),
      devices=jax.devices()[:num_devices],
  )


def param_shardings(layout: str, mesh) -> Any:
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  return {
      name: {k: NamedSharding(mesh, P(*spec_for(layout, v.shape))) for k, v in layer.items()}
      for name, layer in problem().items()
  }


_OPTIMIZER = None


def optimizer():
  """Built once, so the jitted step compiles once per process."""
  global _OPTIMIZER
  if _OPTIMIZER is None:
    import optax

    import accum_jax

    _OPTIMIZER = accum_jax.accumulate(optax.adam(1e-2), every_k=EVERY_K)
  return _OPTIMIZER


def _loss(params, batch):
  import jax.numpy as jnp

  hidden = jnp.tanh(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"])
  return jnp.mean((hidden @ params["out"]["w"] + params["out"]["b"] - batch["y"]) ** 2)


_STEP = None


def train_step(params, opt_state, batch, weight):
  global _STEP
  if _STEP is None:
    import jax
    import optax

    def step(params, opt_state, batch, weight):
      grads = jax.grad(_loss)(params, batch)
      updates, opt_state = optimizer().update(grads, opt_state, params, weight=weight)
      return optax.apply_updates(params, updates), opt_state

    _STEP = jax.jit(step)
  return _STEP(params, opt_state, batch, weight)


def train(params, opt_state, calls: range, mesh):
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  for call in calls:
    batch = jax.device_put(batch_for(call), NamedSharding(mesh, P("data")))
    params, opt_state = train_step(params, opt_state, batch, weight_for(call))
  return params, opt_state


def _check_sharded_like(tree: Any, shardings: Any, name: str) -> None:
  import jax

  for (path, x), s in zip(jax.tree.leaves_with_path(tree), jax.tree.leaves(shardings)):
    assert x.sharding.is_equivalent_to(s, x.ndim), (
        f"{name}{jax.tree_util.keystr(path)} is sharded as {x.sharding}, its parameter as {s}"
    )


def resume(layout: str, checkpoint: str, output: str) -> None:
  import jax
  import orbax.checkpoint as ocp

  import accum_jax
  from accum_jax._across_calls._resume import abstract_state

  assert len(jax.devices()) == RESTORE_DEVICES, jax.devices()
  mesh = make_mesh(RESTORE_DEVICES)
  shardings = param_shardings(layout, mesh)
  params = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), problem(), shardings
  )
  target = {"params": params, "opt_state": abstract_state(optimizer(), params)}
  restored = ocp.v1.load(checkpoint, target)
  params, state = restored["params"], restored["opt_state"]

  assert int(state.mini_step) == SAVED_AFTER, state.mini_step
  _check_sharded_like(params, shardings, "params")
  _check_sharded_like(state.acc_grads, shardings, "acc_grads")
  adam = state.inner_opt_state[0]
  _check_sharded_like(adam.mu, shardings, "mu")
  _check_sharded_like(adam.nu, shardings, "nu")
  for path, x in jax.tree.leaves_with_path(state):
    assert x.sharding.device_set == set(mesh.devices.flat), (
        f"opt_state{jax.tree_util.keystr(path)} lives on {x.sharding.device_set}"
    )

  params, state = train(params, state, range(SAVED_AFTER, EVERY_K), mesh)
  assert int(accum_jax.optimizer_step(state)) == 1, state
  np.savez(output, *(np.asarray(x) for x in jax.tree.leaves((params, state))))


if __name__ == "__main__":
  # Before jax is imported: this process has fewer devices than the one that saved.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  os.environ["XLA_FLAGS"] = " ".join(
      [*flags, f"--xla_force_host_platform_device_count={RESTORE_DEVICES}"]
  )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  resume(*sys.argv[1:4])
