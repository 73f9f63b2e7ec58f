"""A drop-in for ``optax.MultiSteps``, built on :func:`accum_jax.accumulate`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from accum_jax import _schedules, _state, _transform


class MultiSteps:
  """Drop-in replacement for ``optax.MultiSteps``.

  The constructor, the methods and the state fields users read are Optax's;
  built on :func:`accum_jax.accumulate`, it computes the inner update only on
  the call that applies it, skips non-finite gradients, and accepts ``weight=``
  and ``flush=`` in ``update``. ``acc_grads`` holds the window's weighted *sum*.

  See the guide: :doc:`/migrating`.

  Args:
    opt: the wrapped optimizer.
    every_k_schedule: an int >= 1, or a callable from the gradient step to the
      number of mini-steps per update.
    use_grad_mean: average the accumulated gradients (True) or sum them.
    should_skip_update_fn: an Optax skip function such as
      ``optax.skip_not_finite``; a mini-step it rejects is not accumulated.
    accumulator_dtype: the least precision of the accumulator; float32 by
      default. None accumulates in the gradients' dtype.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax
    >>> opt = accum_jax.MultiSteps(optax.adam(1e-3), every_k_schedule=4)
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> int(state.mini_step), int(state.gradient_step)
    (0, 0)
  """

  def __init__(
      self,
      opt: optax.GradientTransformation,
      every_k_schedule: int | _schedules.EveryKSchedule,
      use_grad_mean: bool = True,
      should_skip_update_fn: _transform.ShouldSkipUpdateFunction | None = None,
      accumulator_dtype: Any = jnp.float32,
  ):
    self._opt = optax.with_extra_args_support(opt)
    self._transform = _transform._accumulate(
        self._opt,
        every_k_schedule,
        reduction="mean" if use_grad_mean else "sum",
        accumulator_dtype=accumulator_dtype,
        should_skip_update_fn=should_skip_update_fn,
        every_k_name="every_k_schedule",
    )

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer, with extra-argument support."""
    return self._opt

  def init(self, params: Any) -> _state.AccumulationState:
    """The initial state: an empty window and the inner optimizer's state."""
    return self._transform.init(params)

  def update(
      self,
      updates: Any,
      state: _state.AccumulationState,
      params: Any = None,
      **extra_args: Any,
  ) -> tuple[Any, _state.AccumulationState]:
    """Accumulates ``updates``; on the last mini-step of a window, updates.

    Takes ``weight=`` and ``flush=`` as :func:`accum_jax.accumulate` does; other
    keyword arguments reach the inner optimizer.
    """
    return self._transform.update(updates, state, params, **extra_args)

  def has_updated(self, state: Any) -> jax.Array:
    """Whether the last ``update`` applied the inner optimizer (bool scalar)."""
    return _state.has_updated(state)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This optimizer as an Optax transformation (what ``init``/``update`` call)."""
    return self._transform
