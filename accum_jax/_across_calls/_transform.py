"""Accumulation across calls: an Optax gradient transformation.

:func:`accumulate`'s ``update`` is a short composition of the steps below::

  options = _make_options(...)                  # once, when it is built
  call = _bind(options, grads, state, ...)      # per call: checks, the gradient packed
  window = _add(options, call, state)           # the call into the window; does it end?
  inner = _apply.host_apply(...) or ...          # the inner update, on emitting calls only
  return inner.updates, _next_state(...)        # counters advanced, the window closed

Who decides that a window ends: the host, with ``apply=`` a Python bool (two
compiled programs: ``False`` only adds, with nothing of the inner optimizer in it;
``True`` adds and applies, with no conditional), or the device, with ``apply``
left out (``every_k`` and ``flush``, the inner update under a conditional).

A window that ends writes nothing into its sum's buffers: its call count restarts,
and the next call adds to zeros (``_core.add``); zeros written at the end would
cost the applying call a copy of the sum. The state and its readers are in
``_state``, its layout in ``_layout``, the window lengths in ``_schedules``, the
checks of one call's arguments in ``_update_args``, the gradient-noise fields in
``_noise_fields``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

from accum_jax import _arguments, _core, _noise
from accum_jax._across_calls import _apply, _inner_checks, _inner_state, _layout, _noise_fields
from accum_jax._across_calls import _update_args as _args
from accum_jax._across_calls._schedules import EveryKSchedule, WindowSchedule, check_every_k
from accum_jax._across_calls._state import (
  COUNT,
  COUNTS,
  SUM,
  SUMS,
  AccumulationState,
  Reductions,
  counts_and_sums,
)


class ShouldSkipUpdateFunction(Protocol):
  """Optax's skip-function protocol, e.g. ``optax.skip_not_finite``."""

  def __call__(
      self, updates: Any, gradient_step: jax.Array, params: Any
  ) -> tuple[jax.typing.ArrayLike, Any]:
    ...


LAYOUTS = ("auto", "packed", "tree")


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
  skip_fn: ShouldSkipUpdateFunction | None
  layout: str  # one of LAYOUTS


class _Call(NamedTuple):
  """The arguments of one ``update``, checked."""

  grads: Any
  kinds: list[str]  # how each buffer of the window combines (_core.per_leaf)
  grad_kinds: list[str]  # how each leaf of the gradient combines
  params: Any
  weight: Any  # a scalar, or None: the call weighs 1
  flush: jax.Array  # shape=(), dtype=bool
  value: jax.Array | None  # this call's loss, for the inner optimizer's `value`
  window_grad: bool  # the inner optimizer takes the window's gradient as `grad`
  extra_args: dict[str, Any]  # for the inner optimizer, as the emitting call gives them
  apply: bool | None  # the host's decision (a Python bool); None: the device schedule


class _Window(NamedTuple):
  """The window with this call added, and what becomes of it."""

  accumulator: _core.Accumulator  # with this call (if kept); num_skipped: this call's
  kept: jax.Array  # shape=(), dtype=bool: this call was added
  counts: dict[str, Any]  # this call's additions to the state's counters
  skip_state: Any  # what should_skip_update_fn reported
  value_accumulator: _core.Accumulator | None  # the window's `value`s, None without
  noise: Any  # the window's noise sums, () without gradient noise
  done: jax.Array  # shape=(), dtype=bool: the window ends with this call
  apply: Any  # bool: ... and the inner optimizer runs on it (a Python bool where surely)


def _make_options(
    inner, every_k, *, reduction, accumulator_dtype, on_nonfinite, should_skip_update_fn,
    every_k_name, gradient_noise, layout,
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
      on_nonfinite=_arguments.check_on_nonfinite(on_nonfinite, _args.ON_NONFINITE, "accumulate"),
      skip_fn=should_skip_update_fn,
      layout=_args.check_layout(layout, LAYOUTS),
  )


