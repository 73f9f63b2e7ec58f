"""The accumulation core: weighted sums in a wide dtype, non-finite skip.

Both front doors, :func:`accum_jax.accumulate` (across calls) and
:func:`accum_jax.value_and_grad` (inside one step), keep an :class:`Accumulator`
and use the functions below (init, add, result, merge). The algorithm, for
microbatch gradients ``g_i`` with weights ``w_i``::

  total, weight = 0, 0                     # total in the accumulator dtype, weight in float32
  for g, w in microbatches:
    if w < 0 or w > 0 and not all_finite(g):  # skipped, counted, never added
      num_skipped += 1
      continue
    count += 1
    if w > 0:
      weight += w
      total += w * g                       # float32 and wider accumulators: the sum
      total += w / weight * (g - total)    # narrower ones (float16, bfloat16): the mean
  mean = total / weight  (0 where weight == 0), cast back to g's dtype

The accumulator dtype of a leaf is the promotion of ``accumulator_dtype`` and the
leaf's dtype: float32 for bfloat16 and float16 gradients, complex64 for complex64
ones (the imaginary part is kept), float64 for float64 ones.

An accumulator narrower than float32 (``accumulator_dtype=None`` with float16 or
bfloat16 gradients) holds the running weighted *mean*, computed in float32 and
rounded once per call: a weighted sum of finite float16 gradients overflows
float16 long before their mean does (four gradients of 30000, or one of 100 with
a weight of 1000 tokens). The mean of finite values is finite, so nothing that
fits the gradient dtype overflows, and the float32 weight is never rounded. This
costs no extra pass over the gradients; the float32 path adds and does nothing else.

A zero weight adds nothing, even where its gradient is NaN: padding microbatches
cannot poison the sum.

Inside one step the whole batch's weight ``W = sum w_i`` is known before the loop,
so :func:`accum_jax.value_and_grad` scales each microbatch's loss by its share
``w_i / W`` before differentiating, and :func:`add_share` adds what comes out,
``w_i g_i / W``, as it is: no product per leaf, a sum the size of the mean, and
each microbatch's gradient already the part of the full batch's gradient that a
reduce-scatter across devices sums. :func:`share_result` multiplies the total by
``W / sum_kept w_i`` (:func:`share_factor`; 1 when nothing was skipped).

Each leaf combines in one of four ways (``kinds``, one per leaf; None: all
``"mean"``): ``"mean"`` and ``"sum"`` are the weighted sums above, normalised
differently at the end; ``"max"`` and ``"last"`` are statistics, whose raw values
are kept (``_statistics``). Dtypes, placement and the finiteness checks are in
``_arrays``.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from accum_jax._arrays import (  # noqa: F401  (re-exported: the core's vocabulary)
    PACK_LIMIT,
    accumulator_dtype_for,
    all_finite,
    all_finite_packed,
    canonicalize_accumulator_dtype,
    explicitly_sharded,
    is_narrow,
    is_sharded,
    loop_zeros,
    positive_int,
    zeros_like,
)
from accum_jax._statistics import (  # noqa: F401  (re-exported likewise)
    add_statistic,
    is_statistic,
    merge_statistics,
    statistic_result,
)

# How one leaf reduces over microbatches or calls; see the module docstring.
Reduction = Literal["mean", "sum", "max", "last"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "last")


class Accumulator(NamedTuple):
  """A running weighted sum (or, in a narrow dtype, mean) of pytrees.

  Attributes:
    total: ``sum(w_i * x_i)`` over the added pytrees, leaves in the accumulator
      dtype; for leaves narrower than float32 (float16, bfloat16), the weighted
      mean ``sum(w_i * x_i) / sum(w_i)`` instead, which cannot overflow. While
      ``count`` is 0 (a window that holds no call yet) it is not read, and may
      hold the last window's values: :func:`add` starts from zeros then, so that
      ending a window writes nothing into its buffers.
    weight: ``sum(w_i)``; shape=(), dtype=float32.
    count: number of pytrees offered and not skipped, zero weights included;
      shape=(), dtype=int32.
    num_skipped: number of non-finite pytrees refused, never reset when a
      window ends; shape=(), dtype=int32.
  """

  total: Any
  weight: jax.Array
  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count
  num_skipped: jax.Array


def init(
    tree: Any, accumulator_dtype: Any = jnp.float32, kinds: Any = None, *, in_loop: bool = False,
) -> Accumulator:
  """An empty accumulator shaped like ``tree``, keeping its leaves' sharding.

  Each leaf's accumulator has the dtype :func:`accumulator_dtype_for` gives; a
  "max" or "last" leaf (``kinds``, see :func:`per_leaf`) the leaf's own. With
  ``in_loop``, the initial carry of a loop inside a step: :func:`loop_zeros`.
  """
  make = loop_zeros if in_loop else zeros_like
  return Accumulator(
      total=map_kinds(functools.partial(_sum_zeros, accumulator_dtype=accumulator_dtype,
                                        make=make),
                      kinds, tree, statistic=functools.partial(_statistic_zeros, make=make)),
      weight=jnp.zeros((), jnp.float32),
      count=jnp.zeros((), jnp.int32),
      num_skipped=jnp.zeros((), jnp.int32),
  )


def per_leaf(kinds: Any, tree: Any) -> list[str]:
  """One kind per leaf of ``tree``: ``kinds`` is None (all "mean"), a kind, or one per leaf."""
  num_leaves = len(jax.tree.leaves(tree))
  if kinds is None or isinstance(kinds, str):
    return [kinds or "mean"] * num_leaves
  return list(kinds)


def gradient_leaves(tree: Any, kinds: Any) -> list[Any]:
  """The leaves of ``tree`` that are gradients ("mean", "sum"), not statistics: what a
  gradient-noise estimate looks at."""
  return [x for x, kind in zip(jax.tree.leaves(tree), per_leaf(kinds, tree))
          if not is_statistic(kind)]


def init_leaf(x: Any, kind: str, accumulator_dtype: Any) -> jax.Array:
  """The empty accumulator of one leaf of ``kind``, as :func:`init` makes it."""
  if is_statistic(kind):
    return _statistic_zeros(x, kind)
  return _sum_zeros(x, kind, accumulator_dtype)


def _sum_zeros(x: Any, kind: str, accumulator_dtype: Any, make: Any = zeros_like) -> jax.Array:
  """The empty sum of one leaf, in its accumulator dtype."""
  return make(x, accumulator_dtype_for(x.dtype, accumulator_dtype))


def _statistic_zeros(x: Any, kind: str, make: Any = zeros_like) -> jax.Array:
  """The empty statistic of one leaf, in its own dtype: its max or last value is exact there."""
  return make(x)


class Admission(NamedTuple):
  """What :func:`admit` decides about one pytree offered with a weight.

  Attributes:
    weight: the weight as a float32 scalar (1 where none was given).
    keep: add it: a positive weight, and nothing refused it; bool scalar.
    skipped: refuse it and count it (non-finite, or a negative or non-finite
      weight, or ``accept`` False); bool scalar. A zero weight is neither kept
      nor skipped: it counts as offered and adds nothing.
  """

  weight: jax.Array
  keep: jax.Array
  skipped: jax.Array


def admit(
    tree: Any,
    weight: jax.typing.ArrayLike | None = None,
    *,
    refuse_nonfinite: bool = True,
    accept: jax.typing.ArrayLike = True,
) -> Admission:
  """Decides whether ``tree`` of weight ``weight`` is added, skipped or neither.

  Args:
    tree: the pytree offered (a gradient, or a loss and its gradient).
    weight: a non-negative scalar; None counts as 1.
    refuse_nonfinite: refuse a ``tree`` holding NaN or Inf (one reduction per
      leaf). When False, only ``accept`` and the weight are looked at.
    accept: a further condition (a bool scalar); where False, ``tree`` is
      skipped and counted like a non-finite one.

  Returns:
    An :class:`Admission`.
  """
  w = jnp.ones((), jnp.float32) if weight is None else jnp.asarray(weight, jnp.float32)
  has_weight = w > 0
  # A negative or non-finite weight is bad data, refused like a NaN gradient.
  ok = jnp.asarray(accept, bool) & jnp.isfinite(w) & (w >= 0)
  if refuse_nonfinite:
    # A zero weight counts for nothing, even where its tree is NaN.
    ok = ok & (all_finite_packed(tree) | ~has_weight)
  return Admission(w, has_weight & ok, ~ok)


def _counted(acc: Accumulator, admission: Admission, total: Any, weight: jax.Array) -> Accumulator:
  return Accumulator(
      total=total,
      weight=weight,
      count=acc.count + (~admission.skipped).astype(jnp.int32),
      num_skipped=acc.num_skipped + admission.skipped.astype(jnp.int32),
  )


def map_kinds(fun: Any, kinds: Any, tree: Any, *rest: Any, statistic: Any = None) -> Any:
  """``jax.tree.map`` over ``tree`` and ``rest``, with each leaf's kind last: a
  weighted-sum leaf ("mean", "sum") by ``fun``, a "max" or "last" leaf by
  ``statistic`` (default ``fun``). ``kinds`` as for :func:`per_leaf`; where it is
  None, every leaf is a "mean" and no leaf's kind is asked about."""
  statistic = fun if statistic is None else statistic
  if kinds is None or isinstance(kinds, str):  # one kind for every leaf
    kind = kinds or "mean"
    chosen = fun if kinds is None or not is_statistic(kind) else statistic
    return jax.tree.map(functools.partial(chosen, kind=kind), tree, *rest)

  def by_kind(*leaves):
    return (statistic if is_statistic(leaves[-1]) else fun)(*leaves)

  kinds_tree = jax.tree.unflatten(jax.tree.structure(tree), list(kinds))
  return jax.tree.map(by_kind, tree, *rest, kinds_tree)


