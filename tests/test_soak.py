"""The soak run of bench/soak.py, at CI size and (marked slow) at full size.

The soak lives in bench/ because it is also run on its own to report its figures; the
tests import it from there, so the script cannot rot.

The full run is skipped unless asked for, by ``ACCUM_JAX_SLOW=1`` in the environment or
by selecting the marker (``pytest -m slow``). Both work without a ``--runslow`` option,
which would need a ``pytest_addoption`` hook in the shared root conftest.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

SOAK_PATH = Path(__file__).resolve().parent.parent / "bench" / "soak.py"

# float32 round-off in these runs is ~1e-5 (mostly Adam's float32 bias correction
# 1 - 0.999**t in its first steps); a lost, doubled or misplaced window is O(1).
MAX_REL_DEVIATION = 1e-4


def _load_soak():
  spec = importlib.util.spec_from_file_location("accum_jax_bench_soak", SOAK_PATH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def _slow_tests_requested(config: pytest.Config) -> bool:
  """``ACCUM_JAX_SLOW=1``, or a ``-m`` expression naming ``slow`` (not ``not slow``)."""
  if os.environ.get("ACCUM_JAX_SLOW") == "1":
    return True
  return re.search(r"(?<!not )\bslow\b", config.getoption("markexpr") or "") is not None


def _check(report) -> None:
  assert report.compiles == 1, "the scan recompiled: the state changed type"
  assert report.windows_match, "other calls updated than in the float64 reference"
  assert report.updates_applied == report.reference_updates_applied
  assert report.update_max_rel_deviation < MAX_REL_DEVIATION, report
  assert report.params_max_rel_deviation < MAX_REL_DEVIATION, report
  # No worse than the same algorithm in plain float32 NumPy.
  assert report.update_max_rel_deviation <= 2 * report.float32_model_update_max_rel_deviation
  assert report.params_max_rel_deviation <= 2 * report.float32_model_params_max_rel_deviation
  assert report.num_skipped == report.reference_num_skipped
  assert report.empty_windows == report.reference_empty_windows
  np.testing.assert_allclose(report.applied_weight, report.reference_applied_weight, rtol=1e-6)


@pytest.mark.parametrize("on_nonfinite", ["skip_window", "skip_microbatch"])
def test_soak_of_500_micro_steps_with_nonfinite_gradients_and_flushes(on_nonfinite):
  report = _load_soak().run(steps=500, every_k=4, chunk=250, on_nonfinite=on_nonfinite)
  # The stream exercises every path: injections, NaN padding, flushes.
  assert report.injections > 0 and report.padding_steps > 0 and report.flushes > 1
  if on_nonfinite == "skip_microbatch":
    assert report.reference_num_skipped == report.injections
  else:  # each window with an injection is skipped whole: more calls than injections
    assert report.reference_num_skipped > report.injections
  _check(report)


@pytest.mark.slow
def test_soak_of_10000_micro_steps_compiles_once_and_does_not_drift(request):
  if not _slow_tests_requested(request.config):
    pytest.skip("slow: set ACCUM_JAX_SLOW=1 or pass -m slow to run")
  report = _load_soak().run(steps=10_000, every_k=4, chunk=250)
  _check(report)
