"""Which call ends a window, decided on the host: :class:`HostSchedule`.

``accumulate(...).update(..., apply=flag)`` with a Python bool compiles two
programs: one that only adds, one that adds and applies. The host must then say,
for each call, which one runs. :class:`HostSchedule` keeps that count in Python,
so that a training loop never writes the modulo and never reads the device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from accum_jax import _state
from accum_jax._noise import NoiseScaleSchedule
from accum_jax._schedules import EveryKSchedule, check_every_k


class HostSchedule:
  """Says, on the host, which calls of ``accumulate(...).update`` apply.

  Pass its answer as ``apply=``: the call that ends a window applies the inner
  optimizer, the others only add. It follows ``every_k`` (an int or a schedule of
  the optimizer step, as :func:`accum_jax.accumulate` takes it), ends a window
  early on the epoch's last call (``last=True``), and resumes where a restored
  state left off: it reads the state's counters once, when it is made.

  The windows it counts are the ones it ended. A window that the device skipped
  (its sum not finite) or found empty (zero weight) advances this count but not
  :func:`accum_jax.optimizer_step`; a schedule keyed on the step can differ from
  then on by those windows. Make a new one from the state to agree again.

  Args:
    every_k: calls per window, an int >= 1 or a callable from the optimizer
      step to it (:func:`accum_jax.piecewise_every_k`). A
      :func:`accum_jax.noise.noise_scale_every_k` schedule is decided on the device:
      leave ``apply`` out for it.
    state: the optimizer state to resume from (the state of
      :func:`accum_jax.accumulate`, or any pytree holding one: a chain's state,
      a Flax ``TrainState``, an ``nnx.Optimizer``); None starts a new run.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, accum_jax
    >>> opt = accum_jax.accumulate(optax.sgd(0.1), every_k=3)
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> schedule = accum_jax.HostSchedule(3, state)
    >>> [schedule.next() for _ in range(5)] + [schedule.next(last=True)]
    [False, False, True, False, False, True]
  """

  def __init__(self, every_k: int | EveryKSchedule, state: Any = None):
    if isinstance(every_k, NoiseScaleSchedule):
      raise ValueError(
          "every_k=noise_scale_every_k(...) sets each window's length on the device, from"
          " the gradient noise the state measures. Leave apply= out of update for it (the"
          " device schedule), or give HostSchedule an int or a schedule of the step.")
    self._every_k = check_every_k(every_k, "every_k")
    self.calls, self.optimizer_step = 0, 0
    if state is not None:
      found = _state.find_state(state, "HostSchedule")
      # asarray unwraps the nnx.Variables of an nnx.Optimizer's state.
      counters = (jnp.asarray(found.accumulator.count), jnp.asarray(found.optimizer_step))
      calls, step = jax.device_get(counters)
      self.calls, self.optimizer_step = int(calls), int(step)

  @property
  def window_length(self) -> int:
    """Calls in the current window: ``every_k`` at this optimizer step."""
    return int(jnp.asarray(self._every_k(jnp.asarray(self.optimizer_step, jnp.int32))))

  def next(self, last: bool = False) -> bool:
    """Whether the coming call ends its window; counts the call.

    Args:
      last: the epoch's (or the run's) last call: its window ends here,
        however short.

    Returns:
      A Python bool, for ``update(..., apply=...)``.
    """
    self.calls += 1
    if not (last or self.calls >= self.window_length):
      return False
    self.calls = 0
    self.optimizer_step += 1
    return True
