"""Testing utilities: which collectives a compiled step runs, where the host waits, and
what XLA:GPU does with its conditionals.

:func:`collectives` reads a compiled function's HLO text and lists its
all-reduces, reduce-scatters, all-gathers, all-to-alls and collective permutes:
whether each sits inside a loop (run once per microbatch) or inside a
conditional branch (run only when the branch is taken), how many bytes it
moves, and, given the mesh, over which mesh axes it runs. A test (ours or a
user's) can then check that a microbatched step reduces its gradient once,
after the loop, or reduce-scatters it into shards per microbatch, and nothing
more. :func:`collective_counts` summarises.

:func:`host_syncs` lists the loops and conditionals of a compiled program: which
loops have a trip count XLA proved, and which conditionals or uncounted loops sit
inside loops, where XLA:GPU makes the host wait for the device once per iteration.
:func:`assert_no_host_syncs_in_loops` fails on the latter.

:func:`gpu_conditionals` predicts, from the program before optimisation, which
conditionals XLA:GPU keeps and which it replaces by selects, running both branches
on every call (a rewrite the CPU compiler never makes, so a CPU-compiled program
cannot show it). :func:`assert_conditionals_kept` fails on the latter.

:func:`opcode_counts`, :func:`copied_shapes` and :func:`kernel_counts` count the
instructions of a compiled program as kernels go: the top-level fusions (on a GPU
about one kernel launch each), the copies XLA inserted and the shapes they move, the
conditionals; :func:`hlo_shape` spells an array's shape as the HLO text does. Not
imported by ``import accum_jax``.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Any, NamedTuple

import numpy as np

__all__ = (
    "Collective",
    "CollectiveCounts",
    "Conditional",
    "HostSyncs",
    "GpuConditional",
    "KernelCounts",
    "Loop",
    "assert_conditionals_kept",
    "assert_no_host_syncs_in_loops",
    "collective_counts",
    "collectives",
    "copied_shapes",
    "gpu_conditionals",
    "hlo_shape",
    "host_syncs",
    "kernel_counts",
    "opcode_counts",
)

# A computation's first line: "name (params) -> shape {" in compiled text, "name {" in the
# unoptimised text of a Lowered.
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_CALLED = re.compile(
    r"(?:body|condition|to_apply|calls|branch_computations|called_computations|"
    r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)
_BRANCHES = re.compile(
    r"(?:branch_computations|true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)
_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[\w\[\],{}:]+?)\s+(?P<kind>" + "|".join(_KINDS) + r")(?:-start)?\("
)
_ARRAY = re.compile(
    r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64|c64|c128|f8\w*)\[([\d,]*)\]"
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


def _names(pattern: re.Pattern[str], lines: list[str]) -> set[str]:
  names: set[str] = set()
  for line in lines:
    for m in pattern.finditer(line):
      names.update(n.strip().lstrip("%") for n in m.group(1).strip("{}").split(","))
  return names


def _closure(roots: set[str], comps: dict[str, list[str]]) -> set[str]:
  """``roots`` and every computation they call."""
  seen: set[str] = set()
  todo = list(roots)
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    todo.extend(_names(_CALLED, comps[name]))
  return seen


def _bytes(shape: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
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
  comps = _computations(hlo_text)
  loop_bodies = set()
  for lines in comps.values():
    for line in lines:
      if " while(" in line:
        m = re.search(r"body=%?([\w.\-]+)", line)
        if m:
          loop_bodies.add(m.group(1))
  in_loop = _closure(loop_bodies, comps)
  in_branch = _closure(set().union(*(_names(_BRANCHES, lines) for lines in comps.values())),
                       comps)
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


_WHILE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+while\(")
_CONDITIONAL = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+conditional\(")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="((?:[^"\\]|\\.)*)"')
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
      but both branches run; None where unknown (only compiled text was given).

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
    time. Known only when a ``Lowered`` was given.
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


def _jax_stage(program: Any) -> Any:
  """``program``, or the JAX stage that a framework's own stage wraps: Flax's
  ``nnx.jit(f).lower(...)`` gives a ``Lowered`` whose ``.lowered`` is JAX's, and
  its ``.compile()`` a ``Compiled`` whose ``.compiled`` is."""
  import jax  # here, so that reading HLO text alone needs no jax

  stages = (jax.stages.Lowered, jax.stages.Compiled)
  if isinstance(program, (str, *stages)):
    return program
  for name in ("lowered", "compiled"):
    if isinstance(inner := getattr(program, name, None), stages):
      return inner
  return program


def _hlo_text(program: Any) -> tuple[str, tuple[GpuConditional, ...] | None]:
  """The compiled text of ``program``, and what XLA:GPU does with its conditionals
  where the unoptimised program was given (a ``Lowered``, compiled here)."""
  if isinstance(program, str):
    return program, None
  import jax  # here, so that reading HLO text alone needs no jax

  program = _jax_stage(program)
  predicted = None
  if isinstance(program, jax.stages.Lowered):
    predicted = gpu_conditionals(program)
    program = program.compile()
  if isinstance(program, jax.stages.Compiled):
    text = program.as_text()
    if text is None:
      raise ValueError("this backend gives no HLO text for the compiled program")
    return text, predicted
  if isinstance(program, (jax.stages.Wrapped, jax.stages.Traced)):
    raise TypeError(
        "host_syncs needs a lowered or compiled program: pass f.lower(*args) or "
        f"f.lower(*args).compile(), not a {type(program).__name__}")
  raise TypeError(
      "host_syncs takes a jax.stages.Lowered (jax.jit(f).lower(*args)), a "
      "jax.stages.Compiled (its .compile()) or the compiled .as_text(), not a "
      f"{type(program).__name__}")


def _gpu_kept(op_name: str, predicted: tuple[GpuConditional, ...] | None) -> bool | None:
  """The prediction for a compiled conditional, matched by ``op_name``; None where
  there is none, or where conditionals of that ``op_name`` were judged differently."""
  verdicts = {c.kept for c in predicted or () if c.op_name == op_name}
  return verdicts.pop() if op_name and len(verdicts) == 1 else None


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

  Given the unoptimised program (a ``Lowered``), it compiles it on the current
  backend for the trip counts and also predicts, with :func:`gpu_conditionals`,
  which conditionals XLA:GPU replaces by selects: those make no host wait (they
  are left out of ``in_loops`` and ``per_run``), but run both branches
  (``both_branches``). Given only compiled text, every conditional counts.

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
  text, predicted = _hlo_text(program)
  comps = _computations(text)
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
        whiles.append((comp, m.group(1), _op_name(line), trips, called))
        continue
      m = _CONDITIONAL.match(line)
      if m:
        conds.append((comp, m.group(1), _op_name(line)))
      sites.extend((comp, callee, 1) for callee in _names(_CALLED, [line]))
  in_loop = _closure(set().union(*(called for *_, called in whiles)), comps)
  in_branch = _closure(set().union(*(_names(_BRANCHES, lines) for lines in comps.values())),
                       comps)
  runs = _runs(comps, sites)
  loops = []
  for comp, name, op_name, trips, called in whiles:
    inside = _closure(called, comps)
    loops.append(Loop(name, op_name, trips, sum(c in inside for c, *_ in conds),
                      comp in in_loop, comp in in_branch))
  conditionals = tuple(
      Conditional(name, op_name, comp in in_loop, comp in in_branch, runs.get(comp),
                  _gpu_kept(op_name, predicted))
      for comp, name, op_name in conds
  )
  return HostSyncs(tuple(loops), conditionals)


def _op_name(line: str) -> str:
  m = _OP_NAME.search(line)
  return m.group(1) if m else ""


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


# What XLA:GPU does with a conditional (openxla/xla): its algebraic simplifier turns the
# index of a two-branch conditional(convert(pred)), which is how lax.cond lowers, into the
# pred itself; then ConditionalSimplifier::TryRemoveConditional (conditional_simplifier.cc)
# replaces a two-branch PRED conditional by selects when both branches hold only the
# opcodes below or elementwise ones, after calls are inlined. Nothing else counts as cheap,
# whatever its size: the rule has no limit on sizes or counts.
_CHEAP = frozenset((
    "broadcast", "concatenate", "dynamic-slice", "get-tuple-element", "reduce", "reshape",
    "pad", "parameter", "slice", "tuple",
))
_ELEMENTWISE = frozenset((
    # HloInstruction::IsElementwise: constants, and the unary, binary and ternary maps.
    "constant", "abs", "round-nearest-afz", "round-nearest-even", "ceil",
    "count-leading-zeros", "convert", "bitcast-convert", "copy", "cosine", "erf",
    "exponential", "exponential-minus-one", "floor", "imag", "is-finite", "log",
    "log-plus-one", "not", "negate", "popcnt", "real", "reduce-precision", "rsqrt",
    "logistic", "sign", "sine", "sqrt", "cbrt", "tan", "tanh", "stochastic-convert", "add",
    "atan2", "compare", "complex", "divide", "maximum", "minimum", "multiply", "power",
    "remainder", "subtract", "and", "or", "xor", "shift-left", "shift-right-arithmetic",
    "shift-right-logical", "select", "clamp", "map", "rng",
))
_SIDE_EFFECTS = frozenset((
    "rng", "rng-get-and-update-state", "send", "send-done", "recv", "recv-done", "infeed",
    "outfeed",
))
# A branch of only these that returns an array is "empty": a select would cost more.
_PASS_THROUGH = frozenset(("parameter", "tuple", "get-tuple-element"))
_INSTRUCTION_LINE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


class _Instruction(NamedTuple):
  name: str
  opcode: str
  shape: str
  operands: tuple[str, ...]
  line: str


class _Computation(NamedTuple):
  instructions: dict[str, _Instruction]  # in text order
  root: str


def _balanced(text: str, start: int) -> int:
  """The index just past the parenthesis that closes the one at ``start``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


