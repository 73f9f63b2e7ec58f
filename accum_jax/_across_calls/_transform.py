"""Accumulation across calls: an Optax gradient transformation.

:func:`accumulate`'s ``update`` is a short composition of the steps below::

  options = _make_options(...)                  # once, when it is built
  call = _bind(options, grads, state, ...)      # per call: checks, window arguments
  window = _add(options, call, state)           # the call into the window; does it end?
  inner = _step_inner(options, call, state, window)
                                                # the inner update, on emitting calls only
  return inner.updates, _next_state(...)        # counters advanced, the window closed

Who decides that a window ends: the host, with ``apply=`` a Python bool (two
compiled programs: ``False`` only adds, with nothing of the inner optimizer in it;
``True`` adds and applies, with no conditional), or the device, with ``apply``
left out (``every_k`` and ``flush``, the inner update under a conditional).

The state and its readers are in ``_state``, the window lengths in ``_schedules``,
the checks of one call's arguments in ``_update_args``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

from accum_jax import _arguments, _core, _noise
from accum_jax._across_calls import _inner_checks, _inner_state, _update_args
from accum_jax._across_calls._schedules import (
  ConstantEveryK,
  EveryKSchedule,
  WindowSchedule,
  check_every_k,
)
from accum_jax._across_calls._state import AccumulationState


class ShouldSkipUpdateFunction(Protocol):
  """Optax's skip-function protocol, e.g. ``optax.skip_not_finite``."""

  def __call__(
      self, updates: Any, gradient_step: jax.Array, params: Any
  ) -> tuple[jax.typing.ArrayLike, Any]:
    ...


def _cast_like(new: Any, old: Any) -> Any:
  # Some optimizers return state leaves with wider or weak dtypes than init
  # made; both branches of the conditional must agree.
  return jax.tree.map(
      lambda n, o: jax.lax.convert_element_type(n, jnp.result_type(o)), new, old
  )


def _counters_restarted(done: jax.Array, acc: _core.Accumulator) -> _core.Accumulator:
  """``acc``'s weight and count restarted where ``done`` (its sum and skip count kept)."""
  return acc._replace(weight=jnp.where(done, 0.0, acc.weight), count=jnp.where(done, 0, acc.count))


def _restart_where(done: jax.Array, acc: _core.Accumulator) -> _core.Accumulator:
  """``acc`` emptied where ``done`` (its skip count kept): a select, no copy."""
  return _counters_restarted(done, acc)._replace(total=_emptied_where(done, acc.total))


def _no_skip(updates: Any, gradient_step: jax.Array, params: Any):
  del updates, gradient_step, params
  return jnp.array(False), ()


class _Options(NamedTuple):
  """The options of one ``accumulate(...)``, checked when it is built."""

  inner: optax.GradientTransformationExtraArgs
  schedule: EveryKSchedule | None  # None: the window length is in the state
  by_noise: _noise.NoiseScaleSchedule | None  # every_k given as a noise_scale_every_k
  track_noise: bool  # the state keeps the gradient-noise sums
  reduction: Any  # per leaf: a string, a pytree prefix or a callable (_arguments.grad_reductions)
  value_reduction: str  # of `value`: "sum" where reduction is "sum", else "mean"
  accumulator_dtype: Any
  on_nonfinite: str  # one of _update_args.ON_NONFINITE
  skip_fn: ShouldSkipUpdateFunction
  pack_inner_state: bool  # the inner state kept as one vector per dtype (_inner_state)


class _Call(NamedTuple):
  """The arguments of one ``update``, checked."""

  grads: Any
  kinds: tuple[str, ...]  # how each gradient leaf combines (_core.per_leaf)
  params: Any
  weight: Any  # a scalar, or None: the call weighs 1
  flush: jax.Array  # shape=(), dtype=bool
  value: jax.Array | None  # this call's loss, for the inner optimizer's `value`
  window_grad: bool  # the inner optimizer takes the window's gradient as `grad`
  extra_args: dict[str, Any]  # for the inner optimizer, as the emitting call gives them
  apply: bool | None  # the host's decision (a Python bool); None: the device schedule


