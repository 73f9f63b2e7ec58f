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

The result keeps each parameter's sharding. A microbatch's loss is scaled by its
share of the whole batch's weight before differentiation, so a sum across
devices is already the right weighted sum, and a skipped microbatch is zeroed on
its own device before anything crosses devices.

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
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum_jax import _core

Gather = Literal["per_microbatch", "once"]
GATHERS: tuple[str, ...] = ("per_microbatch", "once")


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


def _cast(x: jax.Array, dtype: Any) -> jax.Array:
  return x if dtype is None else x.astype(dtype)


def gather(plan: Plan | None, params: Any) -> Any:
  """This device's shards of ``params`` gathered into the full parameters for ``fun``."""
  if plan is None or not plan.sharded:
    return params

  def gather_leaf(x, leaf):
    if not leaf.gathers:
      return x
    x = _cast(x, plan.gather_dtype)
    for dim, axes in leaf.gathers:
      x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
    return x

  return jax.tree.unflatten(
      plan.treedef, [gather_leaf(x, p) for x, p in zip(jax.tree.leaves(params), plan.leaves)]
  )


def _scatter(x: jax.Array, leaf: LeafPlan, reduce_dtype: Any, dtype: Any) -> jax.Array:
  x = _cast(x, reduce_dtype)
  for dim, axes in reversed(leaf.gathers):
    x = jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
  return x.astype(dtype)


def scatter(plan: Plan | None, grads: Any, like: Any) -> Any:
  """Per microbatch: full local gradients of sharded leaves reduce-scattered to shards.

  ``like``: the accumulator's leaves, whose dtypes the results take. Other leaves
  pass unchanged.
  """
  if plan is None or not plan.scatters_per_microbatch:
    return grads
  return jax.tree.unflatten(plan.treedef, [
      _scatter(g, leaf, plan.reduce_dtype, t.dtype) if leaf.gathers else g
      for g, leaf, t in zip(jax.tree.leaves(grads), plan.leaves, jax.tree.leaves(like))
  ])


def masked(
    plan: Plan | None, tree: Any, scattered: jax.Array, local: jax.Array | None = None
) -> Any:
  """``tree`` with zeros where a microbatch is not kept (:func:`_core.masked`): the
  leaves reduce-scattered per microbatch where ``scattered`` is False, the others
  where ``local`` is (None: they are left as they are)."""
  def local_leaf(x):
    return x if local is None else _core.masked(x, local)

  if plan is None or not plan.scatters_per_microbatch:
    return jax.tree.map(local_leaf, tree)
  leaves = [
      _core.masked(x, scattered) if leaf.gathers else local_leaf(x)
      for x, leaf in zip(jax.tree.leaves(tree), plan.leaves)
  ]
  return jax.tree.unflatten(jax.tree.structure(tree), leaves)


def _reduce_leaf(x: jax.Array, leaf: LeafPlan, plan: Plan) -> jax.Array:
  """After the loop: a leaf's local sum reduced as the plan says."""
  if leaf.gathers and plan.gather == "once":
    x = _scatter(x, leaf, plan.reduce_dtype, x.dtype)
  if leaf.replicas:
    x = jax.lax.psum(_cast(x, plan.reduce_dtype), leaf.replicas).astype(x.dtype)
  return x


def reduce_grads(plan: Plan, grads: Any) -> Any:
  """After the loop: each leaf of the local gradient sums reduced as planned."""
  return jax.tree.unflatten(
      plan.treedef, [_reduce_leaf(g, leaf, plan) for g, leaf in zip(jax.tree.leaves(grads),
                                                                     plan.leaves)]
  )


class LocalSums(NamedTuple):
  """What one device's scan over its microbatches leaves, before normalisation.

  Attributes:
    acc: the sums of ``(value, grads)``, an ``_core.Accumulator`` filled by
      ``_core.add_share``.
    aux_sums: per aux leaf, its running sum, or None for a per-example leaf.
    state: the threaded state after the last microbatch (None without one).
    per_example: per aux leaf, its outputs in batch order (``"concat"``), or
      stacked by microbatch (``"stack"``), or None for a summed leaf.
    noise: the sums of the gradient-noise estimate, an ``_noise.NoiseSums``, or
      None without ``gradient_noise``.
    batch_weight: the weight of the whole batch (every device's), float32.
    loss_finite: with ``on_nonfinite="propagate"``, whether each microbatch's loss
      is finite (padding counts as finite), shape (N,), in device order under a
      mesh; else None.
  """

  acc: Any
  aux_sums: Any  # a list of arrays and None (or, as out_specs, one spec)
  state: Any
  per_example: Any  # likewise
  noise: Any = None
  batch_weight: Any = None
  loss_finite: Any = None  # per microbatch, whether its loss is finite (on_nonfinite="propagate")