def _instruction(line: str) -> tuple[_Instruction, bool] | None:
  m = _INSTRUCTION_LINE.match(line)
  if not m:
    return None
  rest = m.group(3)
  end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
  op = re.match(r"\s*([\w\-]+)\(", rest[end:])
  if end < 0 or not op:
    return None
  args_start = end + op.end() - 1
  args = rest[args_start + 1:_balanced(rest, args_start) - 1]
  operands = tuple(re.findall(r"%?([\w.\-]+)(?=\s*(?:,|$))", args))
  return _Instruction(m.group(2), op.group(1), rest[:end], operands, line), bool(m.group(1))


def _parse(hlo_text: str) -> dict[str, _Computation]:
  parsed = {}
  for name, lines in _computations(hlo_text).items():
    instructions, root = {}, ""
    for line in lines:
      found = _instruction(line)
      if found:
        instructions[found[0].name] = found[0]
        root = found[0].name if found[1] else root
    parsed[name] = _Computation(instructions, root)
  return parsed


class GpuConditional(NamedTuple):
  """What XLA:GPU does with one ``conditional`` (``lax.cond``, ``lax.switch``).

  Attributes:
    name: the conditional's name in the HLO text, e.g. ``"cond.1"``.
    op_name: its metadata ``op_name`` (``""`` if none), e.g. ``"jit(step)/cond"``.
    kept: True where XLA:GPU keeps the conditional (one branch runs, after the host
      has read the index); False where it becomes selects: both branches run on
      every call and the host does not wait.
    reason: which rule decided, naming the instruction that did.

  Examples:
    >>> from accum_jax.testing import GpuConditional
    >>> c = GpuConditional("cond.1", "jit(step)/cond", True, "branch 1 holds a dot (dot.3)")
    >>> c.kept
    True
  """

  name: str
  op_name: str
  kept: bool
  reason: str


