"""Inside one step, the ways of taking one batch's gradient, and how they are checked.

Each takes a loss and a number of microbatches N and returns a function of
``(params, tokens)`` returning ``(loss, grads)`` for a batch of B = N x micro
sequences, with no optimizer update (the ratios are about the loop):

- ``accum_jax``: ``accum_jax.value_and_grad(loss_fn, N)``, defaults (float32
  accumulator); ``--quick`` also runs it with ``on_nonfinite="skip_microbatch"`` and
  ``on_nonfinite="unchecked"``;
- ``lax.scan``: the hand-written loop MaxText and Levanter write: the batch
  reshaped to (N, micro, T + 1), ``jax.value_and_grad`` in a ``lax.scan`` body,
  float32 sums carried, divided by N after;
- ``full batch``: ``jax.value_and_grad(loss_fn)`` of all B sequences at once.

accum_jax's loss and gradient are checked against the scan's (:func:`compare`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import accum_jax

FULL = "full batch"
SCAN = "lax.scan"
ACCUM = "accum_jax"
METHOD_NAMES = (ACCUM, SCAN, FULL)

# --quick's names for the door's three ways of judging non-finite data.
DEFAULT = "default"
MICROBATCH = "on_nonfinite='skip_microbatch'"
NO_SKIP = "on_nonfinite='unchecked'"

# accum_jax against the hand-written scan: both sum the same bfloat16 microbatch
# gradients in float32 and cast the mean to bfloat16, so they differ by the
# rounding of that cast and the order of the sums: a few bfloat16 ulps (2**-8
# relative) of a leaf's largest entry at most.
GRAD_RTOL = 2e-2
LOSS_RTOL = 1e-4  # the loss is float32 on both sides


def full_batch(loss: Callable, num_microbatches: int) -> Callable:
  del num_microbatches
  return jax.value_and_grad(loss)


def hand_written_scan(loss: Callable, num_microbatches: int) -> Callable:
  """The loop users write: reshape to (N, micro, ...), scan, float32 sums, divide by N."""

  def value_and_grad(params, tokens):
    microbatches = tokens.reshape(num_microbatches, -1, *tokens.shape[1:])

    def body(total, microbatch):
      out = jax.value_and_grad(loss)(params, microbatch)
      return jax.tree.map(lambda s, x: s + x.astype(jnp.float32), total, out), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (jnp.zeros(()), params))
    (value, grads), _ = jax.lax.scan(body, zeros, microbatches)
    return value / num_microbatches, jax.tree.map(
        lambda g, p: (g / num_microbatches).astype(p.dtype), grads, params
    )

  return value_and_grad


def accum_jax_value_and_grad(loss: Callable, num_microbatches: int) -> Callable:
  return accum_jax.value_and_grad(loss, num_microbatches)


METHODS: dict[str, Callable[[Callable, int], Callable]] = {
    ACCUM: accum_jax_value_and_grad,
    SCAN: hand_written_scan,
    FULL: full_batch,
}

# --quick: the scan first (the reference), then the door's three ways of judging
# non-finite data, then the full batch.
QUICK_METHODS: dict[str, Callable[[Callable, int], Callable]] = {
    SCAN: hand_written_scan,
    DEFAULT: accum_jax_value_and_grad,
    MICROBATCH: lambda loss, n: accum_jax.value_and_grad(loss, n, on_nonfinite="skip_microbatch"),
    NO_SKIP: lambda loss, n: accum_jax.value_and_grad(loss, n, on_nonfinite="unchecked"),
    FULL: full_batch,
}


def compile_timed(fn: Callable, *args: Any) -> tuple[Any, float]:
  """``jax.jit(fn)`` lowered and compiled for ``args``, and the seconds that took."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - start


def rel_diff(a: Any, b: Any) -> float:
  """The largest |a - b| of any leaf, relative to the largest |b| of that leaf, in float32."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)
    scale = float(np.max(np.abs(y))) or 1.0
    worst = max(worst, float(np.max(np.abs(x - y))) / scale)
  return worst


def compare(
    out: tuple[Any, Any], reference: tuple[Any, Any], *, check: bool = True
) -> dict[str, Any]:
  """Loss and gradient against a reference; ``check``: with the verdict (``match``)."""
  loss_diff = rel_diff(out[0], reference[0])
  grad_diff = rel_diff(out[1], reference[1])
  result = {
      "loss": float(out[0]),
      "reference_loss": float(reference[0]),
      "loss_rel_diff": loss_diff,
      "grad_max_rel_diff": grad_diff,
  }
  if check:
    result["match"] = loss_diff <= LOSS_RTOL and grad_diff <= GRAD_RTOL
  return result
