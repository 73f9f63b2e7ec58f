"""Helpers shared by the benchmarks: timing, compiled cost, sizes, output, peak memory."""

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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from accum_jax.testing import copied_shapes, hlo_shape

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def time_samples(
    fn: Callable[..., Any], *args: Any, repeats: int = 5, warmup: int = 1
) -> list[float]:
  """Wall-clock seconds of each of ``repeats`` calls ``fn(*args)``.

  Every call is followed by ``jax.block_until_ready`` on its result, so the
  time covers the computation, not just the asynchronous dispatch. ``warmup``
  untimed calls come first (compilation, caches).
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - start)
  return samples


def time_fn(fn: Callable[..., Any], *args: Any, repeats: int = 5, warmup: int = 1) -> float:
  """Median wall-clock seconds of ``fn(*args)``; see :func:`time_samples`."""
  return statistics.median(time_samples(fn, *args, repeats=repeats, warmup=warmup))


def cost_analysis(compiled: jax.stages.Compiled) -> dict[str, float]:
  """XLA's cost analysis of a compiled function as one dict.

  Some jax versions return a list with one dict per device program; the first
  is taken. Keys of interest: ``"flops"``, ``"bytes accessed"``. Note that for
  a conditional XLA counts the costliest branch, not both and not the one that
  runs: the figure is a static per-call upper bound.
  """
  costs = compiled.cost_analysis()
  if isinstance(costs, (list, tuple)):
    costs = costs[0] if costs else {}
  return dict(costs or {})


def compiled_flops(jitted: Any, *args: Any, **kwargs: Any) -> float:
  """FLOPs XLA reports for one call of ``jitted(*args, **kwargs)``; nan if none."""
  costs = cost_analysis(jitted.lower(*args, **kwargs).compile())
  return float(costs.get("flops", float("nan")))


def full_size_copies(compiled: jax.stages.Compiled, like: Any) -> int:
  """``copy`` instructions in ``compiled``'s HLO of arrays as large as ``like``'s largest.

  A copy of a full-size array is a pass over memory that the computation did not
  ask for: XLA inserts one where it cannot give an output the buffer of the input
  it was computed from (donation paired that buffer with another output, or two
  outputs share one value, such as the zeros of several update leaves). Static:
  a copy in a conditional's branch counts whether or not the branch runs; read
  with ``accum_jax.testing.copied_shapes``, in every computation.
  """
  leaves = jax.tree.leaves(like)
  largest = max(x.size for x in leaves)
  shapes = {hlo_shape(x) for x in leaves if x.size == largest}
  return sum(shape in shapes for shape in copied_shapes(compiled, "all"))


def tree_nbytes(tree: Any) -> int:
  """Total bytes of the array leaves of ``tree``."""
  return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


def environment() -> dict[str, Any]:
  """What the numbers were measured on, for the JSON output: the tree's commit too."""
  return {
      "commit": git_commit(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
      "cpu_count": os.cpu_count(),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      # Other processes share the machine; a high load makes timings noisy.
      "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
  }


def git_commit() -> str | None:
  """The short commit of the working tree the benchmark runs from, with "-dirty"
  where tracked files differ from it; None outside git. ``BENCH_COMMIT`` overrides
  it, for a copy of the tree whose git history is not the tree's (a remote machine
  handed the working tree alone)."""
  if os.environ.get("BENCH_COMMIT"):
    return os.environ["BENCH_COMMIT"]
  try:
    out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                         capture_output=True, text=True, timeout=10,
                         cwd=Path(__file__).resolve().parent)
  except (OSError, subprocess.TimeoutExpired):
    return None
  if out.returncode != 0:
    return None
  return out.stdout.strip() or None


def write_json(name: str, data: Any) -> Path:
  """Writes ``data`` to ``bench/results/<name>.json`` and returns the path."""
  RESULTS_DIR.mkdir(parents=True, exist_ok=True)
  path = RESULTS_DIR / f"{name}.json"
  path.write_text(json.dumps(data, indent=2, default=_to_json) + "\n")
  return path


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


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]], *, rounds: int = 5, warmup: int = 1
) -> dict[str, list[float]]:
  """Wall-clock seconds of each of ``rounds`` calls of every ``fns[name]()``.

  The functions take turns, one call each per round, and the round starts one
  function further each time: drift in the machine's speed (other processes,
  clocks, thermal state) falls on all of them alike instead of on whichever ran
  last. Each call is blocked on, as in :func:`time_samples`; ``warmup`` untimed
  calls of each come first.
  """
  names = list(fns)
  for name in names:
    for _ in range(warmup):
      jax.block_until_ready(fns[name]())
  samples: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[: r % len(names)]:
      samples[name] += time_samples(fns[name], repeats=1, warmup=0)
  return samples