class _Window(NamedTuple):
  """The window with this call added, and what becomes of it."""

  accumulator: _core.Accumulator  # with this call (if kept)
  kept: jax.Array  # shape=(), dtype=bool: this call was added
  skip_state: Any  # what should_skip_update_fn reported
  value_accumulator: _core.Accumulator  # the window's `value`s, likewise
  noise: Any  # the window's noise sums, () without gradient noise
  done: jax.Array  # shape=(), dtype=bool: the window ends with this call
  apply: jax.Array  # shape=(), dtype=bool: ... and the inner optimizer runs on it


class _Inner(NamedTuple):
  """What the inner optimizer made of this call."""

  updates: Any  # zeros unless applied
  state: Any  # the inner optimizer's state after this call
  last_noise: Any  # the last applied window's GradientNoise, () without gradient noise
  # shape=(), dtype=bool: the window was applied: it ended, held weight, and (with
  # on_nonfinite="skip_window") its sums were finite. A Python bool where the host decided.
  applied: Any
  # The accumulator's sum after the call: the window's, or zeros where it ended.
  total: Any


def _make_options(
    inner, every_k, *, reduction, accumulator_dtype, on_nonfinite, should_skip_update_fn,
    every_k_name, gradient_noise, pack_inner_state=False,
) -> _Options:
  by_noise = every_k if isinstance(every_k, _noise.NoiseScaleSchedule) else None
  schedule = None if by_noise else check_every_k(every_k, every_k_name)
  _arguments.check_grad_reduction(reduction, "reduction")
  return _Options(
      inner=optax.with_extra_args_support(inner),
      schedule=schedule,
      by_noise=by_noise,
      track_noise=gradient_noise or by_noise is not None,
      reduction=reduction,
      value_reduction="sum" if reduction == "sum" else "mean",
      accumulator_dtype=_core.canonicalize_accumulator_dtype(accumulator_dtype),
      on_nonfinite=_arguments.check_on_nonfinite(
          on_nonfinite, _update_args.ON_NONFINITE, "accumulate"),
      skip_fn=should_skip_update_fn or _no_skip,
      pack_inner_state=_update_args.check_flag(pack_inner_state, "pack_inner_state"),
  )


def _init(options: _Options, params: Any) -> AccumulationState:
  """An empty window, and the inner optimizer's initial state."""
  # optax.lookahead takes LookaheadParams, and gradients of the fast ones.
  grads_like = params.fast if isinstance(params, optax.LookaheadParams) else params
  zeros = jax.tree.map(jnp.zeros_like, grads_like)
  _, skip_state = options.skip_fn(zeros, jnp.zeros((), jnp.int32), params)
  inner_state = options.inner.init(params)
  # A noise transformation inside must see the window's sum, and optax's DP
  # aggregate cannot run here at all (it needs per-example gradients).
  _inner_checks.check_inner(inner_state, options.reduction)
  return AccumulationState(
      accumulator=_empty_window(options, grads_like),
      optimizer_step=jnp.zeros((), jnp.int32),
      inner_opt_state=_inner_state.stored(_inner_state.sharded_like(inner_state, params), params,
                                           pack=options.pack_inner_state),
      last_updated=jnp.array(False),
      num_empty_windows=jnp.zeros((), jnp.int32),
      value_accumulator=_core.init(jnp.zeros((), jnp.float32), jnp.float32),
      window_value=jnp.zeros((), jnp.float32),
      skip_state=skip_state,
      **_init_noise(options.track_noise, options.by_noise),
      every_k=WindowSchedule(options.schedule),
  )


def _empty_window(options: _Options, grads_like: Any) -> _core.Accumulator:
  """The empty accumulator, of the gradient's tree."""
  return _core.init(grads_like, options.accumulator_dtype, _kinds(options, grads_like))


def _kinds(options: _Options, grads: Any) -> tuple[str, ...]:
  """How each leaf of ``grads`` combines: ``reduction`` per leaf, Flax's FP8
  statistics "max" by default (see ``_arguments.grad_reductions``)."""
  return _arguments.grad_reductions(options.reduction, grads, "reduction")


