"""Which call ends a window, decided on the host: :class:`HostSchedule`.

``accumulate(...).update(..., apply=flag)`` with a Python bool compiles two
programs: one that only adds, one that adds and applies. The host must then say,
for each call, which one runs. :class:`HostSchedule` keeps that count in Python:
its ``next()`` is integer arithmetic that never touches the device, so the loop
runs ahead of the device as JAX's asynchronous dispatch lets it. The window
length is the one ``accumulate`` was given, read from the state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from accum_jax._across_calls import _state
from accum_jax._across_calls._schedules import host_window_length


class HostSchedule:
  """Says, on the host, which calls of ``accumulate(...).update`` apply.

  Pass its answer as ``apply=``: the call that ends a window applies the inner
  optimizer, the others only add. Windows hold the ``every_k`` calls that
  :func:`accum_jax.accumulate` was given (an int, or a schedule of the optimizer
  step), read from the state, and a window ends early on the epoch's last call
  (``last=True``). ``next()`` is Python arithmetic: it moves no data and never
  waits for the device.

  Making one reads the state's two counters (one transfer, which waits for the
  steps in flight): make it before the loop, from a new or a restored state.

  The windows it counts are the ones it ended. A window that the device skipped
  (its sum not finite) or found empty (zero weight) advances this count but not
  :func:`accum_jax.optimizer_step`; a schedule keyed on the step can differ from
  then on by those windows. Make a new one from the state to agree again.

  Args:
    state: the optimizer state (the state of :func:`accum_jax.accumulate`, or
      any pytree holding one: a chain's state, a Flax ``TrainState``, an
      ``nnx.Optimizer``). A :func:`accum_jax.noise.noise_scale_every_k` schedule
      is decided on the device: leave ``apply`` out for it.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, accum_jax
    >>> opt = accum_jax.accumulate(optax.sgd(0.1), every_k=3)
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> schedule = accum_jax.HostSchedule(state)
    >>> [schedule.next() for _ in range(5)] + [schedule.next(last=True)]
    [False, False, True, False, False, True]
  """

  def __init__(self, state: Any, *args: Any):
    if args or isinstance(state, int) or callable(state):
      raise TypeError(
          "HostSchedule takes the optimizer state alone: HostSchedule(state), or"
          " HostSchedule(optimizer) for an nnx.Optimizer. It reads the window length"
          " from the state, where accumulate(inner, every_k=...) put it, so that it is"
          " said once.")
    found = _state.find_state(state, "HostSchedule")
    if found.every_k.schedule is None:
      raise ValueError(
          "This state's accumulate has every_k=noise_scale_every_k(...), which sets each"
          " window's length on the device, from the gradient noise the state measures."
          " Leave apply= out of update for it (the device schedule), or give accumulate"
          " an int or a schedule of the step.")
    self._every_k = found.every_k.schedule
    # asarray unwraps the nnx.Variables of an nnx.Optimizer's state.
    counts = jax.device_get(jnp.asarray(found.scalars))
    self.calls = int(counts[_state.COUNT["mini_step"]])
    self.optimizer_step = int(counts[_state.COUNT["optimizer_step"]])
    self._length = (self.optimizer_step, host_window_length(self._every_k, self.optimizer_step))

  @property
  def window_length(self) -> int:
    """Calls in the current window: ``every_k`` at this optimizer step."""
    step, length = self._length
    if step != self.optimizer_step:
      self._length = step, length = (
          self.optimizer_step, host_window_length(self._every_k, self.optimizer_step))
    return length

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
