"""The tables of bench_gpu.py's full run: inside a step (time, memory), across calls, fit.

Each reads the run's JSON as :mod:`gpu_step`, :mod:`gpu_across` and
:mod:`gpu_fit` wrote it; :func:`header` says what model, card and JAX ran.
"""

from __future__ import annotations

from typing import Any

from _common import markdown_table
from gpu_across import MULTISTEPS
from gpu_methods import ACCUM, METHOD_NAMES, SCAN

_MIB = 2**20


def _mib(x: Any) -> str:
  return "-" if x is None else f"{x / _MIB:.1f}"


def _ratio(a: Any, b: Any) -> str:
  return "-" if a is None or b is None or not b else f"{a / b:.3f}"


def _time_cell(entry: dict[str, Any]) -> str:
  if entry.get("step_ms") is not None:
    return f"{entry['step_ms']:.2f}"
  return entry.get("status", "-")


def _peak_cell(entry: dict[str, Any]) -> str:
  memory = entry.get("memory") or {}
  if memory.get("status") != "ok":
    return memory.get("status", "-")
  return _mib(memory["step_peak_bytes"]) + (" (masked)" if memory.get("masked") else "")


def step_tables(config: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[str, str]:
  time_rows, memory_rows = [], []
  fpt = config["flops_per_token"]
  for row in rows:
    m = row["methods"]
    accum, scan, full = (m.get(k, {}) for k in METHOD_NAMES)
    head = [row["num_microbatches"], row["micro"], row["batch"]]
    if row["status"].startswith("skipped"):
      time_rows.append(head + [row["status"]] + ["-"] * 8)
      memory_rows.append(head + [row["status"]] + ["-"] * 7)
      continue
    exact, vs_full = row.get("exact"), row.get("vs_full")
    tflops = (f"{fpt * row['batch'] * config['model']['context'] / accum['step_ms'] / 1e9:.3g}"
              if accum.get("step_ms") else "-")
    time_rows.append(head + [
        _time_cell(accum), _time_cell(scan), _time_cell(full),
        _ratio(accum.get("step_ms"), scan.get("step_ms")),
        _ratio(accum.get("step_ms"), full.get("step_ms")),
        tflops,
        f"{exact['loss_rel_diff']:.1e} / {exact['grad_max_rel_diff']:.1e}" if exact else "-",
        ("yes" if exact["match"] else "NO") if exact else "-",
        f"{vs_full['grad_max_rel_diff']:.1e}" if vs_full else "-",
    ])
    peaks = [(e.get("memory") or {}).get("step_peak_bytes")
             if (e.get("memory") or {}).get("status") == "ok" else None
             for e in (accum, scan, full)]
    memory_rows.append(head + [
        _peak_cell(accum), _peak_cell(scan), _peak_cell(full),
        _ratio(peaks[0], peaks[1]), _ratio(peaks[0], peaks[2]),
        *(_mib(e.get("xla", {}).get("temp_bytes")) for e in (accum, scan, full)),
    ])
  time_table = markdown_table(
      ["N", "micro", "batch", "accum_jax ms", "lax.scan ms", "full batch ms", "vs scan",
       "vs full", "accum_jax TFLOP/s", "vs scan: loss / grad rel diff", "match",
       "vs full: grad rel diff"],
      time_rows,
  )
  memory_table = markdown_table(
      ["N", "micro", "batch", "accum_jax peak MiB", "lax.scan peak MiB", "full batch peak MiB",
       "vs scan", "vs full", "accum_jax XLA temp MiB", "lax.scan XLA temp MiB",
       "full batch XLA temp MiB"],
      memory_rows,
  )
  return time_table, memory_table


def across_calls_table(results: list[dict[str, Any]]) -> str:
  rows = []
  for r in results:
    if r["status"] != "ok":
      rows.append([r["every_k"], r["status"]] + ["-"] * 9)
      continue
    a, o = r[ACCUM], r[MULTISTEPS]
    rows.append([
        r["every_k"], f"{a['micro_step_ms']:.3f}", f"{o['micro_step_ms']:.3f}",
        f"{r['micro_step_ratio']:.3f}", f"{a['apply_step_ms']:.3f}", f"{o['apply_step_ms']:.3f}",
        f"{a['window_ms']:.3f}", f"{o['window_ms']:.3f}", f"{r['window_ratio']:.3f}",
        _mib(a["state_bytes"]), _mib(o["state_bytes"]),
    ])
  return markdown_table(
      ["every_k", "accum_jax micro-step ms", "MultiSteps micro-step ms", "ratio",
       "accum_jax last call ms", "MultiSteps last call ms", "accum_jax window ms",
       "MultiSteps window ms", "ratio", "accum_jax state MiB", "MultiSteps state MiB"],
      rows,
  )


def fit_table(fit: dict[str, Any]) -> str:
  rows = [[f"full batch {t['batch']}", t["status"],
           f"{t['step_ms']:.2f}" if "step_ms" in t else "-",
           _mib(t.get("xla", {}).get("temp_bytes")), "-"] for t in fit["tried"]]
  exact = fit.get("exact")
  for method in (ACCUM, SCAN):
    e = fit.get(method)
    if e is None:
      continue
    label = (f"{method} {fit['batch']} = {e['num_microbatches']} x {e['micro']}"
             if e.get("status") == "ok" else f"{method} {fit['batch']}")
    diff = (f"loss {exact['loss_rel_diff']:.1e}, grad {exact['grad_max_rel_diff']:.1e}"
            if exact and method == ACCUM else "-")
    rows.append([label, e["status"], f"{e['step_ms']:.2f}" if "step_ms" in e else "-",
                 _mib(e.get("xla", {}).get("temp_bytes")), diff])
  return markdown_table(["step", "status", "step ms (full batch: one call)", "XLA temp MiB",
                         "vs lax.scan: rel diff"], rows)



def header(config: dict[str, Any]) -> str:
  m = config["model"]
  env = config["environment"]
  return (
      f"GPT ({'tiny' if config['tiny'] else 'GPT-2 small'}): {m['layers']} layers, width"
      f" {m['width']}, {m['heads']} heads, MLP {m['mlp']}, vocabulary {m['vocab']}, context"
      f" {m['context']}, tied head, bfloat16, {config['param_count'] / 1e6:.2f}M parameters;"
      f" attention: {config['attention']}\n"
      f"device: {config['device_kind']} ({env['devices'][0]}), jax {env['jax']},"
      f" {env['cpu_count']} CPUs, load average at start {env['load_average']};"
      f" {config['rounds']} timed rounds (median), interleaved"
  )

