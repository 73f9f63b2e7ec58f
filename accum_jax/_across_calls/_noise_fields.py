"""The gradient-noise fields of :func:`accum_jax.accumulate`'s state.

With ``gradient_noise=True`` (or an ``every_k`` from
:func:`accum_jax.noise.noise_scale_every_k`) the state keeps the current window's
noise sums (``noise``), the last applied window's estimate (``last_noise``) and,
for a noise-driven window length, its moving average and the current length.
Without, these fields are ``()`` and nothing here runs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from accum_jax import _core, _noise


def init(track_noise: bool, by_noise: _noise.NoiseScaleSchedule | None) -> dict[str, Any]:
  """The noise fields of a new state (none without gradient noise)."""
  if not track_noise:
    return {}
  nan = jnp.full((), jnp.nan, jnp.float32)
  fields: dict[str, Any] = {
      "noise": _noise.zero_sums(), "last_noise": _noise.GradientNoise(nan, nan)
  }
  if by_noise:
    fields["noise_ema"] = _noise.NoiseScaleEMA.create(by_noise.decay)
    fields["window_length"] = jnp.asarray(by_noise.k_min, jnp.int32)
  return fields


def add(state: Any, call: Any, kept: jax.Array) -> Any:
  """The window's noise sums with this call's gradient (per call without weight=:
  B_simple is then counted in calls)."""
  leaves = _core.gradient_leaves(call.grads, state.reductions.kinds)
  weight = jnp.asarray(1.0 if call.weight is None else call.weight)
  return _noise.add(state.noise, leaves, weight, kept)


def window(window: Any, call: Any) -> Any:
  """The window's GradientNoise, from its sums and its mean gradient's norm, read
  off the accumulator (of the gradient leaves, "sum" ones as means: statistics
  are left out)."""
  acc = window.accumulator
  totals = _core.gradient_leaves(acc.total, call.kinds)
  factor = 1.0 / jnp.where(acc.weight > 0, acc.weight, 1.0)
  return _noise.estimate(window.noise, _noise.mean_squared_norm(totals, factor))


def next(state: Any, window: Any, applied: jax.Array, last_noise: Any,
         by_noise: _noise.NoiseScaleSchedule | None) -> dict[str, Any]:
  """The noise fields after a call: emptied with the window, averaged when applied."""
  if state.noise == ():
    return {}
  fields = {
      "noise": jax.tree.map(lambda x: jnp.where(window.done, jnp.zeros_like(x), x),
                            window.noise),
      "last_noise": last_noise,
  }
  if by_noise:
    ema = jax.tree.map(
        lambda new, old: jnp.where(applied, new, old),
        state.noise_ema.update(last_noise),
        state.noise_ema,
    )
    fields["noise_ema"] = ema
    fields["window_length"] = jnp.where(
        applied, by_noise.next_k(ema, state.window_length), state.window_length
    )
  return fields
