"""bench/bench_gpu.py at its CPU size: it runs, writes its JSON, and accum_jax matches the scan.

The benchmark is meant for a GPU (GPT-2 small); ``--tiny`` runs the same code on a
2-layer model of width 64, which is what CI can afford. The script runs in a
subprocess as a user runs it, with N in (1, 2), microbatches of 2 sequences, 2
rounds, inside a step only, and its JSON and its one table are checked: every
(N, micro) row timed for all three methods, accum_jax's loss and gradient equal to
the hand-written scan's. A second test makes one method run out of memory and checks
that the row records it and the others go on. The ``--quick`` check's functions (in the
modules of bench/ that the script imports) run at a smaller size still: every
row inside a step measured and the doors checked against the scan; across calls, on two
leaves, the rows of the headline figures (the interface's floor, the host schedule,
MultiSteps); and the one table with an earlier run's figures beside the rows that
match. The host schedule's rows (both layouts) leave the parameters as they were on a
micro-step and apply on the window's last call what the device schedule applies; the
hand-written floor emits on the k-th call only. Timings are not checked: the
machine is shared.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # left out of the README's command (conftest.py)

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPT = BENCH / "bench_gpu.py"


def _bench(*names: str):
  """Modules of bench/ (``models``, ``gpu_step``, ...), imported as bench_gpu.py imports them."""
  if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the bench modules import _common and each other as siblings
  modules = tuple(importlib.import_module(name) for name in names)
  return modules if len(modules) > 1 else modules[0]


@pytest.mark.scripts
def test_the_tiny_run_writes_its_rows_and_matches_the_scan() -> None:
  name = f"gpu_test_{os.getpid()}"
  path = BENCH / "results" / f"{name}.json"
  # One CPU device, as the script is run on its own (the root conftest.py asks for 8).
  flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
  env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}
  try:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--ns", "1", "2", "--micro", "2",
         "--rounds", "2", "--sections", "step", "--name", name],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    data = json.loads(path.read_text())
  finally:
    path.unlink(missing_ok=True)

  config = data["config"]
  assert config["tiny"] and config["platform"] == "cpu" and config["sections"] == ["step"]
  assert config["model"]["layers"] == 2 and config["model"]["width"] == 64
  assert config["device_kind"] and config["environment"]["devices"]
  rows = {(r["num_microbatches"], r["micro"]): r for r in data["results"]}
  assert set(rows) == {(1, 2), (2, 2)}
  for (n, micro), row in rows.items():
    assert row["status"] == "ok" and row["batch"] == n * micro, row
    assert list(row["methods"]) == ["lax.scan", "default", "on_nonfinite='skip_microbatch'",
                                    "on_nonfinite='unchecked'", "full batch"]
    for method, entry in row["methods"].items():
      assert entry["status"] == "ok", (n, micro, method, entry)
      assert entry["step_ms"] > 0 and len(entry["step_ms_samples"]) == 2
      assert entry["xla"]["temp_bytes"] > 0
    assert len(row["checks"]) == 3
    for checked, exact in row["checks"].items():
      assert exact["match"], (n, micro, checked, exact)
      assert exact["loss_rel_diff"] <= config["loss_rtol"]
      assert exact["grad_max_rel_diff"] <= config["grad_rtol"]
    if n == 1:  # one microbatch: the same computation as the scan's single step
      assert row["checks"]["default"]["grad_max_rel_diff"] < 1e-6, row["checks"]
  assert data["all_match"] is True
  assert data["fit"] is None  # off a GPU only with --fit
  # The printed table: each row against the scan.
  cells = _cells(result.stdout[result.stdout.index("| door "):])
  assert cells["inside a step", "2x2", "lax.scan"][4] == "1.000"
  assert float(cells["inside a step", "2x2", "default"][4]) == pytest.approx(
      rows[2, 2]["methods"]["default"]["step_ms"]
      / rows[2, 2]["methods"]["lax.scan"]["step_ms"], abs=1e-3)


def test_a_configuration_out_of_memory_is_recorded_and_the_others_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
  models, gpu_step, gpu_report, common = _bench("models", "gpu_step", "gpu_report", "_common")

  def out_of_memory(loss, num_microbatches):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes.")

  # The scan and the default beside the method that fails: the rows' other ways
  # compile as these do (the quick check below runs them all).
  kept = {gpu_step.SCAN: gpu_step.METHODS[gpu_step.SCAN],
          gpu_step.DEFAULT: gpu_step.METHODS[gpu_step.DEFAULT], gpu_step.FULL: out_of_memory}
  monkeypatch.setattr(gpu_step, "METHODS", kept)
  # Smaller than --tiny: only the bookkeeping is under test.
  config = models.Config(layers=1, width=16, heads=2, mlp=32, vocab=32, context=8)
  graphdef, params = models.make_model(config, "xla")
  rows = gpu_step.measure_steps(
      [(2, 1)], models.make_loss(graphdef), params, config, rounds=1,
      budget=common.Budget(0), on_group=lambda: None,
  )
  row = rows[2, 1]
  assert row["methods"]["full batch"]["status"] == "OOM"
  assert "step_ms" not in row["methods"]["full batch"]
  for method in ("default", "lax.scan"):
    assert row["methods"][method]["status"] == "ok" and row["methods"][method]["step_ms"] > 0
  assert row["checks"]["default"]["match"] and "vs_full" not in row
  table = gpu_report.one_table(gpu_report.records_of({"results": [row]}))
  assert _cells(table)["inside a step", "2x1", "full batch"][3] == "OOM"
  assert common.is_oom(RuntimeError("... out of memory ..."))
  assert not common.is_oom(ValueError("x"))


def _legacy_run() -> dict:
  """A JSON as bench_gpu.py wrote it before --quick (the H200 run at d1c9549), cut down."""
  return {
      "config": {"device_kind": "NVIDIA H200", "environment": {"jax": "0.11.2"}},
      "results": [{"num_microbatches": 2, "micro": 1, "batch": 2, "status": "ok", "methods": {
          "accum_jax": {"status": "ok", "step_ms": 40.0},
          "lax.scan": {"status": "ok", "step_ms": 32.0}}}],
  }


def _cells(table: str) -> dict[tuple[str, ...], list[str]]:
  """A markdown table's rows by their first three cells (door, case, row)."""
  rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
  return {tuple(r[:3]): r for r in rows}


