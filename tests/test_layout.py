"""The house rules of the package, read from its import statements (no code runs).

accum_jax's file list shows its design: the shared pieces at the top
(``_core`` with ``_arrays`` and ``_statistics``, ``_arguments``, ``_noise``), the two
ways in in private packages of
their own (``_across_calls``: ``accumulate`` and what only it uses;
``_inside_step``: ``value_and_grad`` and what only it uses), the public modules
beside them, and ``testing``, which reads compiled programs and imports none of
them. Imports point down: a shared module imports no door, a door imports neither
the other door nor a public module, and no import goes round in a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "accum_jax"
SHARED = {"accum_jax._core", "accum_jax._arrays", "accum_jax._statistics", "accum_jax._arguments",
          "accum_jax._noise"}
DOORS = ("accum_jax._across_calls", "accum_jax._inside_step")
PUBLIC = {"accum_jax", "accum_jax.checkpoint", "accum_jax.diagnostics", "accum_jax.equinox",
          "accum_jax.flax", "accum_jax.noise", "accum_jax.privacy"}


def _module_name(path: Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
  """The accum_jax modules ``path`` imports (``from accum_jax.x import y`` counts
  ``accum_jax.x.y`` where that is a module, else ``accum_jax.x``)."""
  modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.split(".")[0] != "accum_jax":
        continue
      for alias in node.names:
        child = f"{node.module}.{alias.name}"
        found.add(child if child in modules else node.module)
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.split(".")[0] == "accum_jax"}
  return found - {_module_name(path)}


GRAPH = {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _door(module: str) -> str | None:
  return next((d for d in DOORS if module == d or module.startswith(d + ".")), None)


def test_the_file_list_shows_the_two_doors_and_the_shared_core():
  assert {_door(m) for m in GRAPH} >= set(DOORS)
  assert {"accum_jax._core", "accum_jax.testing"} <= set(GRAPH)
  top_private = {m for m in GRAPH if m.count(".") == 1 and m.split(".")[1].startswith("_")
                 and m not in DOORS}
  assert top_private == SHARED, f"private modules beside the doors: {sorted(top_private - SHARED)}"


def test_no_private_module_is_over_500_lines_nor_a_public_one_over_600():
  lines = {_module_name(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
  limit = {m: 500 if m.rsplit(".", 1)[-1].startswith("_") else 600 for m in lines}
  long = {m: n for m, n in lines.items() if n > limit[m] and not m.endswith("__init__")}
  assert not long, long


def test_shared_modules_import_no_door_and_doors_import_neither_the_other_nor_a_public_module():
  for module, imported in GRAPH.items():
    if module in SHARED:
      assert not {i for i in imported if _door(i) or i in PUBLIC}, (module, imported)
    door = _door(module)
    if door:
      other = [i for i in imported if _door(i) not in (None, door)]
      assert not other, (module, other)
      assert not imported & PUBLIC, (module, imported & PUBLIC)


def test_testing_reads_programs_and_imports_nothing_of_the_library():
  for module, imported in GRAPH.items():
    if module.startswith("accum_jax.testing"):
      assert all(i.startswith("accum_jax.testing") for i in imported), (module, imported)


def test_no_import_cycle():
  state: dict[str, str] = {}

  def visit(module: str, path: list[str]) -> None:
    state[module] = "open"
    for child in sorted(GRAPH.get(module, ())):
      # A package's __init__ re-exporting its children is not a cycle of code.
      if child.startswith(module + "."):
        continue
      if state.get(child) == "open":
        raise AssertionError("import cycle: " + " -> ".join([*path, module, child]))
      if child not in state:
        visit(child, [*path, module])
    state[module] = "done"

  for module in GRAPH:
    if module not in state:
      visit(module, [])
