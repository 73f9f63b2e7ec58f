"""Every ```python block of README.md runs as written and prints what the page says.

A python block followed by a ```text block must print that text (doctest's rules:
``...`` matches anything, runs of whitespace compare equal); a python block without
one must print nothing. ``tests/test_docs.py`` applies the same rule to the pages of
the documentation.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import re
import sys
import types
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

_FENCE = re.compile(
    r"^(?P<heading>#+ [^\n]*)$"
    r"|^```python\n(?P<code>.*?)^```\n(?:\n*```text\n(?P<expected>.*?)^```)?",
    re.M | re.S,
)
_CHECKER = doctest.OutputChecker()
_OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


class Block(NamedTuple):
  heading: str
  code: str
  expected: str  # "" when the page shows no output: the block must print nothing


def python_blocks(path: Path) -> list[Block]:
  """The python blocks of a Markdown page, each with the output shown after it."""
  blocks, heading = [], "top"
  for match in _FENCE.finditer(path.read_text()):
    if match.group("heading"):
      heading = match.group("heading").lstrip("# ").strip()
    else:
      blocks.append(Block(heading, match.group("code"), match.group("expected") or ""))
  return blocks


def run_block(block: Block, filename: str, *, check_output: bool = True) -> None:
  """Runs the block's code; fails unless it prints what the page shows.

  With ``check_output=False``, a block without a ```text block may print anything.
  """
  # A module of its own in sys.modules, as a script has: dataclasses look it up.
  module = types.ModuleType("docs_example")
  sys.modules[module.__name__] = module
  out = io.StringIO()
  try:
    with contextlib.redirect_stdout(out):
      exec(compile(block.code, filename, "exec"), module.__dict__)
  finally:
    del sys.modules[module.__name__]
  printed = out.getvalue()
  if not check_output and not block.expected:
    return
  assert _CHECKER.check_output(block.expected, printed, _OPTIONS), (
      f"{filename}, section {block.heading!r}: the page shows\n{block.expected}\n"
      f"but the code printed\n{printed}"
  )


BLOCKS = python_blocks(README)


def test_the_readme_has_python_examples_that_show_their_output():
  assert len(BLOCKS) >= 2
  assert all(block.expected for block in BLOCKS), "every README example shows its output"


@pytest.mark.parametrize(
    "block", BLOCKS, ids=[f"{b.heading} #{i}" for i, b in enumerate(BLOCKS)]
)
def test_a_readme_example_prints_what_the_readme_shows(block):
  run_block(block, str(README))
