"""Many devices: where each gradient leaf is reduced, decided once per call.

Under ``DataParallel(mesh=...)``, each device scans its own rows of the batch inside
``jax.shard_map`` (manual over the data axes only; tensor axes stay automatic).
Per differentiated leaf, the parameter's sharding decides what crosses devices
(a :class:`Plan`, made by :func:`plan`)::

  replicated over the data axes (data parallel):
      local float32 sums, one psum after the loop
  sharded over a data axis (FSDP, ZeRO-3), gather="per_microbatch":
      the shard gathered for fun (XLA hoists it out of the loop), each
      microbatch's gradient reduce-scattered into a float32 accumulator of the
      shard: 4 bytes x parameters / devices
  sharded, gather="once" (ZeRO-1/2, PyTorch's no_sync):
      gathered once before the loop, a full-size local sum, one reduce-scatter
      after the loop
  replicated over some data axes and sharded over others (HSDP):
      the above over the sharded axes, one psum over the replica axes

This module decides; :mod:`._across_devices` carries the decision out inside
``shard_map`` (gathers, reduce-scatters, the one reduction after the loop). A
call without a mesh enters neither. The result keeps each parameter's sharding.
A microbatch's loss is scaled by its share of the whole batch's weight before
differentiation, so a sum across devices is already the right weighted sum, and a
skipped microbatch is zeroed on its own device before anything crosses devices.

The sharding of a parameter is read from its type (explicit mesh axes), from
the array itself (an eager call, the planner), or from ``param_sharding=``. Under
``jax.jit`` with automatic axes a trace cannot see its arguments' shardings (one
trace serves sharded and replicated parameters alike): without
``param_sharding=`` such a parameter counts as replicated (data parallel keeps its
one reduction per step), and :class:`UnknownShardingWarning` says so.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum_jax import _core


class UnknownShardingWarning(UserWarning):
  """Under a mesh, a differentiated parameter's sharding cannot be seen at trace time.

  Raised when the step is traced (by ``jax.jit``, ``nnx.jit``,
  ``eqx.filter_jit``) with a mesh and ``param_sharding=`` names no sharding,
  and a parameter's traced type does not say how it is sharded (automatic mesh
  axes, or an array placed on no mesh): it is taken as replicated over the
  data axes. That is right for data parallelism; for a parameter that is in
  fact sharded over a data axis (FSDP, HSDP) each device then holds a
  full-size float32 accumulator and the gradient comes back replicated. Pass
  ``param_sharding=`` (``P()`` for replicated parameters), use explicit mesh
  axes, or call the step eagerly.

  Examples:
    >>> import warnings
    >>> import jax, jax.numpy as jnp, accum_jax
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> w, x = jnp.ones((4, 2)), jnp.ones((2 * jax.device_count(), 4))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   dp = accum_jax.DataParallel(mesh)
    ...   _ = jax.jit(accum_jax.value_and_grad(loss, 2, data_parallel=dp))(w, x)
    ...   dp = accum_jax.DataParallel(mesh, param_sharding=P())
    ...   _ = jax.jit(accum_jax.value_and_grad(loss, 2, data_parallel=dp))(w, x)
    >>> [c.category.__name__ for c in caught]
    ['UnknownShardingWarning']
  """


def resolve_mesh(mesh: Any, data_axis: Any) -> tuple[Any, tuple[str, ...]]:
  """The mesh to use (``mesh`` or the ambient one) and its data axes."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError(
          f"data_axis={data_axis!r} is given but there is no mesh: give the DataParallel a"
          " mesh=, or set one with `with jax.set_mesh(mesh):` around the call."
      )
  names = tuple(mesh.axis_names)
  if data_axis is None:
    if len(names) != 1:
      raise ValueError(
          f"The mesh has axes {names}: give the DataParallel data_axis= to name the one the"
          " batch is sharded over (a tuple for several, e.g. ('replica', 'fsdp') for HSDP)."
      )
    return mesh, names
  axes = tuple(data_axis) if isinstance(data_axis, (tuple, list)) else (data_axis,)
  for axis in axes:
    if axis not in names:
      which = "is not" if len(axes) == 1 else f"names {axis!r}, which is not"
      raise ValueError(
          f"data_axis={data_axis!r} {which} an axis of the mesh, whose axes are {names}."
      )
  if len(set(axes)) != len(axes) or not axes:
    raise ValueError(f"data_axis={data_axis!r} must name distinct mesh axes, at least one.")
  return mesh, axes


