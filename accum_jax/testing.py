"""Testing utilities: where the cross-device reductions of a compiled step sit.

``collective_counts`` reads a compiled function's HLO text and counts the
all-reduces, reduce-scatters and all-gathers inside loops and outside them, so a
test (ours or a user's) can check that a microbatched step reduces its gradient
across devices once, after the loop, not in every iteration. Not imported by
``import accum_jax``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ("CollectiveCounts", "collective_counts")

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
_CALLED = re.compile(
    r"(?:body|condition|to_apply|calls|branch_computations|called_computations)="
    r"\{?(%[\w.\-]+(?:,\s*%[\w.\-]+)*)\}?"
)
_COLLECTIVES = ("all-reduce(", "all-reduce-start(", "reduce-scatter(", "all-gather(",
               "all-gather-start(")


class CollectiveCounts(NamedTuple):
  """Cross-device collectives in a compiled module, by where they run.

  Examples:
    >>> from accum_jax.testing import CollectiveCounts
    >>> CollectiveCounts(in_loop=0, outside_loop=1).outside_loop
    1
  """

  in_loop: int  # inside a while loop's body (run once per iteration)
  outside_loop: int  # run once per call


def _computations(hlo_text: str) -> dict[str, list[str]]:
  comps: dict[str, list[str]] = {}
  name = None
  for line in hlo_text.splitlines():
    if name is None:
      m = _HEADER.match(line)
      if m:
        name = m.group(1)
        comps[name] = []
    elif line.startswith("}"):
      name = None
    else:
      comps[name].append(line)
  return comps


def _called(lines: list[str]) -> set[str]:
  names: set[str] = set()
  for line in lines:
    for m in _CALLED.finditer(line):
      names.update(n.strip().lstrip("%") for n in m.group(1).split(","))
  return names


def collective_counts(hlo_text: str) -> CollectiveCounts:
  """Counts collective ops inside and outside while-loop bodies.

  Args:
    hlo_text: ``jax.jit(f).lower(...).compile().as_text()``.

  Returns:
    The counts of all-reduce, reduce-scatter and all-gather instructions.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from accum_jax.testing import collective_counts
    >>> hlo = jax.jit(lambda x: 2 * x).lower(jnp.ones(4)).compile().as_text()
    >>> collective_counts(hlo)
    CollectiveCounts(in_loop=0, outside_loop=0)
  """
  comps = _computations(hlo_text)
  loop_bodies = set()
  for lines in comps.values():
    for line in lines:
      if " while(" in line:
        m = re.search(r"body=%?([\w.\-]+)", line)
        if m:
          loop_bodies.add(m.group(1))
  in_loop: set[str] = set()
  todo = list(loop_bodies)
  while todo:
    name = todo.pop()
    if name in in_loop or name not in comps:
      continue
    in_loop.add(name)
    todo.extend(_called(comps[name]))

  def count(names):
    return sum(line.count(op) for n in names for line in comps[n] for op in _COLLECTIVES)

  return CollectiveCounts(count(in_loop), count(set(comps) - in_loop))
