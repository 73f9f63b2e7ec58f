"""Accumulation across calls: an Optax gradient transformation.

:func:`accumulate`'s ``update`` is a short composition of the steps below::

  options = _make_options(...)                  # once, when it is built
  call = _bind(options, grads, state, ...)      # per call: checks, window arguments
  window = _add(options, call, state)           # the call into the window; does it end?
  updates, inner_state, last_noise = _step_inner(options, call, state, window)
                                                # the inner update, on emitting calls only
  return updates, _next_state(...)              # counters advanced, the window closed
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

from accum_jax import _core, _noise, _options


class EveryKSchedule(Protocol):
  """Maps the optimizer step (updates applied so far) to the window length."""

  def __call__(self, optimizer_step: jax.Array) -> jax.typing.ArrayLike:
    ...


class ShouldSkipUpdateFunction(Protocol):
  """Optax's skip-function protocol, e.g. ``optax.skip_not_finite``."""

  def __call__(
      self, updates: Any, gradient_step: jax.Array, params: Any
  ) -> tuple[jax.typing.ArrayLike, Any]:
    ...


class AccumulationState(NamedTuple):
  """State of :func:`accumulate`.

  The names ``mini_step``, ``gradient_step``, ``acc_grads`` and
  ``inner_opt_state`` read as in ``optax.MultiStepsState``.
  """

  # The current window; see _core.Accumulator. After a window closes, `total`
  # keeps its sum until the next call adds to zeros: read `acc_grads`, which
  # is zeros while the window holds no call (count == 0).
  accumulator: _core.Accumulator
  optimizer_step: jax.Array  # shape=(), dtype=int32: updates emitted so far
  inner_opt_state: Any  # the inner optimizer's state, advanced only on updates
  last_updated: jax.Array  # shape=(), dtype=bool: did the last call update
  num_empty_windows: jax.Array  # shape=(), dtype=int32: windows of zero weight
  # The window's `value=` arguments (losses) and their weights: the inner
  # optimizer gets their weighted mean; total shape=(), dtype=float32.
  value_accumulator: _core.Accumulator
  # The `value=` the inner optimizer got on the last update: the last applied
  # window's loss, weighted as its gradient (0 until one is); shape=(),
  # dtype=float32. What to log as the window's loss.
  window_value: jax.Array
  skip_state: Any = ()  # what MultiSteps' should_skip_update_fn reported
  # With gradient_noise (or a noise_scale_every_k schedule); () otherwise:
  noise: Any = ()  # _noise.NoiseSums of the current window's calls
  last_noise: Any = ()  # GradientNoise of the last applied window (NaN before)
  noise_ema: Any = ()  # NoiseScaleEMA, with a noise_scale_every_k schedule
  window_length: Any = ()  # shape=(), int32: k of the current window, likewise

  @property
  def mini_step(self) -> jax.Array:
    """Calls accumulated in the current window; shape=(), dtype=int32."""
    return self.accumulator.count

  @property
  def gradient_step(self) -> jax.Array:
    """Alias of ``optimizer_step``, the name ``optax.MultiSteps`` uses."""
    return self.optimizer_step

  @property
  def acc_grads(self) -> Any:
    """The window's weighted gradient sum, in the accumulator dtype.

    For an accumulator narrower than float32 (``accumulator_dtype=None`` with
    float16 or bfloat16 gradients), the weighted mean, as ``optax.MultiSteps``
    keeps it: a float16 sum overflows where the mean does not. Zeros while the
    window holds no call.
    """
    if isinstance(self.accumulator.count, jax.ShapeDtypeStruct):
      return self.accumulator.total  # an abstract state (a restore target): no values
    return _window_sum(self.accumulator)

  @property
  def num_skipped(self) -> jax.Array:
    """Calls skipped so far: a gradient or ``value`` that was not finite, a traced
    weight that was negative or not finite, a call a skip function rejected, or
    the calls of a window whose weighted sum (``reduction="sum"``) overflows the
    gradients' float16 or bfloat16 dtype; int32 scalar."""
    return self.accumulator.num_skipped


