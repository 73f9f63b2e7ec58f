"""Across calls, in the step users write: what a call that only accumulates costs.

The rows (:func:`across_candidates`): the acc-only floor (the gradient and a float32
add per leaf); the interface's floor (the same with the inner state passed through, as
an Optax transformation is handed its whole state on every call); ``accumulate(adamw)``
on the host schedule (two programs: ``apply=True`` on a window's last call only) and on
the device schedule (one program, a kept conditional); ``accumulate(optax.flatten(
adamw))`` on the host schedule; a hand-written ``lax.cond`` accumulator; a plain AdamW
step; ``optax.MultiSteps(adamw)``. Each call the gradient of one sequence and the update
in one jit, donated; the rows take turns a window of 8 at a time. Per row: the median
micro-step against both floors, the window against MultiSteps', and the compiled
micro-step's fusions, copies and conditionals (``accum_jax.testing.kernel_counts``;
tests/test_bench_micro_step.py bounds them). Here on ``models.gpt2_tree`` (148 narrow
leaves); bench_gpu.py runs the same rows on GPT-2 small.

Run from the repository root::

  python bench/bench_micro_step.py            # bench/results/micro_step.json
  python bench/bench_micro_step.py --quick    # a few rounds, smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _common import (
    Budget,
    add_float32,
    environment,
    git_commit,
    markdown_table,
    memory_analysis_dict,
    report_failure,
    rotations,
    tree_nbytes,
    write_json,
    zeros_float32,
)
from models import gpt2_tree, loss_fn

import accum_jax
from accum_jax.testing import copied_shapes, kernel_counts

EVERY_K = 8
ACC_FLOOR = "acc-only floor: gradient + f32 tree add"
FLOOR = "interface's floor: the same, AdamW state passed through"
HOST = "accumulate(adamw), host schedule"
DEVICE = "accumulate(adamw), device schedule"
HAND_COND = "hand-written lax.cond accumulator"
PLAIN = "plain AdamW step"
MULTISTEPS_ADAMW = "optax.MultiSteps(adamw)"
FLATTEN_HOST = "accumulate(optax.flatten(adamw)), host schedule"


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way of handling a call's gradient: ``init(params)`` and ``update(params, state,
  grads, apply) -> (params, state)``, jitted with ``apply`` static. ``host``: the host
  says which call ends a window (``apply`` True on its last call only), else ``apply``
  is None."""

  init: Callable[[Any], Any]
  update: Callable[[Any, Any, Any, bool | None], tuple[Any, Any]]
  host: bool = False


def _floor(inner: optax.GradientTransformation | None = None) -> Candidate:
  """The gradient's float32 add per leaf and nothing else (the acc-only floor); with
  ``inner``, its state passed through untouched (the interface's floor: an Optax
  transformation is handed its whole state on every call, each buffer dispatched)."""

  def update(params, state, grads, apply):
    if inner is None:
      return params, add_float32(state, grads)
    return params, (add_float32(state[0], grads), state[1])

  if inner is None:
    return Candidate(zeros_float32, update)
  return Candidate(lambda p: (zeros_float32(p), inner.init(p)), update)


def _hand_written_cond(inner: optax.GradientTransformation, every_k: int) -> Candidate:
  """What a careful user writes: a float32 tree, the inner update under a kept conditional.

  The skip branch only passes its operands through, so XLA:GPU keeps the
  conditional (it turns one whose branches hold only cheap ops into selects of
  both); the zero updates and the reset are ``where``s outside it.
  """

  def init(params):
    return jnp.zeros((), jnp.int32), zeros_float32(params), inner.init(params)

  def update(params, state, grads, apply):
    del apply
    count, acc, inner_state = state
    count = count + 1
    acc = add_float32(acc, grads)
    emit = count % every_k == 0

    def apply_inner(acc, inner_state, params):
      mean = jax.tree.map(lambda a, p: (a / every_k).astype(p.dtype), acc, params)
      return inner.update(mean, inner_state, params)

    def skip(acc, inner_state, params):
      return params, inner_state  # the parameters stand in for the updates' shapes

    updates, inner_state = jax.lax.cond(emit, apply_inner, skip, acc, inner_state, params)
    updates = jax.tree.map(lambda u: jnp.where(emit, u, jnp.zeros_like(u)), updates)
    acc = jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc)
    return optax.apply_updates(params, updates), (count, acc, inner_state)

  return Candidate(init, update)