def _lowered_text(program: Any) -> str:
  if isinstance(program, str):
    return program
  import jax  # here, so that reading HLO text alone needs no jax

  program = _jax_stage(program)
  if isinstance(program, jax.stages.Lowered):
    return program.as_text(dialect="hlo", debug_info=True)
  if isinstance(program, jax.stages.Compiled):
    raise TypeError(
        "gpu_conditionals needs the unoptimised program, as XLA:GPU receives it: pass "
        "jax.jit(f).lower(*args), not its .compile(), which another backend has already "
        "optimised")
  raise TypeError(
      "gpu_conditionals takes a jax.stages.Lowered (jax.jit(f).lower(*args)) or its "
      f".as_text(dialect='hlo'), not a {type(program).__name__}")


def gpu_conditionals(program: Any) -> tuple[GpuConditional, ...]:
  """Predicts which conditionals XLA:GPU keeps and which it turns into selects.

  XLA:GPU's algebraic simplifier turns the index of a two-branch
  ``conditional(convert(pred))``, which is how ``jax.lax.cond`` lowers, into the
  boolean itself (openxla/xla 433638e0). Its ``simplify-conditional`` pass
  (``ConditionalSimplifier::TryRemoveConditional``) then replaces a two-branch
  conditional on a boolean by selects when every instruction of both branches is
  cheap: elementwise, or a broadcast, concatenate, dynamic-slice,
  get-tuple-element, reduce, reshape, pad, parameter, slice or tuple, calls being
  inlined first. Both branches then run on every call. It keeps the conditional
  when something in it has a side effect, when there are not exactly two
  branches, when the index is not a converted boolean (``lax.switch`` clamps its
  index), when a branch holds anything else (a dot, transpose, iota, while loop,
  custom call, optimization barrier, a conditional it keeps, ...), or when a
  branch only passes values through. The CPU compiler keeps every conditional,
  so a CPU-compiled program cannot show this; this function applies the rules
  to the program before optimisation.

  Other simplifications can change what a branch holds before the rule runs (a
  dot with a vector operand may become a multiply and a reduce; a transpose of
  size-1 dimensions a reshape), and a conditional whose index is a constant is
  inlined: the predictions are for the program as written.

  Args:
    program: ``jax.jit(f).lower(*args)`` (or ``nnx.jit``'s), or its
      ``.as_text(dialect="hlo")``.

  Returns:
    One :class:`GpuConditional` per conditional, in text order.

  Raises:
    TypeError: ``program`` is compiled, or not a program.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from accum_jax.testing import gpu_conditionals
    >>> def step(x, n):
    ...   return jax.lax.cond(n % 8 == 0, lambda x: 2 * x, lambda x: x + 1, x)
    >>> (c,) = gpu_conditionals(jax.jit(step).lower(jnp.ones(4), 0))
    >>> c.op_name, c.kept, c.reason
    ('jit(step)/cond', False, 'all instructions cheap: both branches run')
  """
  comps = _parse(_lowered_text(program))
  prefixes = _op_name_prefixes(comps)
  memo: dict[str, tuple[bool, str]] = {}
  found = []
  for name, comp in comps.items():
    for instr in comp.instructions.values():
      if instr.opcode == "conditional":
        kept, reason = _judge(instr, comp, comps, memo)
        op_name = "/".join(p for p in (prefixes.get(name, ""), _op_name(instr.line)) if p)
        found.append(GpuConditional(instr.name, op_name, kept, reason))
  return tuple(found)