class NoiseScaleSchedule(NamedTuple):
  """A window length that follows the measured critical batch size.

  Made by :func:`noise_scale_every_k`; pass it as ``accumulate(every_k=...)``.

  Examples:
    >>> import accum_jax
    >>> schedule = accum_jax.noise_scale_every_k(8, k_max=32)
    >>> schedule.k_min, schedule.k_max, schedule.monotone
    (2, 32, True)
  """

  microbatch_size: float
  k_min: int
  k_max: int
  decay: float
  monotone: bool

  def next_k(self, ema: _noise.NoiseScaleEMA, k: jax.Array) -> jax.Array:
    """``clip(round(B_simple / microbatch_size), k_min, k_max)``; ``k`` while unknown."""
    b_simple = ema.simple_noise_scale
    known = jnp.isfinite(b_simple) & (b_simple > 0)
    new = jnp.round(jnp.where(known, b_simple, 0.0) / self.microbatch_size)
    new = jnp.clip(new, self.k_min, self.k_max).astype(jnp.int32)
    if self.monotone:
      new = jnp.maximum(new, k)
    return jnp.where(known, new, k)


def noise_scale_every_k(
    microbatch_size: float,
    *,
    k_max: int,
    k_min: int = 2,
    decay: float = 0.9,
    monotone: bool = True,
) -> NoiseScaleSchedule:
  """``every_k`` for :func:`accumulate` that follows the gradient noise scale.

  The state keeps a :class:`accum_jax.NoiseScaleEMA` of each window's
  :class:`accum_jax.GradientNoise`; when a window is applied, the next one's
  length becomes ``k = clip(round(B_simple / microbatch_size), k_min, k_max)``
  (never less than before with ``monotone``): a batch-size warm-up that follows
  the critical batch size as training finds it. ``k`` is a traced value, so a
  change does not recompile; it changes only between windows. The learning
  rate stays per optimizer step (see the noise-scale guide).

  Args:
    microbatch_size: the weight of one call, in the unit of ``weight=``: its
      examples or tokens (1 when calls pass no weight: ``B_simple`` is then
      counted in calls).
    k_max: the longest window.
    k_min: the shortest window, and the first; at least 2, as the spread of
      the calls' gradients needs two of them.
    decay: of the moving averages, in [0, 1).
    monotone: never shorten the window.

  Returns:
    A :class:`NoiseScaleSchedule`, for ``accumulate(inner, every_k=...)``.

  Examples:
    >>> import optax, accum_jax
    >>> opt = accum_jax.accumulate(
    ...     optax.adam(1e-3), every_k=accum_jax.noise_scale_every_k(32, k_max=16))
  """
  if not float(microbatch_size) > 0:
    raise ValueError(
        f"microbatch_size={microbatch_size!r} must be positive: the weight of one call"
        " (its examples or tokens; 1 when calls pass no weight=)."
    )
  k_min_, k_max_ = _core.positive_int(k_min), _core.positive_int(k_max)
  if k_min_ is None or k_max_ is None or not 2 <= k_min_ <= k_max_:
    raise ValueError(
        f"k_min={k_min!r} and k_max={k_max!r} must be ints with 2 <= k_min <= k_max: a"
        " window of one call shows no spread between gradients, so no noise scale."
    )
  _noise.NoiseScaleEMA.create(decay)  # checks decay
  return NoiseScaleSchedule(float(microbatch_size), k_min_, k_max_, float(decay), monotone)


def _check_every_k(every_k: Any, name: str) -> EveryKSchedule:
  if callable(every_k):
    return every_k
  k = _core.positive_int(every_k)
  if k is None:
    raise ValueError(
        f"{name}={every_k!r} must be an int >= 1 (the number of calls per"
        " update) or a callable from the optimizer step to that number; use"
        " 1 for no accumulation."
    )
  return lambda optimizer_step: k


def _check_tree_matches(grads: Any, like: Any) -> None:
  structure: Any = jax.tree.structure(grads)
  expected: Any = jax.tree.structure(like)
  if structure != expected:
    raise ValueError(
        f"The gradients' tree structure {structure} differs from the"
        f" parameters' given to init, {expected}. Pass gradients taken with"
        " respect to the same parameters (jax.grad of the params pytree)."
    )
  for (path, g), t in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(like)):
    if jnp.shape(g) != jnp.shape(t):
      raise ValueError(
          f"The gradient at {jax.tree_util.keystr(path)} has shape"
          f" {jnp.shape(g)} but the parameter has shape {jnp.shape(t)}. Pass"
          " gradients with the parameters' shapes."
      )


