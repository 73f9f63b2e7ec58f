"""Runs every benchmark, each in its own process, and prints a summary.

The benchmarks (``bench_transform.py``, ``bench_microbatch.py``,
``bench_planner.py``, ``bench_sharded.py``, ``bench_gpu.py`` (GPT-2 small on a GPU,
its tiny configuration elsewhere; and its ``--quick`` check of both doors),
``bench_many_leaves.py``, and ``soak.py`` where it exists) write
their JSON, and ``bench_microbatch.py`` and ``bench_sharded.py`` their plots, into
``bench/results/``. This script adds
``run_all.json``: what ran, how long it took, the end of each one's output, and
the headline figures. On a
GPU the summary gives absolute step times and device peak memory; on a CPU
shared with other work only the ratios between methods mean much, so it gives
those.

Run from the repository root::

  python bench/run_all.py            # the full benchmarks, 30 to 40 minutes on 2 CPU cores
  python bench/run_all.py --quick    # every benchmark's smoke run, about 12 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, markdown_table, write_json

BENCH_DIR = Path(__file__).resolve().parent
_MIB = 2**20

# name -> (script, extra arguments for a full run, for a quick run)
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "transform": ("bench_transform.py", [], ["--quick"]),
    "microbatch": ("bench_microbatch.py", [], ["--quick"]),
    "planner": ("bench_planner.py", [], ["--quick"]),
    "sharded": ("bench_sharded.py", [], ["--quick"]),
    # Off a GPU, GPT-2 small would take the whole budget for a few rows.
    "gpu": ("bench_gpu.py", ["--tiny-off-gpu"], ["--tiny"]),
    # The GPU check of both doors in one table (under 4 minutes on a GPU).
    "gpu_check": ("bench_gpu.py", ["--quick", "--tiny-off-gpu"],
                  ["--quick", "--tiny", "--ns", "2", "--micro", "1"]),
    "many_leaves": ("bench_many_leaves.py", [], ["--quick"]),
    # The soak has no --quick: 500 micro-steps are what its test runs.
    "soak": ("soak.py", [], ["--steps", "500"]),
}


def run(name: str, quick: bool) -> dict[str, Any]:
  """Runs one benchmark, echoing its output; what ran and how it ended."""
  script, full_args, quick_args = BENCHMARKS[name]
  command = [sys.executable, str(BENCH_DIR / script), *(quick_args if quick else full_args)]
  print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
  # Each benchmark starts its own processes on the device; none may take it all.
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  start, start_time = time.perf_counter(), time.time()
  lines = []
  with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, bufsize=1) as proc:
    assert proc.stdout is not None
    for line in proc.stdout:
      print(line, end="", flush=True)
      lines.append(line)
  return {
      "command": " ".join(command),
      "returncode": proc.returncode,
      "started": start_time,
      "seconds": time.perf_counter() - start,
      "output_tail": "".join(lines)[-4000:],
  }


def _load(name: str, since: float = 0.0) -> dict[str, Any] | None:
  """``bench/results/<name>.json`` if it was written after ``since`` (a time.time())."""
  path = RESULTS_DIR / f"{name}.json"
  if not path.exists() or path.stat().st_mtime < since:
    return None
  return json.loads(path.read_text())


def summary(quick: bool, since: float) -> list[list[str]]:
  """Headline figures from the JSON written since ``since``: (benchmark, figure, value)."""
  suffix = "_quick" if quick else ""
  rows: list[list[str]] = []
  if transform := _load("transform" + suffix, since):
    for entry in transform["results"]:
      rows.append(["transform", f"{entry['inner']}: accum_jax / MultiSteps window time",
                   f"{entry['window_ratio']:.3f} (target <= {entry['target_ratio']:.3f})"])
  if microbatch := _load("microbatch" + suffix, since):
    on_gpu = microbatch["config"]["platform"] == "gpu"
    by_label = {r["label"]: r for r in microbatch["results"]}
    n = max(r["num_microbatches"] for r in microbatch["results"])
    n = 8 if "accum_jax N=8" in by_label else n
    if on_gpu:
      for label in ("full batch", f"lax.scan N={n}", f"optax.microbatching N={n}",
                    f"accum_jax N={n}"):
        r = by_label[label]
        rows.append(["microbatch", f"{label}: step ms / device peak MiB",
                     f"{r['step_ms']:.2f} / {r['peak_bytes'] / _MIB:.1f}"])
    for t in microbatch["targets"]:
      verdict = "met" if t["met"] else "NOT met"
      rows.append(["microbatch", t["target"],
                   f"{t['measured']:.3f} (<= {t['limit']:.2f}, {verdict})"])
    for method, c in microbatch["collectives"]["methods"].items():
      rows.append(["microbatch", f"{method}: collectives per step (8 devices)",
                   f"{c['per_step']} (work per device {c['work_vs_data_parallel']:.1f}x"
                   " data-parallel)"])
  if planner := _load("planner" + suffix, since):
    errors = ", ".join(f"N={r['num_microbatches']} {100 * r['error']:+.0f}%"
                       for r in planner["results"])
    rows.append(["planner", "estimate / measured - 1", errors])
    plan = planner["plan"]
    if plan.get("num_microbatches") is not None:
      rows.append(["planner", f"chosen N for {plan['memory_budget_bytes'] / _MIB:.1f} MiB",
                   f"{plan['num_microbatches']} (measured"
                   f" {plan['chosen_measured_bytes'] / _MIB:.1f} MiB,"
                   f" {'fits' if plan['chosen_fits'] else 'OVER'})"])
  if sharded := _load("sharded" + suffix, since):
    for g in sharded["goals"]:
      rows.append(["sharded", f"FSDP N={g['num_microbatches']}: temp + output / hand-written"
                   " scan; accumulator; collectives and MiB per microbatch (ours / scan)",
                   f"{g['memory_vs_hand_written']:.2f}"
                   f" ({'met' if g['memory_met'] else 'NOT met'});"
                   f" {(g['accumulator_bytes'] or 0) / _MIB:.1f} MiB"
                   f"{' FULL-SIZE' if g['full_size_accumulator'] else ''};"
                   f" {g['per_microbatch_count'][0]} / {g['per_microbatch_count'][1]},"
                   f" {g['per_microbatch_bytes'][0] / _MIB:.1f} /"
                   f" {g['per_microbatch_bytes'][1] / _MIB:.1f}"])
  # Off a GPU the full run falls back to the tiny configuration, gpu_quick.json.
  if gpu := _load("gpu" + suffix, since) or _load("gpu_quick", since):
    rows += gpu_summary(gpu)
  # The GPU check names its JSON by where it ran: gpu_check on a GPU, gpu_check_tiny off it.
  for check_name in ("gpu_check", "gpu_check_tiny"):
    if check := _load(check_name, since):
      where = check["config"]["device_kind"]
      rows += [["gpu_check", f"{figure} ({where})", f"{value} (goal {goal})"]
               for figure, value, goal in check.get("goals", [])]
  if many := _load("many_leaves" + suffix, since):
    for model, results in many["results"].items():
      scan = results["scan"]
      for row in ("default", "on_nonfinite='unchecked'"):
        r = results[row]
        rows.append(["many_leaves", f"{model}, {row}: step, compile time / scan",
                     f"{r['step_seconds'] / scan['step_seconds']:.3f},"
                     f" {r['compile_seconds'] / scan['compile_seconds']:.2f}"])
  # The soak writes soak.json whatever its length.
  if soak := _load("soak", since):
    rows.append(["soak", f"{soak.get('steps')} micro-steps: compiles, same windows as the"
                 " reference, skipped / injected",
                 f"{soak.get('compiles')}, {soak.get('windows_match')},"
                 f" {soak.get('num_skipped')} / {soak.get('injections')}"])
  return rows


def gpu_summary(gpu: dict[str, Any]) -> list[list[str]]:
  """bench_gpu.py's headline figures: accum_jax against the scan and the full batch."""
  device = gpu["config"]["device_kind"]
  model = "tiny GPT" if gpu["config"]["tiny"] else "GPT-2 small"
  rows: list[list[str]] = []
  timed = [r for r in gpu["results"]
           if all("step_ms" in r["methods"].get(m, {}) for m in ("accum_jax", "lax.scan"))]
  if timed:
    ratios = sorted((r["methods"]["accum_jax"]["step_ms"] / r["methods"]["lax.scan"]["step_ms"],
                     r["num_microbatches"], r["micro"]) for r in timed)
    worst = ratios[-1]
    rows.append(["gpu", f"{model} on {device}: accum_jax / lax.scan step time, median of"
                 f" {len(ratios)} (N, micro) [worst]",
                 f"{statistics.median(r[0] for r in ratios):.3f} [{worst[0]:.3f} at N={worst[1]},"
                 f" micro={worst[2]}]"])
  peaks = []
  for r in gpu["results"]:
    accum, full = (r["methods"].get(m, {}).get("memory", {}) for m in ("accum_jax", "full batch"))
    if accum.get("status") == full.get("status") == "ok" and r["num_microbatches"] > 1:
      peaks.append((r["num_microbatches"], r["micro"],
                    accum["step_peak_bytes"] / full["step_peak_bytes"]))
  if peaks:
    n, micro, ratio = max(peaks)
    rows.append(["gpu", f"accum_jax peak / full batch peak at N={n}, micro={micro}",
                 f"{ratio:.3f}"])
  checked = [r["exact"] for r in gpu["results"] if "exact" in r]
  if checked:
    worst_grad = max(e["grad_max_rel_diff"] for e in checked)
    rows.append(["gpu", f"accum_jax loss and gradient = the scan's ({len(checked)} checked;"
                 " largest grad rel diff)",
                 f"{'yes' if all(e['match'] for e in checked) else 'NO'} ({worst_grad:.1e})"])
  for a in gpu["across_calls"]:
    if a["status"] == "ok":
      rows.append(["gpu", f"accumulate / MultiSteps (AdamW), every_k={a['every_k']}: micro-step,"
                   " window", f"{a['micro_step_ratio']:.3f}, {a['window_ratio']:.3f}"])
  fit = gpu.get("fit")
  if fit and "exact" in fit:
    accum = fit["accum_jax"]
    rows.append(["gpu", f"largest full batch {fit['largest_full_batch']}"
                 f"{' (cap)' if fit['cap_reached'] else ''}; {fit['batch']} as"
                 f" {accum['num_microbatches']} x {accum['micro']}: grad rel diff vs scan",
                 f"{fit['exact']['grad_max_rel_diff']:.1e}"
                 f" ({'match' if fit['exact']['match'] else 'NO MATCH'})"])
  return rows


