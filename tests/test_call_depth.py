"""How much of the library one plain call passes through.

Depth is what a contributor pays: a call that uses no option should enter only
the functions its work needs, and an option adds its functions to the calls that
use it, not to every call. Counted as optax's own calls are: the distinct
functions of the package (``(file, name)``, comprehensions and lambdas included)
that Python enters while ``accum_jax.value_and_grad(loss, 4)`` is built and one
call of it is traced under ``jax.jit``. Nothing is compiled.
"""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import accum_jax

PACKAGE = Path(accum_jax.__file__).resolve().parent

# Distinct functions entered by a plain value_and_grad(loss, 4), built and traced:
# 110 before its options were resolved once; 58 before the argument numbers were checked
# at once and a sharding test entered no generator; 55 before the recheck passes were
# entered only by "skip_microbatch" and all-"mean" kinds were laid out by no per-leaf list;
# 53 before a leaf's kind was asked about only where some leaf is a statistic, and the
# kept weight read only where a microbatch can be left out; 51 before a call of plain
# options ran the plain scan (`_plain`), with no microbatch traced before its loop.
PLAIN_BOUND = 35


def _entered(run) -> dict[tuple[str, str], int]:
  """The package's functions ``run()`` enters, with how often each is entered."""
  entered: collections.Counter = collections.Counter()
  root = str(PACKAGE)

  def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(root):
      path = Path(frame.f_code.co_filename).relative_to(PACKAGE)
      entered[(str(path), frame.f_code.co_name)] += 1

  sys.setprofile(profile)
  try:
    run()
  finally:
    sys.setprofile(None)
  return dict(entered)


def _loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
BATCH = {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 2))}


def _plain_call():
  jax.jit(accum_jax.value_and_grad(_loss, 4)).trace(PARAMS, BATCH)


def test_a_plain_value_and_grad_passes_through_a_short_path():
  entered = _entered(_plain_call)
  files = sorted({path for path, _ in entered})
  assert len(entered) <= PLAIN_BOUND, (len(entered), files, sorted(entered))


# The extras, built on the plain path: a call enters them only when it asks. The
# statistics ("max", "last" leaves) and the gradient noise are options too.
EXTRAS = ("_sharding", "_across_devices", "_cached", "_stats", "_parity", "_diagnosis",
          "_planner", "_statistics", "_noise")


def test_a_plain_call_enters_none_of_the_extras():
  entered = _entered(_plain_call)
  assert not [f for f in entered if Path(f[0]).stem in EXTRAS], sorted(entered)


def test_options_left_at_their_defaults_are_not_checked_again():
  # The defaults are valid by construction: building enters no validator of an
  # option that was not given.
  entered = _entered(lambda: accum_jax.value_and_grad(_loss, 4))
  assert len(entered) <= 6, sorted(entered)


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """A function's lines, its docstring left out."""
  body = node.body
  first = body[0]
  if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and len(body) > 1:
    first = body[1]
  return node.end_lineno - first.lineno + 1


def test_the_inside_step_door_reads_in_modules_of_at_most_500_lines_and_functions_of_60():
  door = PACKAGE / "_inside_step"
  long_modules = {p.name: n for p in door.glob("_*.py")
                  if (n := len(p.read_text().splitlines())) > 500}
  long_functions = {
      f"{p.name}:{node.name}": _body_lines(node)
      for p in door.glob("*.py") for node in ast.walk(ast.parse(p.read_text()))
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > 60
  }
  assert not long_modules, long_modules
  assert not long_functions, long_functions
