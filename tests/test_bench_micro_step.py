"""bench/bench_micro_step.py on a small tree: the compiled micro-steps meet their bounds.

Timings are not checked (the machine is shared), and the benchmark's timed rounds
are left to it; the compiled programs are deterministic, and issue 32 bounds them
against the interface's floor (the gradient plus a float32 tree add, with the
optimizer state passed through): in the combined form (the gradient in the same
jit), the host schedule's call that only accumulates holds no conditional and no
copy of more than a scalar; the device schedule keeps one conditional, and copies no
leaf either.
How many top-level fusions each makes against the floor's (at most 1.10x and 1.15x),
how many scalar copies XLA makes, and that it copies every leaf a hand-written
conditional passes through, are its choices: pinned below, on these programs, and
marked ``xla_fact`` as those of tests/test_xla_facts.py are (they stay beside the
programs, which take the longest of the suite's to compile).
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path

import jax
import optax
import pytest

import accum_jax
from accum_jax._across_calls._state import COUNTS, SUMS
from accum_jax.testing import copied_shapes, kernel_counts

pytestmark = pytest.mark.bench  # left out of the README's command (conftest.py)

BENCH = Path(__file__).resolve().parent.parent / "bench"
HAND = "hand-written lax.cond accumulator"
PACKED_DEVICE = "accumulate(sgd, layout='packed'), device schedule"


def _import(name: str):
  if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the bench modules import _common and each other as siblings
  return importlib.import_module(name)


@functools.cache
def bench_module():
  """bench/bench_micro_step.py, imported once."""
  return _import("bench_micro_step")


@functools.cache
def micro_step_programs():
  """The compiled micro-step of each row, by name; compiled once for this file's
  design checks and the compiler's facts below."""
  bench, models = bench_module(), _import("models")
  # 148 leaves, as GPT-2, at the bench's width, a shorter sequence. SGD inside:
  # the counts are of a call that only accumulates, and SGD compiles fastest.
  params = models.gpt2_tree(vocab=32, context=4)
  tokens = jax.numpy.arange(5) % 32
  candidates = bench.across_candidates(bench.EVERY_K, optax.sgd(0.1))
  # The default state of one device, which these tests' eight devices do not give.
  candidates[PACKED_DEVICE] = bench._transformation(
      accum_jax.accumulate(optax.sgd(0.1), every_k=bench.EVERY_K, layout="packed"))
  programs = {}
  for name in (bench.FLOOR, bench.HOST, bench.DEVICE, PACKED_DEVICE, HAND):
    row, _ = bench.build_row(candidates[name], models.loss_fn, params, tokens, bench.EVERY_K)
    programs[name] = row.programs[row.applies[0]]  # a call that only accumulates
  return programs


@pytest.fixture(scope="module")
def bench():
  return bench_module()


@pytest.fixture(scope="module")
def programs():
  return micro_step_programs()


def _counts(programs):
  return {name: kernel_counts(compiled) for name, compiled in programs.items()}


# accumulate's counters and sums: one int32 vector of a few entries.
_COUNTERS = (f"s32[{len(COUNTS) + len(SUMS)}]",)


def _leaf_copies(compiled):
  """The copied shapes of more than a scalar or the state's counters: a leaf's."""
  return [s for s in copied_shapes(compiled) if not s.endswith("[]") and s not in _COUNTERS]


def test_the_hand_written_row_is_the_bench_s():
  assert HAND == bench_module().HAND_COND


def test_the_host_schedule_s_micro_step_holds_no_conditional_and_copies_no_leaf(bench, programs):
  host = kernel_counts(programs[bench.HOST])
  assert host.conditionals == 0, host
  # Its copies, if any, are of scalars (a counter, a flag), never of a leaf.
  assert _leaf_copies(programs[bench.HOST]) == []