def _bind(options, grads, state, params, weight, flush, apply, extra_args) -> _Call:
  """Checks one call's arguments (at trace time) and sorts its extra arguments."""
  _update_args.check_tree_matches(grads, state.accumulator.total)
  _update_args.check_weight(weight)
  apply = _update_args.check_apply(apply, flush)
  flush = _update_args.check_flush(flush)
  extra_args = dict(extra_args)
  value = extra_args.pop("value", None)
  if value is not None:
    _update_args.check_value(value)
    value = jnp.asarray(value)
  return _Call(
      grads=grads,
      kinds=_kinds(options, grads),
      params=params,
      weight=weight,
      flush=flush,
      value=value,
      # A line search's gradient at `params` is the window's gradient.
      window_grad=extra_args.pop("grad", None) is not None,
      extra_args=extra_args,
      apply=apply,
  )


def _add(options: _Options, call: _Call, state: AccumulationState) -> _Window:
  """This call into the window (unless skipped), and whether the window ends."""
  should_skip, skip_state = options.skip_fn(call.grads, state.optimizer_step, call.params)
  accept = ~jnp.asarray(should_skip, bool) & _within_window(options, call, state)
  per_call = options.on_nonfinite == "skip_microbatch"
  if call.value is not None and per_call:
    # A NaN loss is bad data as much as a NaN gradient (and would poison the
    # window's mean loss): the call is skipped.
    accept = accept & jnp.isfinite(call.value)
  accumulator, kept = _core.add(
      state.accumulator, call.grads, call.weight, refuse_nonfinite=per_call, accept=accept,
      kinds=call.kinds,
  )
  value_accumulator = state.value_accumulator
  if call.value is not None:
    value_accumulator, _ = _core.add(
        value_accumulator, call.value, call.weight, refuse_nonfinite=False, accept=kept
    )
  # Per call without weight=: B_simple is then counted in calls.
  noise = (
      _noise.add(
          state.noise, _core.gradient_leaves(call.grads, call.kinds),
          jnp.asarray(1.0 if call.weight is None else call.weight), kept,
      )
      if options.track_noise else ()
  )
  if call.apply is None:
    done = (accumulator.count >= _window_length(options, state)) | call.flush
  else:
    done = jnp.array(call.apply)  # a constant: XLA folds what depends on it
  window = _Window(
      accumulator, kept, skip_state, value_accumulator, noise, done,
      apply=done if _never_empty(options, call) else done & (accumulator.weight > 0),
  )
  return _drop_overflowing_sum(window, call) if "sum" in call.kinds else window


def _never_empty(options: _Options, call: _Call) -> bool:
  """Whether a window the host ends surely holds weight: each call counts 1 (no
  ``weight=``) and none is refused (no per-call check, no skip function), so an
  applying call's window holds at least itself. Then ``apply`` is the host's
  constant, and XLA folds the selects that guard an empty window."""
  return (call.apply is not None and call.weight is None and options.skip_fn is _no_skip
          and options.on_nonfinite != "skip_microbatch")


def _within_window(options: _Options, call: _Call, state: AccumulationState) -> Any:
  """Where the host decides and ``every_k`` is an int: whether the window has room
  for this call. A flag that lets a window run past ``every_k`` calls (not
  :class:`accum_jax.HostSchedule`'s) has its extra calls refused and counted as
  skipped, so that a window never holds more calls than ``every_k`` says."""
  if call.apply is None or not isinstance(options.schedule, ConstantEveryK):
    return True
  return state.accumulator.count < options.schedule.k


def _window_length(options: _Options, state: AccumulationState) -> jax.Array:
  """k of the current window: the schedule's, or the state's (noise-driven)."""
  if options.schedule is None:
    return state.window_length
  return jnp.asarray(options.schedule(state.optimizer_step), jnp.int32)


def _drop_overflowing_sum(window: _Window, call: _Call) -> _Window:
  """A float16 sum beyond 65504 would reach the inner optimizer as inf: the
  window is dropped and its calls counted as skipped, like non-finite ones."""
  acc = window.accumulator
  overflows = window.apply & ~_core.sum_fits(acc, call.grads, call.kinds)
  return window._replace(
      accumulator=acc._replace(
          num_skipped=acc.num_skipped + jnp.where(overflows, acc.count, 0).astype(jnp.int32)
      ),
      apply=window.apply & ~overflows,
  )


def _inner_update(options, call, inner_state, window, value_window):
  """The inner optimizer's update on the window's gradient (and `value`)."""
  grads = _core.result(window, call.grads, call.kinds)
  window_args = {}
  if call.value is not None:
    window_args["value"] = _core.result(value_window, call.value, options.value_reduction)
  if call.window_grad:
    window_args["grad"] = grads
  return options.inner.update(grads, inner_state, call.params, **call.extra_args, **window_args)