def holds_mean(total: jax.Array) -> bool:
  """Whether an accumulator's leaf holds the running mean (a narrow one), not a sum:
  what the modules built on the core ask, here ``is_narrow`` of its dtype."""
  return is_narrow(total.dtype)


def add(
    acc: Accumulator,
    tree: Any,
    weight: jax.typing.ArrayLike | None = None,
    *,
    refuse_nonfinite: bool = True,
    accept: jax.typing.ArrayLike = True,
    kinds: Any = None,
    leafwise: Any = None,
) -> tuple[Accumulator, jax.Array]:
  """Adds ``weight * tree`` to ``acc``, unless it is non-finite (across calls).

  Args:
    acc: the accumulator.
    tree: a pytree with the structure of ``acc.total``.
    weight: a non-negative scalar; None counts as 1. A negative or non-finite
      weight is skipped and counted like a non-finite ``tree``.
    refuse_nonfinite: refuse (and count) a ``tree`` holding NaN or Inf. When
      False, it is added as it is.
    accept: a further condition (a bool scalar); where False, ``tree`` is
      skipped and counted like a non-finite one.
    kinds: per leaf, see :func:`per_leaf`; a "max" or "last" leaf takes the
      leaf of ``tree`` as it is, unweighted.
    leafwise: how the elementwise ``add_leaf(total, x, kind)`` is mapped over
      ``acc.total`` and ``tree`` (default: by ``kinds``; buckets: ``Packed.added``).

  Returns:
    The new accumulator, and whether ``tree`` was added (a bool scalar).
  """
  admission = admit(tree, weight, refuse_nonfinite=refuse_nonfinite, accept=accept)
  w, keep = admission.weight, admission.keep
  new_weight = acc.weight + jnp.where(keep, w, 0.0)
  # The new call's share of the window, for the running means of narrow leaves.
  share = w / jnp.where(new_weight > 0, new_weight, 1.0)
  first = acc.weight == 0
  empty = acc.count == 0  # the total may hold the last window's values: not read

  def add_leaf(total, x, kind):
    # A select fused into the add, not zeros written when the window ended: that
    # write would cost the ending call a copy of the window's sum.
    total = jnp.where(empty, jnp.zeros((), total.dtype), total)
    if is_statistic(kind):
      return add_statistic(kind, total, x, keep, first)
    if is_narrow(total.dtype):
      # The running mean, computed in float32 and rounded once: a convex
      # combination of finite values, so it cannot overflow.
      mean = total.astype(jnp.float32)
      new = (mean + share * (x.astype(jnp.float32) - mean)).astype(total.dtype)
    else:
      # The product in float32 at least, so that a bfloat16 gradient times a
      # large weight does not round in the gradient's dtype.
      new = total + (w.astype(jnp.promote_types(total.dtype, jnp.float32)) * x).astype(total.dtype)
    # `where`, not a product with `keep`: 0 * NaN is NaN.
    return jnp.where(keep, new, total)

  total = map_kinds(add_leaf, kinds, acc.total, tree) if leafwise is None else leafwise(add_leaf)
  return _counted(acc, admission, total, new_weight), keep


