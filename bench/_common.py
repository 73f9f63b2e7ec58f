"""Helpers shared by the benchmarks: timing, sizes, output, budgets and
failures, the hand-written scan, and the peak memory of one step in a fresh process."""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def tree_nbytes(tree: Any) -> int:
  """Total bytes of the array leaves of ``tree``."""
  return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


def environment() -> dict[str, Any]:
  """What the numbers were measured on, for the JSON output: the tree's commit too."""
  return {
      "commit": git_commit(), "jax": jax.__version__, "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
      "platform": platform.platform(), "python": platform.python_version(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      # Other processes share the machine; a high load makes timings noisy.
      "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
  }


def git_commit() -> str | None:
  """The tree's short commit, "-dirty" where tracked files differ; None outside git.
  ``BENCH_COMMIT`` overrides it, for a copy of the tree without its history."""
  if os.environ.get("BENCH_COMMIT"):
    return os.environ["BENCH_COMMIT"]
  try:
    out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                         capture_output=True, text=True, timeout=10,
                         cwd=Path(__file__).resolve().parent)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return (out.stdout.strip() or None) if out.returncode == 0 else None


def write_json(name: str, data: Any) -> Path:
  """Writes ``data`` to ``bench/results/<name>.json`` and returns that path, from the
  repository's root (what a run prints, and what its log keeps)."""
  RESULTS_DIR.mkdir(parents=True, exist_ok=True)
  path = RESULTS_DIR / f"{name}.json"
  path.write_text(json.dumps(data, indent=2, default=_to_json) + "\n")
  return path.relative_to(RESULTS_DIR.parent.parent)


def _to_json(x: Any) -> Any:
  # Numpy and jax scalars that json does not know.
  if hasattr(x, "item"):
    return x.item()
  if hasattr(x, "tolist"):
    return x.tolist()
  raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub-flavoured markdown table; numbers are right-aligned."""
  cells = [[str(c) for c in row] for row in rows]
  numeric = [
      all(_is_number(row[i]) for row in rows) if rows else False for i in range(len(headers))
  ]
  widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

  def line(values: Sequence[str]) -> str:
    padded = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
    return "| " + " | ".join(padded) + " |"

  rule = ["-" * (w - 1) + ":" if num else "-" * w for w, num in zip(widths, numeric)]
  return "\n".join([line(headers), line(rule)] + [line(r) for r in cells])


def _is_number(x: Any) -> bool:
  if isinstance(x, (int, float)):
    return True
  try:
    float(str(x).rstrip("x%"))
  except ValueError:
    return False
  return True


def rotations(names: Iterable[Any], rounds: int) -> Iterator[list[Any]]:
  """Each round's order of ``names``, starting one further along each round: drift in
  the machine's speed (other processes, clocks, heat) falls on all of them alike
  instead of on whichever runs last."""
  names = list(names)
  for r in range(rounds if names else 0):
    yield names[r % len(names):] + names[:r % len(names)]


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]], *, rounds: int = 5, warmup: int = 1
) -> dict[str, list[float]]:
  """Wall-clock seconds of each of ``rounds`` calls of every ``fns[name]()``, taking turns
  (:func:`rotations`). Each call is blocked on (``jax.block_until_ready``), so that the
  time covers the computation, not only its dispatch; ``warmup`` untimed calls first.
  """
  for name in fns:
    for _ in range(warmup):
      jax.block_until_ready(fns[name]())
  samples: dict[str, list[float]] = {name: [] for name in fns}
  for order in rotations(fns, rounds):
    for name in order:
      start = time.perf_counter()
      jax.block_until_ready(fns[name]())
      samples[name].append(time.perf_counter() - start)
  return samples


def quartiles(samples: Sequence[float]) -> tuple[float, float]:
  """The first and third quartiles of ``samples`` (the value itself for one)."""
  if len(samples) < 2:
    return samples[0], samples[0]
  q = statistics.quantiles(samples, n=4)
  return q[0], q[2]


# ---------------------------------------------------------------------------
# Budgets and failures: a run that must end inside a job's time, and a row that runs out
# of memory, are results, not crashes.


class Budget:
  """Deadlines: each phase may start new work until its share of ``seconds`` is spent
  (0: no limit). Work started before its deadline runs to its end, so a run ends, its
  JSON written, one configuration's time after the budget at most."""

  # Cumulative shares of the budget at which each phase stops starting new work.
  SHARES = {"step": 0.75, "across_calls": 0.85, "loop": 0.92, "fit": 1.0}
  # bench_gpu.py --quick: by the times of a run on an H200 (245 s), the pairs 8x1 and
  # 8x4, the four rows of the across-calls figures, the loop's first six loops.
  QUICK_SHARES = {"step": 0.36, "across_calls": 0.54, "loop": 0.93, "fit": 1.0}

  def __init__(self, seconds: float, shares: dict[str, float] | None = None):
    self.start = time.perf_counter()
    self.seconds = seconds
    self.shares = shares or self.SHARES

  def left(self, phase: str) -> bool:
    if not self.seconds:
      return True
    return time.perf_counter() - self.start < self.seconds * self.shares[phase]