def _held(update_shapes: Any, grads: Any, make: Any = None) -> Any:
  """Values of the updates' shapes made outside the inner update: each gradient
  leaf where it fits (cast if need be), else ``make(shape, leaf)`` (zeros by
  default). Which values does not matter where a ``where`` makes them zeros after."""
  shapes, treedef = jax.tree.flatten(update_shapes)
  given = jax.tree.leaves(grads)
  if len(given) != len(shapes):
    given = [None] * len(shapes)

  def held(x: jax.ShapeDtypeStruct, g: Any) -> jax.Array:
    if make is not None:
      return make(x, g)
    if g is not None and jnp.shape(g) == x.shape:
      return jnp.asarray(g).astype(x.dtype)
    return _core.zeros_like(x)

  return jax.tree.unflatten(treedef, [held(x, g) for x, g in zip(shapes, given)])


def _constant_zeros(x: jax.ShapeDtypeStruct, g: Any) -> jax.Array:
  """Zeros that XLA folds: ``params + 0`` in the caller's ``optax.apply_updates``
  becomes ``params``, and donated parameters pass through untouched. A type that
  carries an explicit sharding keeps it (``zeros_like`` of a constant folds too)."""
  if g is not None and jnp.shape(g) == x.shape and _core.explicitly_sharded(g):
    return jnp.zeros_like(g, x.dtype)
  return jnp.zeros(x.shape, x.dtype)


def _zero_unless(apply: jax.Array, updates: Any) -> Any:
  """``updates`` where ``apply``, else zeros: a select that fuses with the add of
  ``optax.apply_updates`` in the caller's step."""
  return jax.tree.map(lambda u: jnp.where(apply, u, jnp.zeros((), u.dtype)), updates)


def _window_finite(options, call, acc, value_window) -> jax.Array | None:
  """With ``on_nonfinite="skip_window"``, whether the window's sums (and its
  ``value``s) are finite: one check when the window is applied, none per call.
  None where nothing is judged here."""
  if options.on_nonfinite != "skip_window":
    return None
  finite = _core.all_finite_packed(acc.total)
  if call.value is not None:
    finite = finite & jnp.isfinite(value_window.total)
  return finite


def _emit(options, call, window, inner_state, acc, value_window, last_noise, carrier):
  """The emitting call: the inner update on the window, kept only where the
  window is applied (``window.apply``, and finite where it is judged here). The
  updates come back in ``carrier``'s dtypes."""

  def update(inner_state, last_noise):
    del last_noise
    tree = _inner_state.tree_of(inner_state)
    new_updates, new_tree = _inner_update(options, call, tree, acc, value_window)
    window_noise = _window_noise(window.noise, acc, call) if options.track_noise else ()
    if isinstance(inner_state, _inner_state.Packed):
      new_tree = _inner_state.repack(inner_state, new_tree)  # its leaves cast in place
    else:
      new_tree = _cast_like(new_tree, tree)
    return _cast_like(new_updates, carrier), new_tree, window_noise

  def refuse(inner_state, last_noise):
    return carrier, inner_state, last_noise

  finite = _window_finite(options, call, acc, value_window)
  if finite is None and call.apply is None:
    # Under the conditional this runs only where window.apply: nothing to judge.
    return (*update(inner_state, last_noise), jnp.array(True))
  applied = window.apply if finite is None else window.apply & finite
  if call.apply is None:
    # Inside the device schedule's conditional: a select of the inner state here
    # would have XLA copy the state through the outer conditional on every call.
    new = jax.lax.cond(applied, update, refuse, inner_state, last_noise)
  else:
    # The host's applying call: no conditional, a select that fuses with the update.
    new = jax.tree.map(
        lambda n, o: jnp.where(applied, n, o), update(inner_state, last_noise),
        refuse(inner_state, last_noise))
  return (*new, applied)


def _emptied(total: Any) -> Any:
  """Zeros of ``total``'s leaves, each computed from its leaf, so that XLA writes
  them in place of the window's buffers (a zero constant would be one shared
  value, copied into each buffer)."""
  return jax.tree.map(
      lambda t: jnp.where(jnp.isfinite(t), t - t, jnp.zeros((), t.dtype)), total)