def masked(tree: Any, keep: jax.Array) -> Any:
  """``tree`` where ``keep``, else zeros (not a product: ``0 * NaN`` is NaN)."""
  return jax.tree.map(lambda x: jnp.where(keep, x, jnp.zeros((), x.dtype)), tree)


def add_share(
    acc: Accumulator, shares: Any, admission: Admission, batch_weight: jax.Array,
    kinds: Any = None,
) -> Accumulator:
  """Adds one microbatch's shares of the batch's mean (inside a step).

  ``shares`` is the microbatch's contribution already scaled by its share of the
  batch, ``weight / batch_weight`` (the loss was scaled before differentiation),
  and already zero where the microbatch is not kept (:func:`masked`; a sum
  across devices may hold other devices' kept shares). Wide leaves add it; a
  narrow leaf holds the running mean of the kept microbatches' unscaled values,
  ``mean + w / K * (x / share - mean)`` with ``K`` the kept weight so far, as
  one convex combination that cannot overflow.

  Args:
    acc: the accumulator.
    shares: a pytree with the structure of ``acc.total``.
    admission: what :func:`admit` decided for this microbatch.
    batch_weight: the weight of the whole batch, ``sum w_i`` over every
      microbatch (of every device); float32 scalar.
    kinds: per leaf, see :func:`per_leaf`; a "max" or "last" leaf of
      ``shares`` is the raw value, not scaled by the share.

  Returns:
    The new accumulator.
  """
  kept_weight = jnp.where(admission.keep, admission.weight, 0.0)
  new_weight = acc.weight + kept_weight
  safe = jnp.where(new_weight > 0, new_weight, 1.0)
  first = acc.weight == 0

  def add_leaf(total, x, kind):
    if is_narrow(total.dtype):
      mean = total.astype(jnp.float32)
      new = mean * (1.0 - kept_weight / safe) + x.astype(jnp.float32) * (batch_weight / safe)
      return new.astype(total.dtype)
    return total + x.astype(total.dtype)

  def add_kept(total, x, kind):
    return add_statistic(kind, total, x, admission.keep, first)

  total = map_kinds(add_leaf, kinds, acc.total, shares, statistic=add_kept)
  return _counted(acc, admission, total, new_weight)


