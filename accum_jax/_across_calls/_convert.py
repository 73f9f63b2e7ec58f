""":func:`accum_jax.accumulate`'s state moved between layouts, and from 0.1.0's fields.

The two layouts (:mod:`._layout`) hold the same numbers: the window's sum and the
inner optimizer's state, leaf by leaf, in a tree or in the buckets of a
:class:`_layout.Packed`; the counters and the other fields are the same in both.
Converting is therefore a rearrangement, exact bit for bit::

  tree = the source's window sum and inner state as trees   # slices of its buckets
  check that tree has the target's structure, shapes and dtypes (else refuse)
  the target's part = tree, in the target's buckets or tree  # a concatenate, or as it is
  the counters, sums and noise fields: the source's, as they are
  every_k, reductions: the target's (static data, not in a checkpoint)

Nothing is cast and nothing is read on the host: slices, reshapes and concatenates of
arrays on their devices, then an explicit copy to where the target places a leaf
(``jax.device_put``), where it names a sharding.

accum_jax 0.1.0 kept the window in ``accumulator`` (:class:`_core.Accumulator`, whose
``total`` is the tree layout's window sum: a weighted sum, or for a leaf narrower
than float32 the weighted mean, as now) and its counters as scalars; :class:`State010`
names its fields, for a checkpoint of it to be read into.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from accum_jax import _core
from accum_jax._across_calls import _layout
from accum_jax._across_calls._state import COUNTS, SUMS, AccumulationState, scalars

# The fields that hold the same leaves in both layouts.
_SAME_IN_BOTH = ("scalars", "skip_state", "noise", "last_noise", "noise_ema",
                 "window_length")
_FIX = ("convert moves one optimizer's state between layouts, not between optimizers or"
        " parameters: build target with the optimizer and parameters that made state, e.g."
        " abstract_state(accumulate(inner, every_k, layout=...), params).")


class State010(NamedTuple):
  """The fields of accum_jax 0.1.0's ``AccumulationState``, in its order."""

  accumulator: _core.Accumulator  # the window: total, weight, count, num_skipped
  optimizer_step: Any  # shape=(), dtype=int32
  inner_opt_state: Any  # the inner optimizer's state, a tree
  last_updated: Any  # shape=(), dtype=bool
  num_empty_windows: Any  # shape=(), dtype=int32
  value_accumulator: _core.Accumulator  # the window's `value=`s; total shape=(), float32
  skip_state: Any = ()


def is_state(x: Any) -> bool:
  return isinstance(x, AccumulationState | State010)


def _describe(x: Any) -> str:
  text = str(x)
  return text if len(text) <= 160 else text[:150] + " ... " + text[-8:]


def _aval(x: Any) -> str:
  return f"{tuple(jnp.shape(x))} {jnp.dtype(x.dtype)}"


def _refuse(what: str, where: str, detail: str) -> ValueError:
  return ValueError(f"convert(state, target): {what} of state{where} is not the one"
                    f" target{where} holds: {detail}. {_FIX}")


def _expected(like: Any) -> tuple[Any, list[tuple[Any, Any]]]:
  """The structure (NNX Variables unwrapped) and per leaf the shape and dtype of a
  state part kept either way."""
  if not isinstance(like, _layout.Packed):
    leaves, treedef = jax.tree.flatten(_layout.unwrapped(like))
    return treedef, [(tuple(jnp.shape(x)), jnp.dtype(x.dtype)) for x in leaves]
  kept = iter(jax.tree.leaves(like.skeleton))
  avals = []
  for slot in like.layout.slots:
    if slot is None:
      leaf = next(kept)
      avals.append((tuple(jnp.shape(leaf)), jnp.dtype(leaf.dtype)))
    else:
      avals.append((slot.shape, jnp.dtype(like.vectors[slot.bucket].dtype)))
  return like.layout.treedef, avals


