"""Every figures file a page names is in bench/figures, and bench/README.md lists them all.

A figure on a page is only as good as the run behind it: its JSON or log is kept in
``bench/figures/``, named by card, script and commit. These tests read the pages
(README.md, CHANGELOG.md, docs/**/*.md, bench/README.md) as text, with no JAX. The
table of questions at the top of bench/README.md names, for each, the script that
answers it (one that is there, or one marked removed) and runs that are kept.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "bench" / "figures"
BENCH_README = ROOT / "bench" / "README.md"
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", BENCH_README]
    + [p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts]
)

# `bench/figures/NAME` on any page; NAME may end in `.*` for a run's JSON and log.
_NAMED = re.compile(r"bench/figures/([\w.*-]+)")
# In bench/README.md's list of figures: `NAME.*`, `NAME.json`, `NAME.log`, `NAME.md`.
_LISTED = re.compile(r"`([\w-]+\.(?:\*|json|log|md))`")


def named_files(text: str) -> set[str]:
  """The names under bench/figures/ that a page's text refers to."""
  return {name.rstrip(".") for name in _NAMED.findall(text) if name.rstrip(".")}


def listed_files(text: str) -> set[str]:
  """The names in bench/README.md's list of figures (the items after '`figures/`')."""
  start = text.index("`figures/` keeps")
  end = text.index("\n\n", text.index("\n- ", start))
  return set(_LISTED.findall(text[start:end]))


def missing(names: set[str]) -> list[str]:
  """The names that match no file in bench/figures (a `.*` name needs at least one)."""
  return sorted(name for name in names if not list(FIGURES.glob(name)))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_figures_file_a_page_names_is_there(page):
  names = named_files(page.read_text())
  if page == BENCH_README:
    names |= listed_files(page.read_text())
  assert not missing(names), (
      f"{page.relative_to(ROOT)} names files that are not in bench/figures: {missing(names)}"
  )


def test_bench_readme_lists_every_figures_file():
  listed = listed_files(BENCH_README.read_text())
  unlisted = sorted(
      path.name
      for path in FIGURES.iterdir()
      if not any(path.match(pattern) for pattern in listed)
  )
  assert not unlisted, f"bench/README.md's list of figures leaves out {unlisted}"


def question_table(text: str) -> list[list[str]]:
  """The rows of bench/README.md's table of questions: question, scripts, kept runs."""
  table = text[text.index("## Which script answers which question"):].split("\n\n")[1]
  return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_the_question_table_names_scripts_and_runs_that_exist():
  rows = question_table(BENCH_README.read_text())
  assert len(rows) >= 6 and all(len(row) == 3 for row in rows), rows
  for question, scripts, runs in rows:
    named = re.findall(r"[\w/]+\.py", scripts)
    assert named, question
    for script in named:
      path = ROOT / script if "/" in script else ROOT / "bench" / script
      assert path.exists() != ("removed" in scripts), (question, script)
    assert not missing(set(re.findall(r"`([\w.*-]+)`", runs))), (question, runs)


def test_the_check_sees_a_misspelt_name():
  text = "see `bench/figures/h200-quick-a7c4af8.log` and bench/figures/cpu2-micro-step-049a227.*"
  assert named_files(text) == {"h200-quick-a7c4af8.log", "cpu2-micro-step-049a227.*"}
  assert missing(named_files(text)) == ["h200-quick-a7c4af8.log"]