def share_factor(acc: Accumulator, batch_weight: jax.Array) -> jax.Array:
  """``W / sum_kept w_i`` (0 where nothing was kept): what turns the wide "mean"
  leaves of an :func:`add_share` accumulator into the kept microbatches' weighted
  mean."""
  kept = acc.weight > 0
  return jnp.where(kept, batch_weight / jnp.where(kept, acc.weight, 1.0), 0.0)


def share_result(
    acc: Accumulator, like: Any, batch_weight: jax.Array, kinds: Any = None,
    every_kept: bool = False,
) -> Any:
  """The mean over the kept microbatches of an :func:`add_share` accumulator.

  Wide leaves hold the sum of the kept shares, ``sum_kept w_i x_i / W``: times
  ``W / sum_kept w_i`` (1 when nothing was skipped), the kept microbatches'
  weighted mean; times ``W``, a "sum" leaf's weighted sum. Narrow leaves hold
  the mean already. Zeros where nothing was kept.

  Args:
    acc: the accumulator (after any cross-device reduction).
    like: a pytree (of arrays or shape-dtype structs) with the target dtypes.
    batch_weight: as for :func:`add_share`.
    kinds: per leaf, see :func:`per_leaf`.
    every_kept: every microbatch was added with weight 1 (no weight was given
      and none can be left out), as the caller knows before the loop: then
      ``sum_kept w_i == W``, and the wide "mean" leaves are the mean as they are.

  Returns:
    A pytree with the structure of ``acc.total`` and the dtypes of ``like``.
  """
  factor = None if every_kept else share_factor(acc, batch_weight)

  def finish(total, x, kind):
    if is_narrow(total.dtype):
      return _narrow_result(total, acc.weight, kind).astype(x.dtype)
    if kind == "sum":
      return (total * batch_weight.astype(total.dtype)).astype(x.dtype)
    if factor is None:  # every microbatch kept: the sum of the shares is the mean
      return total.astype(x.dtype)
    return (total * factor.astype(total.dtype)).astype(x.dtype)

  def kept(total, x, kind):
    return statistic_result(total, x.dtype, acc.weight)

  return map_kinds(finish, kinds, acc.total, like, statistic=kept)


def total_for(value: jax.Array, weight: jax.Array, kind: str) -> jax.Array:
  """:func:`result` undone for a "mean" or "sum" leaf: what an accumulator in the
  dtype of ``value`` holds when its result at ``weight`` is ``value``."""
  if is_narrow(value.dtype):  # holds the mean
    if kind == "mean":
      return value
    divisor = jnp.where(weight > 0, weight, 1.0)
    return (value.astype(jnp.float32) / divisor).astype(value.dtype)
  return value * weight.astype(value.dtype) if kind == "mean" else value


