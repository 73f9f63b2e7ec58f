"""The inner optimizer's state as :func:`accum_jax.accumulate`'s state keeps it.

Placed like the parameters (:func:`sharded_like`), and with ``pack_inner_state``
packed: a pytree kept as one vector per dtype, :class:`Packed`.

Each array passed to a jitted call costs the host its dispatch (about 20 us a
buffer on an H200 machine, 13 us on a 2-core CPU, whatever its size), and an Optax
transformation is handed its whole state on every call. ``accumulate(...,
pack_inner_state=True)`` keeps the inner optimizer's state packed: AdamW's two
moments per parameter become one float32 vector, which a call that only adds
passes through untouched; the call that applies a window unpacks it, runs the
inner optimizer on the tree it made, and packs the result. The inner optimizer
sees its own tree: packing changes no arithmetic.

A leaf that is weakly typed (a Python scalar made an array) is kept as it is:
a vector cannot hold its weak type.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from accum_jax import _core
from accum_jax._across_calls import _update_args


@dataclasses.dataclass(frozen=True)
class _Slot:
  """Where one leaf lives: in vector ``group`` from ``offset``, or loose (group -1)."""

  group: int
  offset: int
  shape: tuple[int, ...]
  dtype: Any


@functools.partial(jax.tree_util.register_dataclass, data_fields=["vectors", "loose"],
                   meta_fields=["treedef", "slots"])
@dataclasses.dataclass(frozen=True)
class Packed:
  """A pytree as one vector per dtype (and its weakly typed leaves as they are).

  Attributes:
    vectors: one 1-D array per dtype, the leaves of that dtype raveled in order.
    loose: the leaves that stay leaves (weakly typed).
    treedef: the tree's structure (static).
    slots: per leaf, where it lives (static).
  """

  vectors: tuple[Any, ...]
  loose: tuple[Any, ...]
  treedef: Any
  slots: tuple[_Slot, ...]

  def unpack(self) -> Any:
    """The tree, each leaf a slice of its vector, reshaped."""
    loose = iter(self.loose)
    leaves = [
        next(loose) if s.group < 0
        else jax.lax.slice(self.vectors[s.group], (s.offset,),
                           (s.offset + math.prod(s.shape),)).reshape(s.shape)
        for s in self.slots
    ]
    return jax.tree.unflatten(self.treedef, leaves)


def pack_tree(tree: Any) -> Packed:
  """``tree`` as a :class:`Packed`: its arrays grouped by dtype, in order."""
  leaves, treedef = jax.tree.flatten(tree)
  groups: dict[Any, list[Any]] = {}
  slots, loose = [], []
  sizes: dict[Any, int] = {}
  for leaf in leaves:
    leaf = jnp.asarray(leaf)
    if getattr(jax.typeof(leaf), "weak_type", False):
      slots.append(_Slot(-1, 0, leaf.shape, leaf.dtype))
      loose.append(leaf)
      continue
    index = list(groups).index(leaf.dtype) if leaf.dtype in groups else len(groups)
    offset = sizes.get(leaf.dtype, 0)
    groups.setdefault(leaf.dtype, []).append(leaf.reshape(-1))
    sizes[leaf.dtype] = offset + leaf.size
    slots.append(_Slot(index, offset, leaf.shape, leaf.dtype))
  vectors = tuple(
      jnp.concatenate(parts) if len(parts) > 1 else parts[0] for parts in groups.values())
  return Packed(vectors, tuple(loose), treedef, tuple(slots))


def repack(packed: Packed, tree: Any) -> Packed:
  """``tree``'s leaves (as many as ``packed``'s, each cast to its slot's dtype) packed
  in ``packed``'s slots and structure, so that the state keeps one structure across
  calls (a framework may wrap the leaves the inner update returns, as
  ``nnx.Optimizer`` does its parameters: the leaves are what count)."""
  leaves = jax.tree.leaves(tree)
  if len(leaves) != len(packed.slots):
    raise ValueError(
        f"The inner optimizer's update returned {len(leaves)} state leaves where its init"
        f" made {len(packed.slots)}, which pack_inner_state=True cannot keep in place:"
        " pass pack_inner_state=False.")
  cast = [jax.lax.convert_element_type(x, s.dtype) if s.group >= 0 else x
          for x, s in zip(leaves, packed.slots)]
  new = pack_tree(jax.tree.unflatten(packed.treedef, cast))
  if new.slots != packed.slots:
    raise ValueError(
        "The inner optimizer's update changed its state's leaves (their shapes or weak"
        " types), which pack_inner_state=True cannot keep in place: pass"
        " pack_inner_state=False.")
  return new


def stored(inner_state: Any, params: Any, *, pack: bool) -> Any:
  """The inner state as the state keeps it: packed with ``pack_inner_state``."""
  if not pack:
    return inner_state
  _update_args.check_packable(params)
  return pack_tree(inner_state)


def tree_of(stored: Any) -> Any:
  """The inner optimizer's own tree of a stored inner state."""
  return stored.unpack() if isinstance(stored, Packed) else stored


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