def _check_weight(weight: Any) -> None:
  if weight is None:
    return
  if jnp.ndim(weight) != 0:
    raise ValueError(
        f"weight must be a scalar (e.g. this microbatch's number of valid"
        f" tokens), got an array of shape {jnp.shape(weight)}. Reduce it, e.g."
        " weight=mask.sum()."
    )
  if not isinstance(weight, jax.core.Tracer) and not 0 <= float(weight) < math.inf:
    raise ValueError(
        f"weight={float(weight)} must be a finite number >= 0 (e.g. a count of"
        " valid tokens). Under jit such a weight is skipped and counted in"
        " state.num_skipped instead."
    )


def _cast_like(new: Any, old: Any) -> Any:
  # Some optimizers return state leaves with wider or weak dtypes than init
  # made; both branches of the conditional must agree.
  return jax.tree.map(
      lambda n, o: jax.lax.convert_element_type(n, jnp.result_type(o)), new, old
  )


def _check_flush(flush: Any) -> jax.Array:
  """``flush`` as a bool scalar; None (as for ``weight``) means no flush."""
  if flush is None:
    return jnp.array(False)
  if jnp.ndim(flush) != 0:
    raise ValueError(
        f"flush must be a scalar bool (True on the last call of an epoch), got an array"
        f" of shape {jnp.shape(flush)}."
    )
  dtype = jnp.result_type(flush)
  if not (jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(dtype, jnp.integer)):
    raise ValueError(
        f"flush must be a bool (True on the last call of an epoch), got a value of dtype"
        f" {dtype}: {flush!r}. Pass a Python bool or a bool array, e.g."
        " flush=step == steps_per_epoch - 1."
    )
  return jnp.asarray(flush, bool)


# Extra arguments of `update` that describe this call's batch: the inner optimizer
# gets the window's, not the emitting call's. `value` (the loss, for polyak_sgd,
# reduce_on_plateau, line searches) is reduced over the window's kept calls like
# the gradient; `grad` (line searches: the gradient at `params`) is the window's
# gradient itself. Every other extra argument (`value_fn`, hyperparameters...) is
# taken from the emitting call.
WINDOW_ARGS = ("value", "grad")


def _check_value(value: Any) -> None:
  if jnp.ndim(value) != 0:
    raise ValueError(
        f"value must be a scalar loss (this call's), got an array of shape"
        f" {jnp.shape(value)}. Pass the mean loss of the microbatch, e.g."
        " value=loss where loss, grads = jax.value_and_grad(loss_fn)(params, batch)."
    )


def _restart_where(done: jax.Array, acc: _core.Accumulator) -> _core.Accumulator:
  """``acc`` emptied where ``done`` (its skip count kept): a select, no copy."""
  return _core.Accumulator(
      total=jax.tree.map(lambda t: jnp.where(done, jnp.zeros((), t.dtype), t), acc.total),
      weight=jnp.where(done, 0.0, acc.weight),
      count=jnp.where(done, 0, acc.count),
      num_skipped=acc.num_skipped,
  )


def _window_sum(acc: _core.Accumulator) -> Any:
  """The window's sum: ``acc.total``, or zeros while the window holds no call.

  A closed window's sum stays in the accumulator until the next call, whose
  addition starts from these zeros instead, in the same pass. Emptying it when
  the window closes would cost every call that only accumulates a pass more (a
  select after the conditional, whose emitting branch reads the window), or a
  copy of it (XLA does not write a conditional's output in place).
  """
  empty = jnp.asarray(acc.count) == 0

  def masked(total):
    # States stacked by a scan have the same leading axes on the count.
    where = jnp.reshape(empty, empty.shape + (1,) * (jnp.ndim(total) - empty.ndim))
    return jnp.where(where, jnp.zeros((), total.dtype), total)

  return jax.tree.map(masked, acc.total)


