"""bench/bench_micro_step.py on a small tree: the counts of its compiled rows meet their bounds.

Timings are not checked (the machine is shared), and the benchmark's timed rounds
are left to it; the compiled programs' top-level fusions are deterministic, and
issue 27 bounds them against the hand-written floor: ``skip_nonfinite=False``
within 1.2x, the default within 1.6x (it was 2.35x when the check took a
reduction per leaf), the flat layout within either.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import optax
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


FLOOR = "floor: hand-written lax.cond, inner branch kept"
BOUNDS = {
    "accumulate, skip_nonfinite=False": 1.2,
    "accumulate (default)": 1.6,
    "accumulate, layout='flat', skip_nonfinite=False": 1.2,
    "accumulate, layout='flat'": 1.2,
}


@pytest.fixture(scope="module")
def counts():
  if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the bench modules import _common as a sibling
  spec = importlib.util.spec_from_file_location("bench_micro_step", BENCH / "bench_micro_step.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  # 148 leaves, as GPT-2, at the bench's width: XLA:CPU splits a reduction of 64
  # elements in two, which a check per leaf pays for each of the 98 vectors.
  params = module.gpt2_tree(width=64, vocab=64, context=16)
  # SGD inside: the counts are of the top level, outside the inner optimizer's
  # branch, and SGD's branch compiles fastest.
  built = module.compile_rows(params, [FLOOR, *BOUNDS], optax.sgd(0.1))
  return {name: module.entry_counts(compiled) for name, (compiled, *_) in built.items()}


def test_every_row_keeps_one_conditional(counts):
  assert set(counts) == {FLOOR, *BOUNDS}
  assert all(c["conditionals"] == 1 for c in counts.values()), counts


def test_the_micro_step_launches_about_what_the_floor_does(counts):
  floor = counts[FLOOR]["fusions"]
  for name, bound in BOUNDS.items():
    assert counts[name]["fusions"] <= bound * floor, (name, counts[name]["fusions"], floor)