def quartiles(samples: Sequence[float]) -> tuple[float, float]:
  """The first and third quartiles of ``samples`` (the value itself for one)."""
  if len(samples) < 2:
    return samples[0], samples[0]
  q = statistics.quantiles(samples, n=4)
  return q[0], q[2]


# Peak memory of one step, measured in a fresh process.
#
# What we want is the memory one compiled step needs while it runs (its
# temporaries and outputs), apart from what the process held before (the
# Python and XLA runtime, the arguments) and apart from what compiling took.
#
# CPU: the kernel keeps the process's resident-set high-water mark (VmHWM in
# /proc/self/status). After compiling, the worker frees what it can (gc,
# malloc_trim), resets the mark to the current resident size (writing "5" to
# /proc/self/clear_refs, Linux >= 4.0), runs the step and reads the mark: the
# step's growth is VmHWM - VmRSS before the step. This is done twice. The first
# call also faults in one-time things that are no part of any step's working
# memory (runtime thread stacks, code pages, lazily built runtime state: about
# 10 MiB on the CPU here, whatever the model); it is kept as first_call_peak_bytes. The
# second call, its predecessor's outputs freed, gives step_peak_bytes. glibc is told to serve
# every allocation of 1 MiB or more with its own mmap (MALLOC_MMAP_THRESHOLD_),
# so that XLA's buffers come as fresh pages, are counted when touched, and go
# back to the kernel when freed, instead of reusing heap memory that compiling
# left resident (which would hide part of the step). Where clear_refs cannot be
# written, the growth of ru_maxrss over the step is used; it is 0 (and flagged)
# when the step stays below the compile's own peak.
#
# GPU: device.memory_stats() of the XLA allocator, without preallocation:
# peak_bytes_in_use after the step minus bytes_in_use before it. The peak
# cannot be reset, so it is flagged as masked when an earlier peak (setting up,
# autotuning at compile time) is not exceeded by the step.
#
# A fresh process per measurement: nothing from another program (caches, heap
# fragmentation, the allocator's pools) is left to distort the figure.

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


def _maxrss_bytes() -> int:
  import resource

  # Linux reports kilobytes, macOS bytes.
  scale = 1 if sys.platform == "darwin" else 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


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


def run_json_worker(
    command: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 600,
    cpus: int | None = None,
) -> dict[str, Any]:
  """Runs ``command`` and returns the JSON on its last ``PEAK_RESULT_JSON:`` line.

  ``env`` is added to this process's environment; with ``cpus``, the worker may
  run on only that many of this process's CPUs (XLA:CPU sizes its thread pool by
  them). A worker that fails raises ``RuntimeError`` with the end of its output.
  """
  full_env = {**os.environ, **(env or {})}
  allowed = sorted(os.sched_getaffinity(0))[:cpus] if cpus else None
  proc = subprocess.run(
      list(command), env=full_env, capture_output=True, text=True, timeout=timeout,
      preexec_fn=(lambda: os.sched_setaffinity(0, allowed)) if allowed else None,
  )
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith(_PEAK_MARKER):
      return json.loads(line[len(_PEAK_MARKER):])
  raise RuntimeError(
      f"worker {' '.join(command)} returned {proc.returncode} without a result:\n"
      f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
  )


def print_worker_result(result: Mapping[str, Any]) -> None:
  """What a worker run by :func:`run_json_worker` prints last."""
  print(_PEAK_MARKER + json.dumps(result, default=_to_json), flush=True)