def _transformation(tx: optax.GradientTransformation, *, host: bool = False) -> Candidate:
  """``tx.update`` and ``apply_updates``; ``host``: with the host's ``apply=``."""

  def update(params, state, grads, apply):
    extra = {} if apply is None else {"apply": apply}
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state

  return Candidate(tx.init, update, host)


def across_candidates(every_k: int, inner: optax.GradientTransformation | None = None,
                      ) -> dict[str, Candidate]:
  """The rows, ``inner`` (default AdamW) inside, in the order they are measured: the
  headline figures' rows first (the interface's floor, both schedules, MultiSteps),
  then the packed inner state's and its floor, so that a budget cut falls on the
  others."""
  adamw = inner or optax.adamw(1e-4)

  def accumulate(**kwargs):
    return accum_jax.accumulate(adamw, every_k=every_k, **kwargs)

  return {
      FLOOR: _floor(adamw),
      HOST: _transformation(accumulate(), host=True),
      DEVICE: _transformation(accumulate()),
      MULTISTEPS_ADAMW: _transformation(optax.MultiSteps(adamw, every_k).gradient_transformation()),
      ACC_FLOOR: _floor(),
      FLATTEN_HOST: _transformation(
          accum_jax.accumulate(optax.flatten(adamw), every_k=every_k), host=True),
      HAND_COND: _hand_written_cond(adamw, every_k),
      PLAIN: _transformation(adamw),
  }


@dataclasses.dataclass
class Row:
  """A row compiled: its programs by ``apply``, each call's ``apply`` in a window, and
  ``carry``, its own ``[params, state]``, updated by each call."""

  programs: dict[bool | None, Any]
  applies: list[bool | None]
  carry: list[Any]


def build_row(
    candidate: Candidate, loss: Callable, params: Any, tokens: jax.Array, every_k: int
) -> tuple[Row, dict[str, Any]]:
  """The row's step (the gradient of ``tokens`` and the update, one jit) compiled for each
  ``apply`` it takes; its entry: compile time, XLA's memory (of the program that
  applies), the state's bytes and buffers, and what a micro-step launches
  (``kernel_counts``; ``leaf_copies``: the copies of more than a scalar)."""

  def step(params, state, tokens, apply):
    return candidate.update(params, state, jax.grad(loss)(params, tokens), apply)

  jitted = jax.jit(step, static_argnames="apply", donate_argnums=(0, 1))
  own = jax.tree.map(jnp.copy, params)  # donated: each row its own copy
  state = jax.jit(candidate.init)(own)
  # Each call's apply in a window: the host's (True on the last call only), or None.
  applies = [False] * (every_k - 1) + [True] if candidate.host else [None] * every_k
  programs, start = {}, time.perf_counter()
  for apply in dict.fromkeys(applies):  # False then True, or None
    programs[apply] = jitted.lower(own, state, tokens, apply=apply).compile()
  micro_step = programs[applies[0]]
  entry = {"compile_s": time.perf_counter() - start, "programs": len(programs),
           "xla": memory_analysis_dict(programs[applies[-1]]), "state_bytes": tree_nbytes(state),
           "state_buffers": len(jax.tree.leaves(state)),
           "micro_step_counts": {**kernel_counts(micro_step)._asdict(), "leaf_copies": sum(
               not shape.endswith("[]") for shape in copied_shapes(micro_step))}}
  if len(programs) > 1:
    entry["micro_step_xla"] = memory_analysis_dict(micro_step)
  return Row(programs, applies, [own, state]), entry


