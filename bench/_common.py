"""Helpers shared by the benchmarks: timing, compiled cost, sizes, output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

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


def tree_nbytes(tree: Any) -> int:
  """Total bytes of the array leaves of ``tree``."""
  return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


def environment() -> dict[str, Any]:
  """What the numbers were measured on, for the JSON output."""
  return {
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