def is_oom(error: BaseException) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def error_status(error: BaseException) -> str:
  """``OOM``, or the error's type and first line."""
  if is_oom(error):
    return "OOM"
  return f"error: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def report_failure(name: str, error: BaseException) -> str:
  """Prints a failure (with its traceback unless out of memory) and returns its status."""
  status = error_status(error)
  if status != "OOM":
    traceback.print_exc()
  print(f"    {name}: {status}", flush=True)
  return status


# ---------------------------------------------------------------------------
# Float32 sums, and the reference inside a step.


def zeros_float32(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)


def add_float32(acc: Any, grads: Any) -> Any:
  return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)


def hand_written_scan(loss: Callable, num_microbatches: int) -> Callable:
  """The loop users write (MaxText, Levanter): the batch reshaped to ``(N, B / N, ...)``,
  ``jax.value_and_grad`` in a ``lax.scan`` body, float32 sums, divided by N after and
  cast back to the parameters' dtype."""

  def value_and_grad(params, batch):
    microbatches = jax.tree.map(
        lambda x: x.reshape(num_microbatches, -1, *x.shape[1:]), batch)

    def body(total, microbatch):
      return add_float32(total, jax.value_and_grad(loss)(params, microbatch)), None

    zeros = zeros_float32((jnp.zeros(()), params))
    (value, grads), _ = jax.lax.scan(body, zeros, microbatches)
    return value / num_microbatches, jax.tree.map(
        lambda g, p: (g / num_microbatches).astype(p.dtype), grads, params)

  return value_and_grad


# Peak memory of one step, measured in a fresh process (bench/README.md, "How the peak
# memory of one step is measured"): on a CPU the growth of the resident set over the
# step (the kernel's high-water mark, reset before it through /proc/self/clear_refs;
# every allocation of 1 MiB or more its own mmap, so that XLA's buffers are fresh
# pages); on a GPU the allocator's peak over what was in use before the step. A fresh
# process, so that nothing of another program (caches, fragmentation, pools) distorts it.

_PEAK_MARKER = "PEAK_RESULT_JSON:"
_MMAP_THRESHOLD = 1 << 20