def _close_where(done: jax.Array, acc: _core.Accumulator) -> _core.Accumulator:
  """The window closed where ``done``: its counters restart; its sum stays (see
  :func:`_window_sum`), and so does the skip count."""
  return acc._replace(weight=jnp.where(done, 0.0, acc.weight), count=jnp.where(done, 0, acc.count))


def _no_skip(updates: Any, gradient_step: jax.Array, params: Any):
  del updates, gradient_step, params
  return jnp.array(False), ()


class _Options(NamedTuple):
  """The options of one ``accumulate(...)``, checked when it is built."""

  inner: optax.GradientTransformationExtraArgs
  schedule: EveryKSchedule | None  # None: the window length is in the state
  by_noise: NoiseScaleSchedule | None  # every_k given as a noise_scale_every_k
  track_noise: bool  # the state keeps the gradient-noise sums
  reduction: Any  # per leaf: a string, a pytree prefix or a callable (_options.grad_reductions)
  value_reduction: str  # of `value`: "sum" where reduction is "sum", else "mean"
  accumulator_dtype: Any
  skip_nonfinite: bool
  skip_fn: ShouldSkipUpdateFunction


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


class _Window(NamedTuple):
  """The window with this call added, and what becomes of it."""

  accumulator: _core.Accumulator  # with this call (if kept)
  kept: jax.Array  # shape=(), dtype=bool: this call was added
  skip_state: Any  # what should_skip_update_fn reported
  value_accumulator: _core.Accumulator  # the window's `value`s, likewise
  noise: Any  # the window's noise sums, () without gradient noise
  done: jax.Array  # shape=(), dtype=bool: the window ends with this call
  apply: jax.Array  # shape=(), dtype=bool: ... and the inner optimizer runs on it


def _make_options(
    inner, every_k, *, reduction, accumulator_dtype, skip_nonfinite, should_skip_update_fn,
    every_k_name, gradient_noise,
) -> _Options:
  by_noise = every_k if isinstance(every_k, NoiseScaleSchedule) else None
  schedule = None if by_noise else _check_every_k(every_k, every_k_name)
  _options.check_grad_reduction(reduction, "reduction")
  return _Options(
      inner=optax.with_extra_args_support(inner),
      schedule=schedule,
      by_noise=by_noise,
      track_noise=gradient_noise or by_noise is not None,
      reduction=reduction,
      value_reduction="sum" if reduction == "sum" else "mean",
      accumulator_dtype=_core.canonicalize_accumulator_dtype(accumulator_dtype),
      skip_nonfinite=skip_nonfinite,
      skip_fn=should_skip_update_fn or _no_skip,
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
  from accum_jax import privacy  # here: privacy builds on this module
  privacy.check_inner(inner_state, options.reduction)
  return AccumulationState(
      accumulator=_core.init(grads_like, options.accumulator_dtype, _kinds(options, grads_like)),
      optimizer_step=jnp.zeros((), jnp.int32),
      inner_opt_state=_sharded_like(inner_state, params),
      last_updated=jnp.array(False),
      num_empty_windows=jnp.zeros((), jnp.int32),
      value_accumulator=_core.init(jnp.zeros((), jnp.float32), jnp.float32),
      window_value=jnp.zeros((), jnp.float32),
      skip_state=skip_state,
      **_init_noise(options.track_noise, options.by_noise),
  )


def _sharded_like(tree: Any, params: Any) -> Any:
  """``tree`` with each parameter-shaped leaf sharded like its parameter.

  An optimizer's ``init`` makes its moments with ``jnp.zeros_like``; under
  ``jax.jit`` with automatic sharding such zeros have no sharding of their own and
  come out replicated: Adam's moments of FSDP-sharded parameters would cost every
  device the whole model. A leaf belongs to a parameter when its key path ends
  with the parameter's and it has the parameter's shape (the rule of
  :func:`accum_jax.abstract_state`); it gets the parameter's sharding: placed
  there (concrete arrays), resharded (explicit sharding), or, with automatic
  sharding, by adding zeros made from the parameter (:func:`_core.zeros_like`),
  whose sharding XLA then propagates to it.
  """
  by_path = {tuple(path): p for path, p in jax.tree.leaves_with_path(params)}

  def parameter_of(path: tuple[Any, ...], leaf: Any) -> Any:
    for start in range(len(path) + 1):  # the longest matching path first
      p = by_path.get(path[start:])
      if p is not None and jnp.shape(p) == jnp.shape(leaf):
        return p
    return None

  def shard(path, leaf):
    p = parameter_of(tuple(path), leaf)
    if p is None or not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      return leaf
    if not isinstance(leaf, jax.core.Tracer) and not isinstance(p, jax.core.Tracer):
      sharding = getattr(p, "sharding", None)  # None for NumPy parameters
      current = getattr(leaf, "sharding", None)
      if sharding is None or (current and current.is_equivalent_to(sharding, leaf.ndim)):
        return leaf
      return jax.device_put(leaf, sharding)
    spec = getattr(jax.typeof(p).sharding, "spec", ())
    if any(axis is not None for axis in spec):  # explicit sharding: the type carries it
      if jax.typeof(leaf).sharding == jax.typeof(p).sharding:
        return leaf
      return jax.sharding.reshard(leaf, jax.typeof(p).sharding)
    return leaf + _core.zeros_like(p, jnp.result_type(leaf))

  return jax.tree.map_with_path(shard, tree)


def _kinds(options: _Options, grads: Any) -> tuple[str, ...]:
  """How each leaf of ``grads`` combines: ``reduction`` per leaf, Flax's FP8
  statistics "max" by default (see ``_options.grad_reductions``)."""
  return _options.grad_reductions(options.reduction, grads, "reduction")


def _bind(options, grads, state, params, weight, flush, extra_args) -> _Call:
  """Checks one call's arguments (at trace time) and sorts its extra arguments."""
  _check_tree_matches(grads, state.accumulator.total)
  _check_weight(weight)
  flush = _check_flush(flush)
  extra_args = dict(extra_args)
  value = extra_args.pop("value", None)
  if value is not None:
    _check_value(value)
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
  )