def _tiny_model():
  """Smaller than --tiny: what runs on the GPU, in seconds here."""
  models = _bench("models")
  config = models.Config(layers=1, width=16, heads=2, mlp=32, vocab=32, context=8)
  graphdef, params = models.make_model(config, "xla")
  return config, models.make_loss(graphdef), params


def _small_problem():
  """Two bfloat16 leaves and a loss of them: how the across-calls rows are built and
  driven is under test, and they compile here in a sixth of the model's time."""
  import jax.numpy as jnp

  def loss(params, x):
    return jnp.mean((x @ params["w"].astype(jnp.float32) + params["b"]) ** 2)

  params = {"w": jnp.full((4, 3), 0.01, jnp.bfloat16), "b": jnp.zeros(3, jnp.bfloat16)}
  return loss, params, jnp.arange(8, dtype=jnp.float32).reshape(2, 4)


def test_the_quick_check_puts_both_doors_in_one_table_beside_an_earlier_run() -> None:
  gpu_step, common = _bench("gpu_step", "_common")
  micro_step, gpu_report = _bench("bench_micro_step", "gpu_report")
  config, loss, params = _tiny_model()
  rows = gpu_step.measure_steps(
      [(2, 1)], loss, params, config, rounds=1, budget=common.Budget(0), on_group=lambda: None)
  row = rows[2, 1]
  for method in gpu_step.METHODS:
    entry = row["methods"][method]
    assert entry["status"] == "ok" and entry["step_ms"] > 0 and entry["compile_s"] > 0, entry
  assert set(row["checks"]) == {gpu_step.DEFAULT, gpu_step.MICROBATCH, gpu_step.NO_SKIP}
  assert all(c["match"] for c in row["checks"].values()), row["checks"]

  # Across calls, a window of 2 calls: the rows of the figures below.
  host, device, floor = micro_step.HOST, micro_step.DEVICE, micro_step.FLOOR
  names = (floor, host, micro_step.MULTISTEPS_ADAMW)
  assert len(micro_step.across_candidates(2)) == 8 and set(names) | {device} <= set(
      micro_step.across_candidates(2))
  small_loss, small_params, x = _small_problem()
  across = micro_step.measure_rows(small_params, small_loss, x, every_k=2, rounds=1,
                                    budget=common.Budget(0), names=names)
  assert set(across) == set(names)
  for name, entry in across.items():
    assert entry["status"] == "ok" and entry["micro_step_ms"] > 0, (name, entry)
    assert len(entry["call_ms_samples"]) == 1 and len(entry["call_ms_samples"][0]) == 2
    assert entry["programs"] == (2 if name == host else 1), (name, entry)
    assert ("micro_step_xla" in entry) == (name == host), (name, entry)

  # Before: the d1c9549 run inside a step, and an earlier run of these rows.
  before = {**_legacy_run(), "quick_across": {"combined": {
      floor: {"status": "ok", "micro_step_ms": 4.0, "window_ms": 40.0},
      host: {"status": "ok", "micro_step_ms": 5.0, "window_ms": 48.0},
      micro_step.MULTISTEPS_ADAMW: {"status": "ok", "micro_step_ms": 6.0, "window_ms": 60.0}}}}
  records = gpu_report.records_of({"results": [row], "quick_across": {"combined": across}})
  cells = _cells(gpu_report.one_table(records, gpu_report.records_of(before)))
  # Today's default beside the default of then, each as a ratio to its own scan.
  default = cells["inside a step", "2x1", "default"]
  assert default[-2:] == ["40.000", "1.250"], default
  assert float(default[4]) == pytest.approx(
      row["methods"]["default"]["step_ms"] / row["methods"]["lax.scan"]["step_ms"], abs=1e-3)
  assert cells["inside a step", "2x1", "lax.scan"][4] == "1.000"
  assert cells["inside a step", "2x1", "on_nonfinite='unchecked'"][-2:] == ["-", "-"]
  # Micro-steps against the interface's floor, windows against MultiSteps'.
  micro = cells["across calls", "micro-step + gradient", host]
  assert micro[-2:] == ["5.000", "1.250"], micro
  assert float(micro[4]) == pytest.approx(
      across[host]["micro_step_ms"] / across[floor]["micro_step_ms"], abs=1e-3)
  assert cells["across calls", "window of 8 + gradient", host][-2:] == ["48.000", "0.800"]
  assert cells["across calls", "window of 8 + gradient", micro_step.MULTISTEPS_ADAMW][4] == (
      "1.000")
  figures = {g[0]: g[1] for g in gpu_report.goals(records)}
  assert "default / lax.scan step time, 2x1" in figures
  assert figures[f"{host} / interface's floor, micro-step + gradient"] == (
      f"{across[host]['micro_step_ms'] / across[floor]['micro_step_ms']:.3f}")
  assert figures[f"{device} / interface's floor, micro-step + gradient"] == "-"  # not measured
  assert figures[f"{host} / MultiSteps, window of 8 + gradient"] == (
      f"{across[host]['window_ms'] / across[micro_step.MULTISTEPS_ADAMW]['window_ms']:.3f}")
  # The run of then on its own: its default (named "accum_jax" then) against its scan.
  legacy = _cells(gpu_report.one_table(gpu_report.records_of(_legacy_run())))
  assert legacy["inside a step", "2x1", "default"][3:5] == ["40.000", "1.250"]
  assert gpu_report.source_label(_legacy_run(), "/x/h200-bench_gpu-d1c9549.json") == (
      "NVIDIA H200, jax 0.11.2, at d1c9549")


