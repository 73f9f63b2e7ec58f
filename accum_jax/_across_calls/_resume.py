"""Restore targets for checkpoints: abstract states with the new mesh's shardings.

Orbax restores each array with the sharding its target leaf names. Restoring on
the devices that saved the checkpoint, ``jax.eval_shape`` of the function that
built the state is target enough; on a different number of devices every leaf
needs a sharding on the new mesh. The rule here, for any state::

  for each leaf of the state, at key path K, of shape s:
    if some parameter's key path is a suffix of K and its shape is s:
      the leaf is that parameter's optimizer statistic: shard it like the parameter
    else:
      a counter, a scalar, a reduced statistic: replicate it on the parameters' mesh

Adam's ``mu['w']``, the accumulator's ``total['w']`` and a ``TrainState``'s
``params['w']`` all end in the parameter's path ``['w']``; so do the statistics
of a masked or partitioned optimizer (``optax.masked``, ``optax.multi_transform``),
whose subtrees hold only some of the parameters.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from accum_jax._across_calls import _convert, _layout
from accum_jax._across_calls._state import AccumulationState

KeyPath = tuple[Any, ...]


class _HasInit(Protocol):
  init: Callable[[Any], Any]


def _describe(path: KeyPath) -> str:
  return f"params{jax.tree_util.keystr(path)}" if path else "params"


def _sharding_of(path: KeyPath, leaf: Any) -> jax.sharding.Sharding:
  if isinstance(leaf, jax.core.Tracer):
    raise ValueError(
        f"{_describe(path)} is a traced value: build the restore target outside jax.jit,"
        " with the new parameters or jax.ShapeDtypeStructs that carry their shardings."
    )
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) or sharding is None:
    raise ValueError(
        f"{_describe(path)} is a {type(leaf).__name__} without a sharding: the restore"
        " target needs to know where each parameter lives on the new devices. Pass"
        " jax.Arrays placed with jax.device_put(x, sharding), or"
        " jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))."
    )
  if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh):
    raise ValueError(
        f"{_describe(path)} has a sharding on an abstract mesh, {sharding}: a restore"
        " needs devices. Build the sharding on a concrete mesh, e.g. jax.make_mesh(...)."
    )
  return sharding


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec())
  devices = np.array(sorted(sharding.device_set, key=lambda d: getattr(d, "id", 0)))
  return NamedSharding(jax.sharding.Mesh(devices, ("devices",)), PartitionSpec())


class _ParamIndex:
  """The parameters' key paths, shapes and shardings, and the mesh they share."""

  def __init__(self, params: Any):
    leaves = jax.tree.leaves_with_path(params)
    if not leaves:
      raise ValueError(
          f"params holds no arrays (got {params!r}): the restore target takes its"
          " mesh from the parameters. Pass the new parameters, or jax.ShapeDtypeStructs"
          " with their shardings."
      )
    self.entries: dict[KeyPath, tuple[tuple[int, ...], jax.sharding.Sharding]] = {}
    first_path: Any = None
    first: Any = None
    for path, leaf in leaves:
      sharding = _sharding_of(path, leaf)
      if first is None:
        first_path, first = path, sharding
      elif sharding.device_set != first.device_set:
        raise ValueError(
            f"{_describe(path)} and {_describe(first_path)} live on different sets of"
            f" devices ({len(sharding.device_set)} and {len(first.device_set)} devices):"
            " the state's counters must be replicated where every parameter is. Place"
            " all the parameters on one mesh."
        )
      self.entries[tuple(path)] = (tuple(leaf.shape), sharding)
    # A NamedSharding, if any, names the mesh the training step runs on.
    named = [s for _, s in self.entries.values() if isinstance(s, NamedSharding)]
    self.replicated = _replicated(named[0] if named else first)
    self.abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
    )

  def sharding_for(self, path: KeyPath, shape: tuple[int, ...]) -> jax.sharding.Sharding:
    path = tuple(path)
    # Longest suffix first: params['a']['w'] before a parameter at params['w'].
    for start in range(len(path) + 1):
      entry = self.entries.get(path[start:])
      if entry is not None and entry[0] == shape:
        return entry[1]
    return self.replicated


