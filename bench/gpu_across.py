"""Across calls: ``accumulate`` against ``optax.MultiSteps`` and the floors, a window at a time.

The full run: ``accum_jax.accumulate(optax.adamw(1e-4), every_k=N)`` against
``optax.MultiSteps(optax.adamw(1e-4), every_k_schedule=N)`` on the model's
bfloat16 parameters: one jitted ``tx.update`` + ``optax.apply_updates`` with
params and state donated, timed per call (a micro-step only accumulates; the
window's last call applies AdamW) and per window of N calls.

``--quick``: the rows of :func:`across_candidates`, each a window at a time.
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


# --quick, across calls: floors, accumulate in both layouts, MultiSteps; alone and
# in the step that takes the gradient.

VECTOR = "floor: one f32 vector acc += g"
PER_LEAF = "floor: per-leaf acc += g (jax.tree.map)"
HAND_COND = "floor: hand-written lax.cond(emit, adamw, skip)"
PLAIN = "floor: plain adamw step"
MULTISTEPS_ADAMW = "optax.MultiSteps(adamw)"
LAYOUTS = ("tree", "flat")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way of handling a call's gradient: its state and its update, both of plain arrays.

  ``update(params, state, grads) -> (params, state)`` is jitted with the
  parameters and the state donated. ``vector_grads``: standing alone, it is
  handed the gradient as one vector (the floor of memory traffic).
  """

  init: Callable[[Any], Any]
  update: Callable[[Any, Any, Any], tuple[Any, Any]]
  vector_grads: bool = False


def _ravel(tree: Any) -> jax.Array:
  return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])


def _vector_floor() -> Candidate:
  def update(params, acc, grads):
    g = grads if isinstance(grads, jax.Array) else _ravel(grads)
    return params, acc + g.astype(jnp.float32)

  return Candidate(lambda p: jnp.zeros(sum(x.size for x in jax.tree.leaves(p)), jnp.float32),
                   update, vector_grads=True)


def _per_leaf_floor() -> Candidate:
  def update(params, acc, grads):
    return params, jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)

  return Candidate(lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p), update)


def _hand_written_cond(inner: optax.GradientTransformation, every_k: int) -> Candidate:
  """What a careful user writes: a float32 tree, the inner update under a kept conditional.

  The skip branch only passes its operands through, so XLA:GPU keeps the
  conditional (it turns one whose branches hold only cheap ops into selects of
  both); the zero updates and the reset are ``where``s outside it.
  """

  def init(params):
    acc = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
    return jnp.zeros((), jnp.int32), acc, inner.init(params)

  def update(params, state, grads):
    count, acc, inner_state = state
    count = count + 1
    acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
    emit = count % every_k == 0

    def apply(acc, inner_state, params):
      mean = jax.tree.map(lambda a, p: (a / every_k).astype(p.dtype), acc, params)
      return inner.update(mean, inner_state, params)

    def skip(acc, inner_state, params):
      return params, inner_state  # the parameters stand in for the updates' shapes

    updates, inner_state = jax.lax.cond(emit, apply, skip, acc, inner_state, params)
    updates = jax.tree.map(lambda u: jnp.where(emit, u, jnp.zeros_like(u)), updates)
    acc = jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc)
    return optax.apply_updates(params, updates), (count, acc, inner_state)

  return Candidate(init, update)


