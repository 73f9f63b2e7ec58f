"""Accumulation inside one step: ``value_and_grad`` over microbatches.

:func:`value_and_grad` is a short composition of the steps below::

  options = _options.make(...)                    # once, when it is built
  call = _options.bind(options, args)             # per call: batch, sizes, mesh
  shapes = _trace_one(...)                        # one microbatch, abstractly
  sums = _scan(...)                               # lax.scan: weighted sums
         (or _sharding.data_parallel(_scan, ...)) # per device, one reduction
  return _finalise(sums, ...)                     # normalise, cast, reduce aux
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from accum_jax import _batching, _core, _noise, _options, _sharding
from accum_jax._batching import Split, divisors  # noqa: F401  (re-exported for the planner)
from accum_jax._options import AuxReduction


class MicrobatchInfo(NamedTuple):
  """What happened to the microbatches of one call (``return_info=True``).

  Attributes:
    num_skipped: microbatches skipped because their loss or gradient was not
      finite (or their weight negative); shape=(), dtype=int32. With dynamic
      loss scaling, a non-zero count is an overflow the scaler must see.
    total_weight: the sum of the kept microbatches' weights (their number when
      there is no ``weight_fn``); shape=(), dtype=float32.
    gradient_noise: with ``gradient_noise=True``, the :class:`GradientNoise`
      estimated from the microbatches' gradients (per unit of weight; per
      example without ``weight_fn``); else None.
  """

  num_skipped: jax.Array
  total_weight: jax.Array
  gradient_noise: _noise.GradientNoise | None = None


class _Shapes(NamedTuple):
  """One microbatch's outputs, abstractly, and how each aux leaf is reduced."""

  value: jax.ShapeDtypeStruct
  grads: Any
  aux: Any
  reductions: tuple[str, ...]  # one per leaf of aux


def _describe(x: Any) -> str:
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of {len(x)}"
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
  return f"a {type(x).__name__}"


def _check_state(new: Any, old: Any, argnum: int) -> None:
  """``new`` must be a state of the same tree, shapes and dtypes as ``old``."""
  fix = (
      f" fun must return (value, (new_state, aux)) with new_state shaped like its"
      f" argument {argnum} (state_argnums), e.g. Linen's"
      " `(loss, (updates['batch_stats'], aux))`."
  )
  new_structure: Any = jax.tree.structure(new)
  if new_structure != jax.tree.structure(old):
    raise ValueError(
        f"The new state has structure {jax.tree.structure(new)}, but the state passed in"
        f" has structure {jax.tree.structure(old)}.{fix}"
    )
  for (path, a), b in zip(jax.tree.leaves_with_path(new), jax.tree.leaves(old)):
    if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
      raise ValueError(
          f"The new state's leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(a)} and"
          f" dtype {jnp.result_type(a)}, but the state passed in has shape {jnp.shape(b)}"
          f" and dtype {jnp.result_type(b)}.{fix}"
      )


def _checked(fun: Callable[..., Any], options: _options.Options) -> Callable[..., Any]:
  """``fun`` returning ``(value, (new_state, aux))``, with what it returned checked."""

  def checked(*args, **kwargs):
    out = fun(*args, **kwargs)
    if options.has_aux:
      if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(
            f"has_aux=True, so fun must return a pair (value, aux), but it returned"
            f" {_describe(out)}. Return (loss, aux) (gather several outputs into one aux"
            " pytree), or pass has_aux=False."
        )
      value, aux = out
    elif isinstance(out, (tuple, list)):
      raise ValueError(
          f"fun returned {_describe(out)}, not a scalar loss. If it returns (loss, aux),"
          " pass has_aux=True."
      )
    else:
      value, aux = out, ()
    if not hasattr(value, "shape") or jnp.ndim(value) != 0:
      raise ValueError(
          f"fun must return a scalar loss, got {_describe(value)}: reduce it (e.g. with"
          " jnp.mean), and return other outputs as aux with has_aux=True."
      )
    new_state = None
    if options.state_argnums:
      if not isinstance(aux, (tuple, list)) or len(aux) != 2:
        raise ValueError(
            f"With state_argnums={options.state_argnums}, fun must return (value,"
            f" (new_state, aux)), but its aux is {_describe(aux)}. Return (loss,"
            " (new_state, aux)), with aux=() if there is nothing else."
        )
      new_state, aux = aux
      _check_state(new_state, args[options.state_argnums[0]], options.state_argnums[0])
    return value, (new_state, aux)

  diff = options.argnums[0] if options.single_argnum else options.argnums
  return jax.value_and_grad(checked, argnums=diff, has_aux=True)