def _carrier(update_shapes: Any, held: Any, acc: _core.Accumulator) -> tuple[Any, bool]:
  """What the device schedule's conditional takes and returns as the updates, and
  whether it is the window's sum before this call.

  The branch that holds the window must pass it through untouched (XLA:GPU keeps
  only such a conditional), and a value passed through is free only if nothing
  reads it after: the parameters are read again by ``apply_updates`` (XLA copies
  them into the branch), and so is a gradient taken in the same step, by the add
  after the conditional. The window's sum before this call is free: where the
  window holds, the add after the conditional reads it from the conditional's
  output, and where it ends, the branch that ends it is its last reader, so the
  updates can take its buffers. Where the updates do not fit it (another tree, or
  a dtype the sum cannot hold exactly), ``held``: the gradient, cast.
  """
  total = acc.total
  structure: Any = jax.tree.structure(total)
  if structure == jax.tree.structure(update_shapes):
    fits = all(
        jnp.shape(t) == u.shape and jnp.promote_types(u.dtype, t.dtype) == t.dtype
        for t, u in zip(jax.tree.leaves(total), jax.tree.leaves(update_shapes))
    )
    if fits:
      return total, True
  return held, False


def _step_inner(options, call, state, window) -> _Inner:
  """The updates, the inner state and the last window's noise, after this call:
  decided by the host (:func:`_host_step`) or by the device (:func:`_device_step`)."""
  # The shapes and dtypes of the inner update (an abstract trace; nothing is computed).
  update_shapes, _ = jax.eval_shape(
      functools.partial(_inner_update, options, call),
      _inner_state.tree_of(state.inner_opt_state), window.accumulator, window.value_accumulator,
  )
  step = _device_step if call.apply is None else _host_step
  return step(options, call, state, window, update_shapes)


def _host_step(options, call, state, window, update_shapes) -> _Inner:
  """``apply=False``: constant zeros and the inner state as it is, with nothing of
  the inner optimizer in the program. ``apply=True``: the inner update, with no
  conditional, and the window emptied."""
  total = window.accumulator.total
  if not call.apply:
    zeros = _held(update_shapes, call.grads, make=_constant_zeros)
    return _Inner(zeros, state.inner_opt_state, state.last_noise, False, total)
  updates, inner_state, last_noise, applied = _emit(
      options, call, window, state.inner_opt_state, window.accumulator,
      window.value_accumulator, state.last_noise, _held(update_shapes, call.grads))
  return _Inner(_zero_unless(applied, updates), inner_state, last_noise, applied,
                _emptied(total))


def _device_step(options, call, state, window, update_shapes) -> _Inner:
  """The inner update under a conditional that every backend keeps, so that it runs
  on the call that ends a window alone.

  XLA:GPU replaces a two-branch conditional whose branches hold only cheap
  operations (elementwise, broadcasts, reductions: Adam's whole update) by selects,
  and then runs both branches on every call; it keeps one whose other branch only
  passes its operands through (:func:`accum_jax.testing.gpu_conditionals` predicts
  which). So the branch that skips the inner update returns its operands as they
  are: the inner state, the last window's noise, and a value of the updates'
  shapes (:func:`_carrier`); the zero updates are a ``where`` after the
  conditional (:func:`_zero_unless`), and so is the window's sum, emptied where
  the window ended (applied, or empty).
  """
  held = _held(update_shapes, call.grads)  # the updates' dtypes, as the caller gets them
  carrier, is_sum = _carrier(update_shapes, held, window.accumulator)

  def emit(inner_state, acc, value_window, last_noise, carrier, not_applied):
    del not_applied
    return _emit(options, call, window, inner_state, acc, value_window, last_noise, carrier)

  def hold(inner_state, acc, value_window, last_noise, carrier, not_applied):
    del acc, value_window
    return carrier, inner_state, last_noise, not_applied

  # `window.apply` (False where hold runs) passes through as the flag: a
  # constant made in the branch would make XLA:GPU turn the conditional into selects.
  out, inner_state, last_noise, applied = jax.lax.cond(
      window.apply, emit, hold, state.inner_opt_state, window.accumulator,
      window.value_accumulator, state.last_noise, carrier, window.apply)
  updates = _zero_unless(applied, _cast_like(out, held))
  # Where the inner update did not run, `out` is the sum, passed through; where it
  # ran, the updates took the sum's buffers. Where the window ended, it is emptied.
  total = _emptied_where(window.done, out if is_sum else window.accumulator.total)
  return _Inner(updates, inner_state, last_noise, applied, total)