def _optimizer(tx: optax.GradientTransformation) -> Candidate:
  """An Optax transformation's update and ``apply_updates``, every call."""

  def update(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return Candidate(tx.init, update)


def _inner(name: str) -> optax.GradientTransformation:
  if name == "sgd":
    return optax.sgd(1e-3)
  if name == "adamw":
    return optax.adamw(1e-4)
  return optax.contrib.muon(1e-3)


def across_candidates(every_k: int) -> dict[str, Candidate]:
  """The rows of the quick across-calls table, references first."""
  rows: dict[str, Candidate] = {
      VECTOR: _vector_floor(),
      PER_LEAF: _per_leaf_floor(),
      HAND_COND: _hand_written_cond(_inner("adamw"), every_k),
      PLAIN: _optimizer(_inner("adamw")),
      MULTISTEPS_ADAMW: _optimizer(
          optax.MultiSteps(_inner("adamw"), every_k).gradient_transformation()),
  }
  for inner in ("adamw", "sgd", "muon"):
    for layout in LAYOUTS:
      rows[accumulate_row(inner, layout)] = _optimizer(
          accum_jax.accumulate(_inner(inner), every_k=every_k, layout=layout))
  return rows


def accumulate_row(inner: str, layout: str) -> str:
  return f"accumulate({inner}), {layout}"


def _window_times(step: Callable, carry: list[Any], grads: Any, every_k: int) -> list[float]:
  """Seconds of each call of one window; ``carry`` holds ``[params, state]``, updated."""
  times = []
  for _ in range(every_k):
    start = time.perf_counter()
    carry[:] = jax.block_until_ready(step(*carry, grads))
    times.append(time.perf_counter() - start)
  return times


def measure_quick_across(
    params: Any, loss: Callable, tokens: jax.Array, *, every_k: int, rounds: int,
    budget: Budget, combined: bool, names: Collection[str] | None = None,
) -> dict[str, dict[str, Any]]:
  """Each row a window at a time, taking turns: micro-step, last call, window, compile.

  ``combined``: the jitted call takes the gradient of ``tokens`` (one sequence)
  and updates, as users jit a step; else it is handed a fixed gradient.
  ``names``: the rows to measure (None: all of :func:`across_candidates`).
  """
  keys = jax.random.split(jax.random.key(1), 2)
  grads = jax.tree.map(lambda p, k=keys[0]: 1e-3 * jax.random.normal(k, p.shape, p.dtype), params)
  vector = _ravel(grads)
  results: dict[str, dict[str, Any]] = {}
  steps, carries, inputs = {}, {}, {}
  for name, candidate in across_candidates(every_k).items():
    if names is not None and name not in names:
      continue
    if not budget.left("across_calls"):
      results[name] = {"status": "skipped (budget)"}
      continue
    if combined:
      def call(params, state, tokens, update=candidate.update):
        return update(params, state, jax.grad(loss)(params, tokens))
      inputs[name] = tokens
    else:
      call = candidate.update
      inputs[name] = vector if candidate.vector_grads else grads
    print(f"  {name}", flush=True)
    own = jax.tree.map(jnp.copy, params)  # donated: each its own copy
    try:
      state = jax.jit(candidate.init)(own)
      start = time.perf_counter()
      steps[name] = jax.jit(call, donate_argnums=(0, 1)).lower(own, state, inputs[name]).compile()
      results[name] = {"compile_s": time.perf_counter() - start,
                       "xla": memory_analysis_dict(steps[name]), "state_bytes": tree_nbytes(state)}
      carries[name] = [own, state]
      _window_times(steps[name], carries[name], inputs[name], every_k)  # warm-up
    except Exception as e:
      results[name] = {"status": report_failure(name, e)}
      steps.pop(name, None)
      carries.pop(name, None)
  per_call: dict[str, list[list[float]]] = {name: [] for name in steps}
  names = list(steps)
  for r in range(rounds if names else 0):
    for name in names[r % len(names):] + names[:r % len(names)]:
      per_call[name].append(_window_times(steps[name], carries[name], inputs[name], every_k))
  for name, windows in per_call.items():
    micro = [t for w in windows for t in w[:-1]]
    results[name].update(
        status="ok",
        micro_step_ms=1e3 * statistics.median(micro),
        last_call_ms=1e3 * statistics.median(w[-1] for w in windows),
        window_ms=1e3 * statistics.median(sum(w) for w in windows),
        call_ms_samples=[[1e3 * t for t in w] for w in windows],
    )
  return results