def proc_status_bytes(field: str) -> int | None:
  """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None


def _release_free_memory() -> None:
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


def _reset_peak_rss() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    return False
  return True


def fresh_process_peak(
    builder: str, config: Mapping[str, Any], *, timeout: float = 600, cpus: int | None = None,
    xla_flags: str | None = None,
) -> dict[str, Any]:
  """The memory of one step of a compiled function, measured in a new process.

  ``builder``, ``"module:function"`` of bench/, is called there with ``**config`` and
  returns the jitted step and its arguments, already on the device (made with NumPy and
  ``jax.device_put``: setting up leaves no temporaries). ``cpus``: the worker on that
  many of this process's CPUs (XLA:CPU sizes its thread pool by them); ``xla_flags``:
  added to its ``XLA_FLAGS``. Returns ``step_peak_bytes`` (the step's growth),
  ``method``, ``masked`` (a lower bound), ``argument_bytes``, ``output_bytes``, ``xla``
  (``memory_analysis()``), ``compile_seconds``, on a CPU ``first_call_peak_bytes``, and
  the raw readings; a worker that fails raises ``RuntimeError`` with its output's end.
  """
  env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD),
         # A second process sharing a GPU with the first: allocate as needed.
         "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  if xla_flags:
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()
  command = [sys.executable, __file__, "--peak-worker", builder, json.dumps(dict(config))]
  allowed = sorted(os.sched_getaffinity(0))[:cpus] if cpus else None
  proc = subprocess.run(
      command, env=env, capture_output=True, text=True, timeout=timeout,
      preexec_fn=(lambda: os.sched_setaffinity(0, allowed)) if allowed else None)
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith(_PEAK_MARKER):
      return json.loads(line[len(_PEAK_MARKER):])
  raise RuntimeError(f"worker {' '.join(command)} returned {proc.returncode} without a"
                     f" result:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def memory_analysis_dict(compiled: jax.stages.Compiled) -> dict[str, int]:
  """The byte counts of ``compiled.memory_analysis()`` as a dict ({} if none)."""
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  fields = ("argument", "output", "temp", "alias", "generated_code", "host_temp")
  out = {}
  for field in fields:
    value = getattr(stats, f"{field}_size_in_bytes", None)
    if value is not None:
      out[f"{field}_bytes"] = int(value)
  peak = getattr(stats, "peak_memory_in_bytes", None)
  if peak is not None:
    out["peak_memory_bytes"] = int(peak)
  return out


def _peak_worker(builder: str, config_json: str) -> None:
  module_name, function_name = builder.split(":")
  jitted, args = getattr(importlib.import_module(module_name), function_name)(
      **json.loads(config_json))
  jax.block_until_ready(args)
  device = jax.devices()[0]
  result: dict[str, Any] = {"platform": device.platform, "device": str(device),
                            "argument_bytes": tree_nbytes(args)}
  _release_free_memory()
  result["rss_after_setup_bytes"] = proc_status_bytes("VmRSS")
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  result.update(compile_seconds=time.perf_counter() - start,
                xla=memory_analysis_dict(compiled),
                hwm_after_compile_bytes=proc_status_bytes("VmHWM"))
  _release_free_memory()
  if device.platform == "gpu":
    before = device.memory_stats() or {}
    out = jax.block_until_ready(compiled(*args))
    after = device.memory_stats() or {}
    in_use, peak = before.get("bytes_in_use"), after.get("peak_bytes_in_use")
    result.update(
        method="gpu peak_bytes_in_use - bytes_in_use before the step",
        bytes_in_use_before=in_use, peak_bytes_in_use_before=before.get("peak_bytes_in_use"),
        peak_bytes_in_use_after=peak, bytes_limit=after.get("bytes_limit"),
        step_peak_bytes=None if in_use is None or peak is None else peak - in_use,
        # The peak cannot be reset: masked where an earlier one (set-up, autotuning) stands.
        masked=in_use is None or peak is None
        or peak <= (before.get("peak_bytes_in_use") or 0))
  else:
    # Twice: the first call also faults in one-time things that belong to no step
    # (thread stacks, code pages, lazily built runtime state), kept as first_call_*.
    for key in ("first_call", "step"):
      out = None
      _release_free_memory()
      reset = _reset_peak_rss()
      rss_before = proc_status_bytes("VmRSS")
      out = jax.block_until_ready(compiled(*args))
      hwm = proc_status_bytes("VmHWM")
      peak = hwm - rss_before if reset and rss_before is not None and hwm is not None else None
      result.update({f"{key}_peak_bytes": peak, f"rss_before_{key}_bytes": rss_before,
                     f"hwm_after_{key}_bytes": hwm})
    result.update(method="VmHWM reset before the step (clear_refs), minus VmRSS before it",
                  masked=result["step_peak_bytes"] is None)
  result["output_bytes"] = tree_nbytes(out)
  print(_PEAK_MARKER + json.dumps(result, default=_to_json), flush=True)


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "--peak-worker":
    _peak_worker(sys.argv[2], sys.argv[3])
  else:
    sys.exit("usage: python bench/_common.py --peak-worker module:function CONFIG_JSON")