def _fold_in(key: jax.Array, index: jax.Array, shard_index: jax.Array | None) -> jax.Array:
  """The key of microbatch ``index`` (on device ``shard_index`` under a mesh)."""
  raw = not jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  if raw:  # uint32[2] (threefry) or uint32[4] (rbg), whatever the default implementation
    key = jax.random.wrap_key_data(key, impl="threefry2x32" if key.shape == (2,) else "rbg")
  key = jax.random.fold_in(key, index)
  if shard_index is not None:
    key = jax.random.fold_in(key, shard_index)
  return jax.random.key_data(key) if raw else key


class _Out(NamedTuple):
  """What one microbatch gives."""

  value: jax.Array
  grads: Any
  state: Any  # the new state, None without state_argnums
  aux: Any
  weight: jax.Array | None


def _one_microbatch(grad_fun, options, call, args, kwargs, index, mb, state, shard_index) -> _Out:
  """Value, gradient, new state, aux and weight of microbatch ``index``."""
  call_args = list(args)
  for n in call.batch_argnums:
    call_args[n] = mb[n]
  for n in options.rng_argnums:
    call_args[n] = jax.tree.map(lambda key: _fold_in(key, index, shard_index), args[n])
  if options.state_argnums:
    call_args[options.state_argnums[0]] = state
  (value, (new_state, aux)), grads = grad_fun(*call_args, **kwargs)
  weight = None
  if options.weight_fn is not None:
    weight = options.weight_fn(*(mb[n] for n in call.batch_argnums))
    if jnp.ndim(weight) != 0:
      raise ValueError(
          f"weight_fn must return a scalar weight per microbatch, got shape"
          f" {jnp.shape(weight)}. Reduce it, e.g. lambda batch: batch['mask'].sum()."
      )
  return _Out(value, grads, new_state, aux, weight)


def _aux_reductions(aux: Any, requested: AuxReduction | None, rows: int) -> tuple[str, ...]:
  """How each aux leaf is reduced. By default a leaf with a leading axis of the
  microbatch's rows is per-example (concatenated); any other is averaged."""
  reductions = []
  for path, leaf in jax.tree.leaves_with_path(aux):
    per_example = len(leaf.shape) >= 1 and leaf.shape[0] == rows
    if requested == "concat" and not per_example:
      raise ValueError(
          f"aux_reduction='concat' returns per-example outputs in batch order, but aux"
          f" leaf {jax.tree_util.keystr(path) or '(the aux)'} has shape {leaf.shape}, with"
          f" no leading axis of the microbatch's {rows} rows. Return one row per example,"
          " or reduce it with aux_reduction='mean' or 'sum'."
      )
    reductions.append(requested or ("concat" if per_example else "mean"))
  return tuple(reductions)


def _trace_one(grad_fun, options, call, args, kwargs) -> _Shapes:
  """The abstract outputs of one microbatch (a trace, no compile)."""
  mb = {
      n: jax.tree.map(lambda x: jax.ShapeDtypeStruct((call.rows, *x.shape[1:]), x.dtype), args[n])
      for n in call.batch_argnums
  }
  state = args[options.state_argnums[0]] if options.state_argnums else None
  one = functools.partial(_one_microbatch, grad_fun, options, call, args, kwargs)
  out = jax.eval_shape(lambda i, mb, state: one(i, mb, state, None), 0, mb, state)
  reductions = _aux_reductions(out.aux, options.aux_reduction, call.rows)
  return _Shapes(out.value, out.grads, out.aux, reductions)


def _aux_sum_dtype(dtype: Any, reduction: str) -> Any:
  """Means in float32 at least; sums of integers in integers, exactly."""
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.promote_types(dtype, jnp.float32)
  return jnp.float32 if reduction == "mean" else jnp.promote_types(dtype, jnp.int32)


def _aux_add(total: jax.Array, x: jax.Array, reduction: str, weight, kept) -> jax.Array:
  x = x.astype(total.dtype)
  if reduction == "mean" and weight is not None:
    x = jnp.asarray(weight, jnp.float32).astype(total.dtype) * x
  # `where`, not a product with `kept`: a skipped microbatch's aux may be NaN.
  return total + jnp.where(kept, x, jnp.zeros_like(x))