def _init(options: _Options, params: Any) -> AccumulationState:
  """An empty window, and the inner optimizer's initial state."""
  # optax.lookahead takes LookaheadParams, and gradients of the fast ones.
  grads_like = params.fast if isinstance(params, optax.LookaheadParams) else params
  skip_state = ()
  if options.skip_fn is not None:
    zeros = jax.tree.map(jnp.zeros_like, grads_like)
    _, skip_state = options.skip_fn(zeros, jnp.zeros((), jnp.int32), params)
  inner_state = options.inner.init(params)
  # A noise transformation inside must see the window's sum, and optax's DP
  # aggregate cannot run here at all (it needs per-example gradients).
  _inner_checks.check_inner(inner_state, options.reduction)
  packed = _args.packs(options.layout, params)
  kinds = _arguments.grad_reductions(options.reduction, grads_like, "reduction")
  return AccumulationState(
      window_total=_empty_window(options, grads_like, kinds, packed),
      inner_opt_state=_inner_state.stored(inner_state, params, packed=packed),
      scalars=jnp.zeros(len(COUNTS) + len(SUMS), jnp.int32),  # the sums' bits: 0.0
      skip_state=skip_state,
      **_noise_fields.init(options.track_noise, options.by_noise),
      every_k=WindowSchedule(options.schedule),
      reductions=Reductions(tuple(kinds)),
  )


def _empty_window(options: _Options, grads_like: Any, kinds: Any, packed: bool) -> Any:
  """The window's total, empty: zeros of the gradient's tree, or of its buckets."""
  if not packed:
    return _core.init(grads_like, options.accumulator_dtype, kinds).total
  layout = _layout.plan(grads_like, kinds, added=True)  # NNX Variables unwrapped
  leaves = jax.tree.leaves(grads_like)
  dtypes = _layout.packed_keys(layout.slots, len(layout.sizes), [
      jnp.result_type(x) if _core.is_statistic(k) else
      _core.accumulator_dtype_for(jnp.result_type(x), options.accumulator_dtype)
      for x, k in zip(leaves, kinds)])
  # Placed with the parameters where they were placed on purpose (committed): an
  # uncommitted state keeps a jitted step's first call in the cache of the next.
  first: Any = leaves[0] if leaves else None
  committed = isinstance(first, jax.Array) and not isinstance(first, jax.core.Tracer) and (
      first.committed)
  device = first.sharding if committed else None
  vectors = [jnp.zeros(n, d, device=device) for n, d in zip(layout.sizes, dtypes)]
  kept = [_core.init_leaf(x, k, options.accumulator_dtype)
          for x, k, s in zip(leaves, kinds, layout.slots) if s is None]
  return _layout.packed_with(layout, vectors, kept)


def _bind(options, grads, state, params, weight, flush, apply, extra_args) -> _Call:
  """Checks one call's arguments (at trace time), packs the gradient and sorts its
  extra arguments. A check runs where its argument is given."""
  if extra_args:
    _args.check_extra_args(extra_args)
  if state.every_k.schedule != options.schedule:
    _args.check_same_every_k(state.every_k.schedule, options.schedule)
  total = state.window_total
  packed = isinstance(total, _layout.Packed)
  _args.check_tree_matches(grads, total.layout if packed else total)
  if weight is not None:
    _args.check_weight(weight)
  apply = _args.check_apply(apply, flush)
  extra_args = dict(extra_args)
  value = extra_args.pop("value", None)
  if value is not None:
    _args.check_value(value)
    value = jnp.asarray(value)
  return _Call(
      grads=grads, kinds=list(total.layout.keys if packed else state.reductions.kinds),
      grad_kinds=list(state.reductions.kinds),
      params=params, weight=weight,
      flush=jnp.array(False) if flush is False else _args.check_flush(flush), value=value,
      # A line search's gradient at `params` is the window's gradient.
      window_grad=extra_args.pop("grad", None) is not None,
      extra_args=extra_args, apply=apply,
  )