def _into(stored: Any, like: Any, what: str, where: str) -> Any:
  """``stored`` (a state part in either layout) in ``like``'s layout, checked."""
  if isinstance(stored, _layout.Packed) and isinstance(like, _layout.Packed) and (
      stored.layout == like.layout and _expected(stored) == _expected(like)):
    return stored  # the same buckets: nothing to move
  tree = _layout.unwrapped(_layout.tree_of(stored))
  treedef, avals = _expected(like)
  if jax.tree.structure(tree) != treedef:
    raise _refuse(what, where, f"its tree is {_describe(jax.tree.structure(tree))}, target's"
                               f" {_describe(treedef)}")
  leaves = jax.tree.leaves_with_path(tree)
  for (path, leaf), (shape, dtype) in zip(leaves, avals):
    if (tuple(jnp.shape(leaf)), jnp.dtype(leaf.dtype)) != (shape, dtype):
      raise _refuse(what, where, f"its leaf at {jax.tree_util.keystr(path)} is {_aval(leaf)},"
                                 f" target's {shape} {dtype}")
  values = [leaf for _, leaf in leaves]
  if isinstance(like, _layout.Packed):
    return like.layout.pack(values)
  return jax.tree.unflatten(jax.tree.structure(like), values)


def _same(value: Any, like: Any, name: str, where: str) -> Any:
  """A field that both layouts keep alike: ``value``, checked against ``like``."""
  structure: Any = jax.tree.structure(value)
  if structure != jax.tree.structure(like):
    raise _refuse(f"the field {name}", where, f"it is {_describe(structure)},"
                                              f" target's {_describe(jax.tree.structure(like))}")
  for x, y in zip(jax.tree.leaves(value), jax.tree.leaves(like)):
    if (jnp.shape(x), jnp.dtype(x.dtype)) != (jnp.shape(y), jnp.dtype(y.dtype)):
      raise _refuse(f"the field {name}", where, f"{_aval(x)} where target's is {_aval(y)}")
  return value


def check_v010_target(target: AccumulationState, where: str) -> None:
  """Refuses a target that 0.1.0's state cannot fill: 0.1.0 had no statistics
  reductions and no gradient-noise fields."""
  kinds = target.reductions.kinds if target.reductions else ()
  if set(kinds) - {"mean", "sum"}:
    raise ValueError(
        f"target{where} combines some leaves by {sorted(set(kinds) - {'mean', 'sum'})}, which"
        " accum_jax 0.1.0 did not have: its window holds every leaf's weighted sum (or, for a"
        " leaf narrower than float32, mean). Build target with the reduction 0.1.0 was given"
        " ('mean' or 'sum').")
  noise = (target.noise, target.last_noise, target.noise_ema, target.window_length)
  if jax.tree.leaves(noise):
    raise ValueError(
        f"target{where} keeps gradient-noise sums (gradient_noise=True, or a"
        " noise_scale_every_k), which accum_jax 0.1.0 did not: the current window's sums"
        " are not in its checkpoint. Build target without them (gradient_noise=False, an"
        " every_k that is an int or accum_jax.piecewise_every_k).")


@jax.jit
def _v010_scalars(old: State010) -> jax.Array:
  """0.1.0's scalar counters as the one vector (jitted: no constant leaves the host).
  0.1.0 counted every call left out in ``num_skipped``; it kept no ``window_value``."""
  acc, values = old.accumulator, old.value_accumulator
  counts = {"mini_step": acc.count, "optimizer_step": old.optimizer_step,
            "last_updated": old.last_updated, "num_skipped": acc.num_skipped,
            "num_empty_windows": old.num_empty_windows}
  sums = {"weight": acc.weight, "value_total": values.total, "value_weight": values.weight}
  return scalars(jnp.stack([jnp.asarray(counts.get(n, 0), jnp.int32) for n in COUNTS]),
                 jnp.stack([jnp.asarray(sums.get(n, 0.0), jnp.float32) for n in SUMS]))


def _from_v010(old: State010, target: AccumulationState, where: str) -> AccumulationState:
  check_v010_target(target, where)
  return AccumulationState(
      window_total=old.accumulator.total, inner_opt_state=old.inner_opt_state,
      scalars=_v010_scalars(old), skip_state=old.skip_state)