def _scan(grad_fun, options, call, shapes, args, shard_index, *, kwargs) -> _sharding.LocalSums:
  """Scans this device's microbatches; returns the un-normalised sums.

  With ``skip_nonfinite``, each microbatch is judged by its loss alone (a
  scalar), not by a pass over every gradient leaf: on a model of many small
  leaves those passes cost more than the arithmetic. A gradient can hold NaN or
  Inf where its loss does not; then the sums are not finite, and only then does
  :func:`_recheck` run the loop again judging every gradient.
  """
  def step(check):
    fn = functools.partial(
        _step, grad_fun, options, call, shapes, args, shard_index, kwargs, check=check
    )
    return jax.named_call(fn, name="accum_jax_microbatch")

  split = functools.partial(
      _batching.split, num_microbatches=options.num_microbatches, how=options.split
  )
  batch = {n: jax.tree.map(split, args[n]) for n in call.batch_argnums}
  start = _initial_carry(options, shapes, args)
  xs = (jnp.arange(options.num_microbatches, dtype=jnp.int32), batch)
  carry, stacked = jax.lax.scan(step("loss" if options.skip_nonfinite else "none"), start, xs)
  if options.skip_nonfinite:
    carry, stacked = _recheck(step("all"), start, carry, stacked, batch, options.num_microbatches)
  acc, aux_sums, state, noise = carry
  per_example = [
      _batching.unsplit(x, options.split) if r == "concat" else x
      for x, r in zip(stacked, shapes.reductions)
  ]
  return _sharding.LocalSums(acc, aux_sums, state, per_example, noise)


def _initial_carry(options, shapes, args) -> tuple[Any, ...]:
  """Empty sums (accumulator, aux, gradient noise) and the state passed in."""
  # Zeros made from the parameters themselves keep their sharding: sharded
  # (FSDP-style) parameters get an accumulator sharded the same way.
  params = tuple(args[n] for n in options.argnums)
  params = params[0] if options.single_argnum else params
  acc = _core.init((jnp.zeros((), shapes.value.dtype), params), options.accumulator_dtype)
  aux_sums = [
      jnp.zeros(x.shape, _aux_sum_dtype(x.dtype, r)) if r in ("mean", "sum") else None
      for x, r in zip(jax.tree.leaves(shapes.aux), shapes.reductions)
  ]
  state = args[options.state_argnums[0]] if options.state_argnums else None
  noise = _noise.zero_sums() if options.gradient_noise else None
  return acc, aux_sums, state, noise


def _step(grad_fun, options, call, shapes, args, shard_index, kwargs, carry, xs, *, check):
  """One microbatch into the sums; ``check``: what must be finite ("none", "loss", "all")."""
  acc, aux_sums, state, noise = carry
  index, mb = xs
  out = _one_microbatch(grad_fun, options, call, args, kwargs, index, mb, state, shard_index)
  acc, kept = _core.add(
      acc, (out.value, out.grads), out.weight, skip_nonfinite=check == "all",
      # A zero weight counts for nothing, even with a NaN loss.
      accept=jnp.isfinite(out.value) | (out.weight == 0) if check == "loss" else True,
  )
  aux = jax.tree.leaves(out.aux)
  aux_sums = [
      None if total is None else _aux_add(total, x, r, out.weight, kept)
      for total, x, r in zip(aux_sums, aux, shapes.reductions)
  ]
  per_example = [x if r in ("concat", "stack") else None for x, r in zip(aux, shapes.reductions)]
  if options.state_argnums:
    state = jax.tree.map(lambda new, old: jnp.where(kept, new, old), out.state, state)
  if options.gradient_noise:  # without weight_fn, a microbatch weighs its rows
    size = call.rows if out.weight is None else out.weight
    noise = _noise.add(noise, out.grads, size, kept)
  return (acc, aux_sums, state, noise), per_example


def _recheck(step, start, carry, stacked, batch, num_microbatches):
  """The loop again, judging every gradient leaf, when the sums are not finite.

  A ``fori_loop`` of N iterations then, and of none otherwise, whose carry
  starts in the first loop's buffers (reset where it reruns): no memory beyond
  the first loop's, and one pass over the sums when all is finite.
  """
  rerun = ~_core.all_finite(carry[0].total)
  carry = jax.tree.map(lambda fresh, old: jnp.where(rerun, fresh, old), start, carry)

  def body(i, loop_carry):
    carry, stacked = loop_carry
    carry, per_example = step(carry, (i, jax.tree.map(lambda x: jnp.asarray(x)[i], batch)))
    stacked = [s if s is None else s.at[i].set(x) for s, x in zip(stacked, per_example)]
    return carry, stacked

  return jax.lax.fori_loop(0, jnp.where(rerun, num_microbatches, 0), body, (carry, stacked))