def _add(options: _Options, call: _Call, state: AccumulationState) -> _Window:
  """This call into the window (unless left out), and whether the window ends."""
  counts, sums = counts_and_sums(state.scalars)
  accept: Any = True
  rejected: Any = False
  skip_state = state.skip_state
  if options.skip_fn is not None:
    should_skip, skip_state = options.skip_fn(call.grads, counts[COUNT["optimizer_step"]],
                                              call.params)
    rejected = jnp.asarray(should_skip, bool)
    accept = ~rejected
  per_call = options.on_nonfinite == "skip_microbatch"
  if call.value is not None and per_call:
    # A NaN loss is bad data as much as a NaN gradient (and would poison the
    # window's mean loss): the call is skipped.
    accept = accept & jnp.isfinite(call.value)
  calls = counts[COUNT["mini_step"]]
  zero = jnp.zeros((), jnp.int32)
  view = _core.Accumulator(state.window_total, sums[SUM["weight"]], calls, zero)
  total = state.window_total
  leafwise = (functools.partial(total.added, tree=call.grads)
              if isinstance(total, _layout.Packed) else None)
  accumulator, kept = _core.add(view, call.grads, call.weight, refuse_nonfinite=per_call,
                                accept=accept, kinds=call.kinds, leafwise=leafwise)
  value_accumulator = None
  if call.value is not None:
    value_view = _core.Accumulator(
        sums[SUM["value_total"]], sums[SUM["value_weight"]], calls, zero)
    value_accumulator, _ = _core.add(value_view, call.value, call.weight,
                                     refuse_nonfinite=False, accept=kept)
  if call.apply is None:
    done = (accumulator.count >= _window_length(options, state)) | call.flush
  else:
    done = jnp.array(call.apply)  # a constant: XLA folds what depends on it
  can_leave_out = per_call or call.weight is not None or options.skip_fn is not None
  window = _Window(
      accumulator, kept,
      _left_out(call, accumulator.num_skipped > 0, rejected) if can_leave_out else {},
      skip_state, value_accumulator,
      _noise_fields.add(state, call, kept) if options.track_noise else (),
      done, apply=_applies(options, call, done, accumulator))
  return _drop_overflowing_sum(window, call) if "sum" in call.kinds else window


def _left_out(call: _Call, left_out: Any, rejected: Any) -> dict[str, Any]:
  """Why this call was left out, counted by cause: a bad traced weight, a skip
  function, or else non-finite data."""
  counts: dict[str, Any] = {}
  bad_weight: Any = False
  if call.weight is not None:
    w = jnp.asarray(call.weight, jnp.float32)
    bad_weight = ~(jnp.isfinite(w) & (w >= 0))
    counts["num_bad_weights"] = bad_weight
  if rejected is not False:
    counts["num_rejected"] = left_out & rejected & jnp.logical_not(bad_weight)
  # logical_not: either may be a Python bool, whose ~ is an int's.
  counts["num_skipped"] = left_out & jnp.logical_not(bad_weight) & jnp.logical_not(rejected)
  return counts


def _applies(options: _Options, call: _Call, done: jax.Array, acc: _core.Accumulator) -> Any:
  """Whether the inner optimizer runs on the window, if it ends: where it holds
  weight. A Python True where the host ends a window that surely holds weight:
  each call counts 1 (no ``weight=``) and none is left out (no per-call check, no
  skip function), so an applying call's window holds at least itself."""
  if (call.apply and call.weight is None and options.skip_fn is None
      and options.on_nonfinite != "skip_microbatch"):
    return True
  return done & (acc.weight > 0)


def _window_length(options: _Options, state: AccumulationState) -> jax.Array:
  """k of the current window: the schedule's, or the state's (noise-driven)."""
  if options.schedule is None:
    return state.window_length
  return jnp.asarray(options.schedule(state.optimizer_step), jnp.int32)


def _drop_overflowing_sum(window: _Window, call: _Call) -> _Window:
  """A float16 sum beyond 65504 would reach the inner optimizer as inf: the
  window is dropped and its calls counted in ``num_overflowed``."""
  acc = window.accumulator
  sums = acc._replace(total=_layout.tree_of(acc.total, jax.tree.structure(call.grads)))
  overflows = window.apply & ~_core.sum_fits(sums, call.grads, call.grad_kinds)
  counts = dict(window.counts, num_overflowed=jnp.where(overflows, acc.count, 0))
  return window._replace(counts=counts, apply=window.apply & ~overflows)


