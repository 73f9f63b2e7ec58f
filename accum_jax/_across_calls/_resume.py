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

from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

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
    >>> tx = accum_jax.accumulate(optax.adam(1e-3), every_k=4)
    >>> def create_state():  # a training state: parameters, optimizer state, counter
    ...   p = {"w": jnp.zeros((8, 2))}
    ...   return {"params": p, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32)}
    >>> target = accum_jax.checkpoint.abstract_tree(jax.eval_shape(create_state), params)
    >>> target["params"]["w"].sharding.spec, target["opt_state"].acc_grads["w"].sharding.spec
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
    >>> opt = accum_jax.accumulate(optax.adam(1e-3), every_k=4)
    >>> target = accum_jax.checkpoint.abstract_state(opt, params)
    >>> target.inner_opt_state[0].mu["w"].sharding.spec
    P('data',)
    >>> target.counts.sharding.spec
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
