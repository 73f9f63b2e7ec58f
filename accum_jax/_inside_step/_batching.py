"""Batches and microbatches: sizes, padding, splitting, and back to batch order.

A batch argument is a pytree whose leaves share a leading batch axis of size
``B``. :func:`split` turns each leaf into ``(N, B / N, ...)`` for a
``lax.scan``; :func:`unsplit` is its inverse, for per-example outputs that must
come back as ``(B, ...)`` in the batch's own row order.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp

Split = Literal["contiguous", "strided"]
SPLITS: tuple[str, ...] = ("contiguous", "strided")


def batch_size(batch_args: dict[int, Any]) -> int:
  """The common leading size of every leaf of ``batch_args`` (argument number -> pytree)."""
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
        " leaf of a batch argument must have the same batch size along axis 0; name"
        " the batch arguments with batch_argnums=."
    )
  return next(iter(sizes.values()))


def divisors(n: int) -> list[int]:
  """The divisors of ``n``, ascending: the numbers of microbatches a batch of n allows."""
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted({*small, *(n // d for d in small)})


def check_divisible(size: int, num_microbatches: int, num_shards: int = 1) -> None:
  """Raises a ValueError saying how to fix a batch that does not split evenly."""
  parts = num_microbatches * num_shards
  if size % parts == 0:
    return
  if size % num_shards:
    raise ValueError(
        f"A batch of {size} does not split over the {num_shards} devices of the data"
        f" axis. Pad it to a multiple of {parts} (num_microbatches={num_microbatches} x"
        f" {num_shards} devices) with rows that count for nothing (zero weight, or masked)."
    )
  where = "" if num_shards == 1 else f" on each of {num_shards} devices"
  choices = divisors(size // num_shards)
  raise ValueError(
      f"A batch of {size} does not split into num_microbatches={num_microbatches}"
      f"{where}. Pad it to a multiple of {parts} with rows that count for nothing (zero"
      f" weight, or masked), or choose num_microbatches among {choices}."
  )


def split(x: jax.Array, num_microbatches: int, how: Split) -> jax.Array:
  """``x`` of shape ``(B, ...)`` as ``(num_microbatches, B / num_microbatches, ...)``."""
  size = x.shape[0] // num_microbatches
  if how == "contiguous":  # microbatch i: rows i * size, ..., (i + 1) * size - 1
    return x.reshape(num_microbatches, size, *x.shape[1:])
  # microbatch i: rows i, i + N, i + 2N, ...; with the batch sharded over devices,
  # every microbatch then has rows on every device.
  return jnp.swapaxes(x.reshape(size, num_microbatches, *x.shape[1:]), 0, 1)


def unsplit(x: jax.Array, how: Split) -> jax.Array:
  """The inverse of :func:`split`: ``(N, B / N, ...)`` back to ``(B, ...)`` in row order."""
  if how == "strided":
    x = jnp.swapaxes(x, 0, 1)
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
