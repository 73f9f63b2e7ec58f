"""The data-parallel path: local accumulation, one reduction per call.

Under ``jax.jit`` with a sharded batch, a plain ``lax.scan`` over microbatches
reduces the gradient across devices inside the loop: N microbatches, N
all-reduces. Here each device scans its own shard of the batch inside
``jax.shard_map`` and keeps un-normalised local sums; the sums of all devices
are added once, after the loop, and normalised by the global weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


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


def data_parallel(
    local_sums: Callable[..., Any],
    finish: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    batch_argnums: tuple[int, ...],
    state_argnums: tuple[int, ...],
    mesh: Any,
    axis: str,
) -> Any:
  """Runs ``local_sums`` on each device's shard, reduces once, ``finish``es."""
  in_specs = tuple(P(axis) if i in batch_argnums else P() for i in range(len(args)))
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    # Under explicit sharding shard_map takes arguments only as its specs say.
    args = jax.reshard(args, tuple(NamedSharding(mesh, spec) for spec in in_specs))

  def per_device(*local_args):
    acc, aux_acc, state, _, shapes = local_sums(local_args, shard_index=jax.lax.axis_index(axis))
    # The one cross-device reduction of the call.
    acc, aux_acc = jax.lax.psum((acc, aux_acc), axis)
    if state_argnums:
      # Each device threaded its own shards; their states are averaged, as a
      # synchronised BatchNorm would.
      state = jax.tree.map(
          lambda s: jax.lax.pmean(s, axis) if jnp.issubdtype(s.dtype, jnp.inexact) else s,
          state,
      )
    return finish(acc, aux_acc, state, None, shapes)

  # check_vma=False: the gradient of a replicated argument stays a per-device
  # partial sum until the explicit psum above, instead of being all-reduced in
  # every iteration of the scan.
  return jax.shard_map(
      per_device, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False
  )(*args)
