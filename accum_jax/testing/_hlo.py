"""HLO text, read: its computations, its instructions, what each calls.

Every reader of :mod:`accum_jax.testing` parses text, never an ``HloModule``: the text
of a ``Lowered`` (``as_text(dialect="hlo")``, before any optimisation) and of a
``Compiled`` (``as_text()``, after the backend's) have one syntax, and a test can
write a program by hand. Nothing here needs jax until a jax stage is handed in.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

# A computation's first line: "name (params) -> shape {" in compiled text, "name {" in the
# unoptimised text of a Lowered.
HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.MULTILINE)
CALLED = re.compile(
    r"(?:body|condition|to_apply|calls|branch_computations|called_computations|"
    r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)
BRANCHES = re.compile(
    r"(?:branch_computations|true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)
ARRAY = re.compile(
    r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64|c64|c128|f8\w*)\[([\d,]*)\]"
)
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="((?:[^"\\]|\\.)*)"')
_INSTRUCTION_LINE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def computations(hlo_text: str) -> dict[str, list[str]]:
  """Each computation's name and the lines of its body, in text order."""
  comps: dict[str, list[str]] = {}
  name = None
  for line in hlo_text.splitlines():
    if name is None:
      m = HEADER.match(line)
      if m:
        name = m.group(1)
        comps[name] = []
    elif line.startswith("}"):
      name = None
    else:
      comps[name].append(line)
  return comps


def names(pattern: re.Pattern[str], lines: list[str]) -> set[str]:
  """The computations that ``pattern`` (``CALLED``, ``BRANCHES``) names in ``lines``."""
  found: set[str] = set()
  for line in lines:
    for m in pattern.finditer(line):
      found.update(n.strip().lstrip("%") for n in m.group(1).strip("{}").split(","))
  return found


def closure(roots: set[str], comps: dict[str, list[str]]) -> set[str]:
  """``roots`` and every computation they call."""
  seen: set[str] = set()
  todo = list(roots)
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    todo.extend(names(CALLED, comps[name]))
  return seen


def inside_branches(comps: dict[str, list[str]]) -> set[str]:
  """The computations that run inside some conditional's branch, at any depth."""
  return closure(set().union(*(names(BRANCHES, lines) for lines in comps.values())), comps)


def op_name(line: str) -> str:
  """An instruction's metadata ``op_name``, ``""`` if none."""
  m = _OP_NAME.search(line)
  return m.group(1) if m else ""


class Instruction(NamedTuple):
  name: str
  opcode: str
  shape: str
  operands: tuple[str, ...]
  line: str


class Computation(NamedTuple):
  instructions: dict[str, Instruction]  # in text order
  root: str


def _balanced(text: str, start: int) -> int:
  """The index just past the parenthesis that closes the one at ``start``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


def instruction(line: str) -> tuple[Instruction, bool] | None:
  """The instruction on ``line`` and whether it is its computation's root; None for
  a line that holds none."""
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
  return Instruction(m.group(2), op.group(1), rest[:end], operands, line), bool(m.group(1))


def parse(hlo_text: str) -> dict[str, Computation]:
  """Each computation's instructions, by name, and its root."""
  parsed = {}
  for name, lines in computations(hlo_text).items():
    instructions, root = {}, ""
    for line in lines:
      found = instruction(line)
      if found:
        instructions[found[0].name] = found[0]
        root = found[0].name if found[1] else root
    parsed[name] = Computation(instructions, root)
  return parsed


def jax_stage(program: Any) -> Any:
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


def compiled_as_text(compiled: Any) -> str:
  """The HLO text of a ``jax.stages.Compiled``."""
  text = compiled.as_text()
  if text is None:
    raise ValueError("this backend gives no HLO text for the compiled program")
  return text


def compiled_text(program: Any, reader: str) -> str:
  """The HLO text of a compiled program, or of the text itself; ``reader`` names the
  public function in the error for anything else."""
  if isinstance(program, str):
    return program
  import jax  # here, so that reading HLO text alone needs no jax

  program = jax_stage(program)
  if isinstance(program, jax.stages.Compiled):
    return compiled_as_text(program)
  raise TypeError(
      f"{reader} reads a compiled program: pass jax.jit(f).lower(*args).compile() or its "
      f".as_text(), not a {type(program).__name__}")