def abstract_tree(tree: Any, params: Any) -> Any:
  """``tree`` as ``jax.ShapeDtypeStruct``\\ s sharded like ``params``: a restore target.

  For a whole training state, such as a Flax ``TrainState``: each leaf that
  belongs to a parameter (its key path ends with the parameter's and it has the
  parameter's shape) gets that parameter's sharding; every other leaf is
  replicated on the parameters' mesh. For the optimizer state alone, see
  :func:`abstract_state`.

  See the guide: :doc:`/guides/checkpoints`.

  Args:
    tree: a pytree of ``jax.ShapeDtypeStruct`` or arrays, typically
      ``jax.eval_shape`` of the function that built the saved state.
    params: the parameters on the new devices: ``jax.Array``\\ s, or
      ``jax.ShapeDtypeStruct``\\ s whose ``sharding`` is set, all on one mesh.

  Returns:
    ``tree`` with each leaf a ``jax.ShapeDtypeStruct`` of its shape and dtype
    and the sharding above, for ``orbax.checkpoint``'s restore.

  Raises:
    ValueError: for ``params`` that cannot be placed on one mesh, or a leaf of
      ``tree`` that is not an array or ``jax.ShapeDtypeStruct``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, accum_jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    >>> params = {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32,
    ...                                     sharding=NamedSharding(mesh, P("data")))}
    >>> tx = accum_jax.accumulate(optax.adam(1e-3), every_k=4, layout="tree")
    >>> def create_state():  # a training state: parameters, optimizer state, counter
    ...   p = {"w": jnp.zeros((8, 2))}
    ...   return {"params": p, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32)}
    >>> target = accum_jax.checkpoint.abstract_tree(jax.eval_shape(create_state), params)
    >>> target["params"]["w"].sharding.spec, target["opt_state"].window_total["w"].sharding.spec
    (P('data',), P('data',))
    >>> target["step"].sharding.spec
    P()
  """
  return _abstract_tree(tree, _ParamIndex(params))


def _abstract_tree(tree: Any, index: _ParamIndex) -> Any:
  def abstract(path, leaf):
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      raise ValueError(
          f"tree{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an array:"
          " pass jax.eval_shape of the function that built the saved state."
      )
    shape = tuple(leaf.shape)
    return jax.ShapeDtypeStruct(
        shape,
        leaf.dtype,
        sharding=index.sharding_for(path, shape),
        weak_type=bool(getattr(leaf, "weak_type", False)),
    )

  return jax.tree.map_with_path(abstract, tree)


def abstract_state(opt: _HasInit, params: Any) -> Any:
  """The abstract state of ``opt`` for ``params``' mesh: a target for a restore.

  Builds ``opt.init``'s state abstractly and gives each parameter-shaped leaf
  (the accumulator's ``total``, Adam's ``mu`` and ``nu``) its parameter's
  sharding and every other leaf a sharding replicated on the parameters' mesh,
  so that a state saved on 8 devices restores on 4.

  See the guide: :doc:`/guides/checkpoints`.

  Args:
    opt: the optimizer that made the saved state: anything with Optax's
      ``init(params)``.
    params: the parameters on the new devices: ``jax.Array``\\ s, or
      ``jax.ShapeDtypeStruct``\\ s whose ``sharding`` is set, all on one mesh.

  Returns:
    A pytree of ``jax.ShapeDtypeStruct`` with the structure and classes of
    ``opt.init(params)``, to pass to ``orbax.checkpoint``'s restore.

  Raises:
    ValueError: if ``opt`` has no ``init``, or ``params`` cannot be placed on
      one mesh.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, accum_jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    >>> params = {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32,
    ...                                     sharding=NamedSharding(mesh, P("data")))}
    >>> opt = accum_jax.accumulate(optax.adam(1e-3), every_k=4, layout="tree")
    >>> target = accum_jax.checkpoint.abstract_state(opt, params)
    >>> target.inner_opt_state[0].mu["w"].sharding.spec
    P('data',)
    >>> target.scalars.sharding.spec
    P()

    With Orbax, ``restored = ocp.v1.load(path, target)`` (or
    ``ocp.StandardCheckpointer().restore(path, target)``).
  """
  init = getattr(opt, "init", None)
  if not callable(init):
    raise ValueError(
        f"opt={opt!r} has no init method: pass the optimizer that made the saved"
        " state (an optax.GradientTransformation, accum_jax.accumulate(...),"
        " accum_jax.MultiSteps(...)). For a whole training state use abstract_tree."
    )
  index = _ParamIndex(params)
  return _abstract_tree(jax.eval_shape(init, index.abstract), index)