def _placed(value: Any, like: Any) -> Any:
  """``value`` copied where ``like`` places it, if it names a device sharding."""
  sharding = getattr(like, "sharding", None)
  if not isinstance(sharding, jax.sharding.Sharding) or not isinstance(value, jax.Array):
    return value
  if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
      sharding.mesh, jax.sharding.AbstractMesh):
    return value
  if value.sharding.is_equivalent_to(sharding, value.ndim):
    return value
  return jax.device_put(value, sharding)


def _convert_state(source: Any, target: AccumulationState, where: str) -> AccumulationState:
  if isinstance(source, State010):
    source = _from_v010(source, target, where)
  elif not isinstance(source, AccumulationState):
    raise ValueError(
        f"convert(state, target): state{where} is a {type(source).__name__} where target"
        " holds accum_jax.accumulate's state: pass the state that accumulate's init or"
        " update made (or a checkpoint of it restored), in a tree of target's structure.")
  if source.reductions is not None and target.reductions is not None and (
      source.reductions.kinds != target.reductions.kinds):
    raise _refuse("the reductions", where, f"{source.reductions.kinds} where target's are"
                                           f" {target.reductions.kinds}")
  fields = {name: _same(getattr(source, name), getattr(target, name), name, where)
            for name in _SAME_IN_BOTH}
  converted = target._replace(
      window_total=_into(source.window_total, target.window_total, "the window's sum", where),
      inner_opt_state=_into(source.inner_opt_state, target.inner_opt_state,
                            "the inner optimizer's state", where),
      **fields)
  return jax.tree.map(_placed, converted, target)


def convert(state: Any, target: Any) -> Any:
  """``state``'s values in ``target``'s layout: from ``"packed"`` to ``"tree"``, or back.

  For a checkpoint saved in one layout and resumed in the other (a run on one
  device, packed, resumed on several, tree), or a state kept in memory. The window's
  sum, the inner optimizer's state and the counters move exactly, bit for bit
  (slices and concatenates, nothing cast); ``every_k`` and the reductions, static
  data, are ``target``'s. Arrays stay on their devices: nothing is read on the host,
  and a leaf goes where ``target``'s names a sharding (``jax.device_put``). A
  checkpoint on disk: :func:`load` reads it in either layout.

  See the guide: :doc:`/guides/checkpoints`.

  Args:
    state: the state of :func:`accum_jax.accumulate`, or a pytree holding it (a
      dict train state, an ``optax.chain`` state).
    target: the same tree in the layout wanted: a state, or an abstract one
      (``jax.eval_shape(opt.init, params)``, :func:`abstract_state`).

  Returns:
    ``target``'s tree, each accumulate state holding ``state``'s values; the other
    leaves are ``state``'s (placed as ``target``'s, where those name a sharding).

  Raises:
    ValueError: if ``target`` holds no accumulate state, or ``state``'s is of another
      optimizer, other parameters or another ``accumulator_dtype``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, accum_jax
    >>> params = {"w": jnp.ones((2, 3))}
    >>> packed = accum_jax.accumulate(optax.adam(1e-2), every_k=4, layout="packed")
    >>> tree = accum_jax.accumulate(optax.adam(1e-2), every_k=4, layout="tree")
    >>> _, state = packed.update({"w": jnp.full((2, 3), 2.0)}, packed.init(params), params)
    >>> moved = accum_jax.checkpoint.convert(state, jax.eval_shape(tree.init, params))
    >>> moved.window_total["w"][0], int(moved.mini_step)
    (Array([2., 2., 2.], dtype=float32), 1)
  """
  targets, structure = jax.tree.flatten(target, is_leaf=is_state)
  values, found_structure = jax.tree.flatten(state, is_leaf=is_state)
  found: Any = found_structure
  if not any(isinstance(t, AccumulationState) for t in targets):
    raise ValueError(
        f"convert(state, target): target holds no accum_jax.accumulate state (a"
        f" {type(target).__name__}): pass the state, or the tree holding it, of the layout"
        " wanted, e.g. jax.eval_shape(opt.init, params) or abstract_state(opt, params).")
  if found != structure:
    raise ValueError(
        f"convert(state, target): state's tree {_describe(found)} is not target's"
        f" {_describe(structure)} around accumulate's state: pass target of the same"
        " tree (the same train state, the same optax.chain), in the layout wanted.")
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(target, is_leaf=is_state)[0]]
  out = [_convert_state(v, t, where) if isinstance(t, AccumulationState) else _placed(v, t)
         for v, t, where in zip(values, targets, paths)]
  return jax.tree.unflatten(structure, out)


