"""Window lengths for :func:`accum_jax.accumulate`: fixed or piecewise.

``every_k`` is an int, a callable from the optimizer step (updates applied so far)
to the window length, or a :class:`accum_jax.noise.NoiseScaleSchedule` (in
``_noise``), whose length the state keeps and updates as the measured critical
batch size changes.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from accum_jax import _core


class EveryKSchedule(Protocol):
  """Maps the optimizer step (updates applied so far) to the window length."""

  def __call__(self, optimizer_step: jax.Array) -> jax.typing.ArrayLike:
    ...


def check_every_k(every_k: Any, name: str) -> EveryKSchedule:
  if callable(every_k):
    return every_k
  k = _core.positive_int(every_k)
  if k is None:
    raise ValueError(
        f"{name}={every_k!r} must be an int >= 1 (the number of calls per"
        " update) or a callable from the optimizer step to that number; use"
        " 1 for no accumulation."
    )
  return lambda optimizer_step: k


def piecewise_every_k(
    boundaries: Mapping[int, int],
) -> EveryKSchedule:
  """A piecewise-constant window length: ``{optimizer_step: k}``.

  From each optimizer step named (updates so far) on, ``k`` calls make an
  update, like PyTorch Lightning's ``GradientAccumulationScheduler``; before
  the first one, 1. Use it to warm the batch size up without recompiling.

  Args:
    boundaries: a mapping from optimizer steps (ints >= 0) to window lengths
      (ints >= 1).

  Returns:
    A callable from the optimizer step to k, for ``accumulate(every_k=...)``.

  Examples:
    >>> import jax.numpy as jnp, accum_jax
    >>> schedule = accum_jax.piecewise_every_k({0: 1, 10: 4, 100: 8})
    >>> [int(schedule(jnp.int32(s))) for s in (0, 9, 10, 99, 100, 5000)]
    [1, 1, 4, 4, 8, 8]
  """
  if not isinstance(boundaries, Mapping):
    raise ValueError(
        f"boundaries={boundaries!r} is a {type(boundaries).__name__}, not a mapping: pass a"
        " dict from optimizer steps to window lengths, e.g. {0: 1, 1000: 4}"
        " (dict(pairs) turns a list of (step, k) pairs into one)."
    )
  if not boundaries:
    raise ValueError(
        "boundaries is empty: pass a mapping such as {0: 1, 1000: 4}, from an"
        " optimizer step to the number of calls per update from then on."
    )
  for step, k in boundaries.items():
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
      raise ValueError(
          f"boundaries has the key {step!r}: keys are optimizer steps, ints >= 0."
      )
    if _core.positive_int(k) is None:
      hint = (
          " To compute k from the step with a function, pass the function itself as"
          " every_k (accumulate(inner, every_k=fn))."
          if callable(k)
          else ""
      )
      raise ValueError(
          f"boundaries[{step}]={k!r} must be an int >= 1, the number of calls per"
          f" update from optimizer step {step} on.{hint}"
      )
  steps = sorted(boundaries)
  starts = jnp.array(steps, jnp.int32)
  ks = jnp.array([1] + [int(boundaries[s]) for s in steps], jnp.int32)

  def schedule(optimizer_step: jax.Array) -> jax.Array:
    return ks[jnp.searchsorted(starts, optimizer_step, side="right")]

  return schedule
