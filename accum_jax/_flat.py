"""The flat layout of :func:`accum_jax.accumulate`'s accumulator: a buffer per dtype.

On a GPU every kernel costs 10-15 us whatever its size, so with many small leaves
a call that only accumulates pays per leaf, not per byte: an add and a finiteness
reduction for each of a GPT-2's 148 leaves. The flat layout keeps the window's sum
as one vector per accumulator dtype and combination kind (a *group*): a call
ravels its gradient leaves into those vectors (one concatenation, fused with the
add) and checks them (one reduction per group), whatever the number of leaves.
The inner optimizer still sees the gradient's own tree: the emitting call slices
the vectors back into leaves.

A :class:`Flat` is a pytree whose children are the group vectors and whose static
part, a :class:`FlatLayout`, says where each leaf lies; a state holding one
checkpoints and restores like any other, and the same parameters always give the
same layout. A vector cannot be sharded like the parameters it packs, so the
layout refuses parameters sharded over a mesh axis.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from accum_jax import _core

LAYOUTS = ("tree", "flat")


class FlatLayout(NamedTuple):
  """Where each leaf of a pytree lies in the group vectors (static, hashable)."""

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]  # per leaf
  groups: tuple[int, ...]  # per leaf: the index of its group
  offsets: tuple[int, ...]  # per leaf: where it starts in its group's vector
  group_dtypes: tuple[Any, ...]  # per group: the accumulator dtype
  group_kinds: tuple[str, ...]  # per group: "mean" or "sum"
  group_sizes: tuple[int, ...]  # per group: the vector's length


@jax.tree_util.register_pytree_node_class
class Flat:
  """The group vectors of a flattened pytree; :attr:`layout` unflattens them."""

  def __init__(self, vectors: tuple[Any, ...], layout: FlatLayout):
    self.vectors = tuple(vectors)
    self.layout = layout

  def tree_flatten(self):
    return self.vectors, self.layout

  @classmethod
  def tree_unflatten(cls, layout: FlatLayout, vectors: Any) -> Flat:
    return cls(tuple(vectors), layout)

  def __repr__(self) -> str:
    return f"Flat({', '.join(f'{jnp.shape(v)}' for v in self.vectors)})"


def check_layout(layout: Any) -> str:
  """``layout`` as given, if it is one of :data:`LAYOUTS`."""
  if layout not in LAYOUTS:
    raise ValueError(
        f"layout={layout!r} is not one of {LAYOUTS}: 'tree' keeps the accumulator as the"
        " gradient's tree (any sharding), 'flat' as one vector per dtype (fewer kernels"
        " per call on a GPU, for unsharded parameters)."
    )
  return layout


def make_layout(tree: Any, accumulator_dtype: Any, kinds: tuple[str, ...]) -> FlatLayout:
  """The layout of ``tree``'s leaves: grouped by accumulator dtype and kind, in order.

  Raises:
    ValueError: a leaf combines as a statistic ("max", "last"), which a sum of
      vectors cannot hold, or a leaf is sharded over a mesh axis.
  """
  paths_leaves, treedef = jax.tree.flatten_with_path(tree)
  keys: list[tuple[Any, str]] = []
  groups, offsets, shapes = [], [], []
  sizes: list[int] = []
  for (path, leaf), kind in zip(paths_leaves, kinds):
    _check_leaf(jax.tree_util.keystr(path), leaf, kind)
    key = (_core.accumulator_dtype_for(jnp.result_type(leaf), accumulator_dtype), kind)
    if key not in keys:
      keys.append(key)
      sizes.append(0)
    group = keys.index(key)
    groups.append(group)
    offsets.append(sizes[group])
    shapes.append(tuple(jnp.shape(leaf)))
    sizes[group] += math.prod(jnp.shape(leaf))
  return FlatLayout(
      treedef, tuple(shapes), tuple(groups), tuple(offsets),
      tuple(dtype for dtype, _ in keys), tuple(kind for _, kind in keys), tuple(sizes),
  )


def _check_leaf(where: str, leaf: Any, kind: str) -> None:
  if _core.is_statistic(kind):
    raise ValueError(
        f"layout='flat' cannot hold the leaf at {where or 'the root'}, which combines by"
        f" {kind!r} (a statistic such as an FP8 amax history, not a sum). Use"
        " layout='tree' (the default) for gradients with statistics."
    )
  if _core.is_sharded(leaf):
    raise ValueError(
        f"layout='flat' cannot hold the leaf at {where or 'the root'}: it is sharded"
        f" ({_sharding_of(leaf)}), and one vector per dtype cannot be sharded like the"
        " parameters it packs. Use layout='tree' (the default) for parameters sharded over"
        " a mesh axis; its accumulator is sharded like them."
    )


def _sharding_of(leaf: Any) -> Any:
  if isinstance(leaf, jax.core.Tracer):
    return jax.typeof(leaf).sharding
  return getattr(leaf, "sharding", None)


def checked_layout(layout: FlatLayout, grads: Any, kinds: tuple[str, ...]) -> FlatLayout:
  """``layout``, once ``grads`` (one call's) are known to fit it: unsharded, and
  combining as when the state was made."""
  for (path, leaf), kind in zip(jax.tree.flatten_with_path(grads)[0], kinds):
    _check_leaf(jax.tree_util.keystr(path), leaf, kind)
  return layout


def zeros(layout: FlatLayout) -> Flat:
  """Zero vectors of ``layout``."""
  return Flat(
      tuple(jnp.zeros((n,), dtype) for n, dtype in zip(layout.group_sizes, layout.group_dtypes)),
      layout,
  )


def pack(layout: FlatLayout, tree: Any) -> Flat:
  """``tree``'s leaves raveled into their groups' vectors, in the groups' dtypes."""
  leaves = jax.tree.leaves(tree)
  vectors = []
  for group, dtype in enumerate(layout.group_dtypes):
    parts = [jnp.ravel(x).astype(dtype) for x, g in zip(leaves, layout.groups) if g == group]
    vectors.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
  return Flat(tuple(vectors), layout)


def unpack(flat: Flat, like: Any = None) -> Any:
  """The pytree ``flat`` packs, each leaf in ``like``'s dtype (None: its group's)."""
  layout = flat.layout
  dtypes = [None] * len(layout.shapes) if like is None else [
      jax.dtypes.canonicalize_dtype(jnp.result_type(x)) for x in jax.tree.leaves(like)]
  leaves = []
  for shape, group, offset, dtype in zip(
      layout.shapes, layout.groups, layout.offsets, dtypes):
    vector = flat.vectors[group]
    size = math.prod(shape)
    leaf = jax.lax.slice_in_dim(vector, offset, offset + size).reshape(shape)
    leaves.append(leaf if dtype is None else leaf.astype(dtype))
  return jax.tree.unflatten(layout.treedef, leaves)
