"""A drop-in for ``optax.MultiSteps``, built on :func:`accum_jax.accumulate`.

Its state is Optax's own ``optax.MultiStepsState``, so that Optax's checkpoints
restore into it, and ``_replace`` and ``isinstance`` work as they do for Optax's.
Each ``update`` reads that state as the window :func:`accum_jax.accumulate` keeps
(:func:`_to_accumulation`), runs accumulate's update, and writes the result back
(:func:`_to_multisteps`). The conversions are elementwise, and XLA fuses them into
the add of the gradient.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import optax

from accum_jax import _arguments, _core
from accum_jax._across_calls import _schedules, _state, _transform, _update_args
from accum_jax._across_calls._state import AccumulationState

# optax's class itself, re-exported: accum_jax.MultiSteps' state, and Optax's.
MultiStepsState = optax.MultiStepsState

# The extra arguments that accumulate reads as the window's (the mean loss, the
# window's gradient). optax.MultiSteps passes the applying call's, as they are, and
# its state has no place for a window's losses: they travel to the inner optimizer
# under these names, out of accumulate's sight.
_PASSED = {name: f"_multisteps_{name}" for name in _update_args.WINDOW_ARGS}


def _passing_window_args(inner: optax.GradientTransformationExtraArgs):
  """``inner`` taking ``value`` and ``grad`` under the names of ``_PASSED``."""

  def update(updates, state, params=None, **extra_args):
    for name, passed in _PASSED.items():
      if passed in extra_args:
        extra_args[name] = extra_args.pop(passed)
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update)


def _to_accumulation(
    state: optax.MultiStepsState, grads: Any, kinds: tuple[str, ...], every_k: Any
) -> AccumulationState:
  """``state`` as :func:`accum_jax.accumulate`'s: the window, the counters, the inner state.

  The core keeps a window's sum (``_core.add``): ``acc_grads`` times ``mini_step``
  for a running mean. A leaf whose accumulator is narrower than float32 (both the
  state and the gradient narrow) keeps the running mean instead, as ``acc_grads``
  does under ``use_grad_mean``; a sum is divided by ``mini_step`` there. Each leaf
  is accumulated in the promotion of its ``acc_grads`` dtype and its gradient's, so
  neither is rounded; statistics ("max", "last") in the gradient's dtype, as kept.
  Every call counts 1 (``weight=`` is refused), so the window's weight is
  ``mini_step``. The fields Optax's state has no place for start from their
  initial values: skip counts, the ``value`` window, ``last_updated``.
  """
  count = jnp.asarray(state.mini_step, jnp.int32)
  weight = count.astype(jnp.float32)

  def total(acc, g, kind):
    acc = jnp.asarray(acc)
    if _core.is_statistic(kind):
      return acc.astype(jax.dtypes.canonicalize_dtype(jnp.result_type(g)))
    dtype = jnp.promote_types(acc.dtype, jax.dtypes.canonicalize_dtype(jnp.result_type(g)))
    return _core.total_for(acc.astype(dtype), weight, kind)

  kinds_tree = jax.tree.unflatten(jax.tree.structure(grads), kinds)
  counts = [count, jnp.asarray(state.gradient_step, jnp.int32)]
  return AccumulationState(
      window_total=jax.tree.map(total, state.acc_grads, grads, kinds_tree),
      inner_opt_state=state.inner_opt_state,
      scalars=_state.scalars(
          jnp.stack(counts + [jnp.zeros((), jnp.int32)] * (len(_state.COUNTS) - 2)),
          jnp.stack([weight] + [jnp.zeros((), jnp.float32)] * (len(_state.SUMS) - 1))),
      skip_state=state.skip_state,
      every_k=every_k,
      reductions=_state.Reductions(tuple(kinds)),
  )


def _to_multisteps(
    accumulation: AccumulationState, kinds: tuple[str, ...], like: Any
) -> optax.MultiStepsState:
  """``accumulation`` as ``optax.MultiStepsState``, ``acc_grads`` in the dtypes of ``like``."""
  acc_grads = _state.window_gradient(accumulation)
  return optax.MultiStepsState(
      mini_step=accumulation.mini_step,
      gradient_step=accumulation.optimizer_step,
      inner_opt_state=accumulation.inner_opt_state,
      acc_grads=jax.tree.map(lambda a, x: a.astype(jnp.result_type(x)), acc_grads, like),
      skip_state=accumulation.skip_state,
  )


def _optax_accumulator_dtype() -> Any:
  """``optax.MultiSteps``' default ``accumulator_dtype``; None (the parameters'
  dtype) for an optax that has no such argument."""
  parameter = inspect.signature(optax.MultiSteps).parameters.get("accumulator_dtype")
  return None if parameter is None else parameter.default


# The installed optax's default, so that a MultiSteps state restores into either.
_OPTAX_ACCUMULATOR_DTYPE = _optax_accumulator_dtype()


class MultiSteps:
  """Drop-in replacement for ``optax.MultiSteps``.

  The constructor, the methods and the state are Optax's: the state is an
  ``optax.MultiStepsState`` (also named :class:`accum_jax.MultiStepsState`), with
  ``acc_grads`` the window's running mean (with ``use_grad_mean=False``, its sum)
  and zeros after an update, so that a checkpoint written by either restores into
  the other and ``state._replace(...)`` works. Built on
  :func:`accum_jax.accumulate`, it computes the inner update only on the call that
  applies it, and takes ``flush=True`` in ``update`` to apply a partial window.

  What differs from Optax's: without ``should_skip_update_fn``, a window whose
  gradients hold a NaN or Inf is skipped whole when it ends (zero updates, the inner
  state untouched, ``acc_grads`` emptied) where Optax's keeps the NaN for the rest
  of training. Nothing in the state counts such windows: ``gradient_step`` not
  advancing at the window's end is what shows it. Pass
  ``should_skip_update_fn=optax.skip_not_finite`` to reject each non-finite call
  and have ``skip_state`` report it, or use :func:`accum_jax.accumulate`, whose
  state counts ``num_skipped``. ``update`` takes no ``weight=``: the state keeps
  no total weight (:func:`accum_jax.accumulate` takes ``weight=``).

  See the guide: :doc:`/migrating`.

  Args:
    opt: the wrapped optimizer.
    every_k_schedule: an int >= 1, or a callable from the gradient step to the
      number of mini-steps per update.
    use_grad_mean: average the accumulated gradients (True) or sum them.
    should_skip_update_fn: an Optax skip function such as
      ``optax.skip_not_finite``; a mini-step it rejects is not accumulated.
    accumulator_dtype: the dtype of ``acc_grads``; by default the installed
      ``optax.MultiSteps``' (float32; an optax without the argument keeps the
      parameters' dtype), so that its states restore; None keeps the parameters'
      dtype. Each call accumulates in the promotion of it and the gradient's dtype.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax
    >>> opt = accum_jax.MultiSteps(optax.sgd(0.1), every_k_schedule=3)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = opt.init(params)
    >>> for g in (1.0, 2.0):
    ...   _, state = opt.update({"w": jnp.full(2, g)}, state, params)
    >>> isinstance(state, optax.MultiStepsState), int(state.mini_step)
    (True, 2)
    >>> state.acc_grads["w"]  # the mean of 1 and 2, as in Optax
    Array([1.5, 1.5], dtype=float32)
  """

  def __init__(
      self,
      opt: optax.GradientTransformation,
      every_k_schedule: int | _schedules.EveryKSchedule,
      use_grad_mean: bool = True,
      should_skip_update_fn: _transform.ShouldSkipUpdateFunction | None = None,
      accumulator_dtype: Any = _OPTAX_ACCUMULATOR_DTYPE,
  ):
    self._opt = optax.with_extra_args_support(opt)
    self._reduction = "mean" if use_grad_mean else "sum"
    self._transform = _transform._accumulate(
        _passing_window_args(self._opt),
        every_k_schedule,
        reduction=self._reduction,
        accumulator_dtype=accumulator_dtype,
        should_skip_update_fn=should_skip_update_fn,
        every_k_name="every_k_schedule",
        layout="tree",
    )
    # Optax's dtype of acc_grads (None: the parameters'), checked by accumulate above.
    dtype = _core.canonicalize_accumulator_dtype(accumulator_dtype)
    self._accumulator_dtype = None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)
    self._every_k = _schedules.WindowSchedule(
        _schedules.check_every_k(every_k_schedule, "every_k_schedule")
    )
    self._gradient_transformation = optax.GradientTransformationExtraArgs(
        self.init, self.update
    )

  @property
  def inner_opt(self) -> optax.GradientTransformationExtraArgs:
    """The wrapped optimizer, with extra-argument support."""
    return self._opt

  def _acc_grads_dtype(self, dtype: Any) -> Any:
    """Optax's ``acc_grads`` dtype for a leaf accumulated in ``dtype``: its
    ``accumulator_dtype``, but complex where the leaf is (Optax's would drop the
    imaginary part)."""
    if self._accumulator_dtype is None or jnp.issubdtype(dtype, jnp.complexfloating):
      return dtype
    return self._accumulator_dtype

  def init(self, params: Any) -> optax.MultiStepsState:
    """The initial state: an empty window and the inner optimizer's state."""
    accumulation = self._transform.init(params)
    zeros = jax.tree.map(
        lambda t: t.astype(self._acc_grads_dtype(t.dtype)), accumulation.window_total
    )
    return optax.MultiStepsState(
        mini_step=accumulation.mini_step,
        gradient_step=accumulation.optimizer_step,
        inner_opt_state=accumulation.inner_opt_state,
        acc_grads=zeros,
        skip_state=accumulation.skip_state,
    )

  def update(
      self,
      updates: Any,
      state: optax.MultiStepsState,
      params: Any = None,
      **extra_args: Any,
  ) -> tuple[Any, optax.MultiStepsState]:
    """Accumulates ``updates``; on the last mini-step of a window, updates.

    Takes ``flush=True`` as :func:`accum_jax.accumulate` does (apply the window
    now); refuses ``weight=``. Other keyword arguments, ``value`` included,
    reach the inner optimizer as the applying call gives them, as in Optax.
    """
    if extra_args.pop("weight", None) is not None:
      raise ValueError(
          "accum_jax.MultiSteps takes no weight=: its state, optax.MultiStepsState,"
          " keeps the window's mean (or sum) and its number of mini-steps, not a total"
          " weight, so a weighted window cannot carry over from one call to the next."
          " For windows weighted by e.g. valid tokens use"
          " accum_jax.accumulate(opt, every_k, reduction='mean'), whose update takes"
          " weight=; or leave weight out for optax.MultiSteps' unweighted mean."
      )
    for name, passed in _PASSED.items():
      if name in extra_args:
        extra_args[passed] = extra_args.pop(name)
    _update_args.check_tree_matches(updates, state.acc_grads)
    kinds = _arguments.grad_reductions(self._reduction, updates, "use_grad_mean")
    accumulation = _to_accumulation(state, updates, kinds, self._every_k)
    updates, accumulation = self._transform.update(updates, accumulation, params, **extra_args)
    return updates, _to_multisteps(accumulation, kinds, state.acc_grads)

  def has_updated(self, state: Any) -> jax.Array:
    """Whether the last ``update`` applied the inner optimizer (bool scalar).

    Optax's rule, from the counters: ``mini_step == 0 and gradient_step > 0``.
    A call that ends a window skipped for a NaN, or one a skip function rejects
    at ``mini_step == 0``, reads True once an update has happened; to know for
    sure, compare ``gradient_step`` before and after the call.
    """
    return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

  def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
    """This optimizer as an Optax transformation: its ``init`` and ``update``."""
    return self._gradient_transformation
