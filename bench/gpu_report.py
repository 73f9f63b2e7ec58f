"""bench_gpu.py's report: both doors in one table, an earlier run beside it, the goals.

A run's JSON is read as records (door, case, row, reference row, time, compile time,
static memory), each with ratios to its reference's figures in the same run: the scan's
inside a step; the interface's floor's (micro-steps) and MultiSteps' (windows) across
calls; its door's floor's in the training loop (``bench_loop.REFERENCE``).
"""

from __future__ import annotations

import re
from typing import Any

import bench_loop
from _common import markdown_table
from bench_micro_step import DEVICE, FLATTEN_HOST, FLOOR, HOST, MULTISTEPS_ADAMW
from gpu_step import ACCUM, DEFAULT, SCAN

_MIB = 2**20

INSIDE, ACROSS = bench_loop.INSIDE, bench_loop.ACROSS
MICRO_STEP, WINDOW = "micro-step + gradient", "window of 8 + gradient"
# Across calls, the gradient in the same jit: each case's figure and the row its ratios
# are to (every Optax transformation is handed its whole state: the interface's floor).
ACROSS_CASES = {MICRO_STEP: ("micro_step_ms", FLOOR), WINDOW: ("window_ms", MULTISTEPS_ADAMW)}
LEGACY_ROWS = {ACCUM: DEFAULT}  # earlier JSON's name of the default
# The training loop, per door: its time per 8 microbatches, at the median samples/s.
LOOP_CASES = {ACROSS: "the loop, window of 8", INSIDE: "the loop, batch of 8"}


def _record(door: str, case: str, row: str, ref: str, entry: dict[str, Any],
            ms_key: str) -> dict[str, Any]:
  xla = entry.get("xla") or {}
  memory = (xla["temp_bytes"] + xla["output_bytes"]
            if "temp_bytes" in xla and "output_bytes" in xla else None)
  return {"door": door, "case": case, "row": row, "ref": ref, "ms": entry.get(ms_key),
          "compile_s": entry.get("compile_s"), "memory_bytes": memory,
          "status": entry.get("status", "-")}


def records_of(output: dict[str, Any]) -> list[dict[str, Any]]:
  """The rows of the one table, from a run's JSON (earlier versions': those inside a step,
  across calls with the gradient in the same jit, and the loop)."""
  records = []
  for row in output.get("results", []):
    case = f"{row['num_microbatches']}x{row['micro']}"
    for method, entry in row.get("methods", {}).items():
      records.append(_record(INSIDE, case, LEGACY_ROWS.get(method, method), SCAN, entry,
                             "step_ms"))
  for name, entry in ((output.get("quick_across") or {}).get("combined") or {}).items():
    for case, (key, ref) in ACROSS_CASES.items():
      records.append(_record(ACROSS, case, name, ref, entry, key))
  for name, entry in (output.get("loop") or {}).items():
    for door in bench_loop.doors(name):
      record = _record(door, LOOP_CASES[door], name, bench_loop.REFERENCE[door], entry,
                       "window_ms")
      record["compile_s"] = entry.get("compile_total_s")
      # Samples per second against the reference's: the median of the rounds' ratios.
      record["rate_ratio"] = (entry.get("ratio") or {}).get(door)
      records.append(record)
  return records