def fresh_process_peak(
    builder: str, config: Mapping[str, Any], *, timeout: float = 600, cpus: int | None = None,
    xla_flags: str | None = None,
) -> dict[str, Any]:
  """The memory of one step of a compiled function, measured in a new process.

  Args:
    builder: ``"module:function"``, a module in ``bench/``. The function is
      called with ``**config`` in the new process and returns ``(jitted, args)``:
      the ``jax.jit``-ed step and its arguments, already on the device. Build
      the arguments with NumPy and ``jax.device_put`` so that setting up leaves
      no temporaries behind.
    config: JSON-serialisable keyword arguments for the builder.
    timeout: seconds before the worker is killed.
    cpus: run the worker on this many CPUs only (on CPU, one runs the step's
      kernels one at a time: no two kernels' scratch memory at once).
    xla_flags: added to the worker's ``XLA_FLAGS``.

  Returns:
    A dict: ``step_peak_bytes`` (the step's growth; see the comment above this
    function), ``method`` (how it was measured), ``masked`` (the figure is a
    lower bound), ``argument_bytes``, ``output_bytes``, ``xla`` (the compiled
    ``memory_analysis()`` fields), ``compile_seconds``, ``step_seconds``,
    on CPU ``first_call_peak_bytes`` (the first call's growth, one-time costs
    included),
    ``platform`` and the raw readings.
  """
  env = {
      "MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD),
      # A second process sharing a GPU with the first: allocate as needed.
      "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
  }
  if xla_flags:
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()
  command = [sys.executable, __file__, "--peak-worker", builder, json.dumps(dict(config))]
  return run_json_worker(command, env=env, timeout=timeout, cpus=cpus)


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
  build = getattr(importlib.import_module(module_name), function_name)
  jitted, args = build(**json.loads(config_json))
  jax.block_until_ready(args)
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  result: dict[str, Any] = {
      "platform": device.platform,
      "device": str(device),
      "argument_bytes": tree_nbytes(args),
  }
  _release_free_memory()
  result["rss_after_setup_bytes"] = proc_status_bytes("VmRSS")
  result["hwm_after_setup_bytes"] = proc_status_bytes("VmHWM")

  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  result["compile_seconds"] = time.perf_counter() - start
  result["xla"] = memory_analysis_dict(compiled)
  result["hwm_after_compile_bytes"] = proc_status_bytes("VmHWM")

  _release_free_memory()
  if on_gpu:
    before = device.memory_stats() or {}
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    result["step_seconds"] = time.perf_counter() - start
    after = device.memory_stats() or {}
    in_use, peak_before = before.get("bytes_in_use"), before.get("peak_bytes_in_use")
    peak = after.get("peak_bytes_in_use")
    result.update(
        method="gpu peak_bytes_in_use - bytes_in_use before the step",
        bytes_in_use_before=in_use,
        peak_bytes_in_use_before=peak_before,
        peak_bytes_in_use_after=peak,
        bytes_limit=after.get("bytes_limit"),
    )
    if in_use is None or peak is None:
      result.update(step_peak_bytes=None, masked=True)
    else:
      result.update(step_peak_bytes=peak - in_use, masked=peak <= (peak_before or 0))
  else:
    # Twice: see the comment above fresh_process_peak.
    for key in ("first_call", "step"):
      _release_free_memory()
      reset = _reset_peak_rss()
      rss_before = proc_status_bytes("VmRSS")
      maxrss_before = _maxrss_bytes()
      start = time.perf_counter()
      out = jax.block_until_ready(compiled(*args))
      seconds = time.perf_counter() - start
      hwm, maxrss = proc_status_bytes("VmHWM"), _maxrss_bytes()
      if reset and rss_before is not None and hwm is not None:
        method = "VmHWM reset before the step (clear_refs), minus VmRSS before it"
        peak, masked = hwm - rss_before, False
      else:
        method = "ru_maxrss growth over the step (peak could not be reset)"
        peak, masked = maxrss - maxrss_before, maxrss <= maxrss_before
      result.update({f"{key}_peak_bytes": peak, f"{key}_seconds": seconds,
                     f"rss_before_{key}_bytes": rss_before, f"hwm_after_{key}_bytes": hwm})
      if key == "first_call":
        first_masked = masked
        del out
    if not reset:
      # ru_maxrss cannot be reset: the second call cannot rise above the first.
      result.update(step_peak_bytes=result["first_call_peak_bytes"], masked=first_masked)
    result.update(method=method, masked=result.get("masked", masked))
  result["output_bytes"] = tree_nbytes(out)
  print_worker_result(result)


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "--peak-worker":
    _peak_worker(sys.argv[2], sys.argv[3])
  else:
    sys.exit("usage: python bench/_common.py --peak-worker module:function CONFIG_JSON")
