"""Gradient noise: its estimate from microbatches or calls, and window lengths that follow it.

``accumulate(..., gradient_noise=True)`` and ``value_and_grad(...,
gradient_noise=True)`` estimate the noise of the gradient (McCandlish et al.,
2018) from the spread of the microbatches' or calls' gradients;
:func:`last_window` reads the estimate from an optimizer state, and
:func:`noise_scale_every_k` sets the window length from its running average.
See the guide: :doc:`/guides/noise_scale`.
"""

from typing import Any

import jax.numpy as jnp

from accum_jax._across_calls._state import find_state
from accum_jax._noise import GradientNoise, NoiseScaleEMA, NoiseScaleSchedule, noise_scale_every_k

__all__ = ("GradientNoise", "NoiseScaleEMA", "NoiseScaleSchedule", "last_window",
           "noise_scale_every_k")


def last_window(state: Any) -> GradientNoise:
  """The :class:`accum_jax.noise.GradientNoise` of the last applied window.

  Args:
    state: as for :func:`accum_jax.has_updated`, of an ``accumulate(...,
      gradient_noise=True)`` (or with a :func:`noise_scale_every_k` schedule).

  Returns:
    ``grad_sq`` and ``trace_cov`` (NaN before the first window, or for a window
    of fewer than two kept calls), per unit of the calls' ``weight``.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax
    >>> opt = accum_jax.accumulate(optax.sgd(0.1), every_k=2, gradient_noise=True)
    >>> params = {"w": jnp.zeros(1)}
    >>> state = opt.init(params)
    >>> for g in (1.0, 3.0):
    ...   _, state = opt.update({"w": jnp.array([g])}, state, params)
    >>> noise = accum_jax.noise.last_window(state)  # calls of 1 and 3: mean 2, spread 2
    >>> float(noise.trace_cov), float(noise.grad_sq)
    (2.0, 3.0)
  """
  found = find_state(state, "accum_jax.noise.last_window")
  if isinstance(found.last_noise, tuple) and found.last_noise == ():
    raise ValueError(
        "accum_jax.noise.last_window found an accumulate state that does not measure"
        " the noise: build it with accumulate(..., gradient_noise=True), or with"
        " every_k=accum_jax.noise.noise_scale_every_k(...)."
    )
  # jnp.asarray unwraps the nnx.Variables of an nnx.Optimizer's state.
  return GradientNoise(*(jnp.asarray(x) for x in found.last_noise))