def _key(entry: Any) -> Any:
  """A key path entry as Orbax's metadata tree names it (dicts, then lists)."""
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      value = getattr(entry, attr)
      return value if isinstance(value, int) else str(value)
  return str(entry)


def _signature(tree: Any) -> dict[tuple[Any, ...], tuple[tuple[int, ...], Any]]:
  """Each leaf of ``tree`` (a target, or Orbax's metadata) by its path: shape, dtype."""
  return {tuple(_key(k) for k in path): (tuple(leaf.shape), np.dtype(leaf.dtype))
          for path, leaf in jax.tree.leaves_with_path(tree) if hasattr(leaf, "shape")}


def _saved_at(saved: Any, path: tuple[Any, ...]) -> Any:
  for key in path:
    try:
      saved = saved[key]
    except (KeyError, IndexError, TypeError):
      return None
  return saved


def _kind(saved: Any) -> str | None:
  """Which accumulate state ``saved`` (a node of Orbax's metadata) holds, by its fields."""
  if not isinstance(saved, dict):
    return None
  if "accumulator" in saved and "optimizer_step" in saved:
    return "0.1.0"
  window = saved.get("window_total", None) if "scalars" in saved else None
  if isinstance(window, dict) and "vectors" in window and set(window) <= {"vectors", "skeleton"}:
    return "packed"
  return "tree" if "window_total" in saved else None


def _say(entry: Any) -> str:
  return "nothing" if entry is None else f"{entry[0]} {entry[1]}"


def _difference(saved: dict, expected: dict) -> str:
  """The first leaf where the checkpoint's and the expected leaves differ, in words."""
  for path in sorted(set(saved) | set(expected), key=str):
    if saved.get(path) != expected.get(path):
      name = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)
      return (f"at {name} it holds {_say(saved.get(path))} where target's would hold"
              f" {_say(expected.get(path))}")
  return "their leaves agree"


def _contents(saved: Any) -> str:
  names = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
  return str(names)[:120]


def _read_as(saved: Any, target: AccumulationState, params: Any, path: Any, where: str) -> Any:
  """The target to read one accumulate state with: ``target``, or its state in the
  layout the checkpoint holds (recognised from its fields, checked leaf by leaf)."""
  at = f"the checkpoint at {path} holds, at {where or 'its root'},"
  found = _signature(saved)
  if found == _signature(target):
    return target
  layout = "packed" if isinstance(target.window_total, _layout.Packed) else "tree"
  kind = _kind(saved)
  if kind is None:
    raise ValueError(
        f"load(path, target): {at} no accum_jax.accumulate state"
        f" (it holds {_contents(saved)}), where target holds one: pass a target of the tree"
        " that was saved.")
  if kind == "packed" and layout == "tree" and params is None:
    raise ValueError(
        f"load(path, target): {at} accumulate's state in the packed"
        " layout (saved with layout='packed', or 'auto' on one device), target's is in the"
        " tree layout, and the packed layout's buckets follow the parameters' dtypes, which"
        " a tree target does not hold. Pass the parameters target was built for:"
        " load(path, target, params=params); or restore with a packed target and convert:"
        " convert(ocp.v1.load(path, abstract_state(accumulate(inner, every_k,"
        " layout='packed'), params)), target).")
  if kind == layout:
    as_saved: Any = target
  elif kind == "0.1.0":
    as_saved = _convert.v010_like(target)
  else:
    as_saved = _convert.tree_like(target) if kind == "tree" else _convert.packed_like(
        target, params)
  if _signature(as_saved) != found:
    saved_as = "accum_jax 0.1.0's state" if kind == "0.1.0" else (
        f"accumulate's state in the {kind} layout")
    raise ValueError(
        f"load(path, target): {at} {saved_as}, not of target's"
        f" optimizer and parameters: {_difference(found, _signature(as_saved))}. Build target"
        " with the optimizer (its inner optimizer, reduction and accumulator_dtype) and the"
        " parameters that saved it.")
  if kind == "0.1.0":
    _convert.check_v010_target(target, where)
  return as_saved