def _add(options: _Options, call: _Call, state: AccumulationState) -> _Window:
  """This call into the window (unless skipped), and whether the window ends."""
  should_skip, skip_state = options.skip_fn(call.grads, state.optimizer_step, call.params)
  accept = ~jnp.asarray(should_skip, bool)
  if call.value is not None and options.skip_nonfinite:
    # A NaN loss is bad data as much as a NaN gradient (and would poison the
    # window's mean loss): the call is skipped.
    accept = accept & jnp.isfinite(call.value)
  previous = state.accumulator._replace(total=_window_sum(state.accumulator))
  accumulator, kept = _core.add(
      previous, call.grads, call.weight, skip_nonfinite=options.skip_nonfinite, accept=accept,
      kinds=call.kinds,
  )
  value_accumulator = state.value_accumulator
  if call.value is not None:
    value_accumulator, _ = _core.add(
        value_accumulator, call.value, call.weight, skip_nonfinite=False, accept=kept
    )
  # Per call without weight=: B_simple is then counted in calls.
  noise = (
      _noise.add(
          state.noise, _core.gradient_leaves(call.grads, call.kinds),
          jnp.asarray(1.0 if call.weight is None else call.weight), kept,
      )
      if options.track_noise else ()
  )
  done = (accumulator.count >= _window_length(options, state)) | call.flush
  window = _Window(
      accumulator, kept, skip_state, value_accumulator, noise, done,
      apply=done & (accumulator.weight > 0),
  )
  return _drop_overflowing_sum(window, call) if "sum" in call.kinds else window


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


def _separate_zeros(shapes: Any, seed: jax.Array) -> Any:
  """Zeros shaped like ``shapes``, each leaf a value of its own.

  XLA merges equal ``jnp.zeros`` into one array, which it then copies into each
  output that needs a buffer of its own: with several parameters of one shape, a
  call that only accumulates would copy all but one of its zero updates. Each
  floating leaf here broadcasts its own scalar, ``float32(seed + i) * 0``, which
  XLA can neither fold (``seed`` is only known when the call runs, and a float
  times 0 is not 0 when it is NaN) nor merge, and writes straight into its output.
  The product is formed in float32, where ``seed + i`` is finite, so it is 0 in
  any dtype (float16 or float8 could not hold ``seed + i``).

  Args:
    shapes: ``jax.ShapeDtypeStruct`` leaves (with their shardings).
    seed: an int32 scalar known only at run time (this call's window count).

  Returns:
    The zeros, a pytree like ``shapes``.
  """
  leaves, treedef = jax.tree.flatten(shapes)

  def zeros(i: int, x: jax.ShapeDtypeStruct) -> jax.Array:
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return _core.zeros_like(x)
    zero = ((seed + i).astype(jnp.float32) * 0).astype(x.dtype)
    return _core.zeros_like(x) + zero

  return jax.tree.unflatten(treedef, [zeros(i, x) for i, x in enumerate(leaves)])