def _op_name_prefixes(comps: dict[str, _Computation]) -> dict[str, str]:
  """What to put before the op_names of each computation. JAX names the instructions
  of a called function relative to the call (``cond``, not ``jit(f)/.../cond``), and
  inlining the call prefixes the call's own op_name, as the compiled text shows."""
  parents: dict[str, tuple[str, _Instruction]] = {}
  for name, comp in comps.items():
    for instr in comp.instructions.values():
      for callee in _names(_CALLED, [instr.line]):
        parents.setdefault(callee, (name, instr))
  prefixes: dict[str, str] = {}

  def prefix(name: str, seen: frozenset[str]) -> str:
    if name not in prefixes:
      parent, site = parents.get(name, ("", None))
      outer = prefix(parent, seen | {name}) if site and parent not in seen else ""
      if site is not None and site.opcode == "call":
        outer = "/".join(p for p in (outer, _op_name(site.line)) if p)
      prefixes[name] = outer
    return prefixes[name]

  for name in comps:
    prefix(name, frozenset())
  return prefixes


def _judge(cond: _Instruction, comp: _Computation, comps: dict[str, _Computation],
           memo: dict[str, tuple[bool, str]]) -> tuple[bool, str]:
  """(kept, reason) for one conditional, in the order TryRemoveConditional checks."""
  if cond.name not in memo:
    branches = [name.strip().lstrip("%") for m in _BRANCHES.finditer(cond.line)
                for name in m.group(1).strip("{}").split(",")]
    memo[cond.name] = (
        _side_effect(branches, comps) or _shape_of_choice(cond, comp, branches)
        or _expensive(branches, comps, memo) or _passes_through(branches, comps)
        or (False, "all instructions cheap: both branches run"))
  return memo[cond.name]