def _replicated(target: AccumulationState) -> Any:
  """Where the target keeps its counters (replicated on the mesh), or None."""
  sharding = getattr(target.scalars, "sharding", None)
  if not isinstance(sharding, jax.sharding.Sharding) or (
      isinstance(sharding, jax.sharding.NamedSharding)
      and isinstance(sharding.mesh, jax.sharding.AbstractMesh)):
    return None
  return sharding


def _abstract(tree: Any, sharding: Any) -> Any:
  """``tree``'s leaves as ``jax.ShapeDtypeStruct``\\ s placed by ``sharding``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding, weak_type=bool(getattr(x, "weak_type", False))), tree)


def tree_like(target: AccumulationState) -> AccumulationState:
  """The abstract state ``target`` (an accumulate state) is in the tree layout: its
  window's sum and inner state unpacked, each leaf replicated like its counters."""
  if not isinstance(target.window_total, _layout.Packed):
    return target
  def unpack(t):
    return t._replace(window_total=t.window_total.unpack(wrapped=True),
                      inner_opt_state=t.inner_opt_state.unpack(wrapped=True))
  return _abstract(jax.eval_shape(unpack, _abstract(target, None)), _replicated(target))


def packed_like(target: AccumulationState, params: Any) -> AccumulationState:
  """The abstract state ``target`` is in the packed layout, planned from ``params``
  (whose dtypes a tree-layout state does not hold) as ``accumulate``'s init plans it."""
  if isinstance(target.window_total, _layout.Packed):
    return target

  def pack(t, params):
    grads_like = params.fast if isinstance(params, optax.LookaheadParams) else params
    layout = _layout.plan(grads_like, t.reductions.kinds if t.reductions else None,
                          added=True)
    total = jax.tree.leaves(_layout.unwrapped(t.window_total))
    if len(total) != len(layout.slots):
      raise ValueError(
          f"params has {len(layout.slots)} leaves where target's window has {len(total)}:"
          " pass the parameters target was built for.")
    dtypes = {s.bucket: x.dtype for x, s in zip(total, layout.slots) if s is not None}
    vectors = [jnp.zeros(n, dtypes[b]) for b, n in enumerate(layout.sizes)]
    kept = [x for x, s in zip(total, layout.slots) if s is None]
    inner = _layout.plan(t.inner_opt_state).pack(t.inner_opt_state)
    return t._replace(window_total=_layout.packed_with(layout, vectors, kept),
                      inner_opt_state=inner)

  # Traced without shardings: one bucket holds leaves that their parameters shard apart.
  unplaced = _abstract((target, params), None)
  return _abstract(jax.eval_shape(pack, *unplaced), _replicated(target))


def v010_like(target: AccumulationState) -> State010:
  """The abstract state 0.1.0 saved for ``target``'s optimizer and parameters: the tree
  layout's window and inner state (placed as a tree-layout target places them), scalars."""
  tree = tree_like(target)
  scalar, count, flag = (_abstract(jax.ShapeDtypeStruct((), dtype), _replicated(target))
                         for dtype in (jnp.float32, jnp.int32, jnp.bool_))
  return State010(
      accumulator=_core.Accumulator(tree.window_total, scalar, count, count),
      optimizer_step=count, inner_opt_state=tree.inner_opt_state, last_updated=flag,
      num_empty_windows=count,
      value_accumulator=_core.Accumulator(scalar, scalar, count, count),
      skip_state=tree.skip_state)