def test_the_device_schedule_keeps_one_conditional_and_copies_no_leaf(bench, programs):
  counts = _counts(programs)
  device, hand = counts[bench.DEVICE], counts[HAND]
  assert device.conditionals == 1 and hand.conditionals == 1
  assert counts[PACKED_DEVICE].conditionals == 1
  # The window's sum carried through the conditional as the updates (a packed window:
  # buckets made for them): no leaf copied.
  assert _leaf_copies(programs[bench.DEVICE]) == []
  assert _leaf_copies(programs[PACKED_DEVICE]) == []


# ---------------------------------------------------------------------------
# What XLA:CPU chooses in these programs (tests/test_xla_facts.py says how to
# re-measure a fact after a JAX upgrade).


@pytest.mark.xla_fact
def test_the_host_schedule_s_micro_step_makes_the_floor_s_fusions(bench, programs):
  """XLA:CPU's top-level fusions in the host schedule's micro-step: at most 1.10x those
  of the interface's floor, issue 32's bound.

  On a JAX upgrade that changes it: re-measure with ``python
  bench/bench_micro_step.py --quick`` (its fusions column); if only the host
  schedule's count grew, its micro-step does work the floor does not, a regression.
  """
  counts = _counts(programs)
  floor, host = counts[bench.FLOOR], counts[bench.HOST]
  assert host.fusions <= 1.10 * floor.fusions, (host, floor)


@pytest.mark.xla_fact
def test_the_device_schedule_s_micro_step_makes_a_pass_a_leaf_more_than_the_floor(
    bench, programs):
  """XLA:CPU's top-level fusions in the device schedule's micro-step (the tree layout
  the tests' eight devices give): at most 1.15x the floor's. One pass a leaf more
  than the floor's add: the parameters' update (one program cannot leave them
  untouched); a window that ends writes nothing into its sum (1612 against 1459 on
  JAX 0.10.2, where emptying it cost 1764).

  On a JAX upgrade that changes it: as above; a count past 1.15x that grows with the
  leaves is a pass per leaf more, a regression.
  """
  counts = _counts(programs)
  floor, device = counts[bench.FLOOR], counts[bench.DEVICE]
  assert device.fusions <= 1.15 * floor.fusions, (device, floor)


@pytest.mark.xla_fact
def test_the_packed_device_schedule_s_micro_step_makes_a_pass_a_leaf_more_than_the_floor(
    programs):
  """The same bound for the packed state (the default on one device): the updates
  come out of the conditional in buckets made for them, zeros where the window
  holds, so that nothing computed before the conditional is read again after it
  (1614 against the floor's 1459 on JAX 0.10.2; carried in the gradient, which
  the window's add reads too, 1761).

  On a JAX upgrade that changes it: as above.
  """
  counts = _counts(programs)
  floor, device = counts[bench_module().FLOOR], counts[PACKED_DEVICE]
  assert device.fusions <= 1.15 * floor.fusions, (device, floor)


@pytest.mark.xla_fact
def test_the_device_schedule_copies_a_few_scalars_where_a_hand_written_cond_copies_leaves(
    bench, programs):
  """XLA:CPU's copies (``kernel_counts``: at the top level and in the conditional's
  branches) in the micro-step of bench/bench_micro_step.py's rows, on
  this file's GPT-2-shaped tree of 148 leaves: the device schedule's
  conditional copies a few scalars (3 on JAX 0.10.2: a counter, flags), where a
  hand-written ``lax.cond`` accumulator copies each leaf it passes through (148
  leaves, 149 copies, on JAX 0.10.2).
  That none of the device schedule's copies is of a leaf is a design property,
  checked above.

  On a JAX upgrade that changes it: re-measure with ``python
  bench/bench_micro_step.py --quick`` (its "copies (of leaves)" column) and update
  the 4; a hand-written conditional that copies 4 or fewer means XLA now aliases
  what a branch passes through, and the contrast drawn in docs/benchmarks.md no
  longer holds.
  """
  device = kernel_counts(programs[bench.DEVICE])
  hand = kernel_counts(programs[HAND])
  assert device.copies <= 4 < hand.copies, (device, hand)