def num_shards(mesh: Any, axes: Sequence[str]) -> int:
  """The number of devices the batch is split over."""
  return int(np.prod([mesh.shape[a] for a in axes]))


class LeafPlan(NamedTuple):
  """How one differentiated leaf crosses devices.

  Attributes:
    spec: its ``PartitionSpec`` over the data axes (the ``shard_map`` in and out
      spec; other mesh axes stay automatic).
    gathers: ``(dim, axes)`` pairs: the dimensions sharded over data axes, which
      are gathered for ``fun`` and along which the gradient is reduce-scattered.
    replicas: the data axes it is replicated over: its gradient is summed over
      them once, after the loop.
  """

  spec: P
  gathers: tuple[tuple[int, tuple[str, ...]], ...]
  replicas: tuple[str, ...]


class Plan(NamedTuple):
  """Where each differentiated leaf is gathered and reduced; see the module docstring.

  Attributes:
    mesh: the mesh.
    axes: the data axes (the batch is split over all of them).
    leaves: a :class:`LeafPlan` per leaf of the differentiated arguments.
    treedef: the tree structure of the differentiated arguments.
    gather: ``"per_microbatch"`` or ``"once"``, for the sharded leaves.
    gather_dtype: the dtype sharded leaves are gathered in, and ``fun`` sees
      them in; None keeps theirs.
    reduce_dtype: the dtype gradients cross devices in; None keeps theirs.
    hidden: the indices (among ``leaves``) of the leaves planned as replicated
      because their sharding could not be seen (see :func:`sharding_hidden`);
      :func:`warn_hidden` names them.
  """

  mesh: Any
  axes: tuple[str, ...]
  leaves: tuple[LeafPlan, ...]
  treedef: Any
  gather: str
  gather_dtype: Any
  reduce_dtype: Any
  hidden: tuple[int, ...] = ()

  @property
  def num_shards(self) -> int:
    return num_shards(self.mesh, self.axes)

  @property
  def sharded(self) -> bool:
    """Whether any leaf is sharded over a data axis."""
    return any(leaf.gathers for leaf in self.leaves)

  @property
  def scatters_per_microbatch(self) -> bool:
    return self.sharded and self.gather == "per_microbatch"


