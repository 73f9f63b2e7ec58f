"""Many devices: the plan of :mod:`._sharding` carried out inside ``jax.shard_map``.

Each device scans its own rows of the batch; per differentiated leaf, what the
:class:`._sharding.Plan` says crosses devices: the shards gathered for ``fun``
(:func:`gather`), each microbatch's gradient reduce-scattered into a shard of the
accumulator (:func:`scatter`), and after the loop the one reduction of the sums
(:func:`reduce`). :func:`run` maps a device's loop over the mesh. Only a call
with a mesh enters this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum_jax import _core
from accum_jax._inside_step._result import LocalSums
from accum_jax._inside_step._sharding import (
  LeafPlan,
  Plan,
  _spec_entries,
  num_shards,
  spec_axes,
  spec_of,
)


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


def _own_shard(x: jax.Array, leaf: LeafPlan, plan: Plan) -> jax.Array:
  for dim, axes in leaf.gathers:
    size = x.shape[dim] // num_shards(plan.mesh, axes)
    x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * size, size, dim)
  return x


def own_shards(plan: Plan | None, grads: Any) -> Any:
  """This device's shard of each sharded leaf of full-size ``grads`` that every
  device holds alike (the loss's direct gradient, a merged running mean)."""
  if plan is None or not plan.sharded:
    return grads
  leaves = [_own_shard(x, leaf, plan) for x, leaf in zip(jax.tree.leaves(grads), plan.leaves)]
  return jax.tree.unflatten(plan.treedef, leaves)


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
  if any(_core.holds_mean(x) for x in jax.tree.leaves((value, grad_leaves))):
    # Every device holds the merged mean whole: it keeps its own shards.
    merged = _core.merge(acc._replace(total=(value, grad_leaves)), plan.axes)
    value, grad_leaves = merged.total
    grad_leaves = [None if g is None else _own_shard(g, leaf, plan)
                   for g, leaf in zip(grad_leaves, plan.leaves)]
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