def _narrow_result(mean: jax.Array, weight: jax.Array, kind: str) -> jax.Array:
  """A narrow accumulator holds the running mean; a "sum" is it times the weight."""
  return mean if kind == "mean" else mean.astype(jnp.float32) * weight


def result(acc: Accumulator, like: Any, reduction: Any = "mean") -> Any:
  """The accumulated pytree, normalised, in the dtypes of ``like``.

  Args:
    acc: the accumulator.
    like: a pytree (of arrays or shape-dtype structs) with the target dtypes.
    reduction: ``"mean"`` divides by the total weight (zeros when it is 0);
      ``"sum"`` returns the weighted sum; or one kind per leaf (see
      :func:`per_leaf`), "max" and "last" leaves as kept (0 when none was).

  Returns:
    A pytree with the structure of ``acc.total`` and the dtypes of ``like``.
    A weighted sum beyond the range of ``like``'s dtype is infinite there; see
    :func:`sum_fits`.
  """
  divisor = jnp.where(acc.weight > 0, acc.weight, 1.0)

  def finish(total, x, kind):
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)  # a numpy float64 leaf: float32
    if is_narrow(total.dtype):  # total holds the mean
      return _narrow_result(total, acc.weight, kind).astype(dtype)
    if kind == "sum":
      return total.astype(dtype)
    return (total / divisor.astype(total.dtype)).astype(dtype)

  def kept(total, x, kind):
    return statistic_result(total, jax.dtypes.canonicalize_dtype(x.dtype), acc.weight)

  return map_kinds(finish, reduction, acc.total, like, statistic=kept)


def sum_fits(acc: Accumulator, like: Any, kinds: Any = None) -> jax.Array:
  """Whether the weighted sum is finite in the dtypes of ``like``; shape=().

  Only leaves whose ``like`` dtype is narrower than float32 are looked at (one
  reduction over each); for the others the answer is True without a pass: the
  float32 path gets no extra work. With ``kinds`` (see :func:`per_leaf`), only
  the "sum" leaves.
  """
  checks = [jnp.array(True)]
  leaf_kinds = per_leaf(kinds or "sum", like)
  for total, x, kind in zip(jax.tree.leaves(acc.total), jax.tree.leaves(like), leaf_kinds):
    if not is_narrow(x.dtype) or kind != "sum":
      continue
    wide = total.astype(jnp.promote_types(total.dtype, jnp.float32))
    largest = jnp.max(jnp.abs(wide), initial=0.0)
    if is_narrow(total.dtype):  # total holds the mean
      largest = largest * acc.weight
    checks.append(largest <= float(jnp.finfo(x.dtype).max))
  return jnp.all(jnp.stack(checks))


def merge(acc: Accumulator, axis_name: Any, kinds: Any = None) -> Accumulator:
  """The accumulators of all devices along ``axis_name`` combined, on each device.

  The one cross-device reduction of the data-parallel path (inside
  ``jax.shard_map``): a ``psum`` of the sums, and of the narrow leaves' means
  weighted by each device's weight (a ``psum`` of means would be wrong); "max"
  and "last" leaves by :func:`merge_statistics`.

  Args:
    acc: this device's accumulator.
    axis_name: the mesh axis (or axes) to reduce over.
    kinds: per leaf, see :func:`per_leaf`.

  Returns:
    The combined accumulator, the same on every device along ``axis_name``.
  """
  weight = jax.lax.psum(acc.weight, axis_name)
  share = acc.weight / jnp.where(weight > 0, weight, 1.0)

  def to_sum(total):
    # A narrow mean goes over the wire as this device's share of the global mean.
    return (share * total.astype(jnp.float32)) if is_narrow(total.dtype) else total

  leaves, treedef = jax.tree.flatten(acc.total)
  leaf_kinds = per_leaf(kinds, acc.total)
  sums = [None if is_statistic(k) else to_sum(x) for x, k in zip(leaves, leaf_kinds)]
  summed, count, num_skipped = jax.lax.psum((sums, acc.count, acc.num_skipped), axis_name)
  if any(is_statistic(k) for k in leaf_kinds):
    statistics = merge_statistics(
        [x if is_statistic(k) else None for x, k in zip(leaves, leaf_kinds)], leaf_kinds,
        acc.weight > 0, axis_name,
    )
    summed = [s if x is None else x for x, s in zip(statistics, summed)]
  total = [new.astype(old.dtype) for new, old in zip(summed, leaves)]
  return Accumulator(jax.tree.unflatten(treedef, total), weight, count, num_skipped)