def _step_inner(options, call, state, window) -> tuple[Any, Any, Any]:
  """The updates, the inner state and the last window's noise, after this call.

  A conditional, not a select: the inner update is not computed at all on the
  calls that only accumulate, which return zeros and pass the inner state
  through. The window's sum does not go through it: the addition writes it in
  place before, and the emitting branch only reads it. The zeros are written
  straight into their outputs (:func:`_separate_zeros`): with the state donated
  and returned first, or with the gradients donated too, such a call copies no
  parameter-sized array.

  What no layout of the state avoids: without donation XLA copies the inner
  state on every call, as an output may not share an input's buffer
  (optax.MultiSteps rewrites it on every call instead); and with only the state
  donated to ``jax.jit(tx.update)``, the updates take the state's first
  parameter-shaped buffers, so each parameter-shaped leaf of the state, the
  inner optimizer's moments among them, moves into the next one's buffer (the
  last ones into new buffers).
  """
  inner_update = functools.partial(_inner_update, options, call)
  # The shapes, dtypes and shardings of the inner update, for the zeros of
  # the other branch (an abstract trace; nothing is computed).
  update_shapes, _ = jax.eval_shape(
      inner_update, state.inner_opt_state, window.accumulator, window.value_accumulator
  )

  def emit(inner_state, acc, value_window):
    new_updates, new_inner_state = inner_update(inner_state, acc, value_window)
    window_noise = _window_noise(window.noise, acc, call) if options.track_noise else ()
    return new_updates, _cast_like(new_inner_state, inner_state), window_noise

  def hold(inner_state, acc, value_window):
    del value_window
    return _separate_zeros(update_shapes, acc.count), inner_state, state.last_noise

  return jax.lax.cond(
      window.apply, emit, hold, state.inner_opt_state, window.accumulator,
      window.value_accumulator,
  )


def _next_state(options, call, state, window, inner_state, last_noise) -> AccumulationState:
  """The state after this call: the window closed if it ended, counters advanced."""
  window_value = state.window_value
  if call.value is not None:
    window_value = jnp.where(
        window.apply,
        _core.result(window.value_accumulator, window_value, options.value_reduction),
        window_value,
    )
  acc = window.accumulator
  # A window that ends with zero total weight holds nothing to apply (its
  # sum is zero too); it restarts, and is counted.
  empty_window = window.done & ~window.apply & (acc.count > 0) & (acc.weight == 0)
  return AccumulationState(
      accumulator=_close_where(window.done, acc),
      optimizer_step=state.optimizer_step + window.apply.astype(jnp.int32),
      inner_opt_state=inner_state,
      last_updated=window.apply,
      num_empty_windows=state.num_empty_windows + empty_window.astype(jnp.int32),
      # Untouched (no work, nothing compiled) when no value is passed.
      value_accumulator=(
          state.value_accumulator
          if call.value is None
          else _restart_where(window.done, window.value_accumulator)
      ),
      window_value=window_value,
      skip_state=window.skip_state,
      **_next_noise(state, window, last_noise, options.by_noise),
  )


