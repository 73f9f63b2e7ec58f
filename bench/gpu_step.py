"""Inside one step: each way of taking a batch's gradient timed, compiled, checked, measured.

For each number of microbatches N and microbatch size ``micro``: the step time of
each method (:mod:`gpu_methods`), the methods taking turns in rounds in this
process (``_common.time_interleaved``), median; its compile time and XLA's static
``memory_analysis()``; the door's loss and gradient against the hand-written
scan's; and the peak memory of one step, each (method, N, micro) in a fresh
process (``_common.fresh_process_peak``: the GPU allocator's peak over what was in
use before the step; on CPU the resident-set growth). A method that runs out of
memory is recorded as OOM and the others go on.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import subprocess
import traceback
from collections.abc import Callable
from typing import Any

import jax
from _common import (
    fresh_process_peak,
    memory_analysis_dict,
    quartiles,
    time_interleaved,
)
from gpu_budget import Budget
from gpu_failures import error_status, report_failure, worker_status
from gpu_methods import ACCUM, FULL, METHODS, SCAN, compare, compile_timed
from gpu_model import GPT2_SMALL, TINY, Config, make_loss, make_model, make_tokens

# --quick: the (N, micro) pairs inside a step.
QUICK_PAIRS = ((8, 1), (8, 4), (16, 1))

_MIB = 2**20


def step_configurations(ns: list[int], micros: list[int], max_batch: int):
  """The (N, micro) pairs with N x micro <= max_batch, smallest batch first; and the rest."""
  pairs = [(n, m) for n in ns for m in micros]
  kept = sorted((p for p in pairs if p[0] * p[1] <= max_batch), key=lambda p: (p[0] * p[1], p))
  return kept, [p for p in pairs if p[0] * p[1] > max_batch]


# Peak memory, a fresh process per (method, N, micro).


def build_step(
    method: str, num_microbatches: int, micro: int, tiny: bool, attention: str
) -> tuple[Any, tuple[Any, Any]]:
  """The jitted step of one (method, N, micro) and its arguments: the peak worker's builder."""
  config = TINY if tiny else GPT2_SMALL
  graphdef, params = make_model(config, attention)
  step = jax.jit(METHODS[method](make_loss(graphdef), num_microbatches))
  return step, (params, make_tokens(num_microbatches * micro, config))


