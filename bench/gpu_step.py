"""Inside one step: the ways of taking a batch's gradient, timed, compiled and checked;
and the largest batch that fits.

Each way turns a loss and N into ``value_and_grad(params, tokens)`` for N x micro
sequences: the hand-written scan (the reference), ``accum_jax.value_and_grad`` by
default, with ``on_nonfinite="skip_microbatch"`` and with ``"unchecked"``, and the full
batch. Per (N, micro), after a warm-up compile of one microbatch's gradient per
microbatch size (the process's one-time set-up and a shape's first kernel tuning fall
on no way): each compiled, run once and checked against the scan, then timed in
interleaved rounds; one that runs out of memory is recorded OOM and the others go on.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from _common import (
    Budget,
    error_status,
    hand_written_scan,
    memory_analysis_dict,
    quartiles,
    report_failure,
    time_interleaved,
)
from models import Config, make_tokens

import accum_jax

SCAN = "lax.scan"
DEFAULT = "default"
MICROBATCH = "on_nonfinite='skip_microbatch'"
NO_SKIP = "on_nonfinite='unchecked'"
FULL = "full batch"
ACCUM = "accum_jax"  # the default, in the fit section
CHECKED = (DEFAULT, MICROBATCH, NO_SKIP)  # against the scan
# The scan first: the reference of every ratio.
METHODS: dict[str, Callable[[Callable, int], Callable]] = {
    SCAN: hand_written_scan,
    DEFAULT: lambda loss, n: accum_jax.value_and_grad(loss, n),
    MICROBATCH: lambda loss, n: accum_jax.value_and_grad(loss, n, on_nonfinite="skip_microbatch"),
    NO_SKIP: lambda loss, n: accum_jax.value_and_grad(loss, n, on_nonfinite="unchecked"),
    FULL: lambda loss, n: jax.value_and_grad(loss),
}
QUICK_PAIRS = ((8, 1), (8, 4), (16, 1))  # --quick's N x micro

# The door against the hand-written scan: both sum the same bfloat16 microbatch
# gradients in float32 and cast the mean to bfloat16, so they differ by the rounding
# of that cast and the order of the sums: a few bfloat16 ulps (2**-8 relative) of a
# leaf's largest entry at most.
GRAD_RTOL = 2e-2
LOSS_RTOL = 1e-4  # the loss is float32 on both sides


def compile_timed(fn: Callable, *args: Any) -> tuple[Any, float]:
  """``jax.jit(fn)`` lowered and compiled for ``args``, and the seconds that took."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - start


def rel_diff(a: Any, b: Any) -> float:
  """The largest |a - b| of any leaf, relative to the largest |b| of that leaf, in float32."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    worst = max(worst, float(np.max(np.abs(x - y))) / (float(np.max(np.abs(y))) or 1.0))
  return worst


def compare(out: tuple[Any, Any], reference: tuple[Any, Any], *,
            check: bool = True) -> dict[str, Any]:
  """Loss and gradient against a reference; ``check``: with the verdict (``match``)."""
  result = {"loss": float(out[0]), "reference_loss": float(reference[0]),
            "loss_rel_diff": rel_diff(out[0], reference[0]),
            "grad_max_rel_diff": rel_diff(out[1], reference[1])}
  if check:
    result["match"] = (result["loss_rel_diff"] <= LOSS_RTOL
                       and result["grad_max_rel_diff"] <= GRAD_RTOL)
  return result


def measure_steps(
    pairs: list[tuple[int, int]], loss: Callable, params: Any, config: Config, *,
    rounds: int, budget: Budget, on_group: Callable[[], None],
) -> dict[tuple[int, int], dict[str, Any]]:
  """Per (N, micro): each way compiled (the full batch once per batch size), run once and
  checked, then timed in turns; ``on_group()`` after each (N, micro)."""
  full_steps: dict[int, tuple[Any, dict[str, Any]]] = {}  # by batch size
  warmed: set[int] = set()
  rows: dict[tuple[int, int], dict[str, Any]] = {}
  for n, micro in pairs:
    batch = n * micro
    row: dict[str, Any] = {"num_microbatches": n, "micro": micro, "batch": batch, "methods": {}}
    rows[n, micro] = row
    if not budget.left("step"):
      row["status"] = "skipped (budget)"
      continue
    print(f"  N={n} micro={micro} (batch {batch})", flush=True)
    tokens = make_tokens(batch, config, seed=batch)
    if micro not in warmed:
      compile_timed(jax.value_and_grad(loss), params, tokens[:micro])
      warmed.add(micro)
    compiled, outputs = {}, {}
    for method, make in METHODS.items():
      if method == FULL and batch in full_steps:  # compiled for an earlier row
        step, entry = full_steps[batch][0], dict(full_steps[batch][1])
      else:
        try:
          step, seconds = compile_timed(make(loss, n), params, tokens)
          entry = {"compile_s": seconds, "xla": memory_analysis_dict(step)}
        except Exception as e:
          step, entry = None, {"status": report_failure(method, e)}
      if step is not None:
        try:
          outputs[method], compiled[method] = jax.block_until_ready(step(params, tokens)), step
          entry.setdefault("status", "ok")
        except Exception as e:
          step, entry["status"] = None, report_failure(method, e)
      if method == FULL and batch not in full_steps:
        full_steps[batch] = (step, dict(entry))
      row["methods"][method] = entry
    if SCAN in outputs:
      row["checks"] = {m: compare(outputs[m], outputs[SCAN]) for m in CHECKED if m in outputs}
    if DEFAULT in outputs and FULL in outputs:
      # Not a check: the full batch sums its bfloat16 gradient (the embedding's
      # scatter-add, the weights' products) over all B sequences in bfloat16.
      row["vs_full"] = compare(outputs[DEFAULT], outputs[FULL], check=False)
    del outputs
    if compiled:
      _time_methods(row, compiled, params, tokens, rounds)
    row.setdefault("status", "ok")
    del compiled, tokens
    on_group()
  return rows


def _time_methods(row: dict[str, Any], compiled: dict[str, Any], params: Any,
                  tokens: jax.Array, rounds: int) -> None:
  calls = {m: (lambda s=s, t=tokens: s(params, t)) for m, s in compiled.items()}
  try:
    samples = time_interleaved(calls, rounds=rounds, warmup=1)
  except Exception as e:
    row["status"] = f"timing failed: {error_status(e)}"
    traceback.print_exc()
    return
  for method, times in samples.items():
    row["methods"][method].update(
        step_ms=1e3 * statistics.median(times),
        step_ms_p25_p75=[1e3 * q for q in quartiles(times)],
        step_ms_samples=[1e3 * t for t in times])


def checks_of(row: dict[str, Any]) -> list[dict[str, Any]]:
  """A row's comparisons with the scan (``exact``: the one of earlier JSON)."""
  if "checks" in row:
    return list(row["checks"].values())
  return [row["exact"]] if row.get("exact") else []


