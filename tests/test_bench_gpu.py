"""bench/bench_gpu.py at its CPU size: it runs, writes its JSON, and accum_jax matches the scan.

The benchmark is meant for a GPU (GPT-2 small); ``--tiny`` runs the same code on a
2-layer model of width 64, which is what CI can afford. The script runs in a
subprocess as a user runs it, with N in (1, 2), microbatches of 2 sequences, 2
rounds and no fresh-process memory measurements, and its JSON is checked: every
(N, micro) row timed for all three methods, accum_jax's loss and gradient equal to
the hand-written scan's, the across-calls rows present. A second test makes one
method run out of memory and checks that the row records it and the others go on.
The ``--quick`` check's functions run at a smaller size still: every row inside a
step and three across calls measured, the doors checked against the scan, and the one table with an
earlier run's figures beside the rows that match; the hand-written floor emits on
the k-th call only. Timings are not checked: the machine is shared.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPT = BENCH / "bench_gpu.py"


def _bench(name: str):
  """A module of bench/ (``gpu_model``, ``gpu_step``, ...), imported as bench_gpu.py imports it."""
  if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the bench modules import _common and each other as siblings
  return importlib.import_module(name)


def test_the_tiny_run_writes_its_rows_and_matches_the_scan() -> None:
  name = f"gpu_test_{os.getpid()}"
  path = BENCH / "results" / f"{name}.json"
  # One CPU device, as the script is run on its own (the root conftest.py asks for 8).
  flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
  env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}
  try:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--ns", "1", "2", "--micro", "2",
         "--rounds", "2", "--no-memory", "--name", name],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    data = json.loads(path.read_text())
  finally:
    path.unlink(missing_ok=True)

  config = data["config"]
  assert config["tiny"] and config["platform"] == "cpu" and not config["memory"]
  assert config["model"]["layers"] == 2 and config["model"]["width"] == 64
  assert config["device_kind"] and config["environment"]["devices"]
  rows = {(r["num_microbatches"], r["micro"]): r for r in data["results"]}
  assert set(rows) == {(1, 2), (2, 2)}
  for (n, micro), row in rows.items():
    assert row["status"] == "ok" and row["batch"] == n * micro, row
    for method in ("accum_jax", "lax.scan", "full batch"):
      entry = row["methods"][method]
      assert entry["status"] == "ok", (n, micro, method, entry)
      assert entry["step_ms"] > 0 and len(entry["step_ms_samples"]) == 2
      assert entry["xla"]["temp_bytes"] > 0
    exact = row["exact"]
    assert exact["match"], (n, micro, exact)
    assert exact["loss_rel_diff"] <= config["loss_rtol"]
    assert exact["grad_max_rel_diff"] <= config["grad_rtol"]
    if n == 1:  # one microbatch: the same computation as the scan's single step
      assert exact["grad_max_rel_diff"] < 1e-6, exact
  assert data["all_match"] is True
  assert data["fit"] is None  # off a GPU only with --fit

  (across,) = data["across_calls"]  # N = 1 has no window to accumulate
  assert across["every_k"] == 2 and across["status"] == "ok", across
  for name in ("accum_jax", "optax.MultiSteps"):
    assert across[name]["micro_step_ms"] > 0 and across[name]["window_ms"] > 0
    assert len(across[name]["call_ms_samples"]) == 2
  # The printed tables.
  assert "| N | micro | batch | accum_jax ms" in result.stdout
  assert "| every_k | accum_jax micro-step ms" in result.stdout


def test_a_configuration_out_of_memory_is_recorded_and_the_others_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
  gpu_model, gpu_methods, gpu_step = _bench("gpu_model"), _bench("gpu_methods"), _bench("gpu_step")
  gpu_failures, gpu_tables, gpu_budget = (
      _bench("gpu_failures"), _bench("gpu_tables"), _bench("gpu_budget"))

  def out_of_memory(loss, num_microbatches):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes.")

  monkeypatch.setitem(gpu_methods.METHODS, gpu_methods.FULL, out_of_memory)
  # Smaller than --tiny: only the bookkeeping is under test.
  config = gpu_model.Config(layers=1, width=16, heads=2, mlp=32, vocab=32, context=8)
  graphdef, params = gpu_model.make_model(config, "xla")
  rows = gpu_step.measure_steps(
      [(2, 1)], gpu_model.make_loss(graphdef), params, config, rounds=1,
      budget=gpu_budget.Budget(0), on_group=lambda: None,
  )
  row = rows[2, 1]
  assert row["methods"]["full batch"]["status"] == "OOM"
  assert "step_ms" not in row["methods"]["full batch"]
  for method in ("accum_jax", "lax.scan"):
    assert row["methods"][method]["status"] == "ok" and row["methods"][method]["step_ms"] > 0
  assert row["exact"]["match"] and "vs_full" not in row
  time_table, _ = gpu_tables.step_tables(
      {"flops_per_token": 1.0, "model": {"context": config.context}}, [row]
  )
  assert "| OOM " in time_table
  assert gpu_failures.is_oom(RuntimeError("... out of memory ..."))
  assert not gpu_failures.is_oom(ValueError("x"))


def _legacy_run() -> dict:
  """A JSON as bench_gpu.py wrote it before --quick (the H200 run at d1c9549), cut down."""
  return {
      "config": {"device_kind": "NVIDIA H200", "environment": {"jax": "0.11.2"}},
      "results": [{"num_microbatches": 2, "micro": 1, "batch": 2, "status": "ok", "methods": {
          "accum_jax": {"status": "ok", "step_ms": 40.0},
          "lax.scan": {"status": "ok", "step_ms": 32.0}}}],
      "across_calls": [{"every_k": 8, "status": "ok",
                        "accum_jax": {"micro_step_ms": 11.0, "window_ms": 90.0},
                        "optax.MultiSteps": {"micro_step_ms": 10.0, "window_ms": 80.0}}],
  }


def test_the_quick_check_puts_both_doors_in_one_table_beside_an_earlier_run() -> None:
  gpu_model, gpu_methods, gpu_step = _bench("gpu_model"), _bench("gpu_methods"), _bench("gpu_step")
  gpu_budget, gpu_across, gpu_records = (
      _bench("gpu_budget"), _bench("gpu_across"), _bench("gpu_records"))
  # The quick check's code at the smallest size: what runs on the GPU, in seconds here.
  config = gpu_model.Config(layers=1, width=16, heads=2, mlp=32, vocab=32, context=8)
  graphdef, params = gpu_model.make_model(config, "xla")
  loss = gpu_model.make_loss(graphdef)
  rows = gpu_step.measure_steps(
      [(2, 1)], loss, params, config, rounds=1, budget=gpu_budget.Budget(0),
      on_group=lambda: None, methods=gpu_methods.QUICK_METHODS, warmup_compile=True,
  )
  row = rows[2, 1]
  for method in gpu_methods.QUICK_METHODS:
    entry = row["methods"][method]
    assert entry["status"] == "ok" and entry["step_ms"] > 0 and entry["compile_s"] > 0, entry
  assert set(row["checks"]) == {
      gpu_methods.DEFAULT, gpu_methods.MICROBATCH, gpu_methods.NO_SKIP}
  assert all(c["match"] for c in row["checks"].values()), row["checks"]
  # Three of the rows (the others differ only in the optimizer inside): what the
  # table below reads, and a floor.
  names = ("floor: one f32 vector acc += g", "optax.MultiSteps(adamw)", "accumulate(adamw), tree")
  assert set(names) <= set(gpu_across.across_candidates(2))
  across = gpu_across.measure_quick_across(
      params, loss, gpu_model.make_tokens(1, config), every_k=2, rounds=1,
      budget=gpu_budget.Budget(0), combined=False, names=names)
  assert set(across) == set(names)
  for name, entry in across.items():
    assert entry["status"] == "ok" and entry["micro_step_ms"] > 0, (name, entry)
    assert len(entry["call_ms_samples"]) == 1 and len(entry["call_ms_samples"][0]) == 2

  records = gpu_records.records_of({"results": [row], "quick_across": {"standalone": across}})
  before = gpu_records.records_of(_legacy_run())
  table = {tuple(c.strip() for c in line.strip("|").split("|")[:3]): line
           for line in gpu_records.one_table(records, before).splitlines()[2:]}
  cells = lambda key: [c.strip() for c in table[key].strip("|").split("|")]  # noqa: E731
  # Today's default beside the default of then, each as a ratio to its own scan.
  default = cells(("inside a step", "2x1", "default"))
  assert default[-2:] == ["40.000", "1.250"], default
  assert float(default[4]) == pytest.approx(
      row["methods"]["default"]["step_ms"] / row["methods"]["lax.scan"]["step_ms"], abs=1e-3)
  assert cells(("inside a step", "2x1", "lax.scan"))[4] == "1.000"
  assert cells(("inside a step", "2x1", "skip_nonfinite=False"))[-2:] == ["-", "-"]
  assert cells(("across calls", "window of 8", "accumulate(adamw), tree"))[-2:] == [
      "90.000", "1.125"]
  assert cells(("across calls", "window of 8", "optax.MultiSteps(adamw)"))[4] == "1.000"
  figures = {g[0]: g for g in gpu_records.goals(records)}
  assert "default / lax.scan step time, 2x1" in figures
  assert gpu_records.source_label(_legacy_run(), "/x/h200-bench_gpu-d1c9549.json") == (
      "NVIDIA H200, jax 0.11.2, at d1c9549")


def test_the_hand_written_floor_updates_on_the_kth_call_only() -> None:
  gpu_across = _bench("gpu_across")
  import jax.numpy as jnp
  import optax

  floor = gpu_across._hand_written_cond(optax.sgd(1.0), every_k=2)
  params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros((), jnp.bfloat16)}
  grads = {"w": jnp.full(3, 0.5, jnp.bfloat16), "b": jnp.ones((), jnp.bfloat16)}
  state = floor.init(params)
  first, state = floor.update(params, state, grads)
  assert (first["w"] == 1).all() and first["b"] == 0 and (state[1]["w"] == 0.5).all()
  second, state = floor.update(first, state, grads)
  assert (second["w"] == 0.5).all() and second["b"] == -1, second  # params - mean of 2 grads
  assert (state[1]["w"] == 0).all() and state[1]["b"] == 0  # the accumulator reset