@pytest.mark.parametrize("packed", [False, True], ids=["tree", "optax.flatten"])
def test_the_host_schedule_row_applies_on_the_last_call_what_the_device_schedule_does(
    packed: bool,
) -> None:
  micro_step = _bench("bench_micro_step")
  import jax
  import numpy as np

  loss, params, x = _small_problem()
  candidates = micro_step.across_candidates(2)
  name = micro_step.FLATTEN_HOST if packed else micro_step.HOST
  host, host_entry = micro_step.build_row(candidates[name], loss, params, x, 2)
  device, device_entry = micro_step.build_row(candidates[micro_step.DEVICE], loss, params, x, 2)
  assert host.applies == [False, True] and device.applies == [None, None]
  # The host's micro-step holds no conditional; the device schedule's keeps one.
  assert host_entry["micro_step_counts"]["conditionals"] == 0, host_entry
  assert device_entry["micro_step_counts"]["conditionals"] >= 1, device_entry
  start = jax.tree.map(np.asarray, params)
  host.carry[:] = host.programs[False](*host.carry, x)
  jax.tree.map(np.testing.assert_array_equal, host.carry[0], start)  # a micro-step: unmoved
  host.carry[:] = host.programs[True](*host.carry, x)
  micro_step.run_window(device, x)
  jax.tree.map(np.testing.assert_array_equal, host.carry[0], device.carry[0])
  assert (np.asarray(host.carry[0]["b"]) != 0).all()  # AdamW applied to the window's mean


