"""The inner optimizer's state as :func:`accum_jax.accumulate`'s state keeps it.

With ``layout="packed"``, in buckets (:mod:`._layout`): AdamW's two moments per
parameter become a few vectors, which a call that only adds passes through
untouched; the call that applies a window unpacks them, runs the inner optimizer
on the tree they make, and packs the result (:func:`repack`). The inner optimizer
sees its own tree: packing changes no arithmetic. With ``layout="tree"``, the tree
itself, each parameter-shaped leaf placed like its parameter (:func:`sharded_like`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from accum_jax import _core
from accum_jax._across_calls import _layout


def stored(inner_state: Any, params: Any, *, packed: bool) -> Any:
  """The inner state as the state keeps it: in buckets (:class:`_layout.Packed`), or
  as its tree with each parameter-shaped leaf placed like its parameter."""
  if packed:
    return _layout.plan(inner_state).pack(inner_state)
  return sharded_like(inner_state, params)


def repack(packed: _layout.Packed, tree: Any) -> _layout.Packed:
  """``tree``'s leaves (as many as ``packed``'s, each cast to the dtype init made) in
  ``packed``'s buckets, so that the state keeps one structure across calls."""
  leaves = jax.tree.leaves(tree)
  slots = packed.layout.slots
  if len(leaves) != len(slots) or tuple(map(jnp.shape, leaves)) != packed.layout.shapes:
    raise ValueError(
        "The inner optimizer's update returned a state whose leaves differ from the ones"
        f" its init made ({len(leaves)} leaves where init made {len(slots)}, or other"
        " shapes), which layout='packed' cannot keep in its buckets: pass layout='tree' to"
        " accumulate.")
  kept = iter(jax.tree.leaves(packed.skeleton))
  cast = []
  for x, s in zip(leaves, slots):
    if s is not None:
      cast.append(jax.lax.convert_element_type(x, s.dtype))
      continue
    old = next(kept)  # a weakly typed leaf stays as the update made it
    weak = getattr(jax.typeof(old), "weak_type", False)
    cast.append(x if weak else jax.lax.convert_element_type(x, jnp.result_type(old)))
  return packed.layout.pack(cast, like=packed)


def sharded_like(tree: Any, params: Any) -> Any:
  """``tree`` with each parameter-shaped leaf sharded like its parameter.

  An optimizer's ``init`` makes its moments with ``jnp.zeros_like``; under
  ``jax.jit`` with automatic sharding such zeros have no sharding of their own and
  come out replicated: Adam's moments of FSDP-sharded parameters would cost every
  device the whole model. A leaf belongs to a parameter when its key path ends
  with the parameter's and it has the parameter's shape (the rule of
  :func:`accum_jax.checkpoint.abstract_state`); it gets the parameter's sharding: placed
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
    if _core.explicitly_sharded(p):  # the type carries the sharding
      if jax.typeof(leaf).sharding == jax.typeof(p).sharding:
        return leaf
      return jax.sharding.reshard(leaf, jax.typeof(p).sharding)
    return leaf + _core.zeros_like(p, jnp.result_type(leaf))

  return jax.tree.map_with_path(shard, tree)
