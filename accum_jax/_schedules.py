"""Window lengths for :func:`accum_jax.accumulate`: fixed, piecewise, or by the noise scale.

``every_k`` is an int, a callable from the optimizer step (updates applied so far)
to the window length, or a :class:`NoiseScaleSchedule`, whose length the state
keeps and updates as the measured critical batch size changes.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from accum_jax import _core, _noise


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


class NoiseScaleSchedule(NamedTuple):
  """A window length that follows the measured critical batch size.

  Made by :func:`noise_scale_every_k`; pass it as ``accumulate(every_k=...)``.

  Examples:
    >>> import accum_jax
    >>> schedule = accum_jax.noise.noise_scale_every_k(8, k_max=32)
    >>> schedule.k_min, schedule.k_max, schedule.monotone
    (2, 32, True)
  """

  microbatch_size: float
  k_min: int
  k_max: int
  decay: float
  monotone: bool

  def next_k(self, ema: _noise.NoiseScaleEMA, k: jax.Array) -> jax.Array:
    """``clip(round(B_simple / microbatch_size), k_min, k_max)``; ``k`` while unknown."""
    b_simple = ema.simple_noise_scale
    known = jnp.isfinite(b_simple) & (b_simple > 0)
    new = jnp.round(jnp.where(known, b_simple, 0.0) / self.microbatch_size)
    new = jnp.clip(new, self.k_min, self.k_max).astype(jnp.int32)
    if self.monotone:
      new = jnp.maximum(new, k)
    return jnp.where(known, new, k)


def noise_scale_every_k(
    microbatch_size: float,
    *,
    k_max: int,
    k_min: int = 2,
    decay: float = 0.9,
    monotone: bool = True,
) -> NoiseScaleSchedule:
  """``every_k`` for :func:`accum_jax.accumulate` that follows the gradient noise scale.

  The state keeps a :class:`accum_jax.noise.NoiseScaleEMA` of each window's
  :class:`accum_jax.noise.GradientNoise`; when a window is applied, the next one's
  length becomes ``k = clip(round(B_simple / microbatch_size), k_min, k_max)``
  (never less than before with ``monotone``): a batch-size warm-up that follows
  the critical batch size as training finds it. ``k`` is a traced value, so a
  change does not recompile; it changes only between windows. The learning
  rate stays per optimizer step (see the noise-scale guide).

  Args:
    microbatch_size: the weight of one call, in the unit of ``weight=``: its
      examples or tokens (1 when calls pass no weight: ``B_simple`` is then
      counted in calls).
    k_max: the longest window.
    k_min: the shortest window, and the first; at least 2, as the spread of
      the calls' gradients needs two of them.
    decay: of the moving averages, in [0, 1).
    monotone: never shorten the window.

  Returns:
    A :class:`NoiseScaleSchedule`, for ``accumulate(inner, every_k=...)``.

  Examples:
    >>> import optax, accum_jax
    >>> opt = accum_jax.accumulate(
    ...     optax.adam(1e-3), every_k=accum_jax.noise.noise_scale_every_k(32, k_max=16))
  """
  if not float(microbatch_size) > 0:
    raise ValueError(
        f"microbatch_size={microbatch_size!r} must be positive: the weight of one call"
        " (its examples or tokens; 1 when calls pass no weight=)."
    )
  k_min_, k_max_ = _core.positive_int(k_min), _core.positive_int(k_max)
  if k_min_ is None or k_max_ is None or not 2 <= k_min_ <= k_max_:
    raise ValueError(
        f"k_min={k_min!r} and k_max={k_max!r} must be ints with 2 <= k_min <= k_max: a"
        " window of one call shows no spread between gradients, so no noise scale."
    )
  _noise.NoiseScaleEMA.create(decay)  # checks decay
  return NoiseScaleSchedule(float(microbatch_size), k_min_, k_max_, float(decay), monotone)