def _ratios(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
  """Records by (door, case, row), each with its ratios to its reference's figures."""
  by_key = {(r["door"], r["case"], r["row"]): dict(r) for r in records}
  for (door, case, _), r in by_key.items():
    ref = by_key.get((door, case, r["ref"]), {})
    for field in ("ms", "compile_s", "memory_bytes"):
      a, b = r.get(field), ref.get(field)
      r[f"{field}_ratio"] = a / b if a is not None and b else None
  return by_key


def source_label(output: dict[str, Any], path: str | None = None) -> str:
  """The card, JAX and commit a run was measured with."""
  config = output.get("config", {})
  commit = config.get("commit")
  if not commit and path:
    found = re.search(r"-([0-9a-f]{7,40})\.json$", path)
    commit = found.group(1) if found else None
  jax_version = config.get("environment", {}).get("jax", "?")
  return f"{config.get('device_kind', '?')}, jax {jax_version}, at {commit or 'unknown commit'}"


def _cell(value: Any, scale: float = 1.0, digits: int = 2) -> str:
  return "-" if value is None else f"{value * scale:.{digits}f}"


def one_table(records: list[dict[str, Any]], before: list[dict[str, Any]] | None = None) -> str:
  """Both doors in one table; with ``before``, its time and ratio beside each row it has."""
  now = _ratios(records)
  then = _ratios(before) if before else {}
  rows = []
  for key, r in now.items():
    door, case, row = key
    ok = r["ms"] is not None
    cells = [door, case, row, _cell(r["ms"], digits=3) if ok else r["status"].split(":")[0],
             _cell(r["ms_ratio"], digits=3), _cell(r["compile_s"]),
             _cell(r["compile_s_ratio"]), _cell(r["memory_bytes"], 1 / _MIB, 1),
             _cell(r["memory_bytes_ratio"])]
    if before is not None:
      old = then.get(key, {})
      cells += [_cell(old.get("ms"), digits=3), _cell(old.get("ms_ratio"), digits=3)]
    rows.append(cells)
  headers = ["door", "case", "row", "ms", "x ref", "compile s", "x ref", "temp + output MiB",
             "x ref"]
  if before is not None:
    headers += ["before ms", "before x ref"]
  return markdown_table(headers, rows)


def goals(records: list[dict[str, Any]]) -> list[list[str]]:
  """The headline figures: (figure, measured, goal), the goal '-' where no issue set one:
  inside a step the default against the scan; across calls both schedules' micro-steps
  against the interface's floor, windows against MultiSteps', ``optax.flatten``'s; the
  loop's samples per second against its door's floor (the median of rounds' ratios)."""
  by_key = _ratios(records)
  out = []
  for (door, case, row), r in by_key.items():
    if door == INSIDE and row == DEFAULT:
      out.append([f"default / lax.scan step time, {case}", _cell(r["ms_ratio"], digits=3),
                  "<= 1.02"])
      out.append([f"default / lax.scan compile time, {case}", _cell(r["compile_s_ratio"]),
                  "<= 1.3"])

  def across(case: str, row: str, ref: str) -> str:
    a = by_key.get((ACROSS, case, row), {}).get("ms")
    b = by_key.get((ACROSS, case, ref), {}).get("ms")
    return _cell(a / b if a is not None and b else None, digits=3)

  def loop(row: str, door: str = ACROSS) -> str:
    return _cell(by_key.get((door, LOOP_CASES[door], row), {}).get("rate_ratio"), digits=3)

  loop_goals = [
      [f"{row} loop / {bench_loop.FLOOR}, samples/s", loop(row), goal]
      for row, goal in ((bench_loop.HOST, ">= 0.95"), (bench_loop.HOST_NO_SKIP, ">= 0.98"),
                        (bench_loop.PACKED, ">= 0.95"), (bench_loop.FLATTEN, "-"),
                        (bench_loop.DEVICE, "-"), (bench_loop.MULTISTEPS, "-"),
                        (bench_loop.FLOOR_WITH_STATE, "-"))
  ] + [[f"{bench_loop.VALUE_AND_GRAD} loop / {bench_loop.SCAN}, samples/s",
        loop(bench_loop.VALUE_AND_GRAD, INSIDE), "-"]]
  return out + [
      [f"{HOST} / interface's floor, {MICRO_STEP}", across(MICRO_STEP, HOST, FLOOR), "-"],
      [f"{DEVICE} / interface's floor, {MICRO_STEP}", across(MICRO_STEP, DEVICE, FLOOR), "-"],
      [f"{HOST} / MultiSteps, {WINDOW}", across(WINDOW, HOST, MULTISTEPS_ADAMW), "-"],
      [f"{FLATTEN_HOST} / interface's floor, {MICRO_STEP}",
       across(MICRO_STEP, FLATTEN_HOST, FLOOR), "-"],
      [f"{FLATTEN_HOST} / {HOST}, {WINDOW}", across(WINDOW, FLATTEN_HOST, HOST), "-"],
  ] + loop_goals


def header(config: dict[str, Any]) -> str:
  """The model, the card, JAX and the rounds of a run."""
  m, env = config["model"], config["environment"]
  return (
      f"GPT ({'tiny' if config['tiny'] else 'GPT-2 small'}): {m['layers']} layers, width"
      f" {m['width']}, {m['heads']} heads, MLP {m['mlp']}, vocabulary {m['vocab']}, context"
      f" {m['context']}, tied head, bfloat16, {config['param_count'] / 1e6:.2f}M parameters;"
      f" attention: {config['attention']}\n"
      f"device: {config['device_kind']} ({env['devices'][0]}), jax {env['jax']},"
      f" {env['cpu_count']} CPUs, load average at start {env['load_average']};"
      f" {config['rounds']} timed rounds (median), interleaved")


def fit_table(fit: dict[str, Any]) -> str:
  """The full batches tried, then the microbatched batch through the door and the scan."""
  rows = [[f"full batch {t['batch']}", t["status"],
           f"{t['step_ms']:.2f}" if "step_ms" in t else "-",
           _cell(t.get("xla", {}).get("temp_bytes"), 1 / _MIB, 1), "-"] for t in fit["tried"]]
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
                 _cell(e.get("xla", {}).get("temp_bytes"), 1 / _MIB, 1), diff])
  return markdown_table(["step", "status", "step ms (full batch: one call)", "XLA temp MiB",
                         "vs lax.scan: rel diff"], rows)


def print_report(output: dict[str, Any], before: dict[str, Any] | None,
                 before_path: str | None) -> None:
  records = output["records"]
  print("\nboth doors: step time in ms (inside a step: median of interleaved rounds; across calls:"
        " median micro-step and window, rows taking turns a window at a time), compile s (after"
        " a warm-up compile), temp + output = compiled.memory_analysis() (a host-schedule row:"
        " of its program that applies).\nx ref: to lax.scan at the same N x micro; micro-steps"
        f" to '{FLOOR}'; windows to '{MULTISTEPS_ADAMW}'; '+ gradient': the gradient of one"
        " sequence in the same jit as the update; host schedule: apply=False on 7 calls,"
        " apply=True on the 8th, two compiled programs; the loop: ms per 8 microbatches at"
        " the median samples/s of calls dispatched without blocking, to"
        f" '{bench_loop.FLOOR}' across calls and '{bench_loop.SCAN}' inside a step, compile s"
        " of all of a loop's programs")
  if output.get("loop"):
    bench_loop.print_report(output["loop"])
    print()
  if before is not None:
    print(f"now: {source_label(output)}; before: {source_label(before, before_path)}")
  print(one_table(records, records_of(before) if before is not None else None))
  print()
  print(markdown_table(["figure", "measured", "goal"], output["goals"]))