def _next_state(options, call, state, window, inner: _apply.Inner) -> AccumulationState:
  """The state after this call: the window closed if it ended, counters advanced."""
  acc = window.accumulator
  applied = jnp.asarray(inner.applied)
  counts, sums = counts_and_sums(state.scalars)
  # A window that ends with zero total weight holds nothing to apply (its sum is
  # zero too); it restarts, and is counted. One refused when it was applied (not
  # finite) counts its calls as skipped.
  refused = window.apply & ~applied
  added = dict(window.counts)
  added["num_skipped"] = added.get("num_skipped", 0) + jnp.where(refused, acc.count, 0)
  added["num_empty_windows"] = (window.done & jnp.logical_not(window.apply) & (acc.count > 0)
                                 & (acc.weight == 0))
  added["mini_step"] = jnp.where(window.done, 0, acc.count) - counts[COUNT["mini_step"]]
  added["optimizer_step"] = applied
  added["last_updated"] = applied.astype(jnp.int32) - counts[COUNT["last_updated"]]
  deltas = []  # what this call adds to each counter, in one vector
  for name in COUNTS:
    deltas.append(jnp.asarray(added.get(name, 0), jnp.int32))
  new_sums = {"weight": jnp.where(window.done, 0.0, acc.weight)}
  if window.value_accumulator is not None:
    value = window.value_accumulator
    new_sums["value_total"] = value.total
    new_sums["value_weight"] = jnp.where(window.done, 0.0, value.weight)
    new_sums["window_value"] = jnp.where(
        applied, _core.result(value, sums[0], options.value_reduction),
        sums[SUM["window_value"]])
  columns = []
  for name in SUMS:
    columns.append(jnp.asarray(new_sums.get(name, sums[SUM[name]]), jnp.float32))
  return state._replace(
      window_total=acc.total if inner.total is None else inner.total,
      inner_opt_state=inner.state,
      # _state.scalars, written out: the applying call enters 30 functions at most.
      scalars=jnp.concatenate([counts + jnp.stack(deltas), jax.lax.bitcast_convert_type(
          jnp.stack(columns), jnp.int32)]),
      skip_state=window.skip_state,
      **(_noise_fields.next(state, window, applied, inner.last_noise, options.by_noise)
         if options.track_noise else {}),
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
    layout: str = "auto",
) -> optax.GradientTransformationExtraArgs:
  options = _make_options(
      inner, every_k, reduction=reduction, accumulator_dtype=accumulator_dtype,
      on_nonfinite=on_nonfinite, should_skip_update_fn=should_skip_update_fn,
      every_k_name=every_k_name, gradient_noise=gradient_noise, layout=layout,
  )

  def init_fn(params):
    return _init(options, params)

  def update_fn(
      updates, state, params=None, *, weight=None, flush=False, apply=None, **extra_args
  ):
    call = _bind(options, updates, state, params, weight, flush, apply, extra_args)
    window = _add(options, call, state)
    if call.apply is False:
      inner = _apply.Inner(_apply.zero_updates(call), state.inner_opt_state, state.last_noise,
                           False)
    elif call.apply:
      inner = _apply.host_apply(options, call, state, window)
    else:
      inner = _apply.device_step(options, call, state, window)
    return inner.updates, _next_state(options, call, state, window, inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@_arguments.takes_options("accumulate", retired=("skip_nonfinite",), refused={
    "pack_inner_state": "it was replaced by layout=: layout='packed' keeps the"
                        " accumulator and the inner optimizer's state in a few vectors (the"
                        " default for parameters on one device), layout='tree' one buffer"
                        " per leaf (the default for sharded parameters).",
})
def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | EveryKSchedule,
    *,
    reduction: _core.Reduction | Any = "mean",
    accumulator_dtype: Any = jnp.float32,
    on_nonfinite: str = "skip_window",
    gradient_noise: bool = False,
    layout: str = "auto",
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
      ``GradientTransformation`` or chain; a gate (``optax.apply_if_finite``) or
      weight decay goes inside: after ``accumulate`` it would act on every call.
    every_k: calls per window, an int >= 1, or a schedule from the optimizer
      step to it (:func:`accum_jax.piecewise_every_k`,
      :func:`accum_jax.noise.noise_scale_every_k`), as the device schedule and
      :class:`accum_jax.HostSchedule` count; a host's ``apply=`` ends a window
      whatever its length.
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
    gradient_noise: estimate the gradient noise (:func:`accum_jax.noise.last_window`).
    layout: ``"packed"``: the window's sum and the inner state in a few vectors
      (each buffer a call passes costs the host its dispatch); ``"tree"``: a
      buffer per leaf, sharded like its parameter; ``"auto"`` (default): packed
      where JAX has one device, else tree (an ``init`` traced under ``jax.jit``
      cannot tell a sharding). No arithmetic changes (:doc:`/guides/checkpoints`).

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
      inner, every_k, reduction=reduction, accumulator_dtype=accumulator_dtype,
      on_nonfinite=on_nonfinite, gradient_noise=gradient_noise, layout=layout,
  )