def _drop_padding(x: jax.Array, call: _options.Call) -> jax.Array:
  if x.shape[0] == call.batch_size:
    return x
  if call.mesh is not None and jax.sharding.AxisType.Explicit in call.mesh.axis_types:
    # An explicitly sharded batch axis cannot be cut to a size the devices do
    # not divide; the rows are gathered first.
    x = jax.reshard(x, jax.sharding.NamedSharding(call.mesh, jax.sharding.PartitionSpec()))
  return x[:call.batch_size]


def _aux_result(total, per_example, like, reduction, weight, call) -> jax.Array:
  if reduction == "concat":
    return _drop_padding(per_example, call)
  if reduction == "stack":
    return per_example
  if reduction == "mean":
    total = total / jnp.where(weight > 0, weight, 1.0).astype(total.dtype)
  return total.astype(like.dtype) if jnp.issubdtype(like.dtype, jnp.inexact) else total


def _finalise(sums: _sharding.LocalSums, shapes: _Shapes, options, call) -> Any:
  """Normalises the sums into what ``jax.value_and_grad`` returns."""
  acc = sums.acc
  value, grads = _core.result(acc, (shapes.value, shapes.grads), "mean")
  # Every microbatch skipped: NaN, as on the whole batch, rather than a loss of
  # 0 that hides it (accumulate, apply_if_finite... then skip the step too).
  nothing_kept = (acc.weight == 0) & (acc.num_skipped > 0)
  value, grads = jax.tree.map(
      lambda x: jnp.where(nothing_kept, jnp.nan, x) if jnp.issubdtype(x.dtype, jnp.inexact)
      else x,
      (value, grads),
  )
  aux = jax.tree.unflatten(jax.tree.structure(shapes.aux), [
      _aux_result(total, per_example, like, r, acc.weight, call)
      for total, per_example, like, r in zip(
          sums.aux_sums, sums.per_example, jax.tree.leaves(shapes.aux), shapes.reductions
      )
  ])
  if options.state_argnums:
    aux = (sums.state, aux)
  out = (value, aux) if options.has_aux else value
  if options.return_info:
    return out, grads, MicrobatchInfo(acc.num_skipped, acc.weight, _noise_estimate(sums, shapes))
  return out, grads


def _noise_estimate(sums: _sharding.LocalSums, shapes: _Shapes) -> _noise.GradientNoise | None:
  if sums.noise is None:
    return None
  wide = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jnp.promote_types(x.dtype, jnp.float32)),
      (shapes.value, shapes.grads),
  )
  _, mean_grads = _core.result(sums.acc, wide, "mean")
  return _noise.estimate(sums.noise, mean_grads)