def _emptied_where(done: jax.Array, total: Any) -> Any:
  return jax.tree.map(lambda t: jnp.where(done, jnp.zeros((), t.dtype), t), total)


def _next_state(options, call, state, window, inner: _Inner) -> AccumulationState:
  """The state after this call: the window closed if it ended, counters advanced."""
  applied = jnp.asarray(inner.applied)
  window_value = state.window_value
  if call.value is not None:
    window_value = jnp.where(
        applied,
        _core.result(window.value_accumulator, window_value, options.value_reduction),
        window_value,
    )
  acc = window.accumulator._replace(total=inner.total)
  # A window that ends with zero total weight holds nothing to apply (its
  # sum is zero too); it restarts, and is counted.
  empty_window = window.done & ~window.apply & (acc.count > 0) & (acc.weight == 0)
  # A window refused when it was applied (not finite) counts its calls as skipped.
  refused = window.apply & ~applied
  acc = acc._replace(num_skipped=acc.num_skipped + jnp.where(refused, acc.count, 0))
  return AccumulationState(
      accumulator=_counters_restarted(window.done, acc),
      optimizer_step=state.optimizer_step + applied.astype(jnp.int32),
      inner_opt_state=inner.state,
      last_updated=applied,
      num_empty_windows=state.num_empty_windows + empty_window.astype(jnp.int32),
      # Untouched (no work, nothing compiled) when no value is passed.
      value_accumulator=(
          state.value_accumulator
          if call.value is None
          else _restart_where(window.done, window.value_accumulator)
      ),
      window_value=window_value,
      skip_state=window.skip_state,
      **_next_noise(state, window, applied, inner.last_noise, options.by_noise),
      every_k=state.every_k,
  )


