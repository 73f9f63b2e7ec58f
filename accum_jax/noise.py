"""Gradient noise: its estimate from microbatches or calls, and window lengths that follow it.

``accumulate(..., gradient_noise=True)`` and ``value_and_grad(...,
gradient_noise=True)`` estimate the noise of the gradient (McCandlish et al.,
2018) from the spread of the microbatches' or calls' gradients;
:func:`last_window` reads the estimate from an optimizer state, and
:func:`noise_scale_every_k` sets the window length from its running average.
See the guide: :doc:`/guides/noise_scale`.
"""

from accum_jax._noise import GradientNoise, NoiseScaleEMA
from accum_jax._schedules import NoiseScaleSchedule, noise_scale_every_k
from accum_jax._state import last_window

__all__ = ("GradientNoise", "NoiseScaleEMA", "NoiseScaleSchedule", "last_window",
           "noise_scale_every_k")