def value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    weight_fn: Callable[..., jax.typing.ArrayLike] | None = None,
    rng_argnums: int | Sequence[int] | None = None,
    state_argnums: int | None = None,
    aux_reduction: AuxReduction | None = None,
    split: Split = "contiguous",
    pad_batch: bool = False,
    accumulator_dtype: Any = jnp.float32,
    skip_nonfinite: bool | None = None,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str | None = None,
    return_info: bool = False,
    gradient_noise: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` over a batch split into microbatches.

  The batch arguments are split along axis 0 into ``num_microbatches`` parts and
  a ``jax.lax.scan`` takes the value and gradient of ``fun`` on each in turn, so
  one microbatch's activations are alive at a time. The result is the weighted
  mean over the microbatches, the full batch's mean.

  See the guide: :doc:`/two_doors`.

  Args:
    fun: the function to differentiate, as for ``jax.value_and_grad``.
    num_microbatches: the number of microbatches, an int >= 1 dividing the batch.
    argnums: which positional argument(s) to differentiate.
    batch_argnums: which positional argument(s) are batches (pytrees whose
      leaves share a leading axis). None (default): every positional argument
      not otherwise named whose leaves are arrays with a leading axis.
    has_aux: ``fun`` returns ``(value, aux)``.
    weight_fn: maps one microbatch's batch arguments to its scalar weight,
      e.g. ``lambda batch: batch["mask"].sum()``. None: every microbatch weighs 1.
    rng_argnums: argument(s) holding a PRNG key or a pytree of keys; microbatch
      ``i`` gets ``jax.random.fold_in(key, i)`` of each.
    state_argnums: an argument threaded through the microbatches in order
      (e.g. BatchNorm ``batch_stats``); ``fun`` then returns
      ``(value, (new_state, aux))`` with ``has_aux=True``.
    aux_reduction: ``"mean"``, ``"sum"``, ``"concat"`` (per-example, in batch
      order) or ``"stack"`` (per microbatch). None (default): concatenate the
      leaves with a leading axis of the microbatch's rows, average the others.
    split: ``"contiguous"`` (default) or ``"strided"`` rows per microbatch;
      ``"strided"`` for a sharded batch without ``mesh``.
    pad_batch: pad a batch that does not split with zero rows instead of
      raising; needs a ``weight_fn`` that gives them zero weight.
    accumulator_dtype: the dtype of the running sums (float32 by default; None
      for the gradients' own). Results are cast back.
    skip_nonfinite: skip, and count, a microbatch whose loss or gradient is
      not finite. None (default) means True, but must be given when a dynamic
      loss scale is among the arguments.
    mesh: a ``jax.sharding.Mesh`` to run data-parallel on, with one gradient
      reduction per call. None: the ``jax.set_mesh`` mesh when ``data_axis`` is
      given, else no mesh.
    data_axis: the mesh axis the batch is sharded over.
    return_info: also return a :class:`MicrobatchInfo`.
    gradient_noise: estimate the gradient noise from the microbatches, as
      ``info.gradient_noise``. Needs ``return_info``.

  Returns:
    A function with ``fun``'s signature returning what ``jax.value_and_grad``
    would (and a :class:`MicrobatchInfo` third with ``return_info``). Call it
    under ``jax.jit``: eagerly, every call compiles its loop anew.

  Raises:
    ValueError: for bad options; at trace time, for a batch that does not
      split, a non-scalar weight, or a ``fun`` that does not return what
      ``has_aux`` and ``state_argnums`` promise.

  Examples:
    >>> import jax, jax.numpy as jnp, accum_jax
    >>> def loss(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> w = jnp.ones(3)
    >>> batch = {"x": jnp.arange(24.0).reshape(8, 3) / 24, "y": jnp.ones(8)}
    >>> value, grads = jax.jit(accum_jax.value_and_grad(loss, num_microbatches=4))(w, batch)
    >>> full_value, full_grads = jax.value_and_grad(loss)(w, batch)
    >>> bool(jnp.allclose(value, full_value)), bool(jnp.allclose(grads, full_grads))
    (True, True)
  """
  options = _options.make(
      num_microbatches, argnums=argnums, batch_argnums=batch_argnums, has_aux=has_aux,
      weight_fn=weight_fn, rng_argnums=rng_argnums, state_argnums=state_argnums,
      aux_reduction=aux_reduction, split=split, pad_batch=pad_batch,
      accumulator_dtype=accumulator_dtype, skip_nonfinite=skip_nonfinite, mesh=mesh,
      data_axis=data_axis, return_info=return_info, gradient_noise=gradient_noise,
  )
  grad_fun = _checked(fun, options)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    call = _options.bind(options, args, kwargs)
    if call.padding:
      args = tuple(
          _batching.pad(arg, call.padding) if n in call.batch_argnums else arg
          for n, arg in enumerate(args)
      )
    shapes = _trace_one(grad_fun, options, call, args, kwargs)
    scan = functools.partial(_scan, grad_fun, options, call, shapes, kwargs=kwargs)
    if call.mesh is None:
      sums = scan(args, None)
    else:
      sums = _sharding.data_parallel(
          scan, args, batch_argnums=call.batch_argnums, mesh=call.mesh,
          axis=str(call.data_axis),
      )
    return _finalise(sums, shapes, options, call)

  return wrapped


def grad(fun: Callable[..., Any], num_microbatches: int, **kwargs: Any) -> Callable[..., Any]:
  """``jax.grad`` over microbatches; the options of :func:`value_and_grad`.

  Returns ``grads``, or ``(grads, aux)`` with ``has_aux=True``, as ``jax.grad``
  does (and a :class:`MicrobatchInfo` last with ``return_info=True``).

  Examples:
    >>> import jax.numpy as jnp, accum_jax
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> g = accum_jax.grad(loss, num_microbatches=2)(jnp.ones(2), jnp.eye(2))
    >>> g.tolist()
    [1.0, 1.0]
  """
  vg = value_and_grad(fun, num_microbatches, **kwargs)
  return grad_of(vg, fun, kwargs.get("has_aux", False), kwargs.get("return_info", False))


def grad_of(
    vg: Callable[..., Any], fun: Callable[..., Any], has_aux: bool, return_info: bool
) -> Callable[..., Any]:
  """``vg`` (a microbatched value_and_grad) returning what ``jax.grad`` would."""

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    out, grads, *info = vg(*args, **kwargs)
    result = (grads, out[1]) if has_aux else grads
    return (result, *info) if return_info else result

  return wrapped