def run_window(row: Row, tokens: jax.Array) -> list[float]:
  """Seconds of each call of one window; ``row.carry`` updated."""
  times = []
  for apply in row.applies:
    start = time.perf_counter()
    row.carry[:] = jax.block_until_ready(row.programs[apply](*row.carry, tokens))
    times.append(time.perf_counter() - start)
  return times


def measure_rows(
    params: Any, loss: Callable, tokens: jax.Array, *, every_k: int, rounds: int,
    budget: Budget, names: Collection[str] | None = None,
) -> dict[str, dict[str, Any]]:
  """The rows (``names``; None: all) a window at a time, taking turns, each call the
  gradient of ``tokens`` and the update: micro-step, last call, window, compile."""
  results: dict[str, dict[str, Any]] = {}
  rows: dict[str, Row] = {}
  for name, candidate in across_candidates(every_k).items():
    if names is not None and name not in names:
      continue
    if not budget.left("across_calls"):
      results[name] = {"status": "skipped (budget)"}
      continue
    print(f"  {name}", flush=True)
    try:
      rows[name], results[name] = build_row(candidate, loss, params, tokens, every_k)
      run_window(rows[name], tokens)  # warm-up: the first calls allocate
    except Exception as e:
      results[name] = {"status": report_failure(name, e)}
      rows.pop(name, None)
  windows: dict[str, list[list[float]]] = {name: [] for name in rows}
  for order in rotations(rows, rounds):
    for name in order:
      windows[name].append(run_window(rows[name], tokens))
  for name, timed in windows.items():
    micro = [t for w in timed for t in w[:-1]]
    results[name].update(
        status="ok",
        micro_step_ms=1e3 * statistics.median(micro),
        last_call_ms=1e3 * statistics.median(w[-1] for w in timed),
        window_ms=1e3 * statistics.median(sum(w) for w in timed),
        call_ms_samples=[[1e3 * t for t in w] for w in timed],
    )
  return results


def table(results: dict[str, dict[str, Any]]) -> str:
  floor, acc_floor = results[FLOOR], results[ACC_FLOOR]
  multisteps = results[MULTISTEPS_ADAMW]
  rows = []
  for name, r in results.items():
    counts, fusions = r["micro_step_counts"], floor["micro_step_counts"]["fusions"]
    rows.append([
        name, f"{r['micro_step_ms']:.3f}", f"{r['micro_step_ms'] / floor['micro_step_ms']:.2f}",
        f"{r['micro_step_ms'] / acc_floor['micro_step_ms']:.2f}", f"{r['window_ms']:.2f}",
        f"{r['window_ms'] / multisteps['window_ms']:.2f}", counts["fusions"],
        f"{counts['fusions'] / fusions:.2f}", f"{counts['copies']} ({counts['leaf_copies']})",
        counts["conditionals"], r["state_buffers"]])
  return markdown_table(
      ["row", "micro-step ms", "/ interface's floor", "/ acc-only floor", "window ms",
       "window / MultiSteps", "fusions", "/ floor", "copies (of leaves)", "conditionals",
       "state buffers"], rows)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="3 rounds")
  parser.add_argument("--rounds", type=int, default=40, help="windows of each row (default 40)")
  args = parser.parse_args(argv)
  rounds = 3 if args.quick else args.rounds
  params = gpt2_tree()
  tokens = jax.random.randint(jax.random.key(1), (17,), 0, 128)
  results = measure_rows(params, loss_fn, tokens, every_k=EVERY_K, rounds=rounds,
                         budget=Budget(0))
  report = {"environment": environment(), "commit": git_commit(), "rounds": rounds,
            "every_k": EVERY_K, "leaves": len(jax.tree.leaves(params)), "rows": results}
  print(f"GPT-2-shaped, {report['leaves']} bfloat16 leaves, width 64: gradient of one"
        f" sequence + update, one jit, donated; AdamW inside, every_k={EVERY_K}; {rounds}"
        " windows of each row, interleaved")
  print(table(results))
  print(f"\nwrote {write_json('micro_step_quick' if args.quick else 'micro_step', report)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