def memory_jobs(pairs: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
  """(method, N, micro) to measure; the full batch once per batch size."""
  jobs, batches = [], set()
  for n, micro in pairs:
    jobs += [(ACCUM, n, micro), (SCAN, n, micro)]
    if n * micro not in batches:
      batches.add(n * micro)
      jobs.append((FULL, 1, n * micro))
  return jobs


def measure_memory(
    jobs: list[tuple[str, int, int]], *, tiny: bool, attention: str, workers: int,
    budget: Budget, timeout: float,
) -> dict[tuple[str, int, int], dict[str, Any]]:
  def one(job):
    method, n, micro = job
    if not budget.left("memory"):
      return {"status": "skipped (budget)"}
    config = {"method": method, "num_microbatches": n, "micro": micro, "tiny": tiny,
              "attention": attention}
    try:
      result = fresh_process_peak("gpu_step:build_step", config, timeout=timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
      status = worker_status(e)
      print(f"  peak {method} N={n} micro={micro}: {status}", flush=True)
      return {"status": status}
    print(f"  peak {method} N={n} micro={micro}: {result['step_peak_bytes'] / _MIB:.1f} MiB"
          f"{' (masked)' if result.get('masked') else ''}", flush=True)
    return {"status": "ok", **result}

  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    return dict(zip(jobs, pool.map(one, jobs)))


# Time, compile time and exactness, in this process.


def measure_steps(
    pairs: list[tuple[int, int]], loss: Callable, params: Any, config: Config, *,
    rounds: int, budget: Budget, on_group: Callable[[], None],
    methods: dict[str, Callable[[Callable, int], Callable]] | None = None,
    warmup_compile: bool = False,
) -> dict[tuple[int, int], dict[str, Any]]:
  """Per (N, micro): each method compiled once, run once (compared), then timed in turns.

  ``methods`` (default :data:`gpu_methods.METHODS`): each one other than the scan
  and the full batch is checked against the scan; the first of them is ``exact``,
  all are in ``checks``. ``warmup_compile``: before the methods of the first pair
  of each microbatch size, the gradient of one microbatch is compiled and thrown
  away, so that no method's compile time holds the process's one-time
  initialisation or the first tuning of that shape's kernels (the first method,
  the scan, paid it).
  """
  methods = METHODS if methods is None else methods
  full_steps: dict[int, tuple[Any, dict[str, Any]]] = {}  # by batch size: compiled once
  warmed: set[int] = set()  # the microbatch sizes whose gradient was compiled to warm up
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
    if warmup_compile and micro not in warmed:  # once per microbatch shape
      compile_timed(jax.value_and_grad(loss), params, tokens[:micro])
      warmed.add(micro)
    compiled, outputs = _run_methods(row, methods, loss, params, tokens, full_steps)
    _check(row, outputs, [m for m in methods if m not in (SCAN, FULL)])
    del outputs
    if compiled:
      _time_methods(row, compiled, params, tokens, rounds)
    row.setdefault("status", "ok")
    del compiled, tokens
    on_group()
  return rows


def _run_methods(
    row: dict[str, Any], methods: dict[str, Callable[[Callable, int], Callable]],
    loss: Callable, params: Any, tokens: jax.Array,
    full_steps: dict[int, tuple[Any, dict[str, Any]]],
) -> tuple[dict[str, Any], dict[str, Any]]:
  """Each method compiled (the full batch once per batch size) and run once.

  Returns the compiled steps that ran and their outputs; each method's entry,
  with its status, goes into ``row["methods"]``.
  """
  batch = row["batch"]
  compiled, outputs = {}, {}
  for method in methods:
    if method == FULL and batch in full_steps:  # compiled for an earlier row
      step, entry = full_steps[batch][0], dict(full_steps[batch][1])
    else:
      step, entry = _compile(method, methods[method], loss, row["num_microbatches"], params,
                             tokens)
    if step is not None:
      output = _first_call(method, step, params, tokens, entry)
      if output is None:
        step = None
      else:
        compiled[method], outputs[method] = step, output
    if method == FULL and batch not in full_steps:
      full_steps[batch] = (step, dict(entry))
    row["methods"][method] = entry
  return compiled, outputs


def _compile(name: str, method: Callable[[Callable, int], Callable], loss: Callable, n: int,
             params: Any, tokens: jax.Array) -> tuple[Any, dict]:
  """The method's compiled step and its entry (compile time, XLA's memory), or None and
  its failure (building the step included)."""
  try:
    step, seconds = compile_timed(method(loss, n), params, tokens)
  except Exception as e:
    return None, {"status": report_failure(name, e)}
  return step, {"compile_s": seconds, "xla": memory_analysis_dict(step)}


def _first_call(name: str, step: Any, params: Any, tokens: jax.Array,
                entry: dict[str, Any]) -> Any:
  """The step's output (``entry`` marked ok), or None with the failure in ``entry``."""
  try:
    output = jax.block_until_ready(step(params, tokens))
  except Exception as e:
    entry["status"] = report_failure(name, e)
    return None
  entry.setdefault("status", "ok")
  return output


def _check(row: dict[str, Any], outputs: dict[str, Any], checked: list[str]) -> None:
  """The checked methods' loss and gradient against the scan's, and the first's against
  the full batch's."""
  if SCAN in outputs:
    checks = {m: compare(outputs[m], outputs[SCAN]) for m in checked if m in outputs}
    if checked[0] in checks:
      row["exact"] = checks[checked[0]]
    if len(checked) > 1:
      row["checks"] = checks
  if checked[0] in outputs and FULL in outputs:
    # Not a check: the full batch sums its bfloat16 gradient (the embedding's
    # scatter-add, the weights' products) over all B sequences in bfloat16.
    row["vs_full"] = compare(outputs[checked[0]], outputs[FULL], check=False)


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
        step_ms_samples=[1e3 * t for t in times],
    )


def checks_of(row: dict[str, Any]) -> list[dict[str, Any]]:
  """A row's comparisons with the scan: every checked method's, or the one ``exact``."""
  if "checks" in row:
    return list(row["checks"].values())
  return [row["exact"]] if row.get("exact") else []
