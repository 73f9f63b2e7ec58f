"""Window lengths for :func:`accum_jax.accumulate`: fixed or piecewise.

``every_k`` is an int, a callable from the optimizer step (updates applied so far)
to the window length, or a :class:`accum_jax.noise.NoiseScaleSchedule` (in
``_noise``), whose length the state keeps and updates as the measured critical
batch size changes.

The state keeps the schedule as static data (:class:`WindowSchedule`, no array),
so that :class:`accum_jax.HostSchedule` reads it from the state: the window's
length is said once, to ``accumulate``. On the host, a length is Python
arithmetic (:func:`host_window_length`); on the device, the schedule is traced.
"""

from __future__ import annotations

import bisect
import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from accum_jax import _core


class EveryKSchedule(Protocol):
  """Maps the optimizer step (updates applied so far) to the window length: a
  Python int on the host schedule, a traced int32 scalar on the device schedule."""

  def __call__(self, optimizer_step: Any) -> Any:
    ...


@dataclasses.dataclass(frozen=True)
class ConstantEveryK:
  """``every_k`` given as an int: every window holds ``k`` calls."""

  k: int

  def __call__(self, optimizer_step: Any) -> int:
    del optimizer_step
    return self.k


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
  return ConstantEveryK(k)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class WindowSchedule:
  """The ``every_k`` that :func:`accum_jax.accumulate` was given, kept in its state
  as static data (a pytree node with no leaves: nothing to transfer or checkpoint).

  ``schedule`` is None where the device sets each window's length (a
  :func:`accum_jax.noise.noise_scale_every_k` schedule, whose length is an array
  of the state).
  """

  schedule: EveryKSchedule | None


def host_window_length(schedule: EveryKSchedule, optimizer_step: int) -> int:
  """``schedule``'s window length at ``optimizer_step``, computed on the host.

  The schedule is called with a Python int; it must answer with a Python or
  NumPy int (an int ``every_k`` and :func:`piecewise_every_k` do), since reading
  a device array back would make the host wait for every step in flight.
  """
  k = schedule(optimizer_step)
  if isinstance(k, jax.Array) or not isinstance(k, (numbers.Integral, np.integer)):
    raise TypeError(
        f"every_k({optimizer_step}) returned {type(k).__name__} {k!r}: on the host"
        " schedule, the window length is computed on the host, from a Python int, and"
        " must be a Python int (reading a device array would make the loop wait for the"
        " device on every window). Write the schedule with Python arithmetic, or use"
        " accum_jax.piecewise_every_k, which answers on the host and under jit.")
  if k < 1:
    raise ValueError(f"every_k({optimizer_step}) returned {k}: a window holds >= 1 calls.")
  return int(k)


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
    >>> [schedule(s) for s in (0, 9, 10, 99, 100, 5000)]  # on the host
    [1, 1, 4, 4, 8, 8]
    >>> [int(schedule(jnp.int32(s))) for s in (0, 9, 10, 99, 100, 5000)]  # as under jit
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
  steps = tuple(sorted(boundaries))
  return PiecewiseEveryK(steps, (1,) + tuple(int(boundaries[s]) for s in steps))


@dataclasses.dataclass(frozen=True)
class PiecewiseEveryK:
  """:func:`piecewise_every_k`'s schedule: ``ks[i]`` from ``starts[i - 1]`` on (1
  before the first). A Python int step gets a Python int, computed on the host; a
  traced step (the device schedule) an int32 array."""

  starts: tuple[int, ...]
  ks: tuple[int, ...]

  def __call__(self, optimizer_step: Any) -> Any:
    if isinstance(optimizer_step, (numbers.Integral, np.integer)):
      return self.ks[bisect.bisect_right(self.starts, int(optimizer_step))]
    starts = jnp.array(self.starts, jnp.int32)
    index = jnp.searchsorted(starts, optimizer_step, side="right")
    return jnp.array(self.ks, jnp.int32)[index]
