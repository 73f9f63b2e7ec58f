"""The documentation's code runs as written, and the API reference misses no name.

The ```python blocks of the pages under docs/ run and must print the ```text block
shown after them (see tests/test_readme.py). The guides under docs/guides/ are
included as they land; a block of theirs without a ```text block runs unchecked.

The API reference is generated from ``__all__`` by autosummary, and
``docs/_ext/api_coverage.py`` fails the build on a public name without an entry; the
tests below check, without building, that every public name has a docstring with an
example and that the coverage check sees it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest
from test_readme import python_blocks, run_block

DOCS = Path(__file__).resolve().parents[1] / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
import api_coverage  # noqa: E402

PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
BLOCKS = [
    pytest.param(page, block, id=f"{page.relative_to(DOCS)}: {block.heading} #{i}")
    for page in PAGES
    for i, block in enumerate(python_blocks(page))
]


def test_the_docs_have_python_examples():
  assert len(BLOCKS) >= 10


@pytest.mark.pages  # left out of the README's command (conftest.py)
@pytest.mark.parametrize(("page", "block"), BLOCKS)
def test_a_docs_example_prints_what_the_page_shows(page, block):
  run_block(block, str(page), check_output=page.parent.name != "guides")


def _public_objects():
  for module_name in api_coverage.public_modules():
    module = importlib.import_module(module_name)
    for name in getattr(module, "__all__", ()):
      yield f"{module_name}.{name}", getattr(module, name)


def test_the_coverage_check_sees_every_public_module_and_name():
  modules = api_coverage.public_modules()
  assert {"accum_jax", "accum_jax.flax", "accum_jax.testing"} <= set(modules)
  assert not any(part.startswith("_") for name in modules for part in name.split("."))
  names = [name for name, _ in _public_objects()]
  assert "accum_jax.accumulate" in names and "accum_jax.flax.apply_gradients" in names
  assert api_coverage.missing_entries(set(names)) == []
  assert api_coverage.missing_entries(set(names) - {"accum_jax.accumulate"}) == [
      "accum_jax.accumulate"
  ]


def test_each_private_module_is_documented_under_one_public_module():
  # The [source] pages (sphinx.ext.viewcode) link a private module's code back to the
  # public module of the first name documented from it: a second public home for
  # the same private module gets links to anchors that do not exist.
  homes: dict[str, set[str]] = {}
  for name, obj in _public_objects():
    defined_in = getattr(obj, "__module__", "") or ""
    if defined_in.rsplit(".", 1)[-1].startswith("_"):
      homes.setdefault(defined_in, set()).add(name.rsplit(".", 1)[0])
  assert {m: h for m, h in homes.items() if len(h) > 1} == {}


# Public names whose docstrings show no example yet. Shrink it: adding an example
# to one of these makes the test below fail until its name is removed here.
WITHOUT_EXAMPLE = {
    "accum_jax.AccumulationState",
    "accum_jax.EveryKSchedule",
    "accum_jax.diagnostics.LeafDeviation",
    "accum_jax.diagnostics.MemoryBudgetError",
    "accum_jax.MicrobatchInfo",
    "accum_jax.diagnostics.MicrobatchPlan",
    "accum_jax.diagnostics.ParityReport",
}


# Public names that are another library's objects, re-exported as they are: their
# docstrings are that library's.
REEXPORTED = {"accum_jax.MultiStepsState": "optax.MultiStepsState"}


def test_the_names_without_an_example_are_public_names():
  assert WITHOUT_EXAMPLE <= {name for name, _ in _public_objects()}


def test_the_reexported_names_are_the_other_library_objects():
  for name, origin in REEXPORTED.items():
    module_name, attr = name.rsplit(".", 1)
    origin_module, origin_attr = origin.rsplit(".", 1)
    assert getattr(importlib.import_module(module_name), attr) is getattr(
        importlib.import_module(origin_module), origin_attr)


@pytest.mark.parametrize(
    "name", [name for name, _ in _public_objects() if name not in REEXPORTED])
def test_every_public_name_has_a_docstring_with_an_example(name):
  module_name, attr = name.rsplit(".", 1)
  doc = inspect.getdoc(getattr(importlib.import_module(module_name), attr)) or ""
  assert doc, f"{name} has no docstring"
  has_example = ">>>" in doc or "Example" in doc
  if name in WITHOUT_EXAMPLE:
    assert not has_example, f"{name} has an example now: remove it from WITHOUT_EXAMPLE"
  else:
    assert has_example, f"the docstring of {name} shows no example"
