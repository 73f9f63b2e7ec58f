"""What XLA:GPU does with each conditional: keeps it, or runs both branches as selects.

A model of one rewrite of XLA:GPU, applied to the program before optimisation (the CPU
compiler keeps every conditional, so a CPU-compiled program cannot show it), or, for
:func:`host_syncs` given a ``Compiled``, to the conditionals another backend left. It
follows openxla/xla ``xla/service/conditional_simplifier.cc`` at commit
fdb896a536115dd0493b59fa5f5ccd55284d8a08: ``ConditionalSimplifier::TryRemoveConditional``
(``instruction_is_expensive``, ``ComputationIsEmptyWithArrayRoot``), which XLA:GPU's
simplification pipeline runs after its algebraic simplifier has turned the index of
``lax.cond``, ``convert(pred)``, back into the boolean (openxla/xla 433638e0). On an
NVIDIA H200 with jax 0.11.2, the GPU's compiled programs held exactly the
conditionals it predicts kept, for every program of ``tests/test_gpu_conditionals.py``
and for ``optax.apply_if_finite(optax.adamw(...))``.

After a JAX upgrade: ``tests/test_gpu_conditionals.py`` checks, on the CPU, that each
rule's program still holds what the rule reads and gets the verdict it pinned; on a
machine with a GPU, ``JAX_PLATFORMS=cuda python -m pytest tests/test_gpu_conditionals.py``
also compiles each program there and checks the verdicts against what XLA:GPU kept.
If one fails, read ``TryRemoveConditional`` at the XLA commit the new jax builds
with (its ``third_party/xla/revision.bzl`` names it), then update the rules below, the
pinned verdicts and the commit above.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from accum_jax.testing import _hlo

# TryRemoveConditional replaces a two-branch conditional on a PRED by selects when both
# branches hold only the opcodes below or elementwise ones (instruction_is_expensive), calls
# having been inlined. Nothing else counts as cheap, whatever its size: the rule has no
# limit on sizes or counts.
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
# Only in a compiled program: a reshape (or a transpose) that layout assignment made free,
# counted as the reshape it mostly was; and the copies that copy insertion, which runs
# after the rule, puts where a branch passes a value through.
_LAYOUT_ONLY = frozenset(("bitcast",))
_INSERTED = frozenset(("copy",))
# What a call or a fusion (only in a compiled program) runs.
_CALLEE = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")


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

  program = _hlo.jax_stage(program)
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
  comps = _hlo.parse(_lowered_text(program))
  prefixes = _op_name_prefixes(comps)
  memo: dict[str, tuple[bool, str]] = {}
  found = []
  for name, comp in comps.items():
    for instr in comp.instructions.values():
      if instr.opcode == "conditional":
        kept, reason = _judge(instr, comp, comps, memo)
        op_name = "/".join(p for p in (prefixes.get(name, ""), _hlo.op_name(instr.line)) if p)
        found.append(GpuConditional(instr.name, op_name, kept, reason))
  return tuple(found)


def judged_after_compiling(hlo_text: str) -> dict[str, bool]:
  """Whether XLA:GPU keeps each conditional, by name, of a program another backend
  has compiled (the CPU's, which keeps them all).

  A ``jax.stages.Compiled`` keeps no copy of the program it was compiled from, so
  the rules are applied to the conditionals as that compiler left them: the
  computations it fused looked into (the GPU's rule runs before fusion), its
  ``bitcast`` counted as the reshape it mostly was. What it removed leaves no
  trace: an optimization barrier, which XLA:CPU drops, keeps a conditional on the
  GPU that this judges to run as selects. The program before optimisation
  (:func:`gpu_conditionals`) has no such blind spot.
  """
  comps = _hlo.parse(hlo_text)
  memo: dict[str, tuple[bool, str]] = {}
  return {instr.name: _judge(instr, comp, comps, memo, _PASS_THROUGH | _INSERTED)[0]
          for comp in comps.values() for instr in comp.instructions.values()
          if instr.opcode == "conditional"}


def _op_name_prefixes(comps: dict[str, _hlo.Computation]) -> dict[str, str]:
  """What to put before the op_names of each computation. JAX names the instructions
  of a called function relative to the call (``cond``, not ``jit(f)/.../cond``), and
  inlining the call prefixes the call's own op_name, as the compiled text shows."""
  parents: dict[str, tuple[str, _hlo.Instruction]] = {}
  for name, comp in comps.items():
    for instr in comp.instructions.values():
      for callee in _hlo.names(_hlo.CALLED, [instr.line]):
        parents.setdefault(callee, (name, instr))
  prefixes: dict[str, str] = {}

  def prefix(name: str, seen: frozenset[str]) -> str:
    if name not in prefixes:
      parent, site = parents.get(name, ("", None))
      outer = prefix(parent, seen | {name}) if site and parent not in seen else ""
      if site is not None and site.opcode == "call":
        outer = "/".join(p for p in (outer, _hlo.op_name(site.line)) if p)
      prefixes[name] = outer
    return prefixes[name]

  for name in comps:
    prefix(name, frozenset())
  return prefixes


def _judge(cond: _hlo.Instruction, comp: _hlo.Computation, comps: dict[str, _hlo.Computation],
           memo: dict[str, tuple[bool, str]], passing: frozenset[str] = _PASS_THROUGH,
           ) -> tuple[bool, str]:
  """(kept, reason) for one conditional, in the order TryRemoveConditional checks;
  ``passing``: the opcodes of a branch that only passes its operands through."""
  if cond.name not in memo:
    branches = [name.strip().lstrip("%") for m in _hlo.BRANCHES.finditer(cond.line)
                for name in m.group(1).strip("{}").split(",")]
    memo[cond.name] = (
        _side_effect(branches, comps) or _shape_of_choice(cond, comp, comps, branches)
        or _expensive(branches, comps, memo, passing)
        or _passes_through(branches, comps, passing)
        or (False, "all instructions cheap: both branches run"))
  return memo[cond.name]


def _side_effect(branches: list[str], comps: dict[str, _hlo.Computation]
                 ) -> tuple[bool, str] | None:
  for name in sorted(_hlo.closure(set(branches), {k: [i.line for i in c.instructions.values()]
                                              for k, c in comps.items()})):
    for instr in comps[name].instructions.values():
      if instr.opcode in _SIDE_EFFECTS or "custom_call_has_side_effect=true" in instr.line:
        return True, f"{instr.name} ({instr.opcode}) has a side effect"
  return None


def _shape_of_choice(cond: _hlo.Instruction, comp: _hlo.Computation,
                     comps: dict[str, _hlo.Computation], branches: list[str]
                     ) -> tuple[bool, str] | None:
  if len(branches) != 2:
    return True, f"{len(branches)} branches: only two can become selects"
  index, comp = _index(cond.operands[0], comp, comps) if cond.operands else (None, comp)
  if index is None or index.shape.startswith("pred["):
    return None
  source = comp.instructions.get(index.operands[0]) if index.operands else None
  if index.opcode == "convert" and source is not None and source.shape.startswith("pred["):
    return None
  return True, (f"its index {index.name} is an integer {index.opcode}, not a converted "
                "boolean, so it stays an integer")


def _index(name: str, comp: _hlo.Computation, comps: dict[str, _hlo.Computation]
           ) -> tuple[_hlo.Instruction | None, _hlo.Computation]:
  """What makes the index ``name`` of a conditional of ``comp``, and where. In a
  compiled program, through what only moves it: into the computation a fusion fuses
  (to its root, and from its parameters back to the fusion's operands), and back past
  a bitcast, reshape or copy (XLA:CPU may convert a ``pred[1]``, then reshape)."""
  instr = comp.instructions.get(name)
  fusions: list[tuple[_hlo.Instruction, _hlo.Computation]] = []  # the fusions entered
  while instr is not None:
    callee = _CALLEE.search(instr.line) if instr.opcode == "fusion" else None
    number = re.search(r"parameter\((\d+)\)", instr.line)
    if callee is not None and callee.group(1) in comps:
      fusions.append((instr, comp))
      comp = comps[callee.group(1)]
      instr = comp.instructions.get(comp.root)
    elif instr.opcode in ("bitcast", "reshape", "copy") and len(instr.operands) == 1:
      instr = comp.instructions.get(instr.operands[0])
    elif instr.opcode == "parameter" and fusions and number:
      fusion, comp = fusions.pop()
      operands = fusion.operands
      k = int(number.group(1))
      instr = comp.instructions.get(operands[k]) if k < len(operands) else None
    else:
      break
  return instr, comp


def _live(name: str, comps: dict[str, _hlo.Computation]) -> list[_hlo.Instruction]:
  """The instructions of a computation that its root uses, calls inlined (as XLA:GPU
  inlines them and removes dead code before the rule runs), in text order. In a
  compiled program, fusions are looked into the same way: the rule ran before them."""
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
    if instr.name in used and instr.opcode in ("call", "fusion"):
      callee = _CALLEE.search(instr.line)
      live.extend(_live(callee.group(1), comps) if callee and callee.group(1) in comps
                  else [instr])
    elif instr.name in used:
      live.append(instr)
  return live


def _expensive(branches: list[str], comps: dict[str, _hlo.Computation],
               memo: dict[str, tuple[bool, str]], passing: frozenset[str],
               ) -> tuple[bool, str] | None:
  for i, branch in enumerate(branches):
    for instr in _live(branch, comps):
      if instr.opcode in _CHEAP or instr.opcode in _ELEMENTWISE or instr.opcode in _LAYOUT_ONLY:
        continue
      if (instr.opcode == "conditional"
          and not _judge(instr, comps[branch], comps, memo, passing)[0]):
        continue  # replaced by selects first, its branches inlined: all cheap
      if instr.opcode == "conditional":
        return True, f"branch {i} holds {instr.name}, a conditional XLA:GPU keeps"
      article = "an" if instr.opcode[0] in "aeiou" else "a"
      return True, f"branch {i} holds {article} {instr.opcode} ({instr.name})"
  return None


def _passes_through(branches: list[str], comps: dict[str, _hlo.Computation],
                    passing: frozenset[str]) -> tuple[bool, str] | None:
  for i, branch in enumerate(branches):
    live = _live(branch, comps)
    root = comps[branch].instructions.get(comps[branch].root)
    if (all(instr.opcode in passing for instr in live) and root is not None
        and _hlo.ARRAY.search(root.shape)):
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