def test_the_hand_written_floor_updates_on_the_kth_call_only() -> None:
  micro_step = _bench("bench_micro_step")
  import jax.numpy as jnp
  import optax

  floor = micro_step._hand_written_cond(optax.sgd(1.0), every_k=2)
  params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros((), jnp.bfloat16)}
  grads = {"w": jnp.full(3, 0.5, jnp.bfloat16), "b": jnp.ones((), jnp.bfloat16)}
  state = floor.init(params)
  first, state = floor.update(params, state, grads, None)
  assert (first["w"] == 1).all() and first["b"] == 0 and (state[1]["w"] == 0.5).all()
  second, state = floor.update(first, state, grads, None)
  assert (second["w"] == 0.5).all() and second["b"] == -1, second  # params - mean of 2 grads
  assert (state[1]["w"] == 0).all() and state[1]["b"] == 0  # the accumulator reset


def test_the_loop_s_figures_join_the_one_table_and_the_goals() -> None:
  gpu_report = _bench("gpu_report")
  import bench_loop  # noqa: E402  (bench/ is on the path now)

  def loop(rate: float, ratios: dict[str, float]) -> dict:
    return {"status": "ok", "samples_per_s": rate, "window_ms": 8e3 / rate,
            "compile_total_s": 2.0, "ratio": ratios}

  output = {"loop": {
      bench_loop.FLOOR: loop(100.0, {"across calls": 1.0}),
      bench_loop.HOST: loop(90.0, {"across calls": 0.93}),
      bench_loop.SCAN: loop(200.0, {"inside a step": 1.0}),
      bench_loop.VALUE_AND_GRAD: loop(190.0, {"inside a step": 0.96}),
      bench_loop.MULTISTEPS: {"status": "skipped (budget)"},
  }}
  records = gpu_report.records_of(output)
  cells = _cells(gpu_report.one_table(records))
  host = cells["across calls", "the loop, window of 8", bench_loop.HOST]
  assert host[3:5] == ["88.889", "1.111"], host  # ms per window; to the floor's
  assert cells["across calls", "the loop, window of 8", bench_loop.MULTISTEPS][3] == (
      "skipped (budget)")
  figures = {g[0]: g[1:] for g in gpu_report.goals(records)}
  # Samples per second: the median of the rounds' ratios, as bench_loop reports it.
  assert figures[f"{bench_loop.HOST} loop / {bench_loop.FLOOR}, samples/s"] == ["0.930", ">= 0.95"]
  assert figures[f"{bench_loop.HOST_NO_SKIP} loop / {bench_loop.FLOOR}, samples/s"] == [
      "-", ">= 0.98"]
  assert figures[f"{bench_loop.VALUE_AND_GRAD} loop / {bench_loop.SCAN}, samples/s"][0] == (
      "0.960")
