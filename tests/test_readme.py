"""Every ```python block of README.md runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[tuple[str, str]]:
  blocks, heading = [], "top"
  text = README.read_text()
  for match in re.finditer(r"^(#+ [^\n]*)$|^```python\n(.*?)^```", text, re.M | re.S):
    if match.group(1):
      heading = match.group(1).lstrip("# ").strip()
    else:
      blocks.append((heading, match.group(2)))
  return blocks


BLOCKS = _python_blocks()


def test_the_readme_has_python_examples():
  assert len(BLOCKS) >= 3


@pytest.mark.parametrize(
    "code", [code for _, code in BLOCKS], ids=[f"{h} #{i}" for i, (h, _) in enumerate(BLOCKS)]
)
def test_a_readme_example_runs(code, capsys):
  exec(compile(code, str(README), "exec"), {"__name__": "readme"})
