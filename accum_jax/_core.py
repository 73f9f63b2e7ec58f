"""The accumulation core: weighted sums in a wide dtype, non-finite skip.

Both front doors, :func:`accum_jax.accumulate` (across calls) and
:func:`accum_jax.value_and_grad` (inside one step), keep an :class:`Accumulator`
and use the functions below (init, add, result, empty). The algorithm, for microbatch gradients
``g_i`` with weights ``w_i``::

  total, weight = 0, 0                     # total in accumulator_dtype
  for g, w in microbatches:
    if w < 0 or w > 0 and not all_finite(g):  # skipped, counted, never added
      num_skipped += 1
      continue
    count += 1
    if w > 0:
      total += w * g                       # product in float32, sum in accumulator_dtype
      weight += w
  mean = total / weight  (0 where weight == 0), cast back to g's dtype

A zero weight adds nothing, even where its gradient is NaN: padding microbatches
cannot poison the sum.
"""

from __future__ import annotations

import operator
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

Reduction = Literal["mean", "sum"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum")


class Accumulator(NamedTuple):
  """A running weighted sum of pytrees.

  Attributes:
    total: ``sum(w_i * x_i)`` over the added pytrees, leaves in the accumulator
      dtype.
    weight: ``sum(w_i)``; shape=(), dtype=float32.
    count: number of pytrees offered and not skipped, zero weights included;
      shape=(), dtype=int32.
    num_skipped: number of non-finite pytrees refused, never reset by
      :func:`reset`; shape=(), dtype=int32.
  """

  total: Any
  weight: jax.Array
  count: jax.Array
  num_skipped: jax.Array


def positive_int(value: Any) -> int | None:
  """``value`` as an int if it is a Python, NumPy or concrete JAX integer >= 1."""
  if isinstance(value, bool):
    return None
  try:
    number = operator.index(value)
  except TypeError:
    return None
  return number if number >= 1 else None


def canonicalize_accumulator_dtype(accumulator_dtype: Any) -> jnp.dtype | None:
  """Checks ``accumulator_dtype``: None (the parameters' dtype) or a float."""
  if accumulator_dtype is None:
    return None
  try:
    dtype = jnp.dtype(accumulator_dtype)
  except TypeError as e:
    raise ValueError(
        f"accumulator_dtype={accumulator_dtype!r} is not a dtype. Pass a floating"
        " dtype such as jnp.float32, or None to accumulate in the parameters'"
        " dtype."
    ) from e
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(
        f"accumulator_dtype={dtype} is not a floating dtype: an integer"
        " accumulator would truncate every gradient. Pass jnp.float32 (the"
        " default), or None to accumulate in the parameters' dtype."
    )
  return dtype


def _zeros_like(x: jax.Array, dtype: Any) -> jax.Array:
  dtype = x.dtype if dtype is None else dtype
  if isinstance(x, jax.core.Tracer):
    # Under jit a constant zero has no sharding of its own and comes out
    # replicated; an expression of `x` inherits x's sharding by propagation.
    # (Not `x * 0`, which is NaN where x is not finite.)
    return jnp.zeros_like(x, dtype) * jnp.isnan(x).astype(dtype)
  return jnp.zeros_like(x, dtype=dtype)


def init(tree: Any, accumulator_dtype: Any = jnp.float32) -> Accumulator:
  """An empty accumulator shaped like ``tree``, keeping its leaves' sharding."""
  return Accumulator(
      total=jax.tree.map(lambda x: _zeros_like(x, accumulator_dtype), tree),
      weight=jnp.zeros((), jnp.float32),
      count=jnp.zeros((), jnp.int32),
      num_skipped=jnp.zeros((), jnp.int32),
  )


def all_finite(tree: Any) -> jax.Array:
  """True iff every leaf of ``tree`` is free of NaN and Inf; shape=()."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def add(
    acc: Accumulator,
    tree: Any,
    weight: jax.typing.ArrayLike | None = None,
    *,
    skip_nonfinite: bool = True,
    accept: jax.typing.ArrayLike = True,
) -> tuple[Accumulator, jax.Array]:
  """Adds ``weight * tree`` to ``acc``, unless it is non-finite.

  Args:
    acc: the accumulator.
    tree: a pytree with the structure of ``acc.total``.
    weight: a non-negative scalar; None counts as 1. A negative or non-finite
      weight is skipped and counted like a non-finite ``tree``.
    skip_nonfinite: refuse (and count) a ``tree`` holding NaN or Inf. When
      False, it is added as it is.
    accept: a further condition (a bool scalar); where False, ``tree`` is
      skipped and counted like a non-finite one.

  Returns:
    The new accumulator, and whether ``tree`` was added (a bool scalar).
  """
  w = jnp.ones((), jnp.float32) if weight is None else jnp.asarray(weight, jnp.float32)
  has_weight = w > 0
  # A negative or non-finite weight is bad data, refused like a NaN gradient.
  ok = jnp.asarray(accept, bool) & jnp.isfinite(w) & (w >= 0)
  if skip_nonfinite:
    ok = ok & (all_finite(tree) | ~has_weight)
  keep = has_weight & ok
  skipped = ~ok

  def add_leaf(total, x):
    # The product in float32 at least: a large weight must not overflow a
    # float16 accumulator, nor round in a bfloat16 one. `where`, not a product
    # with `keep`: 0 * NaN is NaN.
    product = w.astype(jnp.promote_types(total.dtype, jnp.float32)) * x
    return jnp.where(keep, total + product.astype(total.dtype), total)

  return (
      Accumulator(
          total=jax.tree.map(add_leaf, acc.total, tree),
          weight=acc.weight + jnp.where(keep, w, 0.0),
          count=acc.count + (~skipped).astype(jnp.int32),
          num_skipped=acc.num_skipped + skipped.astype(jnp.int32),
      ),
      keep,
  )


def result(acc: Accumulator, like: Any, reduction: Reduction = "mean") -> Any:
  """The accumulated pytree, normalised, in the dtypes of ``like``.

  Args:
    acc: the accumulator.
    like: a pytree (of arrays or shape-dtype structs) with the target dtypes.
    reduction: ``"mean"`` divides by the total weight (zeros when it is 0);
      ``"sum"`` returns the weighted sum.

  Returns:
    A pytree with the structure of ``acc.total`` and the dtypes of ``like``.
  """
  divisor = jnp.where(acc.weight > 0, acc.weight, 1.0) if reduction == "mean" else None

  def finish(total, x):
    normalised = total if divisor is None else total / divisor.astype(total.dtype)
    return normalised.astype(x.dtype)

  return jax.tree.map(finish, acc.total, like)


def empty(acc: Accumulator) -> Accumulator:
  """An empty accumulator with the same structure, dtypes and skip count."""
  return Accumulator(
      total=jax.tree.map(jnp.zeros_like, acc.total),
      weight=jnp.zeros_like(acc.weight),
      count=jnp.zeros_like(acc.count),
      num_skipped=acc.num_skipped,
  )