def _accumulate(
    inner: optax.GradientTransformation,
    every_k: int | EveryKSchedule,
    *,
    reduction: _core.Reduction | Any = "mean",
    accumulator_dtype: Any = jnp.float32,
    skip_nonfinite: bool = True,
    should_skip_update_fn: ShouldSkipUpdateFunction | None = None,
    every_k_name: str = "every_k",
    gradient_noise: bool = False,
) -> optax.GradientTransformationExtraArgs:
  options = _make_options(
      inner, every_k, reduction=reduction, accumulator_dtype=accumulator_dtype,
      skip_nonfinite=skip_nonfinite, should_skip_update_fn=should_skip_update_fn,
      every_k_name=every_k_name, gradient_noise=gradient_noise,
  )

  def init_fn(params):
    return _init(options, params)

  def update_fn(updates, state, params=None, *, weight=None, flush=False, **extra_args):
    call = _bind(options, updates, state, params, weight, flush, extra_args)
    window = _add(options, call, state)
    new_updates, inner_state, last_noise = _step_inner(options, call, state, window)
    return new_updates, _next_state(options, call, state, window, inner_state, last_noise)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _init_noise(track_noise: bool, by_noise: NoiseScaleSchedule | None) -> dict[str, Any]:
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


def _next_noise(state, window, last_noise, by_noise) -> dict[str, Any]:
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
        lambda new, old: jnp.where(window.apply, new, old),
        state.noise_ema.update(last_noise),
        state.noise_ema,
    )
    fields["noise_ema"] = ema
    fields["window_length"] = jnp.where(
        window.apply, by_noise.next_k(ema, state.window_length), state.window_length
    )
  return fields