def load(path: Any, target: Any, *, params: Any = None) -> Any:
  """Restores a checkpoint with Orbax into ``target``, whatever layout it was saved in.

  ``ocp.v1.load(path, target)`` for a checkpoint of ``target``'s own tree. Where an
  :func:`accum_jax.accumulate` state was saved in the other layout (``"packed"`` on
  one device, ``"tree"`` on several), or by accum_jax 0.1.0, that state is read into
  a target of the layout it holds (recognised from the checkpoint's leaves, each
  checked against the ones ``target``'s optimizer and parameters make) and moved
  into ``target``'s by :func:`convert`, exactly. A checkpoint of another optimizer
  is refused. 0.1.0 counted every call it left out in ``num_skipped`` (now split by
  cause) and kept no ``window_value`` (0 until the next window is applied).

  See the guide: :doc:`/guides/checkpoints`.

  Args:
    path: the checkpoint's directory, as ``ocp.v1.save`` (or
      ``ocp.StandardCheckpointer``) wrote it.
    target: the tree to restore, with its shardings: :func:`abstract_state`,
      :func:`abstract_tree`, or arrays.
    params: the parameters ``target`` was built for (arrays or
      ``jax.ShapeDtypeStruct``\\ s): needed only to read a packed checkpoint into a
      tree-layout target, whose buckets follow their dtypes.

  Returns:
    ``target``'s tree, holding the checkpoint's values.

  Raises:
    ValueError: for a checkpoint whose accumulate state is not of ``target``'s
      optimizer and parameters, saying what it holds; or a packed one read into a
      tree target without ``params``.

  Examples:
    >>> import tempfile, pathlib, jax.numpy as jnp, optax, orbax.checkpoint as ocp, accum_jax
    >>> params = {"w": jnp.ones((2, 3))}
    >>> packed = accum_jax.accumulate(optax.adam(1e-2), every_k=4, layout="packed")
    >>> tree = accum_jax.accumulate(optax.adam(1e-2), every_k=4, layout="tree")
    >>> _, state = packed.update({"w": jnp.full((2, 3), 2.0)}, packed.init(params), params)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "checkpoint"
    >>> ocp.v1.save(path, state)
    >>> target = accum_jax.checkpoint.abstract_state(tree, params)
    >>> restored = accum_jax.checkpoint.load(path, target, params=params)
    >>> restored.window_total["w"][0], int(restored.mini_step)
    (Array([2., 2., 2.], dtype=float32), 1)
  """
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    raise ImportError("accum_jax.checkpoint.load reads with Orbax: pip install"
                      " orbax-checkpoint (or accum_jax[flax]).") from e
  if isinstance(path, str | os.PathLike) and "://" not in os.fspath(path):
    path = Path(path).absolute()  # Orbax reads absolute paths only
  saved = ocp.v1.metadata(path).metadata
  sites = jax.tree_util.tree_flatten_with_path(target, is_leaf=_convert.is_state)[0]
  read, converting = [], False
  for key_path, node in sites:
    if isinstance(node, AccumulationState):
      where = jax.tree_util.keystr(key_path)
      as_saved = _read_as(_saved_at(saved, tuple(_key(k) for k in key_path)), node, params,
                          path, where)
      converting |= as_saved is not node
      node = as_saved
    read.append(node)
  if not converting:
    return ocp.v1.load(path, target)
  structure = jax.tree.structure(target, is_leaf=_convert.is_state)
  return _convert.convert(ocp.v1.load(path, jax.tree.unflatten(structure, read)), target)
