"""Across calls: ``accumulate`` against ``optax.MultiSteps`` and the floors, a window at a time.

A *micro-step* is a call that only adds its gradient; a *window* is the
``every_k`` calls whose last one applies AdamW.

The full run: ``accum_jax.accumulate(optax.adamw(1e-4), every_k=N)`` against
``optax.MultiSteps(optax.adamw(1e-4), every_k_schedule=N)`` on the model's
bfloat16 parameters: one jitted ``tx.update`` + ``optax.apply_updates`` with
params and state donated, each call handed a fixed gradient, timed per call and
per window of N calls.

``--quick``: the step users write, the gradient of one sequence and the update
in one jit (``build_row``), for each row of :func:`across_candidates`: the
acc-only floor (the gradient and a float32 add per leaf, no optimizer state),
the interface's floor (the same with AdamW's state passed through untouched, as
an Optax transformation is handed its whole state on every call),
``accumulate(adamw)`` on the host schedule (``apply=False`` on the window's first
calls, ``apply=True`` on its last: two compiled programs) and on the device
schedule (``apply`` left out: one program, a kept conditional), a hand-written
``lax.cond`` accumulator, a plain AdamW step, ``optax.MultiSteps(adamw)``, and
``accumulate(optax.flatten(adamw))`` (the inner state packed in one vector) on the
host schedule. The rows take turns,
a window each per round, so that machine noise falls on all alike.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _common import memory_analysis_dict, tree_nbytes
from gpu_budget import Budget
from gpu_failures import error_status, report_failure
from gpu_methods import ACCUM

import accum_jax
from accum_jax.testing import kernel_counts

MULTISTEPS = "optax.MultiSteps"


def _update_step(tx: optax.GradientTransformation) -> Callable:
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def measure_across_calls(
    ns: list[int], params: Any, *, rounds: int, budget: Budget
) -> list[dict[str, Any]]:
  """Per N: each call of a window timed, both optimizers taking turns window by window."""
  keys = jax.random.split(jax.random.key(1), 2)
  grads = [
      jax.tree.map(lambda p, k=k: 1e-3 * jax.random.normal(k, p.shape, p.dtype), params)
      for k in keys
  ]
  results = []
  for n in ns:
    if n < 2:
      continue
    if not budget.left("across_calls"):
      results.append({"every_k": n, "status": "skipped (budget)"})
      continue
    print(f"  every_k={n}", flush=True)
    txs = {
        ACCUM: accum_jax.accumulate(optax.adamw(1e-4), every_k=n),
        MULTISTEPS: optax.MultiSteps(optax.adamw(1e-4), every_k_schedule=n)
        .gradient_transformation(),
    }
    entry: dict[str, Any] = {"every_k": n}
    try:
      carries, steps = {}, {}
      for name, tx in txs.items():
        own = jax.tree.map(jnp.copy, params)  # donated: each its own copy
        carries[name] = (own, tx.init(own))
        steps[name] = _update_step(tx)
        entry[name] = {"state_bytes": tree_nbytes(carries[name][1])}
      per_call: dict[str, list[list[float]]] = {name: [] for name in txs}

      def window(name):
        times = []
        p, s = carries[name]
        for i in range(n):
          start = time.perf_counter()
          p, s = jax.block_until_ready(steps[name](p, s, grads[i % 2]))
          times.append(time.perf_counter() - start)
        carries[name] = (p, s)
        return times

      for name in txs:  # compile and warm up: one window each
        window(name)
      names = list(txs)
      for r in range(rounds):
        for name in names[r % 2:] + names[: r % 2]:
          per_call[name].append(window(name))
      for name, windows in per_call.items():
        micro = [t for w in windows for t in w[:-1]]
        entry[name].update(
            micro_step_ms=1e3 * statistics.median(micro),
            apply_step_ms=1e3 * statistics.median(w[-1] for w in windows),
            window_ms=1e3 * statistics.median(sum(w) for w in windows),
            call_ms_samples=[[1e3 * t for t in w] for w in windows],
        )
      for key in ("micro_step_ms", "apply_step_ms", "window_ms"):
        entry[key.replace("_ms", "_ratio")] = entry[ACCUM][key] / entry[MULTISTEPS][key]
      entry["status"] = "ok"
    except Exception as e:
      entry["status"] = error_status(e)
      if entry["status"] != "OOM":
        traceback.print_exc()
    results.append(entry)
    carries = steps = {}
  return results


# --quick: the step users write (the gradient of one sequence, the optimizer's
# update and apply_updates in one jit), each way of handling the gradient a row.

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
  """One way of handling a call's gradient: its state and its update, both of plain arrays.

  ``update(params, state, grads, apply) -> (params, state)`` is jitted with the
  parameters and the state donated and ``apply`` static. ``host``: the host says
  which call ends a window, ``apply`` False on its first calls and True on its
  last (two compiled programs); else ``apply`` is None and the row ignores it.
  """

  init: Callable[[Any], Any]
  update: Callable[[Any, Any, Any, bool | None], tuple[Any, Any]]
  host: bool = False


def _zeros32(params: Any) -> Any:
  return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)


def _add(acc: Any, grads: Any) -> Any:
  return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)


def _acc_only_floor() -> Candidate:
  """A float32 add per leaf and no optimizer state: the least a micro-step can cost."""

  def update(params, acc, grads, apply):
    del apply
    return params, _add(acc, grads)

  return Candidate(_zeros32, update)


def _interface_floor(inner: optax.GradientTransformation) -> Candidate:
  """The acc-only floor with the inner state passed through untouched: an Optax
  transformation is handed its whole state on every call, each buffer dispatched."""

  def update(params, state, grads, apply):
    del apply
    acc, inner_state = state
    return params, (_add(acc, grads), inner_state)

  return Candidate(lambda p: (_zeros32(p), inner.init(p)), update)


def _hand_written_cond(inner: optax.GradientTransformation, every_k: int) -> Candidate:
  """What a careful user writes: a float32 tree, the inner update under a kept conditional.

  The skip branch only passes its operands through, so XLA:GPU keeps the
  conditional (it turns one whose branches hold only cheap ops into selects of
  both); the zero updates and the reset are ``where``s outside it.
  """

  def init(params):
    return jnp.zeros((), jnp.int32), _zeros32(params), inner.init(params)

  def update(params, state, grads, apply):
    del apply
    count, acc, inner_state = state
    count = count + 1
    acc = _add(acc, grads)
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


def across_candidates(every_k: int) -> dict[str, Candidate]:
  """The rows of the quick across-calls table, AdamW inside, in the order they are
  measured: the headline figures' rows first (the interface's floor, both schedules,
  MultiSteps), then the packed inner state's and its floor, so that a budget cut falls on
  the others."""
  adamw = optax.adamw(1e-4)

  def accumulate(**kwargs):
    return accum_jax.accumulate(adamw, every_k=every_k, **kwargs)

  return {
      FLOOR: _interface_floor(adamw),
      HOST: _transformation(accumulate(), host=True),
      DEVICE: _transformation(accumulate()),
      MULTISTEPS_ADAMW: _transformation(optax.MultiSteps(adamw, every_k).gradient_transformation()),
      ACC_FLOOR: _acc_only_floor(),
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


def window_applies(candidate: Candidate, every_k: int) -> list[bool | None]:
  """Each call's ``apply`` in a window: the host's (True on the last call only), or None."""
  if not candidate.host:
    return [None] * every_k
  return [False] * (every_k - 1) + [True]


def build_row(
    candidate: Candidate, loss: Callable, params: Any, tokens: jax.Array, every_k: int
) -> tuple[Row, dict[str, Any]]:
  """The row's step, the gradient of ``tokens`` and its update in one jit, compiled for
  each ``apply`` it takes; and its entry: compile time (all programs), XLA's memory
  (of the program that applies; a host row's micro-step beside it), state bytes, and
  what a micro-step launches (``accum_jax.testing.kernel_counts``: top-level fusions,
  copies, conditionals)."""

  def step(params, state, tokens, apply):
    return candidate.update(params, state, jax.grad(loss)(params, tokens), apply)

  jitted = jax.jit(step, static_argnames="apply", donate_argnums=(0, 1))
  own = jax.tree.map(jnp.copy, params)  # donated: each row its own copy
  state = jax.jit(candidate.init)(own)
  applies = window_applies(candidate, every_k)
  programs, start = {}, time.perf_counter()
  for apply in dict.fromkeys(applies):  # False then True, or None
    programs[apply] = jitted.lower(own, state, tokens, apply=apply).compile()
  entry = {"compile_s": time.perf_counter() - start, "programs": len(programs),
           "xla": memory_analysis_dict(programs[applies[-1]]), "state_bytes": tree_nbytes(state),
           "micro_step_counts": kernel_counts(programs[applies[0]])._asdict()}
  if len(programs) > 1:
    entry["micro_step_xla"] = memory_analysis_dict(programs[applies[0]])
  return Row(programs, applies, [own, state]), entry


def run_window(row: Row, tokens: jax.Array) -> list[float]:
  """Seconds of each call of one window; ``row.carry`` updated."""
  times = []
  for apply in row.applies:
    start = time.perf_counter()
    row.carry[:] = jax.block_until_ready(row.programs[apply](*row.carry, tokens))
    times.append(time.perf_counter() - start)
  return times


def measure_quick_across(
    params: Any, loss: Callable, tokens: jax.Array, *, every_k: int, rounds: int,
    budget: Budget, names: Collection[str] | None = None,
) -> dict[str, dict[str, Any]]:
  """Each row a window at a time, taking turns: micro-step, last call, window, compile.

  Each call takes the gradient of ``tokens`` (one sequence) and updates, in one
  jit, as users write a train step. ``names``: the rows to measure (None: all of
  :func:`across_candidates`).
  """
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
  order = list(rows)
  windows: dict[str, list[list[float]]] = {name: [] for name in order}
  for r in range(rounds if order else 0):
    for name in order[r % len(order):] + order[:r % len(order)]:
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