def _side_effect(branches: list[str], comps: dict[str, _Computation]
                 ) -> tuple[bool, str] | None:
  for name in sorted(_closure(set(branches), {k: [i.line for i in c.instructions.values()]
                                              for k, c in comps.items()})):
    for instr in comps[name].instructions.values():
      if instr.opcode in _SIDE_EFFECTS or "custom_call_has_side_effect=true" in instr.line:
        return True, f"{instr.name} ({instr.opcode}) has a side effect"
  return None


def _shape_of_choice(cond: _Instruction, comp: _Computation, branches: list[str]
                     ) -> tuple[bool, str] | None:
  if len(branches) != 2:
    return True, f"{len(branches)} branches: only two can become selects"
  index = comp.instructions.get(cond.operands[0]) if cond.operands else None
  if index is None or index.shape.startswith("pred["):
    return None
  source = comp.instructions.get(index.operands[0]) if index.operands else None
  if index.opcode == "convert" and source is not None and source.shape.startswith("pred["):
    return None
  return True, (f"its index {index.name} is an integer {index.opcode}, not a converted "
                "boolean, so it stays an integer")


def _live(name: str, comps: dict[str, _Computation]) -> list[_Instruction]:
  """The instructions of a computation that its root uses, calls inlined (as XLA:GPU
  inlines them and removes dead code before the rule runs), in text order."""
  comp = comps[name]
  used: set[str] = set()
  todo = [comp.root]
  while todo:
    instr = comp.instructions.get(todo.pop())
    if instr is not None and instr.name not in used:
      used.add(instr.name)
      todo.extend(instr.operands)
  live = []
  for instr in comp.instructions.values():
    if instr.name in used and instr.opcode == "call":
      callee = re.search(r"to_apply=%?([\w.\-]+)", instr.line)
      live.extend(_live(callee.group(1), comps) if callee and callee.group(1) in comps
                  else [instr])
    elif instr.name in used:
      live.append(instr)
  return live


def _expensive(branches: list[str], comps: dict[str, _Computation],
               memo: dict[str, tuple[bool, str]]) -> tuple[bool, str] | None:
  for i, branch in enumerate(branches):
    for instr in _live(branch, comps):
      if instr.opcode in _CHEAP or instr.opcode in _ELEMENTWISE:
        continue
      if instr.opcode == "conditional" and not _judge(instr, comps[branch], comps, memo)[0]:
        continue  # replaced by selects first, its branches inlined: all cheap
      if instr.opcode == "conditional":
        return True, f"branch {i} holds {instr.name}, a conditional XLA:GPU keeps"
      article = "an" if instr.opcode[0] in "aeiou" else "a"
      return True, f"branch {i} holds {article} {instr.opcode} ({instr.name})"
  return None


def _passes_through(branches: list[str], comps: dict[str, _Computation]
                    ) -> tuple[bool, str] | None:
  for i, branch in enumerate(branches):
    live = _live(branch, comps)
    root = comps[branch].instructions.get(comps[branch].root)
    if (all(instr.opcode in _PASS_THROUGH for instr in live) and root is not None
        and _ARRAY.search(root.shape)):
      return True, f"branch {i} only passes its operands through"
  return None


def assert_conditionals_kept(program: Any) -> None:
  """Fails where XLA:GPU would replace a conditional by selects (both branches run).

  See :func:`gpu_conditionals` for the rules.

  Args:
    program: ``jax.jit(f).lower(*args)`` (or ``nnx.jit``'s), or its
      ``.as_text(dialect="hlo")``.

  Raises:
    AssertionError: naming each such conditional, its ``op_name`` and why.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from accum_jax.testing import assert_conditionals_kept
    >>> def step(w, n):
    ...   return jax.lax.cond(n % 8 == 0, lambda w: w @ w, lambda w: w, w)
    >>> assert_conditionals_kept(jax.jit(step).lower(jnp.ones((4, 4)), 0))
  """
  flattened = [c for c in gpu_conditionals(program) if not c.kept]
  if flattened:
    raise AssertionError(
        "XLA:GPU would replace these conditionals by selects, running both branches on "
        "every call:\n  " + "\n  ".join(
            f"{c.name} ({c.op_name or 'no op_name'}): {c.reason}" for c in flattened))


