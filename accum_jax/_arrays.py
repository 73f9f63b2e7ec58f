"""Arrays as the accumulation core sees them: accumulator dtypes, placement, finiteness.

The accumulator dtype of a leaf is the promotion of ``accumulator_dtype`` and the
leaf's dtype (:func:`accumulator_dtype_for`); one narrower than float32
(:func:`is_narrow`) holds a running mean instead of a sum (see ``_core``). Zeros
keep the sharding of what they are made like (:func:`zeros_like`), and a value
counts as sharded only where its placement or its type says so (:func:`is_sharded`).
Whether a tree holds NaN or Inf is one reduction per leaf (:func:`all_finite`), or
per dtype for the small leaves (:func:`all_finite_packed`).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp


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


def accumulator_dtype_for(leaf_dtype: Any, accumulator_dtype: Any) -> jnp.dtype:
  """The accumulator dtype of one leaf: the promotion of both (None: the leaf's).

  float32 with bfloat16 gives float32, with complex64 complex64 (a real
  accumulator would drop the imaginary part), with float64 float64.
  """
  leaf_dtype = jnp.dtype(leaf_dtype)
  if accumulator_dtype is None:
    return leaf_dtype
  return jnp.promote_types(accumulator_dtype, leaf_dtype)


def is_narrow(dtype: Any) -> bool:
  """Whether ``dtype`` is a float narrower than float32 (float16, bfloat16, fp8)."""
  dtype = jnp.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def zeros_like(x: Any, dtype: Any = None) -> jax.Array:
  """Zeros with the shape and sharding of ``x``, in ``dtype`` (default ``x``'s).

  ``x`` may be an array, a tracer or a ``jax.ShapeDtypeStruct``. Under
  ``jax.jit`` a constant zero has no sharding of its own and comes out
  replicated; the zeros made here keep ``x``'s:

  - with explicit sharding (the array type carries its sharding), the zeros are
    made with that sharding;
  - with automatic sharding, the zeros are an expression of ``x``, whose sharding
    they inherit by propagation (not ``x * 0``, which is NaN where ``x`` is not
    finite);
  - a ``ShapeDtypeStruct`` with a ``NamedSharding`` gives zeros with it.

  Args:
    x: an array, tracer or ``jax.ShapeDtypeStruct``.
    dtype: the dtype of the zeros; None keeps ``x``'s.

  Returns:
    An array of zeros shaped like ``x``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from accum_jax import _core
    >>> _core.zeros_like(jnp.ones((2, 3)), jnp.bfloat16).dtype
    dtype(bfloat16)
  """
  # JAX's own dtype: a numpy float64 leaf gives float32 zeros (unless x64 is on),
  # as it would once traced, without a warning that float64 was asked for.
  dtype = jax.dtypes.canonicalize_dtype(x.dtype if dtype is None else dtype)
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else None
    return jnp.zeros(x.shape, dtype, out_sharding=sharding)
  if isinstance(x, jax.core.Tracer):
    if explicitly_sharded(x):
      # The type carries the sharding, and zeros_like keeps the type's.
      return jnp.zeros_like(x, dtype)
    return jnp.zeros_like(x, dtype) * jnp.isnan(x).astype(dtype)
  return jnp.zeros_like(x, dtype=dtype)


def loop_zeros(x: Any, dtype: Any = None) -> jax.Array:
  """Zeros shaped like ``x`` as a loop's initial carry, in ``dtype`` (default ``x``'s).

  A constant, as a hand-written scan's zeros are, wherever nothing needs placing:
  ``x`` on one device, explicitly sharded (the type's sharding is kept), or inside
  ``shard_map`` over every axis of its mesh. There :func:`zeros_like`'s expression
  of ``x`` would be a buffer of its own beside the loop's (on GPT-2 small's tree in
  bfloat16, the step needed 1.62x the hand-written scan's memory beyond its
  arguments with it, 0.99x without; ``bench/bench_step_memory.py``). Where ``x``
  lives on a mesh with an automatic axis of several devices, whose placement the
  trace cannot see, the expression places the carry as ``x`` is placed
  (``DataParallel(split="strided")`` without a mesh: 26.9 MiB a device at 8,
  against 30.7 with constant zeros).
  """
  dtype = jax.dtypes.canonicalize_dtype(x.dtype if dtype is None else dtype)
  if isinstance(x, jax.core.Tracer) and not explicitly_sharded(x):
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    for size, kind in zip(getattr(mesh, "axis_sizes", ()), getattr(mesh, "axis_types", ())):
      if size > 1 and kind == jax.sharding.AxisType.Auto:
        return zeros_like(x, dtype)
  return jnp.zeros_like(x, dtype)


def explicitly_sharded(x: Any) -> bool:
  """Whether the type of ``x`` (an array or a tracer) carries an explicit sharding
  over a mesh axis; under automatic sharding a tracer's type says nothing."""
  spec = getattr(jax.typeof(x).sharding, "spec", ())
  return any(map(functools.partial(operator.is_not, None), spec))


def is_sharded(x: Any) -> bool:
  """Whether ``x`` is known to be split over devices: an array placed so, or a
  traced value whose type carries an explicit sharding over a mesh axis (under
  automatic sharding a tracer says nothing, and counts as not sharded)."""
  if isinstance(x, jax.core.Tracer):
    return explicitly_sharded(x)
  sharding = getattr(x, "sharding", None)
  return isinstance(x, jax.Array) and sharding is not None and not sharding.is_fully_replicated


def all_finite(tree: Any) -> jax.Array:
  """True iff every floating leaf of ``tree`` is free of NaN and Inf; shape=().

  ``sum(x - x) == 0``: a finite value minus itself is an exact zero, while NaN
  and Inf give NaN, which every sum keeps, so no sum of large finite values can
  overflow into a false alarm. One fused pass per leaf that reads it once and
  writes nothing (``x * 0`` would have XLA multiply by an array of zeros it
  materialises; ``all(isfinite(x))`` writes a boolean array and reduces it,
  three times slower on CPU), and no conditional: on a GPU one would make the
  host wait.
  """
  zeros = []
  for x in jax.tree.leaves(tree):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      zeros.append(jnp.sum(x - x, dtype=jnp.promote_types(x.dtype, jnp.float32)))
  if not zeros:
    return jnp.array(True)
  return functools.reduce(jnp.add, zeros) == 0


# Leaves of at most this many elements are packed into one vector per dtype for
# the finiteness check; larger ones are checked where they lie.
PACK_LIMIT = 1 << 16


def all_finite_packed(tree: Any, limit: int = PACK_LIMIT) -> jax.Array:
  """:func:`all_finite` with the small leaves checked together: one reduction per dtype.

  The leaves of each dtype of at most ``limit`` elements (:data:`PACK_LIMIT` by
  default), and not sharded, are raveled into one vector, then checked as
  :func:`all_finite` checks a leaf. For a call that only accumulates, a
  reduction per leaf is most of the cost with many small leaves (a kernel each
  on a GPU, several fusions each where XLA:CPU splits a reduction); the
  concatenation is one more pass over them. A large leaf's reduction costs its
  bytes, not its launch, and a sharded one is checked where it lies: packing it
  would gather it.
  """
  groups: dict[Any, list[jax.Array]] = {}
  alone: list[jax.Array] = []
  for x in jax.tree.leaves(tree):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      continue
    if x.size <= limit and not is_sharded(x):
      groups.setdefault(x.dtype, []).append(jnp.ravel(x))
    else:
      alone.append(x)
  vectors = [parts[0] if len(parts) == 1 else jnp.concatenate(parts) for parts in groups.values()]
  return all_finite(vectors + alone)
