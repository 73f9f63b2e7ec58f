"""The data-parallel path: local accumulation, one reduction per call.

Under ``jax.jit`` with a sharded batch, a plain ``lax.scan`` over microbatches
reduces the gradient across devices inside the loop: N microbatches, N
all-reduces. Here each device scans its own shard of the batch inside
``jax.shard_map`` and keeps un-normalised local sums; the sums of all devices
are added once, after the loop, and normalised by the global weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum_jax import _core


def resolve_mesh(mesh: Any, data_axis: str | None) -> tuple[Any, str]:
  """The mesh to use (``mesh`` or the ambient one) and its data axis."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError(
          f"data_axis={data_axis!r} is given but there is no mesh: pass mesh=, or set"
          " one with `with jax.set_mesh(mesh):` around the call."
      )
  names = tuple(mesh.axis_names)
  if data_axis is None:
    if len(names) != 1:
      raise ValueError(
          f"The mesh has axes {names}: pass data_axis= to name the one the batch is"
          " sharded over."
      )
    data_axis = names[0]
  if data_axis not in names:
    raise ValueError(f"data_axis={data_axis!r} is not an axis of the mesh, whose axes are {names}.")
  return mesh, data_axis


class LocalSums(NamedTuple):
  """What one device's scan over its microbatches leaves, before normalisation.

  Attributes:
    acc: the weighted sums of ``(value, grads)``, an ``_core.Accumulator``.
    aux_sums: per aux leaf, its running sum, or None for a per-example leaf.
    state: the threaded state after the last microbatch (None without one).
    per_example: per aux leaf, its outputs in batch order (``"concat"``), or
      stacked by microbatch (``"stack"``), or None for a summed leaf.
    noise: the sums of the gradient-noise estimate, an ``_noise.NoiseSums``, or
      None without ``gradient_noise``.
  """

  acc: Any
  aux_sums: Any  # a list of arrays and None (or, as out_specs, one spec)
  state: Any
  per_example: Any  # likewise
  noise: Any = None


def _is_dynamic(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _leaf_specs(args: tuple[Any, ...], batch_argnums: tuple[int, ...], axis: str) -> list[P]:
  """Per leaf of ``args``: split over ``axis`` for a batch argument, else replicated."""
  return [
      P(axis) if i in batch_argnums else P()
      for i, arg in enumerate(args)
      for _ in jax.tree.leaves(arg)
  ]


def _psum(sums: Any, aux_sums: Any, axis: str) -> tuple[Any, Any]:
  """``psum`` of both as one all-reduce: the int32 counts of ``sums`` travel as
  float32 beside the gradients (exact below 2**24), where XLA would give them an
  all-reduce of their own. Integer aux sums stay integers, exact."""
  def is_count(x):
    return x.dtype == jnp.int32
  wide = jax.tree.map(lambda x: x.astype(jnp.float32) if is_count(x) else x, sums)
  summed, aux_sums = jax.lax.psum((wide, aux_sums), axis)
  return jax.tree.map(lambda s, x: s.astype(x.dtype) if is_count(x) else s, summed, sums), aux_sums


def data_parallel(
    local_sums: Callable[..., LocalSums],
    args: tuple[Any, ...],
    *,
    batch_argnums: tuple[int, ...],
    mesh: Any,
    axis: str,
) -> LocalSums:
  """Runs ``local_sums`` on each device's shard of the batch; reduces once.

  Sums and counts are added over the devices, a threaded state is averaged (as a
  synchronised BatchNorm would), and per-example outputs are concatenated in
  device order, which is batch order. Non-array leaves of the arguments (an
  Equinox module's functions, Python objects) do not enter ``shard_map``.
  """
  leaves, treedef = jax.tree.flatten(args)
  dynamic = [x if _is_dynamic(x) else None for x in leaves]
  in_specs = _leaf_specs(args, batch_argnums, axis)
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    # Under explicit sharding shard_map takes arguments only as its specs say.
    dynamic = [
        None if x is None else jax.reshard(x, NamedSharding(mesh, spec))
        for x, spec in zip(dynamic, in_specs)
    ]

  def per_device(dynamic_leaves):
    local = [d if d is not None else s for d, s in zip(dynamic_leaves, leaves)]
    sums = local_sums(jax.tree.unflatten(treedef, local), jax.lax.axis_index(axis))
    # The one cross-device reduction of the call. A narrow accumulator holds a
    # running mean, which `_core.merge` weighs by each device's weight first.
    # Each device's microbatch is a small batch of the noise estimate.
    if any(_core.is_narrow(x.dtype) for x in jax.tree.leaves(sums.acc.total)):
      acc = _core.merge(sums.acc, axis)
      noise, aux_sums = _psum(sums.noise, sums.aux_sums, axis)
    else:
      (acc, noise), aux_sums = _psum((sums.acc, sums.noise), sums.aux_sums, axis)
    state = jax.tree.map(
        lambda s: jax.lax.pmean(s, axis) if jnp.issubdtype(s.dtype, jnp.inexact) else s,
        sums.state,
    )
    return LocalSums(acc, aux_sums, state, sums.per_example, noise)

  out_specs = LocalSums(acc=P(), aux_sums=P(), state=P(), per_example=P(axis), noise=P())
  # check_vma=False: the gradient of a replicated argument stays a per-device
  # partial sum until the explicit psum above, instead of being all-reduced in
  # every iteration of the scan. axis_names: only the data axis is manual, so
  # parameters sharded over other mesh axes keep their sharding (and so do
  # their gradients).
  return jax.shard_map(
      per_device, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=False,
      axis_names={axis},
  )(dynamic)