def _psum_exact(tree: Any, axes: tuple[str, ...]) -> Any:
  """``psum`` of scalars and aux sums in one all-reduce: int32 counts travel as
  float32 (exact below 2**24), where XLA would give them an all-reduce of their
  own. Integer aux sums stay integers, exact."""
  def is_count(x):
    return x.dtype == jnp.int32
  wide = jax.tree.map(lambda x: x.astype(jnp.float32) if is_count(x) else x, tree)
  summed = jax.lax.psum(wide, axes)
  return jax.tree.map(lambda s, x: s.astype(x.dtype) if is_count(x) else s, summed, tree)


def reduce(
    plan: Plan, sums: LocalSums, grad_kinds: Sequence[str] | None = None,
    aux_kinds: Sequence[str] | None = None,
) -> LocalSums:
  """The one cross-device reduction after the loop (inside ``shard_map``).

  Gradient leaves as the plan says; the loss, weights, counts, aux sums and
  noise sums added over every data axis; a threaded state averaged (as a
  synchronised BatchNorm would). A narrow accumulator holds a running mean,
  which ``_core.merge`` weighs by each device's kept weight. "max" and "last"
  leaves (``grad_kinds``, ``aux_kinds``: per leaf of the gradient and of the aux
  sums; None: none) go apart, to ``_core.merge_statistics``.
  """
  acc = sums.acc
  value, grads = acc.total
  grad_leaves = jax.tree.leaves(grads)
  # One kind per entry of aux_sums, the None of per-example leaves included.
  aux_kinds = ("sum",) * len(sums.aux_sums) if aux_kinds is None else aux_kinds
  kinds = [*_core.per_leaf(grad_kinds, grad_leaves), *aux_kinds]
  local = [*grad_leaves, *sums.aux_sums]
  statistics = [x if _core.is_statistic(k) else None for x, k in zip(local, kinds)]
  rest = [None if _core.is_statistic(k) else x for x, k in zip(local, kinds)]
  grad_leaves, aux_sums = rest[:len(grad_leaves)], rest[len(grad_leaves):]
  narrow = any(_core.is_narrow(x.dtype) for x in jax.tree.leaves((value, grad_leaves)))
  if narrow:
    merged = _core.merge(acc._replace(total=(value, grad_leaves)), plan.axes)
    value, grad_leaves = merged.total
    scalars = (merged.weight, merged.count, merged.num_skipped)
    noise, aux_sums = _psum_exact((sums.noise, aux_sums), plan.axes)
  else:
    value, scalars, noise, aux_sums = _psum_exact(
        (value, (acc.weight, acc.count, acc.num_skipped), sums.noise, aux_sums), plan.axes
    )
    grad_leaves = [
        None if g is None else _reduce_leaf(g, leaf, plan)
        for g, leaf in zip(grad_leaves, plan.leaves)
    ]
  if any(x is not None for x in statistics):
    statistics = _core.merge_statistics(statistics, kinds, acc.weight > 0, plan.axes)
    both = [x if s is None else s for x, s in zip([*grad_leaves, *aux_sums], statistics)]
    grad_leaves, aux_sums = both[:len(grad_leaves)], both[len(grad_leaves):]
  state = jax.tree.map(
      lambda s: jax.lax.pmean(s, plan.axes) if jnp.issubdtype(s.dtype, jnp.inexact) else s,
      sums.state,
  )
  acc = _core.Accumulator((value, jax.tree.unflatten(plan.treedef, grad_leaves)), *scalars)
  return LocalSums(acc, aux_sums, state, sums.per_example, noise, sums.batch_weight,
                   sums.loss_finite)