# The largest batch that fits: the full batch doubles, from the largest that ran inside
# a step up to a cap, until its step runs out of memory; then a batch ``factor`` times
# as large runs through the door with microbatches of that size (halved while they run
# out of memory), its loss and gradient set against the hand-written scan of the same
# batch (a full-batch reference does not fit, by construction).


def measure_fit(
    loss: Callable, params: Any, config: Config, *, known: int | None, cap: int, factor: int,
    rounds: int, budget: Budget,
) -> dict[str, Any]:
  """Doubles the full batch until OOM (or ``cap``), from twice ``known`` (the largest that
  ran inside a step), then runs ``factor`` times the largest microbatched."""
  result: dict[str, Any] = {"cap": cap, "factor": factor, "tried": []}
  largest = None
  if known is not None:
    largest = min(known, cap)
    result["tried"].append({"batch": largest, "status": "ok (step section)"})
  batch = 2 * largest if largest else 1
  while batch <= cap:
    if not budget.left("fit"):
      result["status"] = "skipped (budget)"
      break
    print(f"  full batch {batch}", flush=True)
    tokens = make_tokens(batch, config, seed=batch)
    try:
      step, seconds = compile_timed(METHODS[FULL](loss, 1), params, tokens)
      jax.block_until_ready(step(params, tokens))
      start = time.perf_counter()
      jax.block_until_ready(step(params, tokens))
      result["tried"].append({"batch": batch, "status": "ok", "compile_s": seconds,
                              "step_ms": 1e3 * (time.perf_counter() - start),
                              "xla": memory_analysis_dict(step)})
      largest = batch
    except Exception as e:
      result["tried"].append({"batch": batch, "status": report_failure("full batch", e)})
      break
    finally:
      step = tokens = None
    batch *= 2
  result["largest_full_batch"] = largest
  result["cap_reached"] = largest is not None and largest * 2 > cap
  if largest is None or not budget.left("fit"):
    result.setdefault("status", "no full batch ran" if largest is None else "skipped (budget)")
    return result
  _microbatched(result, loss, params, config, batch=factor * largest, factor=factor,
                rounds=rounds)
  result["status"] = "ok" if "exact" in result else "incomplete"
  return result


def _microbatched(result: dict[str, Any], loss: Callable, params: Any, config: Config, *,
                  batch: int, factor: int, rounds: int) -> None:
  """``batch`` through the door and the scan, microbatches halved while they run out of
  memory; compared and timed."""
  tokens = make_tokens(batch, config, seed=batch)
  result["batch"] = batch
  outputs, steps = {}, {}
  for method, make in ((ACCUM, METHODS[DEFAULT]), (SCAN, METHODS[SCAN])):
    n, status = factor, "no microbatch size divides the batch"
    while batch % n == 0:
      print(f"  {method}: batch {batch} as N={n} x {batch // n}", flush=True)
      try:
        step, seconds = compile_timed(make(loss, n), params, tokens)
        outputs[method] = jax.block_until_ready(step(params, tokens))
      except Exception as e:
        status = report_failure(method, e)
        result.setdefault("failed", []).append({"method": method, "num_microbatches": n,
                                                "status": status})
        if status != "OOM":
          break
        n *= 2  # smaller microbatches
        continue
      steps[method] = step
      result[method] = {"num_microbatches": n, "micro": batch // n, "status": "ok",
                        "compile_s": seconds, "xla": memory_analysis_dict(step)}
      break
    if method not in steps:
      result[method] = {"status": status}
  if ACCUM in outputs and SCAN in outputs:
    result["exact"] = compare(outputs[ACCUM], outputs[SCAN])
  del outputs
  if steps:
    calls = {m: (lambda s=s: s(params, tokens)) for m, s in steps.items()}
    try:
      samples = time_interleaved(calls, rounds=rounds, warmup=0)
    except Exception as e:
      result["timing"] = error_status(e)
      return
    for method, times in samples.items():
      result[method].update(step_ms=1e3 * statistics.median(times),
                            step_ms_samples=[1e3 * t for t in times])
