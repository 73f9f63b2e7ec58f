"""Checkpoint with Orbax, resume in a fresh process, finish bit for bit as if never stopped.

Two doors, one Linen model with BatchNorm and dropout:

* ``accumulate``: a ``TrainState`` whose ``tx`` is ``accum_jax.accumulate(adam,
  every_k=4)``, saved after 2 of the 4 calls of a window, with half a window in
  its accumulator; ``multisteps`` the same with ``accum_jax.MultiSteps(adam, 4)``,
  whose state is ``optax.MultiStepsState`` (unweighted calls: it takes no weight);
* ``value_and_grad``: a ``TrainState`` with plain Adam and BatchNorm statistics,
  stepped by ``accum_jax.value_and_grad`` over 4 microbatches. A call holds no
  state between its microbatches, so it is saved between steps.

Run as a script, this module is the fresh process:
``python test_checkpoint.py DOOR CHECKPOINT_DIR OUTPUT_NPZ`` restores the
checkpoint, trains to the end and saves the final state's leaves.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
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
  """The fresh process: restore, check it is mid-run, train to the end, save leaves."""
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


def _run_test(door: str, tmp_path: Path) -> None:
  uninterrupted = train(make_state(door), door, range(TOTAL_CALLS[door]))
  stopped = train(make_state(door), door, range(CHECKPOINT_AFTER[door]))
  save(tmp_path / "checkpoint", stopped)
  del stopped
  subprocess.run(
      [sys.executable, __file__, door, str(tmp_path / "checkpoint"), str(tmp_path / "final.npz")],
      check=True,
  )
  with np.load(tmp_path / "final.npz") as final:
    resumed = [final[f"arr_{i}"] for i in range(len(final.files))]
  expected = jax.tree.leaves_with_path(uninterrupted)
  assert len(resumed) == len(expected)
  for (path, x), y in zip(expected, resumed):
    assert np.array_equal(np.asarray(x), y), f"at {jax.tree_util.keystr(path)}"


def test_accumulate_resumed_mid_window_in_a_fresh_process_is_bitwise_equal(tmp_path):
  _run_test("accumulate", tmp_path)


def test_multisteps_resumed_mid_window_in_a_fresh_process_is_bitwise_equal(tmp_path):
  _run_test("multisteps", tmp_path)


def test_value_and_grad_loop_resumed_between_steps_in_a_fresh_process_is_bitwise_equal(tmp_path):
  _run_test("value_and_grad", tmp_path)


if __name__ == "__main__":
  resume(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