def _is_dynamic(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _arg_specs(
    args: tuple[Any, ...], batch_argnums: tuple[int, ...], param_argnums: tuple[int, ...],
    plan: Plan,
) -> list[P]:
  """Per leaf of ``args``: the batch split over the data axes, parameters as the
  plan says (its leaves follow ``param_argnums``' order), anything else
  replicated over the data axes."""
  plans = iter(plan.leaves)
  param_specs = {
      n: [next(plans).spec for _ in jax.tree.leaves(args[n])] for n in param_argnums
  }
  specs = []
  for i, arg in enumerate(args):
    if i in batch_argnums:
      specs += [P(plan.axes)] * len(jax.tree.leaves(arg))
    else:
      specs += param_specs.get(i) or [P()] * len(jax.tree.leaves(arg))
  return specs


def grad_specs(plan: Plan) -> Any:
  """The out specs of the gradients: each leaf sharded as its parameter."""
  return jax.tree.unflatten(plan.treedef, [leaf.spec for leaf in plan.leaves])


def map_devices(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    batch_argnums: tuple[int, ...],
    param_argnums: tuple[int, ...],
    plan: Plan,
    out_specs: Any,
) -> Any:
  """``fn(args, shard_index)`` on each device's rows of the batch and shards of the
  parameters, inside ``jax.shard_map`` over the data axes (``out_specs``: its
  outputs' specs).

  Non-array leaves of the arguments (an Equinox module's functions, Python
  objects) do not enter ``shard_map``.
  """
  leaves, treedef = jax.tree.flatten(args)
  dynamic = [x if _is_dynamic(x) else None for x in leaves]
  in_specs = _arg_specs(args, batch_argnums, param_argnums, plan)
  mesh = plan.mesh
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    # Under explicit sharding shard_map takes arguments only as its specs say.
    dynamic = [
        None if x is None else jax.reshard(x, NamedSharding(mesh, _full_spec(x, spec, mesh)))
        for x, spec in zip(dynamic, in_specs)
    ]

  # The data axes along which each leaf enters the same on every device.
  same = [tuple(a for a in plan.axes if a not in spec_axes(spec)) for spec in in_specs]

  def per_device(dynamic_leaves):
    local = [s if d is None else _varying(d, axes)
             for d, s, axes in zip(dynamic_leaves, leaves, same)]
    return fn(jax.tree.unflatten(treedef, local), jax.lax.axis_index(plan.axes))

  # check_vma=False: with JAX's varying-axis checks on, a lax.pmean over a vmap
  # axis name in fun (as eqx.nn.BatchNorm's) fails with a bare AssertionError in
  # pvary, a JAX bug (reproduced in docs/development.md; tests/test_sharding.py
  # pins it). The replicated arguments are already marked varying as they enter
  # (_varying); what else turning the checks on needs: the microbatch scan's
  # initial carries made from constants (the accumulator's sums and counts,
  # _core.init) marked the same way, or the scan refuses them. axis_names: only the
  # data axes are manual, so parameters sharded over other mesh axes keep that
  # sharding (and so do their gradients).
  return jax.shard_map(
      per_device, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=False,
      axis_names=set(plan.axes),
  )(dynamic)


def _varying(x: Any, axes: tuple[str, ...]) -> Any:
  """``x``, which enters ``shard_map`` the same on every device along ``axes``,
  marked as varying along them: a no-op with the varying-axis checks off. With them
  on, what each device derives from it (the gradient of a replicated parameter)
  stays its own partial sum until the one psum after the microbatch loop, as with
  them off; unmarked, the checks all-reduce that gradient inside the loop, once per
  microbatch (seen on 8 CPU devices, jax 0.10.2, with a scan of the gradients of a
  replicated matrix)."""
  if not axes:
    return x
  if hasattr(jax.lax, "pcast"):  # jax 0.8.2 and later; pvary is gone in 0.10
    return jax.lax.pcast(x, axes, to="varying")
  pvary = getattr(jax.lax, "pvary", None)
  return x if pvary is None else pvary(x, axes)


def run(
    local_sums: Callable[..., LocalSums],
    args: tuple[Any, ...],
    *,
    batch_argnums: tuple[int, ...],
    param_argnums: tuple[int, ...],
    plan: Plan,
    grad_kinds: Sequence[str] | None = None,
    aux_kinds: Sequence[str] | None = None,
) -> LocalSums:
  """Runs ``local_sums`` on each device's rows and shards; reduces once after
  (``grad_kinds``, ``aux_kinds``: see :func:`reduce`).

  Per-example outputs are concatenated in device order, which is batch order.
  """
  grads = grad_specs(plan)
  out_specs = LocalSums(
      acc=_core.Accumulator((P(), grads), *(P(),) * 3),  # type: ignore[arg-type]
      aux_sums=P(), state=P(),
      per_example=P(plan.axes), noise=P(), batch_weight=P(), loss_finite=P(plan.axes),
  )
  return map_devices(
      lambda args, shard_index: reduce(plan, local_sums(args, shard_index), grad_kinds, aux_kinds),
      args, batch_argnums=batch_argnums, param_argnums=param_argnums, plan=plan,
      out_specs=out_specs,
  )


def _full_spec(x: Any, spec: P, mesh: Any) -> P:
  """``spec`` over the data axes, keeping the other (automatic or explicit) axes of
  ``x``'s own sharding, for ``jax.reshard`` under explicit axes."""
  own = spec_of(x) or P()
  manual = set(mesh.axis_names) & {a for e in spec for a in _spec_entries(e)}
  entries = []
  ndim = jnp.ndim(x)
  for dim in range(ndim):
    mine = spec[dim] if dim < len(spec) else None
    theirs = own[dim] if dim < len(own) else None
    others = tuple(a for a in _spec_entries(theirs) if a not in manual and a not in spec_axes(spec))
    names = _spec_entries(mine) + others
    entries.append(None if not names else names[0] if len(names) == 1 else names)
  return P(*entries)


def spec_axes(spec: P) -> set[str]:
  return {a for e in spec for a in _spec_entries(e)}
