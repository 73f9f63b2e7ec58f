"""Accumulation inside one step: ``value_and_grad`` over microbatches."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from accum_jax import _core, _sharding

AuxReduction = Literal["mean", "sum", "stack"]
_AUX_REDUCTIONS = ("mean", "sum", "stack")
Split = Literal["contiguous", "strided"]
_SPLITS = ("contiguous", "strided")


class MicrobatchInfo(NamedTuple):
  """What happened to the microbatches of one call (``return_info=True``).

  Attributes:
    num_skipped: microbatches skipped because their loss or gradient was not
      finite (or their weight negative); shape=(), dtype=int32.
    total_weight: the sum of the kept microbatches' weights (their number when
      there is no ``weight_fn``); shape=(), dtype=float32.
  """

  num_skipped: jax.Array
  total_weight: jax.Array


def _as_tuple(argnums: int | Sequence[int] | None, name: str) -> tuple[int, ...]:
  if argnums is None:
    return ()
  nums = (argnums,) if isinstance(argnums, numbers.Integral) else tuple(argnums)
  for n in nums:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
      raise ValueError(f"{name}={argnums!r} must be a non-negative int or a tuple of them.")
  return tuple(int(n) for n in nums)


def _check_num_microbatches(num_microbatches: Any) -> int:
  if (n := _core.positive_int(num_microbatches)) is None:
    raise ValueError(
        f"num_microbatches={num_microbatches!r} must be an int >= 1 that divides the"
        " batch size; use 1 for the whole batch at once."
    )
  return n


def _batch_size(batch_args: dict[int, Any]) -> int:
  sizes = {}
  for i, arg in batch_args.items():
    for path, leaf in jax.tree.leaves_with_path(arg):
      if jnp.ndim(leaf) == 0:
        raise ValueError(
            f"Argument {i}{jax.tree_util.keystr(path)} is a scalar, but batch_argnums"
            " names it: every leaf of a batch argument needs a leading batch axis. Pass"
            " it as another argument, or give it a batch axis."
        )
      sizes[f"argument {i}{jax.tree_util.keystr(path)}"] = jnp.shape(leaf)[0]
  if not sizes:
    raise ValueError("batch_argnums names arguments with no arrays: nothing to split.")
  if len(set(sizes.values())) > 1:
    listed = ", ".join(f"{k}: {v}" for k, v in sizes.items())
    raise ValueError(
        f"The batch arguments have different leading (batch) sizes ({listed}). Every"
        " leaf of a batch argument must have the same batch size along axis 0."
    )
  return next(iter(sizes.values()))


def divisors(n: int) -> list[int]:
  """The divisors of ``n``, ascending: the numbers of microbatches a batch of n allows."""
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted({*small, *(n // d for d in small)})


def _check_divisible(batch_size: int, num_microbatches: int, num_shards: int = 1) -> None:
  parts = num_microbatches * num_shards
  if batch_size % parts == 0:
    return
  if batch_size % num_shards:
    raise ValueError(
        f"A batch of {batch_size} does not split over the {num_shards} devices of the"
        f" data axis. Pad the batch to a multiple of {parts} (num_microbatches="
        f"{num_microbatches} x {num_shards} devices), e.g. with pad_batch=True and a"
        " weight_fn that gives rows of zeros zero weight."
    )
  where = "" if num_shards == 1 else f" on each of {num_shards} devices"
  choices = divisors(batch_size // num_shards)
  raise ValueError(
      f"A batch of {batch_size} does not split into num_microbatches={num_microbatches}"
      f"{where}. Pad the batch to a multiple of {parts} with rows that count for"
      " nothing (pass pad_batch=True, with a weight_fn that gives rows of zeros zero"
      f" weight, e.g. through a mask), or choose num_microbatches among {choices}."
  )


def _fold_in(key: jax.Array, index: jax.Array, shard_index: jax.Array | None) -> jax.Array:
  """The key of microbatch ``index`` (on device ``shard_index`` under a mesh)."""
  key = jax.random.fold_in(key, index)
  return key if shard_index is None else jax.random.fold_in(key, shard_index)


def _pad(batch: Any, num_rows: int) -> Any:
  """``batch`` with ``num_rows`` rows of zeros appended to every leaf."""
  return jax.tree.map(
      lambda x: jnp.pad(x, [(0, num_rows)] + [(0, 0)] * (jnp.ndim(x) - 1)), batch
  )


def _split(x: jax.Array, num_microbatches: int, split: Split) -> jax.Array:
  size = x.shape[0] // num_microbatches
  if split == "contiguous":  # microbatch i: rows i * size, ..., (i + 1) * size - 1
    return x.reshape(num_microbatches, size, *x.shape[1:])
  # microbatch i: rows i, i + N, i + 2N, ...; with the batch sharded over devices,
  # every microbatch then has rows on every device.
  return jnp.swapaxes(x.reshape(size, num_microbatches, *x.shape[1:]), 0, 1)


def _is_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return jnp.ndim(x) == 0
  return dtype == jnp.uint32 and jnp.shape(x) == (2,)  # a raw key


def _check_key(keys: Any, argnum: int) -> None:
  leaves = jax.tree.leaves(keys)
  if not leaves or not all(_is_key(leaf) for leaf in leaves):
    bad = next((leaf for leaf in leaves if not _is_key(leaf)), keys)
    raise ValueError(
        f"rng_argnums names argument {argnum}, which is not a PRNG key or a pytree of"
        f" them (got {getattr(bad, 'dtype', type(bad).__name__)} of shape"
        f" {jnp.shape(bad)}). Pass single keys such as jax.random.key(0), or drop it"
        " from rng_argnums."
    )


def value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    weight_fn: Callable[..., jax.typing.ArrayLike] | None = None,
    rng_argnums: int | Sequence[int] | None = None,
    state_argnums: int | None = None,
    aux_reduction: AuxReduction = "mean",
    split: Split = "contiguous",
    pad_batch: bool = False,
    accumulator_dtype: Any = jnp.float32,
    skip_nonfinite: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str | None = None,
    return_info: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` over a batch split into microbatches.

  The batch arguments are split along axis 0 into ``num_microbatches`` equal
  parts, and a ``jax.lax.scan`` takes the value and gradient of ``fun`` on each
  in turn, so only one microbatch's activations are alive at a time::

    for i, mb in enumerate(split(batch, num_microbatches)):
      w_i = weight_fn(*mb) if weight_fn else 1
      (L_i, aux_i), g_i = jax.value_and_grad(fun, argnums, has_aux)(..., mb, ...)
      accumulate w_i * L_i, w_i * g_i, aux_i     # float32; non-finite skipped
    return (sum w_i L_i / sum w_i, reduce(aux)), sum w_i g_i / sum w_i

  With ``fun`` returning its microbatch's mean loss and ``weight_fn`` the
  microbatch's number of valid tokens, the result is the exact full-batch
  token mean. Without ``weight_fn``, every microbatch counts 1: the mean of
  equal-sized microbatch means, which is the full-batch mean.

  Args:
    fun: the function to differentiate, as for ``jax.value_and_grad``.
    num_microbatches: the number of microbatches, an int >= 1 dividing the batch.
    argnums: which positional argument(s) to differentiate.
    batch_argnums: which positional argument(s) are batches: pytrees whose
      leaves all have the same leading batch size.
    has_aux: ``fun`` returns ``(value, aux)``.
    weight_fn: called with the batch arguments of one microbatch, returns its
      scalar weight (e.g. ``lambda batch: batch["mask"].sum()``). A zero weight
      makes a microbatch count for nothing, even when its loss is NaN.
    rng_argnums: argument(s) holding a PRNG key, or a pytree of keys such as
      Linen's ``{"dropout": key}``; microbatch ``i`` receives
      ``jax.random.fold_in(key, i)`` of each (and, under ``mesh``, the device index
      folded in as well), so dropout differs between microbatches.
    state_argnums: an argument threaded through the microbatches in order, e.g.
      Flax BatchNorm ``batch_stats``. ``fun`` must then have ``has_aux=True``
      and return ``(value, (new_state, aux))``; the result's aux is
      ``(final_state, reduced_aux)``. A skipped or zero-weight microbatch leaves
      the state as it was.
    aux_reduction: ``"mean"`` (default) averages aux leaves like the loss,
      weighted when ``weight_fn`` is given; ``"sum"`` sums them; ``"stack"``
      returns them stacked with a leading ``num_microbatches`` axis.
    split: which rows make microbatch ``i``: ``"contiguous"`` (default), rows
      ``i * B/N`` to ``(i + 1) * B/N - 1``; ``"strided"``, rows ``i, i + N, i +
      2N, ...``. Use ``"strided"`` when the batch is sharded over devices and
      no ``mesh`` is given (e.g. FSDP): each microbatch then spans all devices,
      where a contiguous one would sit on a few and be gathered. With ``mesh``
      each device splits its own shard, so either works.
    pad_batch: when the batch does not split into ``num_microbatches`` (times
      the devices of ``data_axis``), append rows of zeros to every batch leaf
      until it does, instead of raising. Needs ``weight_fn``, which must give
      those rows zero weight (as a mask of zeros does), and ``fun`` must let
      them count for nothing, as a masked mean does: the last, short batch of
      an epoch then needs no other ``num_microbatches``. In a microbatch that
      also holds real rows, the padding goes through the forward pass, so
      BatchNorm statistics (``state_argnums``) see it; a microbatch of padding
      alone has weight 0 and leaves the state as it was.
    accumulator_dtype: the dtype of the running sums (float32 by default; None
      for the gradients' own dtype). Results are cast back.
    skip_nonfinite: skip, and count, a microbatch whose loss or gradient holds
      NaN or Inf; the normalisation uses only what was kept. When every
      microbatch is skipped, the loss and gradients are NaN (as on the whole
      batch), so a following ``accumulate`` skips the step too. Under ``mesh``
      each device decides for its own part of a microbatch.
    mesh: a ``jax.sharding.Mesh`` to run data-parallel on: the batch arguments
      are sharded over ``data_axis``, the other arguments replicated, each
      device accumulates its local gradient, and the devices' sums are reduced
      once per call, after the loop. Defaults to the mesh set with
      ``jax.set_mesh`` when ``data_axis`` is given.
    data_axis: the mesh axis the batch is sharded over.
    return_info: also return a :class:`MicrobatchInfo`.

  Returns:
    A function with ``fun``'s signature returning what ``jax.value_and_grad``
    would: ``(value, aux), grads`` or ``value, grads``; with ``return_info``, a
    :class:`MicrobatchInfo` third. Keyword arguments reach ``fun`` unsplit and
    undifferentiated. Call it under ``jax.jit``: eagerly, every call traces and
    compiles its loop anew.

  Raises:
    ValueError: for ``num_microbatches`` < 1, overlapping or out-of-range
      argnums, an unknown ``aux_reduction``; at trace time, for a batch that
      does not split, batch arguments of different sizes, a ``weight_fn`` that
      does not return a scalar, or an ``rng_argnums`` argument that is no key.

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
  num_microbatches = _check_num_microbatches(num_microbatches)
  diff_nums = _as_tuple(argnums, "argnums")
  batch_nums = _as_tuple(batch_argnums, "batch_argnums")
  rng_nums = _as_tuple(rng_argnums, "rng_argnums")
  state_nums = _as_tuple(state_argnums, "state_argnums")
  if not diff_nums:
    raise ValueError("argnums=() differentiates nothing: name at least one argument.")
  if not batch_nums:
    raise ValueError("batch_argnums=() names no batch: name the argument(s) to split.")
  if len(state_nums) > 1:
    raise ValueError(
        f"state_argnums={state_argnums!r}: one argument can be threaded; gather the"
        " states into one pytree."
    )
  roles = {"argnums": diff_nums, "batch_argnums": batch_nums, "rng_argnums": rng_nums,
           "state_argnums": state_nums}
  names = list(roles)
  for a_i, a in enumerate(names):
    for b in names[a_i + 1:]:
      if both := set(roles[a]) & set(roles[b]):
        raise ValueError(
            f"{a}={roles[a]} and {b}={roles[b]} both name argument(s) {sorted(both)}:"
            " each argument has one role."
        )
  if aux_reduction == "stack" and (mesh is not None or data_axis is not None):
    raise ValueError(
        "aux_reduction='stack' is not available with a mesh: per-microbatch aux differs"
        " between devices. Use 'mean' or 'sum'."
    )
  if pad_batch and weight_fn is None:
    raise ValueError(
        "pad_batch=True needs weight_fn: the rows of zeros it appends must count for"
        " nothing, so pass a weight_fn that gives them zero weight, e.g."
        " weight_fn=lambda batch: batch['mask'].sum()."
    )
  if split not in _SPLITS:
    raise ValueError(
        f"split={split!r} is not one of {_SPLITS}: 'contiguous' makes microbatch i of"
        " consecutive rows, 'strided' of rows i, i + N, i + 2N, ..."
    )
  if aux_reduction not in _AUX_REDUCTIONS:
    raise ValueError(
        f"aux_reduction={aux_reduction!r} is not one of {_AUX_REDUCTIONS}."
    )
  if state_nums and not has_aux:
    raise ValueError(
        "state_argnums needs has_aux=True: fun must return (value, (new_state, aux))."
    )
  accumulator_dtype = _core.canonicalize_accumulator_dtype(accumulator_dtype)
  single_argnum = isinstance(argnums, numbers.Integral)

  def value_and_aux(*args, **kwargs):
    value, aux = fun(*args, **kwargs) if has_aux else (fun(*args, **kwargs), ())
    if jnp.ndim(value) != 0:
      raise ValueError(
          f"fun must return a scalar loss, got shape {jnp.shape(value)}: reduce it (e.g. with"
          " jnp.mean), and return other outputs as aux with has_aux=True."
      )
    return value, aux

  grad_fun = jax.value_and_grad(
      value_and_aux, argnums=diff_nums[0] if single_argnum else diff_nums, has_aux=True
  )
  data_parallel = mesh is not None or data_axis is not None

  def local_sums(args: tuple[Any, ...], kwargs: dict[str, Any], shard_index: jax.Array | None):
    """Scans this device's microbatches; returns the un-normalised sums."""
    split_leaf = functools.partial(_split, num_microbatches=num_microbatches, split=split)
    batch = {i: jax.tree.map(split_leaf, args[i]) for i in batch_nums}

    def call(i, mb, state):
      call_args = list(args)
      for n in batch_nums:
        call_args[n] = mb[n]
      for n in rng_nums:
        call_args[n] = jax.tree.map(lambda key: _fold_in(key, i, shard_index), args[n])
      if state_nums:
        call_args[state_nums[0]] = state
      (value, aux), grads = grad_fun(*call_args, **kwargs)
      new_state, aux = aux if state_nums else (None, aux)
      if weight_fn is None:
        weight = None
      else:
        weight = weight_fn(*(mb[n] for n in batch_nums))
        if jnp.ndim(weight) != 0:
          raise ValueError(
              f"weight_fn must return a scalar weight per microbatch, got shape"
              f" {jnp.shape(weight)}. Reduce it, e.g. lambda batch: batch['mask'].sum()."
          )
      return (value, grads), aux, new_state, weight

    i0 = jax.ShapeDtypeStruct((), jnp.int32)
    mb0 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
    state0 = args[state_nums[0]] if state_nums else None
    out_shape, aux_shape, _, _ = jax.eval_shape(call, i0, mb0, state0)
    # Zeros made from the parameters themselves keep their sharding: sharded
    # (FSDP-style) parameters get an accumulator sharded the same way.
    grads_like = args[diff_nums[0]] if single_argnum else tuple(args[n] for n in diff_nums)
    acc0 = _core.init((jnp.zeros((), out_shape[0].dtype), grads_like), accumulator_dtype)
    # Aux (metrics, counts) is summed in float32 whatever the gradients use.
    aux_acc0 = _core.init(aux_shape, jnp.float32)

    @functools.partial(jax.named_call, name="accum_jax_microbatch")
    def body(carry, xs):
      acc, aux_acc, state = carry
      i, mb = xs
      out, aux, new_state, weight = call(i, mb, state)
      acc, kept = _core.add(acc, out, weight, skip_nonfinite=skip_nonfinite)
      if aux_reduction != "stack":
        aux_weight = weight if aux_reduction == "mean" else None
        aux_acc, _ = _core.add(aux_acc, aux, aux_weight, skip_nonfinite=False, accept=kept)
      if state_nums:
        state = jax.tree.map(lambda new, old: jnp.where(kept, new, old), new_state, state)
      return (acc, aux_acc, state), (aux if aux_reduction == "stack" else None)

    xs = (jnp.arange(num_microbatches, dtype=jnp.int32), batch)
    (acc, aux_acc, state), stacked = jax.lax.scan(body, (acc0, aux_acc0, state0), xs)
    return acc, aux_acc, state, stacked, (out_shape, aux_shape)

  def finish(acc, aux_acc, state, stacked, shapes):
    out_shape, aux_shape = shapes
    value, grads = _core.result(acc, out_shape, "mean")
    # Every microbatch skipped: NaN, as on the whole batch, rather than a loss of
    # 0 that hides it (accumulate, apply_if_finite... then skip the step too).
    nothing_kept = (acc.weight == 0) & (acc.num_skipped > 0)
    value, grads = jax.tree.map(
        lambda x: jnp.where(nothing_kept, jnp.nan, x) if jnp.issubdtype(x.dtype, jnp.inexact)
        else x,
        (value, grads),
    )
    if aux_reduction == "stack":
      aux = stacked
    else:
      aux = _core.result(aux_acc, aux_shape, aux_reduction)
    if state_nums:
      aux = (state, aux)
    out = (value, aux) if has_aux else value
    if return_info:
      return out, grads, MicrobatchInfo(acc.num_skipped, acc.weight)
    return out, grads

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    for role, nums in roles.items():
      for n in nums:
        if n >= len(args):
          raise ValueError(
              f"{role}={roles[role]} names argument {n}, but the function was called with"
              f" {len(args)} positional argument(s). Pass it positionally, or fix {role}."
          )
    for n in rng_nums:
      _check_key(args[n], n)
    batch_size = _batch_size({n: args[n] for n in batch_nums})
    num_shards = 1
    if data_parallel:
      resolved_mesh, axis = _sharding.resolve_mesh(mesh, data_axis)
      num_shards = resolved_mesh.shape[axis]
    if padding := -batch_size % (num_microbatches * num_shards):
      if not pad_batch:
        _check_divisible(batch_size, num_microbatches, num_shards)
      args = tuple(_pad(arg, padding) if n in batch_nums else arg for n, arg in enumerate(args))
    if not data_parallel:
      return finish(*local_sums(args, kwargs, None))
    return _sharding.data_parallel(
        functools.partial(local_sums, kwargs=kwargs),
        finish,
        args,
        batch_argnums=batch_nums,
        state_argnums=state_nums,
        mesh=resolved_mesh,
        axis=axis,
    )

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
  has_aux, return_info = kwargs.get("has_aux", False), kwargs.get("return_info", False)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    out, grads, *info = vg(*args, **kwargs)
    result = (grads, out[1]) if has_aux else grads
    return (result, *info) if return_info else result

  return wrapped