def _spec_entries(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_of(x: Any, given: Any = None) -> P | None:
  """The ``PartitionSpec`` of a parameter: ``given``, its type's, or the array's.

  A tracer's type leaves automatic axes out of its spec (see
  :func:`sharding_hidden`); None where there is no ``NamedSharding`` at all.
  """
  if given is not None:
    return given.spec if isinstance(given, NamedSharding) else given
  sharding = getattr(x, "sharding", None)
  if isinstance(x, jax.core.Tracer):
    sharding = getattr(jax.typeof(x), "sharding", None)
  if isinstance(sharding, NamedSharding):
    return sharding.spec
  return None


def sharding_hidden(x: Any, axes: Sequence[str]) -> bool:
  """Whether ``x`` is a tracer whose type cannot say how it is sharded over ``axes``.

  A traced array's type names only explicit mesh axes: one on a mesh whose data
  axes are automatic (``AxisType.Auto``, the default of ``jax.sharding.Mesh``),
  or on no mesh at all (not placed on one), may be sharded over them or not, and
  only XLA, compiling the step, decides.
  ``jax.jit`` traces once for every sharding of the same types, so nothing
  read while tracing could tell. A scalar cannot be sharded.
  """
  if not isinstance(x, jax.core.Tracer) or jnp.ndim(x) == 0:
    return False
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  if mesh is None or mesh.empty:
    return True
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  return any(types.get(a) != jax.sharding.AxisType.Explicit for a in axes)


def _leaf_plan(
    shape: tuple[int, ...], spec: P | None, axes: tuple[str, ...], path: str
) -> LeafPlan:
  entries = list(spec or ()) + [None] * (len(shape) - len(spec or ()))
  in_spec: list[Any] = []
  gathers: list[tuple[int, tuple[str, ...]]] = []
  used: set[str] = set()
  for dim, entry in enumerate(entries):
    names = _spec_entries(entry)
    data = tuple(a for a in names if a in axes)
    if data and len(data) != len(names):
      raise ValueError(
          f"The parameter at {path or 'the root'} has sharding {spec}: dimension {dim} is"
          f" split over data axes {data} and other axes together, which accum_jax cannot"
          " gather. Shard each dimension over data axes alone or other axes alone."
      )
    in_spec.append((data[0] if len(data) == 1 else data) if data else None)
    if data:
      gathers.append((dim, data))
      used.update(data)
  return LeafPlan(P(*in_spec), tuple(gathers), tuple(a for a in axes if a not in used))


def plan(
    mesh: Any,
    axes: tuple[str, ...],
    params: Any,
    *,
    param_sharding: Any = None,
    gather: str = "per_microbatch",
    gather_dtype: Any = None,
    reduce_dtype: Any = None,
) -> Plan:
  """The :class:`Plan` for ``params`` (the differentiated arguments) on ``mesh``.

  Args:
    mesh: the mesh.
    axes: the data axes.
    params: the differentiated arguments, arrays or tracers.
    param_sharding: None, or a pytree prefix of ``params`` of ``NamedSharding``
      or ``PartitionSpec`` (None leaves: read from the parameter).
    gather: ``"per_microbatch"`` or ``"once"``.
    gather_dtype: see :class:`Plan`.
    reduce_dtype: see :class:`Plan`.

  Returns:
    The plan; where ``param_sharding`` names no sharding at all, its ``hidden``
    lists the leaves whose sharding the trace could not see.
  """
  leaves, treedef = jax.tree.flatten(params)
  given = _broadcast_prefix(param_sharding, params)
  # Only a param_sharding that names nothing leaves the parameters unseen: one
  # that names some leaves said how the others are laid out (None: as their
  # arrays say, replicated where they cannot say; as Flax's NNX metadata means a
  # Variable without any).
  says_nothing = all(spec is None for spec in given)
  plans, hidden = [], []
  for i, ((path, x), spec) in enumerate(zip(jax.tree.leaves_with_path(params), given)):
    plans.append(
        _leaf_plan(jnp.shape(x), spec_of(x, spec), axes, jax.tree_util.keystr(path))
    )
    if says_nothing and sharding_hidden(x, axes):
      hidden.append(i)
  return Plan(mesh, axes, tuple(plans), treedef, gather, gather_dtype, reduce_dtype,
              tuple(hidden))


def warn_hidden(
    plan: Plan, params: Any, argnums: Sequence[int], single_argnum: bool,
    accumulator_dtype: Any,
) -> None:
  """:class:`UnknownShardingWarning` for the leaves ``plan`` took as replicated unseen.

  Args:
    plan: the call's plan.
    params: the differentiated arguments it was made for (one argument's tree
      when ``single_argnum``, else a tuple of them, in ``argnums``' order).
    argnums: the argument numbers of the differentiated arguments.
    single_argnum: whether ``params`` is one argument's tree.
    accumulator_dtype: the ``accumulator_dtype`` option, for the bytes it costs.
  """
  if not plan.hidden:
    return
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  # By argument number where several are differentiated; one is named by its
  # leaves alone (a front door's own argument numbers are not the user's).
  where: dict[int | None, list[str]] = {}
  nbytes, dtypes = 0, []
  for i in plan.hidden:
    path, x = flat[i]
    argnum = None
    if not single_argnum:  # the tuple's index, then the path in that argument
      argnum, path = argnums[path[0].idx], path[1:]
    where.setdefault(argnum, []).append(jax.tree_util.keystr(path))
    dtype = _core.accumulator_dtype_for(jnp.result_type(x), accumulator_dtype)
    nbytes += int(np.prod(jnp.shape(x))) * dtype.itemsize
    dtypes += [] if dtype.name in dtypes else [dtype.name]
  count = len(plan.hidden)
  it, is_, them = ("it", "is", "it") if count == 1 else ("they", "are", "them")
  warnings.warn(
      f"accum_jax cannot see how {_leaves(where, count)} {is_} sharded under jax.jit, so"
      f" {it} {is_} taken as replicated over the data axes {plan.axes}: if {it} {is_}"
      f" sharded over them (FSDP), each device holds a full-size {'/'.join(dtypes)}"
      f" accumulator of {them} ({_size(nbytes)} here, where a sharded one holds as little"
      f" as 1/{plan.num_shards} of that) and the gradient comes back replicated. Give"
      " DataParallel(param_sharding=...) the parameters' PartitionSpecs"
      " (param_sharding=P() for replicated parameters, which also silences this warning),"
      " use explicit mesh axes (AxisType.Explicit), or call the step eagerly.",
      UnknownShardingWarning, stacklevel=_caller_stacklevel(),
  )


def _leaves(where: dict[int | None, list[str]], count: int) -> str:
  """The hidden leaves: "2 differentiated leaves (['w1'], ['w2'])", by argument
  where several are differentiated ("... of argument 0 (['w']) and argument 2")."""
  def listed(paths: list[str]) -> str:
    named = [path for path in paths if path]
    shown = ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")
    return f" ({shown})" if named else ""

  what = "the differentiated leaf" if count == 1 else f"{count} differentiated leaves"
  if len(where) == 1 and None in where:
    return what + listed(where[None])
  return f"{what} of " + " and ".join(
      f"argument {argnum}{listed(paths)}" for argnum, paths in where.items()
  )


def _size(nbytes: int) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if nbytes >= scale:
      return f"{nbytes / scale:.1f} {unit}"
  return f"{nbytes} bytes"


# A warning points at the user's line that called the step, past the frames of
# the libraries between (jax.jit's tracing, the front doors, Flax, Equinox).
_LIBRARIES = frozenset({"accum_jax", "jax", "jaxlib", "flax", "equinox", "contextlib"})


def _caller_stacklevel() -> int:
  """``stacklevel`` for a ``warnings.warn`` in the caller: its first frame outside
  :data:`_LIBRARIES`."""
  frame, level = sys._getframe(1), 1
  while frame.f_back is not None and (
      frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES
  ):
    frame, level = frame.f_back, level + 1
  return level


def _broadcast_prefix(prefix: Any, tree: Any) -> list[Any]:
  """One entry of ``prefix`` (a pytree prefix of ``tree``) per leaf of ``tree``."""
  num_leaves = len(jax.tree.leaves(tree))
  if prefix is None:
    return [None] * num_leaves

  def is_spec(x):
    return x is None or isinstance(x, (P, NamedSharding))

  try:
    out = jax.tree_util.tree_map(
        lambda p, sub: _Repeated([p] * len(jax.tree.leaves(sub))), prefix, tree, is_leaf=is_spec
    )
  except ValueError as e:
    raise ValueError(
        f"param_sharding must be a NamedSharding or PartitionSpec, or a pytree prefix of the"
        f" differentiated argument(s) with those at its leaves (None: read from the"
        f" parameter); it does not match them: {e}"
    ) from e
  return [spec for group in jax.tree.leaves(out) for spec in group]


class _Repeated(list):
  """One prefix entry per leaf below it: a pytree leaf (a list subclass is not a
  pytree node), so that lists inside the parameters' tree are not taken for it."""


def spec_axes(spec: P) -> set[str]:
  return {a for e in spec for a in _spec_entries(e)}
