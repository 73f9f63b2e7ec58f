"""How :func:`accum_jax.accumulate`'s state keeps a tree: in a few vectors, or leaf by leaf.

Each array a jitted call passes in or out costs the host its dispatch, whatever
its size (about 20 us a buffer on an H200 machine, 3 us on a 2-core CPU, 30 us a
Variable under ``nnx.jit``), and an Optax transformation is handed its whole state
on every call. With ``layout="packed"`` the accumulator and the inner optimizer's
state are kept as a few 1-D vectors, *buckets*, planned once from the tree::

  for each kind of leaf (its dtype, and how it combines), in the tree's order:
    the window's sum: one bucket (of at most MAX_BUCKET elements)
    the inner state: FUSED_LEAVES parts to a bucket, a part being a leaf of more
      than SMALL_LEAF bytes, or a run of smaller leaves of at most SMALL_BUCKET bytes

The window's sum is added into leaf by leaf (:meth:`Packed.added`): each leaf's
slice of its bucket is read, added to and written back with a
``dynamic_update_slice`` at the same offset, which XLA performs in place in the
donated bucket, so a bucket can hold every leaf of its kind. The offsets are
hidden from XLA's simplifier: with constant ones it turns the read into a static
slice, which no longer matches the write, and each write then copies the whole
bucket.

The inner state is written whole by the inner optimizer's update and put back with
a concatenate of its parts, read with slices, which XLA fuses into their readers.
XLA:CPU fuses a concatenate of at most eight operands into what computes them
(``kMaxConcatenateArguments`` in its instruction fusion), so a bucket of at most
eight parts is written in place, with no copy of the state; a longer concatenate
is materialized first. So a run of small leaves is concatenated on its own, a
temporary of at most ``SMALL_BUCKET`` bytes, behind an ``optimization_barrier``
(else XLA's simplifier flattens it into its bucket's concatenate), and counts as
one part. (A ``dynamic_update_slice`` per leaf is no way out there: the update
reads the old state before the writes, and each write copies the bucket.)

``layout="tree"`` keeps every leaf as a buffer of its own, with its shape and
sharding: the layout for parameters sharded over devices, whose state a vector
could not shard like them.

A :class:`Packed` is the pytree that holds the buckets and, as static data, the
:class:`Layout` that says where each leaf of the tree lies; its
:meth:`Packed.unpack` gives the tree back. Scalars (an optimizer's step count, its
hyperparameters) and weakly typed leaves (a Python scalar made an array: a vector
cannot hold a weak type) stay where they are, in the tree's own containers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import sys
from typing import Any

import jax
import jax.numpy as jnp

FUSED_LEAVES = 8
SMALL_LEAF = 1 << 16  # bytes
SMALL_BUCKET = 1 << 20  # bytes
MAX_BUCKET = (1 << 31) - 1  # elements: a bucket's offsets are int32


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where one leaf lies: in bucket ``bucket`` from ``offset``, in the bucket's part
  ``part`` (the leaves of a part are concatenated first, see the module docstring)."""

  bucket: int
  offset: int
  shape: tuple[int, ...]
  dtype: Any
  part: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """The buckets of a tree: per leaf its :class:`Slot` (None: the leaf is kept as it
  is), the elements per bucket, and the tree's structure.

  Static data of every state that holds it, compared and hashed on every jitted call:
  its hash is computed once, and a layout equals itself at once.
  """

  treedef: Any  # the tree's structure (NNX Variables unwrapped)
  slots: tuple[Slot | None, ...]  # per leaf of the tree
  sizes: tuple[int, ...]  # elements per bucket
  shapes: tuple[tuple[int, ...], ...]  # per leaf of the tree
  keys: tuple[Any, ...]  # per leaf of the Packed (its buckets', then its kept leaves'): plan's
  wrapped: Any  # treedef's, with the tree's NNX Variables (as plain jax.jit over them sees it)

  def __post_init__(self):
    fields = (self.treedef, self.slots, self.sizes, self.shapes, self.keys, self.wrapped)
    object.__setattr__(self, "_fields", fields)
    object.__setattr__(self, "_hash", hash(fields))

  def __hash__(self) -> int:
    return self._hash  # type: ignore[attr-defined]

  def __eq__(self, other: Any) -> bool:
    return self is other or (isinstance(other, Layout) and self._hash == other._hash  # type: ignore[attr-defined]
                             and self._fields == other._fields)  # type: ignore[attr-defined]

  def pack(self, tree: Any, like: Packed | None = None) -> Packed:
    """``tree`` (of this layout's leaves, in any container) as a :class:`Packed`;
    ``like``: a Packed of this layout, whose skeleton the kept leaves take (no
    pruning on each call)."""
    parts: dict[int, dict[int, list[Any]]] = {}  # bucket -> part -> its leaves, raveled
    skeleton = []  # each leaf kept, or None
    kept = []
    for leaf, slot in zip(jax.tree.leaves(tree), self.slots):
      if slot is None:
        skeleton.append(leaf)
        kept.append(leaf)
      else:
        parts.setdefault(slot.bucket, {}).setdefault(slot.part, []).append(jnp.ravel(leaf))
        skeleton.append(None)
    vectors = []
    for bucket in range(len(self.sizes)):
      runs = parts[bucket]
      if len(runs) == 1:
        vectors.append(jnp.concatenate(runs[0]) if len(runs[0]) > 1 else runs[0][0])
      else:  # each part in order, one of several leaves concatenated first (module docstring)
        vectors.append(jnp.concatenate(list(map(_part, map(runs.__getitem__, range(len(runs)))))))
    if like is not None:
      return Packed(tuple(vectors), jax.tree.unflatten(
          jax.tree.structure(like.skeleton), kept), self)
    return Packed(tuple(vectors), _pruned(jax.tree.unflatten(self.treedef, skeleton)), self)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["vectors", "skeleton"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class Packed:
  """A tree kept as buckets.

  Attributes:
    vectors: the buckets, one 1-D array each.
    skeleton: the tree itself, each subtree of bucketed leaves replaced by None:
      the leaves kept as they are (scalars, weakly typed leaves), and the containers
      on the way to them, stay where they were, so that ``optax.tree.get`` finds an
      inner optimizer's ``count`` or hyperparameters.
    layout: the :class:`Layout` (static).
  """

  vectors: tuple[Any, ...]
  skeleton: Any
  layout: Layout

  def unpack(self, treedef: Any = None, wrapped: bool = False) -> Any:
    """The tree (of ``treedef``, default the skeleton's: with the NNX Variables the
    planned tree had if ``wrapped``), each bucketed leaf a slice of its bucket."""
    kept = iter(jax.tree.leaves(self.skeleton))  # None is no leaf
    leaves = []
    for slot in self.layout.slots:
      leaves.append(next(kept) if slot is None else _leaf(self.vectors[slot.bucket], slot))
    if treedef is None:
      treedef = self.layout.wrapped if wrapped else self.layout.treedef
    return jax.tree.unflatten(treedef, leaves)

  def added(self, fun: Any, tree: Any) -> Packed:
    """``fun(old, new, key)`` of each leaf and its leaf of ``tree``, written in place.

    ``fun`` is elementwise (the accumulator's add); it gets each bucketed leaf's
    slice of its bucket, raveled, with the leaf of ``tree`` raveled, and writes its
    result back where it was read: a ``dynamic_update_slice`` per leaf, each at the
    offset it read from (see the module docstring), so that the donated bucket is
    updated in place with no concatenate of ``tree``.
    """
    layout = self.layout
    buckets = len(layout.sizes)
    starts = []
    for slot in layout.slots:
      starts.append(0 if slot is None else slot.offset)
    offsets = jax.lax.optimization_barrier(jnp.asarray(starts, jnp.int32))
    vectors = list(self.vectors)
    old_kept = iter(jax.tree.leaves(self.skeleton))
    kept_keys = iter(layout.keys[buckets:])
    kept = []
    for i, (leaf, slot) in enumerate(zip(jax.tree.leaves(tree), layout.slots)):
      if slot is None:
        kept.append(fun(next(old_kept), leaf, next(kept_keys)))
        continue
      vector, offset = vectors[slot.bucket], offsets[i]
      part = jax.lax.dynamic_slice_in_dim(vector, offset, math.prod(slot.shape))
      new = fun(part, jnp.ravel(leaf), layout.keys[slot.bucket]).astype(vector.dtype)
      vectors[slot.bucket] = jax.lax.dynamic_update_slice_in_dim(vector, new, offset, 0)
    # The skeleton holds the kept leaves alone, in order.
    skeleton = jax.tree.unflatten(jax.tree.structure(self.skeleton), kept)
    return Packed(tuple(vectors), skeleton, layout)


def _part(leaves: list[Any]) -> Any:
  """A part of a bucket of several: a run of leaves concatenated behind a barrier, so
  that XLA's simplifier does not flatten it into the bucket's concatenate."""
  return jax.lax.optimization_barrier(jnp.concatenate(leaves)) if len(leaves) > 1 else leaves[0]


def _leaf(vector: Any, slot: Slot) -> Any:
  """The leaf ``slot`` places in ``vector`` (of states stacked along leading axes, each
  one's: ``vector`` may have leading axes, e.g. after a ``lax.scan``)."""
  vector = jnp.asarray(vector)
  part = jax.lax.slice_in_dim(vector, slot.offset, slot.offset + math.prod(slot.shape), axis=-1)
  return part.reshape(vector.shape[:-1] + slot.shape)


def plan(tree: Any, keys: Any = None, *, added: bool = False) -> Layout:
  """The buckets of ``tree``: its leaves with at least one dimension, grouped by dtype
  (and ``keys``, one per leaf), in order; scalars, weakly typed leaves and PRNG keys
  stay as they are. ``added``: for a tree added into leaf by leaf
  (:meth:`Packed.added`, the window's sum), one bucket per group (of at most
  :data:`MAX_BUCKET` elements); else the inner state's buckets (module docstring).

  NNX Variables are unwrapped first: ``nnx.Optimizer`` hands ``init`` its
  ``nnx.Param`` state and ``update`` plain arrays, so the tree a :class:`Packed`
  gives back is the plain one ``update`` sees.
  """
  wrapped_def = jax.tree.structure(tree)
  leaves, treedef = jax.tree.flatten(unwrapped(tree))
  keys = [None] * len(leaves) if keys is None else list(keys)
  groups: dict[Any, list[int]] = {}  # (dtype, key) -> its leaves, in the tree's order
  for i, (leaf, key) in enumerate(zip(leaves, keys)):
    aval = jax.typeof(leaf)
    # Scalars, weak types and what is not a number (PRNG keys) stay as they are.
    if aval.shape and not aval.weak_type and (
        jnp.issubdtype(aval.dtype, jnp.number) or jnp.issubdtype(aval.dtype, jnp.bool_)):
      groups.setdefault((aval.dtype, key), []).append(i)
  slots: list[Slot | None] = [None] * len(leaves)
  sizes: list[int] = []
  for (dtype, _), members in groups.items():
    elements = [math.prod(jnp.shape(leaves[i])) for i in members]
    buckets = (_added_buckets(members, elements) if added else
               _inner_buckets(members, elements, dtype.itemsize))
    for bucket in buckets:
      offset = 0
      for part, run in enumerate(bucket):
        for i in run:
          shape = tuple(jnp.shape(leaves[i]))
          slots[i] = Slot(len(sizes), offset, shape, dtype, part)
          offset += math.prod(shape)
      sizes.append(offset)
  shapes = tuple(tuple(jnp.shape(x)) for x in leaves)
  return Layout(treedef, tuple(slots), tuple(sizes), shapes,
                tuple(packed_keys(slots, len(sizes), keys)), wrapped_def)


def _added_buckets(members: list[int], elements: list[int]) -> list[list[list[int]]]:
  """A group added into leaf by leaf: its leaves in buckets of at most MAX_BUCKET
  elements, each bucket one part."""
  buckets: list[list[list[int]]] = []
  total = MAX_BUCKET
  for i, n in zip(members, elements):
    if total + n > MAX_BUCKET:
      buckets.append([[]])
      total = 0
    buckets[-1][0].append(i)
    total += n
  return buckets


def _inner_buckets(members: list[int], elements: list[int], itemsize: int
                   ) -> list[list[list[int]]]:
  """A group of the inner state: its parts (each leaf of more than SMALL_LEAF bytes,
  then runs of the smaller ones of at most SMALL_BUCKET bytes), FUSED_LEAVES to a
  bucket."""
  nbytes = [n * itemsize for n in elements]
  parts = [[i] for i, n in zip(members, nbytes) if n > SMALL_LEAF]
  run_bytes = SMALL_BUCKET
  for i, n in zip(members, nbytes):
    if n <= SMALL_LEAF:
      if run_bytes + n > SMALL_BUCKET:
        parts.append([])
        run_bytes = 0
      parts[-1].append(i)
      run_bytes += n
  return [parts[j:j + FUSED_LEAVES] for j in range(0, len(parts), FUSED_LEAVES)]


def packed_keys(slots: Any, buckets: int, keys: Any) -> list[Any]:
  """One of ``keys`` (one per leaf of the tree) per leaf of its :class:`Packed`: each
  bucket's (its leaves share it, see :func:`plan`), then each kept leaf's."""
  out: list[Any] = [None] * buckets
  kept = []
  for slot, key in zip(slots, keys):
    if slot is None:
      kept.append(key)
    else:
      out[slot.bucket] = key
  return out + kept


def packed_with(layout: Layout, vectors: Any, kept: Any) -> Packed:
  """A :class:`Packed` of ``layout`` from its buckets and its kept leaves, in order."""
  kept = iter(kept)
  skeleton = [next(kept) if slot is None else None for slot in layout.slots]
  return Packed(tuple(vectors), _pruned(jax.tree.unflatten(layout.treedef, skeleton)), layout)


def _pruned(tree: Any) -> Any:
  """``tree`` with each subtree that holds no leaf replaced by None: a skeleton keeps
  only the containers on the way to a kept leaf, so that flattening a state on each
  jitted call walks a few nodes, not one per bucketed leaf."""
  if not jax.tree.leaves(tree):
    return None
  children, node = jax.tree.flatten(tree, is_leaf=functools.partial(operator.is_not, tree))
  if jax.tree_util.treedef_is_leaf(node):
    return tree
  return jax.tree.unflatten(node, list(map(_pruned, children)))


def unwrapped(tree: Any) -> Any:
  """``tree`` with each Flax NNX Variable replaced by its value (flax imported or not)."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return tree
  return jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, tree,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def has_variables(tree: Any) -> bool:
  """Whether ``tree`` holds Flax NNX Variables (as a plain ``jax.jit`` over an
  ``nnx.State`` sees it; ``nnx.Optimizer`` hands ``update`` plain arrays)."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return False
  nodes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return any(isinstance(x, nnx.Variable) for x in nodes)


def tree_of(stored: Any, treedef: Any = None) -> Any:
  """The tree of a state part kept either way: a :class:`Packed` unpacked, a tree as it is."""
  return stored.unpack(treedef) if isinstance(stored, Packed) else stored