# Counting a compiled program's instructions. The scopes: "entry", the entry
# computation's instructions (a fusion there is one kernel; its body is not looked
# into); "entry+branches", those and the instructions of its conditionals' branches,
# nested ones too (each also a kernel or a thunk, whether or not the branch runs);
# "all", every computation's, the bodies of fusions and loops included.
_SCOPES = ("entry", "entry+branches", "all")
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.MULTILINE)
_LAYOUT = re.compile(r"\{[^}]*\}")


def _compiled_text(program: Any, reader: str) -> str:
  if isinstance(program, str):
    return program
  import jax  # here, so that reading HLO text alone needs no jax

  program = _jax_stage(program)
  if isinstance(program, jax.stages.Compiled):
    text = program.as_text()
    if text is None:
      raise ValueError("this backend gives no HLO text for the compiled program")
    return text
  raise TypeError(
      f"{reader} reads a compiled program: pass jax.jit(f).lower(*args).compile() or its "
      f".as_text(), not a {type(program).__name__}")


def _scoped(program: Any, where: str, reader: str) -> list[_Instruction]:
  """The instructions of ``program`` in scope ``where`` (see ``_SCOPES``), in text order."""
  if where not in _SCOPES:
    raise ValueError(f"where={where!r} is not one of {_SCOPES}")
  text = _compiled_text(program, reader)
  comps = _computations(text)
  if where == "all":
    names = list(comps)
  else:
    entry = _ENTRY.search(text)
    if entry is None or entry.group(1) not in comps:
      raise ValueError("the HLO text has no ENTRY computation")
    names, pending = [], [entry.group(1)]
    while pending:
      name = pending.pop()
      if name in comps and name not in names:
        names.append(name)
        if where == "entry+branches":
          pending.extend(sorted(_names(_BRANCHES, comps[name])))
  found = []
  for name in names:
    for line in comps[name]:
      parsed = _instruction(line)
      if parsed:
        found.append(parsed[0])
  return found


def opcode_counts(program: Any, where: str = "entry") -> collections.Counter[str]:
  """How many instructions of each opcode a compiled program holds.

  Args:
    program: ``jax.jit(f).lower(*args).compile()`` (or ``nnx.jit``'s), or its
      ``.as_text()``.
    where: ``"entry"``, the entry computation (each fusion there is one kernel;
      its body is not looked into); ``"entry+branches"``, also the branches of
      its conditionals, nested ones too; ``"all"``, every computation, the
      bodies of fusions and loops included.

  Returns:
    A ``collections.Counter`` from opcode (``"fusion"``, ``"copy"``,
    ``"conditional"``, ``"while"``, ``"all-reduce-start"``, ...) to count; 0 for
    any opcode it does not hold.

  Raises:
    TypeError: ``program`` is not compiled (a ``Lowered`` is not yet optimised).
    ValueError: ``where`` is none of the above.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from accum_jax.testing import opcode_counts
    >>> def step(x, n):
    ...   return jax.lax.cond(n > 0, lambda x: x @ x, lambda x: x + 1, x)
    >>> compiled = jax.jit(step).lower(jnp.ones((4, 4)), 1).compile()
    >>> counts = opcode_counts(compiled)
    >>> counts["conditional"], counts["while"]
    (1, 0)
  """
  return collections.Counter(i.opcode for i in _scoped(program, where, "opcode_counts"))