def _accumulate(
    inner: optax.GradientTransformation,
    every_k: int | EveryKSchedule,
    *,
    reduction: _core.Reduction | Any = "mean",
    accumulator_dtype: Any = jnp.float32,
    on_nonfinite: str = "skip_window",
    should_skip_update_fn: ShouldSkipUpdateFunction | None = None,
    every_k_name: str = "every_k",
    gradient_noise: bool = False,
    pack_inner_state: bool = False,
) -> optax.GradientTransformationExtraArgs:
  options = _make_options(
      inner, every_k, reduction=reduction, accumulator_dtype=accumulator_dtype,
      on_nonfinite=on_nonfinite, should_skip_update_fn=should_skip_update_fn,
      every_k_name=every_k_name, gradient_noise=gradient_noise,
      pack_inner_state=pack_inner_state,
  )

  def init_fn(params):
    return _init(options, params)

  def update_fn(
      updates, state, params=None, *, weight=None, flush=False, apply=None, **extra_args
  ):
    call = _bind(options, updates, state, params, weight, flush, apply, extra_args)
    window = _add(options, call, state)
    inner = _step_inner(options, call, state, window)
    return inner.updates, _next_state(options, call, state, window, inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _init_noise(track_noise: bool, by_noise: _noise.NoiseScaleSchedule | None) -> dict[str, Any]:
  """The noise fields of a new state (empty without gradient_noise)."""
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


def _window_noise(noise: Any, window: _core.Accumulator, call: _Call) -> Any:
  """The window's GradientNoise, from its sums and its mean gradient's norm, read
  off the accumulator (of the gradient leaves, "sum" ones as means: statistics
  are left out)."""
  totals = _core.gradient_leaves(window.total, call.kinds)
  factor = 1.0 / jnp.where(window.weight > 0, window.weight, 1.0)
  return _noise.estimate(noise, _noise.mean_squared_norm(totals, factor))


def _next_noise(state, window, applied, last_noise, by_noise) -> dict[str, Any]:
  """The noise fields after a call: emptied with the window, averaged when applied."""
  if state.noise == ():
    return {}
  fields = {
      "noise": jax.tree.map(
          lambda x: jnp.where(window.done, jnp.zeros_like(x), x), window.noise
      ),
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


@_arguments.takes_options("accumulate", retired=("skip_nonfinite",), refused={
    "layout": "the flat layout was removed: optax.flatten(inner) packs the inner"
              " optimizer's state into one vector, which an H200 ran faster"
              " (docs/guides/gpu.md); accumulate(optax.flatten(inner), every_k).",
})
def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | EveryKSchedule,
    *,
    reduction: _core.Reduction | Any = "mean",
    accumulator_dtype: Any = jnp.float32,
    on_nonfinite: str = "skip_window",
    gradient_noise: bool = False,
    pack_inner_state: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates gradients over ``every_k`` calls, then runs ``inner`` once.

  Each call adds its gradient to a running weighted sum. The call that ends the
  window hands the window's gradient to ``inner`` and returns its update; the
  other calls return zeros and neither compute nor advance ``inner``. The host
  says which call ends a window with ``update(..., apply=<Python bool>)``, static
  in the jitted step: two programs, and :class:`accum_jax.HostSchedule` gives the
  flags. Left out, the device counts ``every_k`` (see :doc:`/two_doors`).

  Args:
    inner: the optimizer to run on the accumulated gradient, any Optax
      ``GradientTransformation`` or chain; a gate (``optax.apply_if_finite``)
      goes inside: around ``accumulate`` it would shift or merge windows.
    every_k: calls per window, an int >= 1, or a schedule from the optimizer
      step to the number of calls (:func:`accum_jax.piecewise_every_k`,
      :func:`accum_jax.noise.noise_scale_every_k`). The window's length under
      either schedule: with an int, a window never holds more calls (a
      hand-written ``apply=False`` past it is refused and counted in
      ``num_skipped``).
    reduction: how each leaf combines: ``"mean"`` (default), ``"sum"``,
      ``"max"`` or ``"last"``, a pytree prefix of them, or a callable ``(path,
      leaf)``, as in :func:`accum_jax.value_and_grad`; see
      :doc:`/guides/leaf_reductions`.
    accumulator_dtype: the least precision of the running sum (float32); None
      keeps the gradients' dtype.
    on_nonfinite: what a NaN or Inf does: ``"skip_window"`` (default: a
      window whose sum holds one is skipped whole when applied, its calls
      counted in ``num_skipped``), ``"skip_microbatch"`` (each call checked, a
      bad one skipped alone and counted) or ``"unchecked"``; the same words as
      :func:`accum_jax.value_and_grad`'s (:doc:`/two_doors`).
    gradient_noise: estimate the gradient noise from the calls' gradients, read
      with :func:`accum_jax.noise.last_window`.
    pack_inner_state: keep the inner state as one vector per dtype between
      windows (``state.inner_opt_state.unpack()`` reads its tree): each buffer a
      call passes costs the host its dispatch (:doc:`/guides/gpu`). No
      arithmetic changes; for parameters on one device or replicated.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
    params=None, *, weight=None, flush=False, apply=None, **extra_args)`` takes a
    scalar ``weight``, ``apply`` (a Python bool: the host ends the window, or
    only adds) or ``flush`` (the device schedule: update now); other keyword
    arguments reach ``inner`` on the updating call. Call it under ``jax.jit``.

  Examples:
    >>> import functools, jax, jax.numpy as jnp, optax, accum_jax
    >>> opt = accum_jax.accumulate(optax.sgd(0.1), every_k=2)
    >>> params = {"w": jnp.ones(3)}
    >>> state = opt.init(params)
    >>> @functools.partial(jax.jit, static_argnames="apply")
    ... def step(grads, state, apply):
    ...   return opt.update(grads, state, params, apply=apply)
    >>> schedule = accum_jax.HostSchedule(state)
    >>> for g in (1.0, 3.0):
    ...   updates, state = step({"w": jnp.full(3, g)}, state, schedule.next())
    ...   print(updates["w"], bool(accum_jax.has_updated(state)))
    [0. 0. 0.] False
    [-0.2 -0.2 -0.2] True
  """
  return _accumulate(
      inner,
      every_k,
      reduction=reduction,
      accumulator_dtype=accumulator_dtype,
      on_nonfinite=on_nonfinite,
      gradient_noise=gradient_noise,
      pack_inner_state=pack_inner_state,
  )
