"""The collectives of a compiled program: where each runs, how much it moves, over which axes.

A microbatched step should reduce its gradient once, after the loop, or reduce-scatter
it into shards per microbatch, and nothing more; :func:`collectives` lists what the
compiled program does, :func:`collective_counts` counts it.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import numpy as np

from accum_jax.testing import _hlo

_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[\w\[\],{}:]+?)\s+(?P<kind>" + "|".join(_KINDS) + r")(?:-start)?\("
)
_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
         "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}


class Collective(NamedTuple):
  """One collective instruction of a compiled module.

  Attributes:
    kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``,
      ``"all-to-all"`` or ``"collective-permute"``.
    in_loop: inside a while loop's body (run once per iteration).
    in_branch: inside a conditional's branch (run only when it is taken).
    result_bytes: the bytes of its result on one device.
    group_size: the devices in each of its groups.
    axes: the mesh axes its groups span (with ``mesh`` given), else None.

  Examples:
    >>> from accum_jax.testing import Collective
    >>> c = Collective("all-reduce", False, False, 4096, 8, ("data",))
    >>> c.bytes_sent
    7168
  """

  kind: str
  in_loop: bool
  in_branch: bool
  result_bytes: int
  group_size: int
  axes: tuple[str, ...] | None

  @property
  def bytes_sent(self) -> int:
    """The bytes one device sends in a ring implementation: ``2(n-1)/n`` of the
    data for an all-reduce, ``(n-1)/n`` of the gathered result for an
    all-gather, ``(n-1)`` shards for a reduce-scatter."""
    n = self.group_size
    if n <= 1:
      return 0
    if self.kind == "all-reduce":
      return 2 * (n - 1) * self.result_bytes // n
    if self.kind == "all-gather":
      return (n - 1) * self.result_bytes // n
    if self.kind == "reduce-scatter":
      return (n - 1) * self.result_bytes
    return self.result_bytes


class CollectiveCounts(NamedTuple):
  """Cross-device collectives in a compiled module, by where they run.

  Examples:
    >>> from accum_jax.testing import CollectiveCounts
    >>> CollectiveCounts(in_loop=0, outside_loop=1).outside_loop
    1
  """

  in_loop: int  # inside a while loop's body (run once per iteration)
  outside_loop: int  # run once per call


def _bytes(shape: str) -> int:
  total = 0
  for dtype, dims in _hlo.ARRAY.findall(shape):
    size = math.prod(int(d) for d in dims.split(",") if d)
    total += size * _BITS.get(dtype, 8) // 8
  return total


def _groups(line: str) -> list[list[int]] | None:
  """The replica groups of a collective, as lists of device (partition) ids."""
  m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
  if m:
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    dims = [int(d) for d in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(p) for p in m.group(4).split(",")])
    return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [a for a, _ in axes]
    ids = np.arange(math.prod(int(s) for _, s in axes)).reshape([int(s) for _, s in axes])
    over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
    rest = [i for i in range(len(names)) if i not in over]
    ids = ids.transpose(rest + over)
    return ids.reshape(-1, math.prod(ids.shape[len(rest):]) if over else 1).tolist()
  return None


def _axes(groups: list[list[int]] | None, mesh: Any) -> tuple[str, ...] | None:
  """The mesh axes along which the devices of a group differ."""
  if mesh is None or groups is None:
    return None
  shape = tuple(mesh.devices.shape)
  varying: set[int] = set()
  for group in groups:
    coords = np.array([np.unravel_index(i, shape) for i in group])
    varying.update(int(a) for a in np.nonzero((coords != coords[0]).any(axis=0))[0])
  return tuple(mesh.axis_names[a] for a in sorted(varying))


def collectives(hlo_text: str, mesh: Any = None) -> list[Collective]:
  """The collective instructions of a compiled module, in text order.

  Args:
    hlo_text: ``jax.jit(f).lower(...).compile().as_text()``.
    mesh: the ``jax.sharding.Mesh`` it was compiled for, to name the axes each
      collective runs over (device ids are taken as positions in
      ``mesh.devices``, as ``jax.jit`` assigns them).

  Returns:
    One :class:`Collective` per instruction.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from accum_jax.testing import collectives
    >>> collectives(jax.jit(lambda x: 2 * x).lower(jnp.ones(4)).compile().as_text())
    []
  """
  comps = _hlo.computations(hlo_text)
  loop_bodies = set()
  for lines in comps.values():
    for line in lines:
      if " while(" in line:
        m = re.search(r"body=%?([\w.\-]+)", line)
        if m:
          loop_bodies.add(m.group(1))
  in_loop = _hlo.closure(loop_bodies, comps)
  in_branch = _hlo.inside_branches(comps)
  found = []
  for name, lines in comps.items():
    for line in lines:
      m = _INSTRUCTION.search(line)
      if not m:
        continue
      groups = _groups(line)
      size = max((len(g) for g in groups), default=1) if groups else 1
      shape = m.group("shape")
      if "-start(" in line and shape.startswith("("):
        shape = shape.rsplit(",", 1)[-1]  # the async result's output, last in its tuple
      found.append(Collective(
          m.group("kind"), name in in_loop, name in in_branch, _bytes(shape), size,
          _axes(groups, mesh),
      ))
  return found


def collective_counts(hlo_text: str) -> CollectiveCounts:
  """Counts collective ops inside and outside while-loop bodies.

  Args:
    hlo_text: ``jax.jit(f).lower(...).compile().as_text()``.

  Returns:
    The counts of all-reduce, reduce-scatter, all-gather, all-to-all and
    collective-permute instructions.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from accum_jax.testing import collective_counts
    >>> hlo = jax.jit(lambda x: 2 * x).lower(jnp.ones(4)).compile().as_text()
    >>> collective_counts(hlo)
    CollectiveCounts(in_loop=0, outside_loop=0)
  """
  found = collectives(hlo_text)
  in_loop = sum(c.in_loop for c in found)
  return CollectiveCounts(in_loop, len(found) - in_loop)