def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | EveryKSchedule,
    *,
    reduction: _core.Reduction | Any = "mean",
    accumulator_dtype: Any = jnp.float32,
    skip_nonfinite: bool = True,
    gradient_noise: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates gradients over ``every_k`` calls, then runs ``inner`` once.

  Each call adds its gradient to a running weighted sum. The ``every_k``-th call
  hands the window's gradient to ``inner`` and returns its update; the other
  calls return zeros and neither compute nor advance ``inner``.

  See the guide: :doc:`/two_doors`.

  Args:
    inner: the optimizer to run on the accumulated gradient, any Optax
      ``GradientTransformation`` or chain.
    every_k: calls per update, an int >= 1, or a schedule from the optimizer
      step to the number of calls (:func:`accum_jax.every_k_schedule`,
      :func:`accum_jax.noise_scale_every_k`).
    reduction: ``"mean"`` (default) divides the accumulated gradient by the
      total weight; ``"sum"`` passes the weighted sum; ``"max"`` and ``"last"``
      pass the largest, or the last kept call's, value of a leaf (unweighted: a
      statistic, not a gradient). One for every leaf, a pytree prefix of the
      gradient with them (or None) at its leaves, or a callable ``(path, leaf)``
      returning one or None, as ``grad_reduction`` of
      :func:`accum_jax.value_and_grad`; Flax's FP8 statistics
      (``_overwrite_with_gradient``) are "max" unless named. See
      :doc:`/guides/leaf_reductions`.
    accumulator_dtype: the least precision of the running sum (float32 by
      default); None keeps the gradients' dtype.
    skip_nonfinite: skip, and count in ``state.num_skipped``, a call whose
      gradient or ``value`` holds NaN or Inf.
    gradient_noise: estimate the gradient noise from the calls' gradients, read
      with :func:`accum_jax.gradient_noise`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
    params=None, *, weight=None, flush=False, **extra_args)`` takes a scalar
    ``weight`` for this call and ``flush`` to update now with what the window
    holds; other keyword arguments reach ``inner`` on the updating call
    (``value`` and ``grad`` as the window's). Call it under ``jax.jit``:
    eagerly, every call compiles anew.

  Raises:
    ValueError: for bad options; at trace time, for gradients whose tree or
      shapes differ from the parameters', a non-scalar ``weight`` or ``value``,
      or a ``flush`` that is not a bool scalar.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, accum_jax
    >>> opt = accum_jax.accumulate(optax.sgd(0.1), every_k=2)
    >>> params = {"w": jnp.ones(3)}
    >>> state = opt.init(params)
    >>> for g in (1.0, 3.0):
    ...   updates, state = opt.update({"w": jnp.full(3, g)}, state, params)
    ...   print(updates["w"], bool(accum_jax.has_updated(state)))
    [0. 0. 0.] False
    [-0.2 -0.2 -0.2] True
  """
  return _accumulate(
      inner,
      every_k,
      reduction=reduction,
      accumulator_dtype=accumulator_dtype,
      skip_nonfinite=skip_nonfinite,
      gradient_noise=gradient_noise,
  )


def every_k_schedule(
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
    >>> schedule = accum_jax.every_k_schedule({0: 1, 10: 4, 100: 8})
    >>> [int(schedule(jnp.int32(s))) for s in (0, 9, 10, 99, 100, 5000)]
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
  steps = sorted(boundaries)
  starts = jnp.array(steps, jnp.int32)
  ks = jnp.array([1] + [int(boundaries[s]) for s in steps], jnp.int32)

  def schedule(optimizer_step: jax.Array) -> jax.Array:
    return ks[jnp.searchsorted(starts, optimizer_step, side="right")]

  return schedule


def _find_state(state: Any, caller: str) -> AccumulationState:
  def is_state(x):
    return isinstance(x, AccumulationState)

  found = [x for x in jax.tree.leaves(state, is_leaf=is_state) if is_state(x)]
  if not found:
    raise ValueError(
        f"{caller} found no accum_jax.accumulate state in {type(state).__name__}."
        " Pass the optimizer state that accumulate(...).init returned, or one"
        " that holds it (an optax.chain state, a Flax TrainState, an nnx.Optimizer)."
    )
  if len(found) > 1:
    raise ValueError(
        f"{caller} found {len(found)} accum_jax.accumulate states in"
        f" {type(state).__name__}, and cannot tell which one you mean. Pass that one"
        " (e.g. one branch of an optax.multi_transform state)."
    )
  return found[0]


def has_updated(state: Any) -> jax.Array:
  """Whether the last ``update`` applied the inner optimizer.

  Args:
    state: the state of :func:`accumulate` or :class:`accum_jax.MultiSteps`,
      or any pytree holding exactly one (an ``optax.chain`` state, a Flax
      ``TrainState`` or its ``opt_state``, an ``nnx.Optimizer`` or its
      ``opt_state``).

  Returns:
    A bool scalar; jit-friendly.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax
    >>> opt = optax.chain(optax.clip(1.0), accum_jax.accumulate(optax.sgd(0.1), every_k=2))
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> _, state = opt.update({"w": jnp.ones(2)}, state)
    >>> bool(accum_jax.has_updated(state))
    False
  """
  # asarray unwraps array-likes such as the nnx.Variables of an nnx.Optimizer.
  return jnp.asarray(_find_state(state, "has_updated").last_updated)


def optimizer_step(state: Any) -> jax.Array:
  """The number of updates the inner optimizer has applied.

  Unlike Flax's ``TrainState.step`` and ``nnx.Optimizer.step``, which count
  calls, this counts real optimizer updates: what the inner optimizer's own
  schedules see.

  Args:
    state: as for :func:`has_updated`.

  Returns:
    An int32 scalar; jit-friendly.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax
    >>> opt = accum_jax.accumulate(optax.sgd(0.1), every_k=2)
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> for _ in range(5):
    ...   _, state = opt.update({"w": jnp.ones(2)}, state)
    >>> int(accum_jax.optimizer_step(state)), int(state.mini_step)
    (2, 1)
  """
  return jnp.asarray(_find_state(state, "optimizer_step").optimizer_step)


def gradient_noise(state: Any) -> _noise.GradientNoise:
  """The :class:`accum_jax.GradientNoise` of the last applied window.

  Args:
    state: as for :func:`has_updated`, of an ``accumulate(...,
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
    >>> noise = accum_jax.gradient_noise(state)  # calls of 1 and 3: mean 2, spread 2
    >>> float(noise.trace_cov), float(noise.grad_sq)
    (2.0, 3.0)
  """
  found = _find_state(state, "gradient_noise")
  if isinstance(found.last_noise, tuple) and found.last_noise == ():
    raise ValueError(
        "gradient_noise found an accumulate state that does not measure the noise: build"
        " it with accum_jax.accumulate(..., gradient_noise=True), or with"
        " every_k=accum_jax.noise_scale_every_k(...)."
    )
  # jnp.asarray unwraps the nnx.Variables of an nnx.Optimizer's state.
  return _noise.GradientNoise(*(jnp.asarray(x) for x in found.last_noise))
