"""Smoke tests: each example runs in its quick setting and reports what it promises.

To add an example, append an ``Example`` to ``EXAMPLES``: the script, its quick arguments
(``{tmp}`` is replaced by a fresh temporary directory), and a check of its stdout.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
# The quickstart's two runs agree to float32 round-off (~1e-7); this leaves room for
# other platforms' kernels without letting a real accumulation error through.
LOSS_DIFFERENCE_TOLERANCE = 1e-4


class Example(NamedTuple):
  script: str
  args: tuple[str, ...]
  outputs: tuple[str, ...]  # files, under {tmp}, the run must create
  check: Callable[[str], None]  # asserts on the run's stdout


def _number_after(label: str, stdout: str) -> float:
  match = re.search(rf"^{re.escape(label)}\s+(\S+)$", stdout, re.MULTILINE)
  assert match, f"no line starting {label!r} in the output:\n{stdout}"
  return float(match.group(1))


def check_quickstart(stdout: str) -> None:
  loss_difference = _number_after("largest loss difference:", stdout)
  assert loss_difference < LOSS_DIFFERENCE_TOLERANCE, stdout


EXAMPLES = [
    Example(
        script="quickstart.py",
        args=("--quick", "--plot", "{tmp}/x.png"),
        outputs=("x.png",),
        check=check_quickstart,
    ),
]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.script)
def test_example_runs(example: Example, tmp_path: Path) -> None:
  args = [arg.format(tmp=tmp_path) for arg in example.args]
  result = subprocess.run(
      [sys.executable, str(EXAMPLES_DIR / example.script), *args],
      capture_output=True,  # not a TTY, so tqdm (disable=None) stays quiet
      text=True,
      timeout=300,
  )
  assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
  for output in example.outputs:
    assert (tmp_path / output).is_file(), f"{example.script} did not write {output}"
  example.check(result.stdout)
