"""Writes ``v010_checkpoint/``: an Orbax checkpoint of accum_jax 0.1.0's state, mid-window.

Made with the release itself (commit e36d086) and orbax-checkpoint 0.12.8::

  git worktree add /tmp/v010 e36d086
  PYTHONPATH=/tmp/v010 .venv/bin/python tests/data/make_v010_checkpoint.py
  git worktree remove /tmp/v010

The state is ``accumulate(optax.adam(1e-2), every_k=4, accumulator_dtype=None)``'s
for three tiny parameters, two float32 (whose accumulator holds the window's weighted
sum) and one bfloat16 (whose accumulator 0.1.0 kept, as narrow ones still are, as the
weighted mean), after 2 of the window's 4 calls, with ``weight=`` and ``value=``.
``{"params": ..., "opt_state": ...}`` is saved with ``ocp.v1.save``.

``v010_expected.npz`` holds what 0.1.0 itself gave when it went on to the end of the
window: the parameters after the window's 4 calls (``params/<name>``, as float32: NumPy
has no bfloat16 of its own, and the bfloat16 values are exact in it).
``tests/test_checkpoint.py`` makes the same calls (:func:`grads`, :data:`WEIGHTS`,
:data:`VALUES`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import accum_jax

HERE = Path(__file__).resolve().parent
EVERY_K = 4
SAVED_AFTER = 2
WEIGHTS = (1.0, 2.0, 0.5, 1.5)
VALUES = (0.25, 0.75, 1.25, 1.75)


def params() -> dict[str, jax.Array]:
  return {
      "b": jnp.zeros(3, jnp.float32),
      "s": jnp.ones(2, jnp.bfloat16),
      "w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 8,
  }


def grads(call: int) -> dict[str, jax.Array]:
  """The gradient of call ``call``: exact in every dtype, different per call and leaf."""
  return {
      "b": jnp.full(3, 0.5 - call, jnp.float32),
      "s": jnp.array([call + 1, -0.25 * call], jnp.bfloat16),
      "w": (jnp.arange(6, dtype=jnp.float32).reshape(2, 3) - call) / 4,
  }


def main() -> None:
  opt = accum_jax.accumulate(optax.adam(1e-2), every_k=EVERY_K, accumulator_dtype=None)
  assert hasattr(opt.init(params()), "accumulator"), "run with accum_jax 0.1.0 (see above)"

  @jax.jit
  def step(p, state, g, weight, value):
    updates, state = opt.update(g, state, p, weight=weight, value=value)
    return optax.apply_updates(p, updates), state

  p, state = params(), opt.init(params())
  for call in range(EVERY_K):
    if call == SAVED_AFTER:
      path = HERE / "v010_checkpoint"
      shutil.rmtree(path, ignore_errors=True)
      ocp.v1.save(path, {"params": p, "opt_state": state})
    p, state = step(p, state, grads(call), jnp.float32(WEIGHTS[call]), jnp.float32(VALUES[call]))
  assert int(state.optimizer_step) == 1
  np.savez(HERE / "v010_expected.npz",
           **{f"params/{k}": np.asarray(v, np.float32) for k, v in p.items()})


if __name__ == "__main__":
  main()
