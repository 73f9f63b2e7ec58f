"""The statistics leaves of an accumulator: "max" and "last", not weighted sums.

A "max" or "last" leaf (such as Flax's FP8 amax histories, whose "gradient" is
their new value) keeps the raw values of the kept pytrees, unweighted, in the
leaf's own dtype: the elementwise maximum or the last one::

  total = x                     if nothing was kept before
  total = max(total, x)         "max"
  total = x                     "last"

:func:`merge_statistics` combines them across devices (the maximum, or the last
device's that kept any), and the result is 0 where nothing was kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def is_statistic(kind: str) -> bool:
  """Whether a leaf of ``kind`` keeps raw values ("max", "last"), not weighted sums."""
  return kind in ("max", "last")


def add_statistic(
    kind: str, total: jax.Array, x: jax.Array, keep: jax.Array, first: jax.Array
) -> jax.Array:
  """A "max" or "last" leaf with ``x`` added where ``keep``; ``first``: nothing kept yet.

  No sentinel: an empty leaf holds zeros, which ``first`` replaces, so that the
  accumulator stays finite and the maximum of negative values is right.
  """
  x = x.astype(total.dtype)
  if kind == "max":
    x = jnp.where(first, x, jnp.maximum(total, x))
  return jnp.where(keep, x, total)


def statistic_result(total: jax.Array, dtype: Any, weight: jax.Array) -> jax.Array:
  """A "max" or "last" leaf's result in ``dtype``: 0 where nothing was kept (``weight`` 0)."""
  return jnp.where(weight > 0, total, jnp.zeros((), total.dtype)).astype(dtype)


def _lowest(dtype: Any) -> Any:
  if jnp.issubdtype(dtype, jnp.floating):
    return -jnp.inf
  return jnp.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.integer) else False


def merge_statistics(
    leaves: Sequence[jax.Array | None], kinds: Sequence[str], have: jax.Array, axis_name: Any
) -> list[jax.Array | None]:
  """The "max" and "last" leaves of all devices along ``axis_name``, on each device.

  Inside ``jax.shard_map``, after each device's loop. ``"max"``: the maximum over
  the devices that kept anything (``have``, this device's kept weight > 0);
  ``"last"``: the value of the last such device in device order, which is batch
  order. One ``pmax`` of the maxima, and for the last leaves one ``pmax`` of an
  index and one ``psum`` (the other devices contribute zeros). Entries that are
  None or of another kind come back None.
  """
  # A device that kept nothing offers the lowest value, which any kept one beats.
  maxima = [
      None if x is None or k != "max"
      else jnp.where(have, x, jnp.asarray(_lowest(x.dtype), x.dtype))
      for x, k in zip(leaves, kinds)
  ]
  out: list[jax.Array | None] = list(jax.lax.pmax(maxima, axis_name))
  if "last" not in kinds:
    return out
  index = jax.lax.axis_index(axis_name)
  last_device = jax.lax.pmax(jnp.where(have, index, -1), axis_name)

  def own(x):  # bools cannot be summed: they travel as int32
    x = jnp.where(index == last_device, x, jnp.zeros_like(x))
    return x.astype(jnp.int32) if x.dtype == bool else x

  lasts = jax.lax.psum(
      [None if x is None or k != "last" else own(x) for x, k in zip(leaves, kinds)], axis_name
  )
  return [
      last.astype(x.dtype) if last is not None and x is not None else m
      for x, m, last in zip(leaves, out, lasts)
  ]