def device_memory() -> dict[str, Any] | None:
  """The first device's memory statistics (GPU), or None (CPU reports none)."""
  import jax

  stats = jax.devices()[0].memory_stats()
  return dict(stats) if stats else None


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="every benchmark's smoke run")
  parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), default=None,
                      help="run only these")
  args = parser.parse_args(argv)
  names = args.only or list(BENCHMARKS)
  start, since = time.perf_counter(), time.time()
  runs, skipped = {}, []
  for name in names:
    if not (BENCH_DIR / BENCHMARKS[name][0]).exists():
      skipped.append(name)
      continue
    runs[name] = run(name, args.quick)
  suffix = "_quick" if args.quick else ""
  rows = summary(args.quick, since)
  # Only now, with every benchmark done, does this process touch the device.
  memory = device_memory()
  total = time.perf_counter() - start
  print(f"\n=== summary ({'quick' if args.quick else 'full'} runs, {total:.0f} s)")
  status = [[name, "ok" if r["returncode"] == 0 else f"FAILED ({r['returncode']})",
             f"{r['seconds']:.0f}"] for name, r in runs.items()]
  status += [[name, "skipped (no script)", "-"] for name in skipped]
  print(markdown_table(["benchmark", "status", "seconds"], status))
  if rows:
    print()
    if args.quick:
      print("smoke runs on tiny models: the targets are judged on the full runs")
    print(markdown_table(["benchmark", "figure", "value"], rows))
  if memory:
    print()
    print("device memory:", ", ".join(f"{k}={v}" for k, v in sorted(memory.items())))
  path = write_json("run_all" + suffix, {
      "quick": args.quick,
      "seconds": total,
      "runs": runs,
      "skipped": skipped,
      "summary": rows,
      "device_memory_stats": memory,
  })
  print(f"\nwrote {path}")
  return 0 if all(r["returncode"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