def copied_shapes(program: Any, where: str = "entry+branches") -> list[str]:
  """The shapes that a compiled program's ``copy`` instructions move, layouts left out.

  XLA inserts a copy where a value cannot stay in the buffer it was computed in:
  an output given the buffer of a donated input that another output took, a value
  a conditional's branch passes through, a layout change. At the top level and
  in conditionals' branches (the default ``where``) each is a kernel that moves a
  buffer; a copy inside a fusion is a layout change within a kernel.

  Args:
    program: ``jax.jit(f).lower(*args).compile()``, or its ``.as_text()``.
    where: which computations to read, as for :func:`opcode_counts`.

  Returns:
    One shape per copy, in text order, as ``"f32[64,256]"`` or ``"s32[]"``; see
    :func:`hlo_shape` to spell an array's.

  Examples:
    >>> from accum_jax.testing import copied_shapes
    >>> hlo = '''
    ... ENTRY %main (p: f32[4,4], n: s32[]) -> (f32[4,4], s32[]) {
    ...   %p = f32[4,4]{1,0} parameter(0)
    ...   %n = s32[] parameter(1)
    ...   %copy = f32[4,4]{0,1} copy(%p)
    ...   %copy.1 = s32[] copy(%n)
    ...   ROOT %tuple = (f32[4,4]{0,1}, s32[]) tuple(%copy, %copy.1)
    ... }
    ... '''
    >>> copied_shapes(hlo)
    ['f32[4,4]', 's32[]']
  """
  return [_LAYOUT.sub("", i.shape) for i in _scoped(program, where, "copied_shapes")
          if i.opcode == "copy"]


class KernelCounts(NamedTuple):
  """What a compiled program runs, as kernels go; see :func:`kernel_counts`.

  Examples:
    >>> from accum_jax.testing import KernelCounts
    >>> KernelCounts(fusions=12, copies=1, conditionals=0)._asdict()
    {'fusions': 12, 'copies': 1, 'conditionals': 0}
  """

  fusions: int  # at the top level: on a GPU about one kernel launch each
  copies: int  # at the top level and in conditionals' branches: each moves a buffer
  conditionals: int  # at the top level: each kept one a wait of the host, on a GPU


def kernel_counts(program: Any) -> KernelCounts:
  """The top-level fusions, the copies and the top-level conditionals of a compiled program.

  On a GPU each top-level fusion is about one kernel launch (10-15 us whatever its
  size), each copy (:func:`copied_shapes`, in conditionals' branches too) a kernel
  that moves a buffer, and each conditional XLA:GPU keeps a wait of the host. The
  CPU's compiled program has the same shape as the GPU's, though not the same
  numbers: how many fusions XLA makes is the compiler's choice, and changes with it.

  Args:
    program: ``jax.jit(f).lower(*args).compile()``, or its ``.as_text()``.

  Returns:
    A :class:`KernelCounts`.

  Examples:
    >>> from accum_jax.testing import kernel_counts
    >>> hlo = '''
    ... ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   %copy = f32[4]{0} copy(%p)
    ...   ROOT %fusion = f32[4]{0} fusion(%copy), kind=kLoop, calls=%fused_computation
    ... }
    ... '''
    >>> kernel_counts(hlo)
    KernelCounts(fusions=1, copies=1, conditionals=0)
  """
  text = _compiled_text(program, "kernel_counts")
  entry = opcode_counts(text)
  return KernelCounts(entry["fusion"], len(copied_shapes(text)), entry["conditional"])


def hlo_shape(array: Any) -> str:
  """An array's dtype and shape as HLO text spells them, layout left out.

  Args:
    array: anything with ``shape`` and ``dtype``: a ``jax.Array``, a NumPy array,
      a ``jax.ShapeDtypeStruct``.

  Returns:
    The shape, as ``"f32[64,256]"``, ``"bf16[8]"`` or ``"pred[]"``: what
    :func:`copied_shapes` returns.

  Examples:
    >>> import numpy as np
    >>> from accum_jax.testing import hlo_shape
    >>> hlo_shape(np.zeros((64, 256), np.float32)), hlo_shape(np.zeros((), bool))
    ('f32[64,256]', 'pred[]')
  """
  name = np.dtype(array.dtype).name
  m = re.fullmatch(r"(u?int|float|complex)(\d+)(?:_(\w+))?", name)
  if name == "bool":
    spelt = "pred"
  elif name == "bfloat16":
    spelt = "bf16"
  elif m:
    kind = {"int": "s", "uint": "u", "float": "f", "complex": "c"}[m.group(1)]
    spelt = f"{kind}{m.group(2)}{m.group(3) or ''}"
  else:
    spelt = name
  return f"{spelt}[{','.join(str(d) for d in array.shape)}]"
