"""A compiled program's instructions counted as kernels go.

On a GPU each top-level fusion is about one kernel launch and each copy a kernel that
moves a buffer, whatever their sizes: for small leaves, what a step launches costs
as much as what it computes.
"""

from __future__ import annotations

import collections
import re
from typing import Any, NamedTuple

import numpy as np

from accum_jax.testing import _hlo

# Counting a compiled program's instructions. The scopes: "entry", the entry
# computation's instructions (a fusion there is one kernel; its body is not looked
# into); "entry+branches", those and the instructions of its conditionals' branches,
# nested ones too (each also a kernel or a thunk, whether or not the branch runs);
# "all", every computation's, the bodies of fusions and loops included.
_SCOPES = ("entry", "entry+branches", "all")
_LAYOUT = re.compile(r"\{[^}]*\}")


def _scoped(program: Any, where: str, reader: str) -> list[_hlo.Instruction]:
  """The instructions of ``program`` in scope ``where`` (see ``_SCOPES``), in text order."""
  if where not in _SCOPES:
    raise ValueError(f"where={where!r} is not one of {_SCOPES}")
  text = _hlo.compiled_text(program, reader)
  comps = _hlo.computations(text)
  if where == "all":
    names = list(comps)
  else:
    entry = _hlo.ENTRY.search(text)
    if entry is None or entry.group(1) not in comps:
      raise ValueError("the HLO text has no ENTRY computation")
    names, pending = [], [entry.group(1)]
    while pending:
      name = pending.pop()
      if name in comps and name not in names:
        names.append(name)
        if where == "entry+branches":
          pending.extend(sorted(_hlo.names(_hlo.BRANCHES, comps[name])))
  found = []
  for name in names:
    for line in comps[name]:
      parsed = _hlo.instruction(line)
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
  text = _hlo.compiled_text(program, "kernel_counts")
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
