"""A drop-in for ``optax.MultiSteps``, built on :func:`accum_jax.accumulate`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from accum_jax import _core, _options, _schedules, _state, _transform


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["accumulation"],
    meta_fields=["use_grad_mean"],
)
@dataclasses.dataclass(frozen=True)
class MultiStepsState:
  """State of :class:`MultiSteps`, whose fields read as ``optax.MultiStepsState``'s.

  ``mini_step``, ``gradient_step``, ``inner_opt_state``, ``acc_grads`` and
  ``skip_state`` hold what Optax's hold after the same calls; they are read-only
  properties of the :class:`accum_jax.AccumulationState` underneath, whose own
  ``acc_grads`` stays the window's weighted sum. :func:`accum_jax.has_updated`,
  :func:`accum_jax.optimizer_step` and :func:`accum_jax.checkpoint.abstract_state` find
  that state inside, and it checkpoints as any pytree does (a leaf's key path
  starts with ``.accumulation``).

  Attributes:
    accumulation: the :func:`accum_jax.accumulate` state underneath.
    use_grad_mean: ``MultiSteps``' argument: whether ``acc_grads`` reads the
      window's mean (True) or its sum. Static: part of the tree structure, not a
      leaf.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax
    >>> opt = accum_jax.MultiSteps(optax.sgd(0.1), every_k_schedule=3)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = opt.init(params)
    >>> for g in (1.0, 2.0):
    ...   _, state = opt.update({"w": jnp.full(2, g)}, state, params)
    >>> state.acc_grads["w"], int(state.mini_step)  # the mean of 1 and 2, as in Optax
    (Array([1.5, 1.5], dtype=float32), 2)
    >>> state.accumulation.acc_grads["w"]  # accumulate's state keeps the sum
    Array([3., 3.], dtype=float32)
  """

  accumulation: _state.AccumulationState
  use_grad_mean: bool

  @property
  def mini_step(self) -> jax.Array:
    """Calls accumulated in the current window; shape=(), dtype=int32."""
    return self.accumulation.mini_step

  @property
  def gradient_step(self) -> jax.Array:
    """Updates applied so far; shape=(), dtype=int32."""
    return self.accumulation.gradient_step

  @property
  def inner_opt_state(self) -> Any:
    """The wrapped optimizer's state, advanced only on updates."""
    return self.accumulation.inner_opt_state

  @property
  def skip_state(self) -> Any:
    """What ``should_skip_update_fn`` reported on the last call (``()`` without one)."""
    return self.accumulation.skip_state

  @property
  def acc_grads(self) -> Any:
    """The window's gradients as ``optax.MultiSteps`` keeps them.

    With ``use_grad_mean=True`` their running mean, otherwise their sum, over
    the calls accumulated since the last update (a call a skip function
    rejected is not one of them); zeros after an update, and while the window
    holds no call. Calls given ``update(..., weight=w)`` enter as the weighted
    mean ``sum(w_i g_i) / sum(w_i)`` (zeros while that weight is 0) or the
    weighted sum ``sum(w_i g_i)``. In the accumulator dtype, with the gradient's
    tree. Flax's FP8 statistics read as kept (their maximum), not averaged.
    """
    acc = self.accumulation.accumulator
    if isinstance(acc.count, jax.ShapeDtypeStruct):
      return acc.total  # an abstract state (a restore target): no values
    return _window_gradient(acc, self.use_grad_mean)

  @property
  def num_skipped(self) -> jax.Array:
    """Calls skipped so far (see :attr:`accum_jax.AccumulationState.num_skipped`)."""
    return self.accumulation.num_skipped

  @property
  def num_empty_windows(self) -> jax.Array:
    """Windows that ended with zero total weight; int32 scalar."""
    return self.accumulation.num_empty_windows

  @property
  def window_value(self) -> jax.Array:
    """The weighted mean of the last applied window's ``value=`` arguments (0 before)."""
    return self.accumulation.window_value


def _window_gradient(acc: _core.Accumulator, use_grad_mean: bool) -> Any:
  """The window's weighted mean (or sum) in the accumulator dtype, zeros while empty.

  The accumulator holds the weighted sum, or in a dtype narrower than float32
  the weighted mean. States stacked by a scan have the same leading axes on the
  counters as on the sums.
  """
  total = acc.total
  kinds = _options.grad_reductions("mean" if use_grad_mean else "sum", total, "use_grad_mean")
  weight = jnp.asarray(acc.weight)

  def read(t, kind):
    if _core.is_statistic(kind):
      return t
    w = jnp.reshape(weight, weight.shape + (1,) * (jnp.ndim(t) - weight.ndim))
    if _core.is_narrow(t.dtype):  # t holds the mean
      return t if kind == "mean" else (t.astype(jnp.float32) * w).astype(t.dtype)
    if kind == "sum":
      return t
    return (t / jnp.where(w > 0, w, 1.0).astype(t.dtype)).astype(t.dtype)

  kinds_tree = jax.tree.unflatten(jax.tree.structure(total), kinds)
  return jax.tree.map(read, total, kinds_tree)


class MultiSteps:
  """Drop-in replacement for ``optax.MultiSteps``.

  The constructor, the methods and the state fields users read are Optax's;
  built on :func:`accum_jax.accumulate`, it computes the inner update only on
  the call that applies it, skips non-finite gradients, and accepts ``weight=``
  and ``flush=`` in ``update``. Its state, a :class:`accum_jax.MultiStepsState`,
  reads as Optax's: ``acc_grads`` is the window's running mean (or, with
  ``use_grad_mean=False``, sum), the weighted one for calls given ``weight=``.

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
    self._use_grad_mean = bool(use_grad_mean)
    self._transform = _transform._accumulate(
        self._opt,
        every_k_schedule,
        reduction="mean" if use_grad_mean else "sum",
        accumulator_dtype=accumulator_dtype,
        should_skip_update_fn=should_skip_update_fn,
        every_k_name="every_k_schedule",
    )
    self._gradient_transformation = optax.GradientTransformationExtraArgs(
        self.init, self.update
    )

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer, with extra-argument support."""
    return self._opt

  def init(self, params: Any) -> MultiStepsState:
    """The initial state: an empty window and the inner optimizer's state."""
    return MultiStepsState(self._transform.init(params), self._use_grad_mean)

  def update(
      self,
      updates: Any,
      state: MultiStepsState,
      params: Any = None,
      **extra_args: Any,
  ) -> tuple[Any, MultiStepsState]:
    """Accumulates ``updates``; on the last mini-step of a window, updates.

    Takes ``weight=`` and ``flush=`` as :func:`accum_jax.accumulate` does; other
    keyword arguments reach the inner optimizer.
    """
    updates, accumulation = self._transform.update(
        updates, state.accumulation, params, **extra_args
    )
    return updates, MultiStepsState(accumulation, self._use_grad_mean)

  def has_updated(self, state: Any) -> jax.Array:
    """Whether the last ``update`` applied the inner optimizer (bool scalar)."""
    return _state.has_updated(state)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This optimizer as an Optax transformation: its ``init`` and ``update``."""
    return self._gradient_transformation
