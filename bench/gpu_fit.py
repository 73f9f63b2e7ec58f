"""The largest batch that fits: the largest full batch, then a larger one microbatched.

The full batch doubles, from the largest that ran inside a step up to a cap,
until its step runs out of memory; then a batch ``factor`` times as large runs
through ``accum_jax.value_and_grad`` with microbatches of that size (halved while
they run out of memory), its loss and gradient set against the hand-written scan
of the same batch (a full-batch reference does not fit, by construction).
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
from _common import memory_analysis_dict, time_interleaved
from gpu_budget import Budget
from gpu_failures import error_status
from gpu_methods import ACCUM, FULL, METHODS, SCAN, compare, compile_timed
from gpu_model import Config, make_tokens


def measure_fit(
    loss: Callable, params: Any, config: Config, *, known: int | None, cap: int, factor: int,
    rounds: int, budget: Budget,
) -> dict[str, Any]:
  """Doubles the full batch until OOM (or ``cap``), then runs ``factor`` times it microbatched.

  ``known``: the largest full batch that already ran (the step section's); the
  doubling starts at twice it.
  """
  result: dict[str, Any] = {"cap": cap, "factor": factor, "tried": []}
  largest = _largest_full_batch(result, loss, params, config, known=known, cap=cap,
                                budget=budget)
  result["largest_full_batch"] = largest
  result["cap_reached"] = largest is not None and largest * 2 > cap
  if largest is None or not budget.left("fit"):
    result.setdefault("status", "no full batch ran" if largest is None else "skipped (budget)")
    return result
  _microbatched(result, loss, params, config, batch=factor * largest, factor=factor,
                rounds=rounds)
  result["status"] = "ok" if "exact" in result else "incomplete"
  return result


def _largest_full_batch(
    result: dict[str, Any], loss: Callable, params: Any, config: Config, *,
    known: int | None, cap: int, budget: Budget,
) -> int | None:
  """Doubles the full batch from twice ``known`` until it fails; each try in
  ``result["tried"]``."""
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
      start_time = time.perf_counter()
      jax.block_until_ready(step(params, tokens))
      result["tried"].append({"batch": batch, "status": "ok", "compile_s": seconds,
                              "step_ms": 1e3 * (time.perf_counter() - start_time),
                              "xla": memory_analysis_dict(step)})
      largest = batch
    except Exception as e:
      status = error_status(e)
      result["tried"].append({"batch": batch, "status": status})
      if status != "OOM":
        traceback.print_exc()
      break
    finally:
      step = tokens = None
    batch *= 2
  return largest


def _microbatched(
    result: dict[str, Any], loss: Callable, params: Any, config: Config, *, batch: int,
    factor: int, rounds: int,
) -> None:
  """``batch`` through the door and the scan, microbatches halved while they run out of
  memory; compared and timed."""
  tokens = make_tokens(batch, config, seed=batch)
  result["batch"] = batch
  outputs, steps = {}, {}
  for method in (ACCUM, SCAN):
    n, status = factor, "no microbatch size divides the batch"
    while batch % n == 0:
      print(f"  {method}: batch {batch} as N={n} x {batch // n}", flush=True)
      try:
        step, seconds = compile_timed(METHODS[method](loss, n), params, tokens)
        outputs[method] = jax.block_until_ready(step(params, tokens))
      except Exception as e:
        status = error_status(e)
        result.setdefault("failed", []).append({"method": method, "num_microbatches": n,
                                                "status": status})
        if status != "OOM":
          traceback.print_exc()
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
    else:
      for method, times in samples.items():
        result[method].update(step_ms=1e3 * statistics.median(times),
                              step_ms_samples=[1e3 * t for t in times])
