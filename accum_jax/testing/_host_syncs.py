"""Where a compiled program makes the host wait for the device, on XLA:GPU.

Every loop whose trip count XLA could not prove, and every conditional XLA:GPU keeps,
copies a value to the host and blocks until the device has drained, each time it
runs: inside a microbatch loop, once per microbatch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

from accum_jax.testing import _hlo
from accum_jax.testing._gpu_conditionals import (
    GpuConditional,
    gpu_conditionals,
    judged_after_compiling,
)

_WHILE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+while\(")
_CONDITIONAL = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+conditional\(")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


class Loop(NamedTuple):
  """One ``while`` instruction of a compiled module.

  Attributes:
    name: the instruction's name in the HLO text, e.g. ``"while.2"``.
    op_name: its metadata ``op_name`` (``""`` if none), e.g. ``"jit(step)/while"``,
      to find it in the code that made it.
    trip_count: the trip count XLA proved, or None where it could not prove one
      (on XLA:GPU the host then waits for the predicate every iteration).
    conditionals: the ``conditional`` instructions in its body or condition, at
      any depth (those of nested loops included).
    in_loop: nested in another loop's body or condition.
    in_branch: inside a conditional's branch.

  Examples:
    >>> from accum_jax.testing import Loop
    >>> Loop("while.2", "jit(step)/while", 8, 0, False, False).trip_count
    8
  """

  name: str
  op_name: str
  trip_count: int | None
  conditionals: int
  in_loop: bool
  in_branch: bool


class Conditional(NamedTuple):
  """One ``conditional`` instruction (``lax.cond``, ``lax.switch``) of a compiled module.

  Attributes:
    name: the instruction's name in the HLO text, e.g. ``"cond.1.clone"``.
    op_name: its metadata ``op_name`` (``""`` if none).
    in_loop: in some loop's body or condition, at any depth: on XLA:GPU, a host
      round trip per iteration.
    in_branch: inside another conditional's branch.
    runs: how many times it runs per run of the program at most (the product of
      the trip counts of the loops around it; fewer where it sits in a branch not
      taken), or None where one of those loops has no known trip count.
    gpu_kept: whether XLA:GPU keeps it (see :func:`gpu_conditionals`): True, it
      makes the host wait; False, it becomes selects, so the host does not wait
      but both branches run; None where unknown (only HLO text was given).

  Examples:
    >>> from accum_jax.testing import Conditional
    >>> Conditional("cond.1", "jit(step)/while/body/cond", True, False, 8).runs
    8
  """

  name: str
  op_name: str
  in_loop: bool
  in_branch: bool
  runs: int | None = None
  gpu_kept: bool | None = None


class HostSyncs(NamedTuple):
  """Where a compiled module makes the host wait for the device, on XLA:GPU.

  Returned by :func:`host_syncs`. Each loop of unknown trip count makes the host
  wait once per iteration; each conditional, once each time it runs, unless
  XLA:GPU replaces it by selects (``gpu_kept`` False): then both its branches run
  and the host does not wait.

  Attributes:
    loops: every ``while`` instruction, in text order.
    conditionals: every ``conditional`` instruction, in text order.

  Examples:
    >>> from accum_jax.testing import Conditional, HostSyncs, Loop
    >>> syncs = HostSyncs(
    ...     (Loop("while.2", "jit(step)/while", 8, 1, False, False),),
    ...     (Conditional("cond.1", "jit(step)/while/body/cond", True, False, 8),))
    >>> [c.name for c in syncs.in_loops], syncs.per_run
    (['cond.1'], 8)
    >>> print(syncs)
    kind         name     trips  where      host waits     op_name
    loop         while.2  8      top level  never          jit(step)/while
    conditional  cond.1   -      in loop    8 times a run  jit(step)/while/body/cond
  """

  loops: tuple[Loop, ...]
  conditionals: tuple[Conditional, ...]

  @property
  def in_loops(self) -> tuple[Loop | Conditional, ...]:
    """What makes the host wait once per iteration of an enclosing loop: the
    conditionals inside loops and the nested loops of unknown trip count."""
    loops = tuple(loop for loop in self.loops if loop.in_loop and loop.trip_count is None)
    return loops + tuple(c for c in self._waiting if c.in_loop)

  @property
  def both_branches(self) -> tuple[Conditional, ...]:
    """The conditionals that XLA's GPU compiler replaces by selects.

    They make the host wait for nothing, but both of their branches run every
    time. Known unless only HLO text was given.
    """
    return tuple(c for c in self.conditionals if c.gpu_kept is False)

  @property
  def _waiting(self) -> tuple[Conditional, ...]:
    return tuple(c for c in self.conditionals if c.gpu_kept is not False)

  @property
  def unknown_trip_count(self) -> tuple[Loop, ...]:
    """The loops XLA could not count, nested or not: the host waits every iteration."""
    return tuple(loop for loop in self.loops if loop.trip_count is None)

  @property
  def per_run(self) -> int | None:
    """Host round trips per run of the program (at most, where conditionals sit in
    branches), or None where a loop's trip count is unknown. Loops of known trip
    count add none; each conditional adds one per run of the loops around it."""
    if self.unknown_trip_count:
      return None
    runs = [c.runs for c in self._waiting]
    return None if None in runs else sum(r for r in runs if r is not None)

  def __str__(self) -> str:
    rows = [("kind", "name", "trips", "where", "host waits", "op_name")]
    for loop in self.loops:
      waits = "never" if loop.trip_count is not None else "every iteration"
      trips = "?" if loop.trip_count is None else str(loop.trip_count)
      rows.append(("loop", loop.name, trips, _where(loop), waits, loop.op_name))
    for c in self.conditionals:
      waits = ("every iteration" if c.runs is None
               else "once a run" if c.runs == 1 else f"{c.runs} times a run")
      if c.in_branch and c.runs is not None:
        waits = "at most " + waits
      if c.gpu_kept is False:
        waits = "never: both branches run"
      rows.append(("conditional", c.name, "-", _where(c), waits, c.op_name))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]
        for row in rows
    ).rstrip()


def _where(item: Loop | Conditional) -> str:
  places = [p for p, here in (("in loop", item.in_loop), ("in branch", item.in_branch)) if here]
  return ", ".join(places) or "top level"


class _Read(NamedTuple):
  text: str  # compiled
  gpu_compiled: bool  # XLA:GPU compiled it: every conditional left is one it kept
  predicted: tuple[GpuConditional, ...] | None  # from the program before optimisation


def _read(program: Any) -> _Read:
  """The compiled text of ``program``, which compiler made it, and what XLA:GPU does
  with its conditionals where the program before optimisation was given (a
  ``Lowered``, compiled here)."""
  if isinstance(program, str):
    return _Read(program, False, None)
  import jax  # here, so that reading HLO text alone needs no jax

  program = _hlo.jax_stage(program)
  predicted = None
  if isinstance(program, jax.stages.Lowered):
    predicted = gpu_conditionals(program)
    program = program.compile()
  if isinstance(program, jax.stages.Compiled):
    platform = getattr(getattr(program.runtime_executable(), "client", None), "platform", "")
    return _Read(_hlo.compiled_as_text(program), platform in ("cuda", "rocm", "gpu"),
                 predicted)
  if isinstance(program, (jax.stages.Wrapped, jax.stages.Traced)):
    raise TypeError(
        "host_syncs needs a lowered or compiled program: pass f.lower(*args) or "
        f"f.lower(*args).compile(), not a {type(program).__name__}")
  raise TypeError(
      "host_syncs takes a jax.stages.Lowered (jax.jit(f).lower(*args)), a "
      "jax.stages.Compiled (its .compile()) or the compiled .as_text(), not a "
      f"{type(program).__name__}")


def _gpu_kept(program: Any, read: _Read) -> Callable[[str, str], bool | None]:
  """Whether XLA:GPU keeps a conditional of the compiled text, from its name and
  ``op_name``: True for all where XLA:GPU compiled it; else the prediction from the
  program before optimisation where it names one verdict for that ``op_name``, or
  the rules applied to the compiled program; None where only text was given."""
  if read.gpu_compiled:
    return lambda name, op_name: True
  if isinstance(program, str):
    return lambda name, op_name: None
  after = judged_after_compiling(read.text)

  def kept(name: str, op_name: str) -> bool | None:
    before = {c.kept for c in read.predicted or () if c.op_name == op_name}
    return before.pop() if op_name and len(before) == 1 else after.get(name)

  return kept


def host_syncs(program: Any) -> HostSyncs:
  """The loops and conditionals of a compiled program, and where the host waits.

  On XLA:GPU (where control flow runs as thunks, not captured in a command
  buffer) a ``while`` loop whose trip count XLA could not prove copies its
  predicate to the host and blocks until the stream has drained, every iteration
  (openxla/xla ``xla/backends/gpu/runtime/while_thunk.cc``); a loop of known trip
  count runs its body that many times without asking. Every ``conditional``
  (``lax.cond``, ``lax.switch``) copies its branch index to the host and blocks
  each time it runs (``conditional_thunk.cc``). Inside a microbatch loop, each of
  these stalls the device once per microbatch. XLA records the trip counts it
  proves as ``known_trip_count`` in the compiled HLO (the CPU compiler too, so
  this can be checked on a CPU).

  Some conditionals XLA:GPU replaces by selects (``gpu_kept`` False): they make
  no host wait (left out of ``in_loops`` and ``per_run``) but run both branches
  (``both_branches``). Where XLA:GPU compiled the program, every conditional left
  is one it kept. Otherwise the answer is XLA:GPU's, predicted with the rules of
  :func:`gpu_conditionals`: given a ``Lowered``, it compiles it on the current
  backend for the trip counts and applies them to the program before
  optimisation; given a ``Compiled`` of another backend, which keeps no copy of
  that program (jax 0.10.2), it applies them to the conditionals as that compiler
  left them, the fusions looked into. The two answers agree, except where XLA:CPU
  has removed what kept a conditional (an optimization barrier): pass the
  ``Lowered`` to be sure. Given HLO text alone, which does not say what compiled
  it, ``gpu_kept`` is None and every conditional counts.

  Args:
    program: ``jax.jit(f).lower(*args)`` (or ``nnx.jit``'s), its ``.compile()``,
      or the compiled ``.as_text()``.

  Returns:
    A :class:`HostSyncs` listing every loop and conditional.

  Raises:
    TypeError: ``program`` is not a lowered or compiled program.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from accum_jax.testing import host_syncs
    >>> def total(x):
    ...   return jax.lax.scan(lambda c, xi: (c + xi, None), 0.0, x)[0]
    >>> syncs = host_syncs(jax.jit(total).lower(jnp.ones(8)).compile())
    >>> [loop.trip_count for loop in syncs.loops], syncs.in_loops, syncs.per_run
    ([8], (), 0)
  """
  read = _read(program)
  text = read.text
  comps = _hlo.computations(text)
  # Every call site: (caller, callee, factor), the factor being how many times
  # the callee runs per run of the caller, None where no one can say.
  sites: list[tuple[str, str, int | None]] = []
  whiles: list[tuple[str, str, str, int | None, set[str]]] = []  # (comp, name, op, trips, calls)
  conds: list[tuple[str, str, str]] = []  # (computation, name, op_name)
  for comp, lines in comps.items():
    for line in lines:
      m = _WHILE.match(line)
      if m:
        count = _TRIP_COUNT.search(line)
        trips = int(count.group(1)) if count else None
        called: set[str] = set()
        # XLA:GPU runs a counted loop's body that many times and its condition
        # never (while_thunk.cc): conditionals there cost nothing.
        for key, factor in (("body", trips), ("condition", None if trips is None else 0)):
          callee = re.search(key + r"=%?([\w.\-]+)", line)
          if callee:
            called.add(callee.group(1))
            sites.append((comp, callee.group(1), factor))
        whiles.append((comp, m.group(1), _hlo.op_name(line), trips, called))
        continue
      m = _CONDITIONAL.match(line)
      if m:
        conds.append((comp, m.group(1), _hlo.op_name(line)))
      sites.extend((comp, callee, 1) for callee in _hlo.names(_hlo.CALLED, [line]))
  in_loop = _hlo.closure(set().union(*(called for *_, called in whiles)), comps)
  in_branch = _hlo.inside_branches(comps)
  runs = _runs(comps, sites)
  loops = []
  for comp, name, op_name, trips, called in whiles:
    inside = _hlo.closure(called, comps)
    loops.append(Loop(name, op_name, trips, sum(c in inside for c, *_ in conds),
                      comp in in_loop, comp in in_branch))
  gpu_kept = _gpu_kept(program, read)
  conditionals = tuple(
      Conditional(name, op_name, comp in in_loop, comp in in_branch, runs.get(comp),
                  gpu_kept(name, op_name))
      for comp, name, op_name in conds
  )
  return HostSyncs(tuple(loops), conditionals)


def _runs(comps: dict[str, list[str]], sites: list[tuple[str, str, int | None]]
          ) -> dict[str, int | None]:
  """How many times each computation runs per run of the program: 1 for those no
  one calls (the entry), else the sum over its call sites of the caller's runs
  times the site's factor (an upper bound where a site is a conditional branch)."""
  callers: dict[str, list[tuple[str, int | None]]] = {name: [] for name in comps}
  for caller, callee, factor in sites:
    if callee in callers and caller in comps:
      callers[callee].append((caller, factor))
  memo: dict[str, int | None] = {}

  def runs(name: str, seen: frozenset[str]) -> int | None:
    if name in memo:
      return memo[name]
    if not callers[name] or name in seen:  # a cycle cannot happen in valid HLO
      return 1
    total: int | None = 0
    for caller, factor in callers[name]:
      if factor == 0:
        continue
      outer = runs(caller, seen | {name})
      if total is None or outer is None or factor is None:
        total = None
      else:
        total += outer * factor
    memo[name] = total
    return total

  return {name: runs(name, frozenset()) for name in comps}


def assert_no_host_syncs_in_loops(program: Any) -> None:
  """Fails where the host would wait for the device inside a loop, on XLA:GPU.

  That is, on a loop of unknown trip count (anywhere) and on a conditional or
  such a loop inside another loop; see :func:`host_syncs`.

  Args:
    program: ``jax.jit(f).lower(*args)`` (or ``nnx.jit``'s), its ``.compile()``,
      or the compiled ``.as_text()``.

  Raises:
    AssertionError: naming each such loop and conditional, its ``op_name`` and why.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from accum_jax.testing import assert_no_host_syncs_in_loops
    >>> def total(x):
    ...   return jax.lax.scan(lambda c, xi: (c + xi, None), 0.0, x)[0]
    >>> assert_no_host_syncs_in_loops(jax.jit(total).lower(jnp.ones(8)).compile())
  """
  syncs = host_syncs(program)
  problems = []
  for loop in syncs.unknown_trip_count:
    where = "nested in a loop" if loop.in_loop else "at top level"
    problems.append(f"loop {loop.name} ({loop.op_name or 'no op_name'}), {where}: XLA could "
                    "not prove its trip count, so the host waits for its predicate every "
                    "iteration")
  for cond in syncs.conditionals:
    if cond.in_loop and cond.gpu_kept is not False:
      problems.append(f"conditional {cond.name} ({cond.op_name or 'no op_name'}): inside a "
                      "loop, so the host waits for its branch index every iteration")
  if problems:
    raise AssertionError("the host waits for the device inside loops (on XLA:GPU):\n  "
                         + "\n  ".join(problems))
