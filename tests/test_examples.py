"""Smoke tests: each example runs in its quick setting and reports what it promises.

To add an example, append an ``Example`` to ``EXAMPLES``: the script, its quick arguments
(``{tmp}`` is replaced by a fresh temporary directory), and a check of its stdout.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

# Each runs its script in a fresh interpreter: out of the default run, in CI's own step.
pytestmark = pytest.mark.scripts

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
# The quickstart's two runs agree to float32 round-off (~1e-7); this leaves room for
# other platforms' kernels without letting a real accumulation error through.
LOSS_DIFFERENCE_TOLERANCE = 1e-4
# Exact accumulation (token-weighted, or data-parallel) matches the full batch to float32
# round-off (~1e-7 relative); the mean of microbatch means misses it by percents.
PARITY_TOLERANCE = 1e-5
MEAN_OF_MEANS_MIN_DEVIATION = 1e-3


class Example(NamedTuple):
  script: str
  args: tuple[str, ...]
  outputs: tuple[str, ...]  # files, under {tmp}, the run must create
  check: Callable[[str], None]  # asserts on the run's stdout


def _number_after(label: str, stdout: str) -> float:
  match = re.search(rf"^{re.escape(label)}\s+(\S+)$", stdout, re.MULTILINE)
  assert match, f"no line starting {label!r} in the output:\n{stdout}"
  return float(match.group(1))


def _rows_after(label: str, stdout: str) -> list[list[float]]:
  """The numbers on every line that starts with ``label``, one list per line."""
  rows = [
      [float(x) for x in line[len(label) :].split()]
      for line in stdout.splitlines()
      if line.startswith(label)
  ]
  assert rows, f"no line starting {label!r} in the output:\n{stdout}"
  return rows


def _check_loss_went_down(stdout: str) -> None:
  assert _number_after("last loss:", stdout) < _number_after("first loss:", stdout), stdout


def check_quickstart(stdout: str) -> None:
  loss_difference = _number_after("largest loss difference:", stdout)
  assert loss_difference < LOSS_DIFFERENCE_TOLERANCE, stdout


def check_token_weighted_lm(stdout: str) -> None:
  # Columns: loss |diff|, loss relative, gradient max |diff|, gradient relative (global norm).
  # One row at initialisation, one after training.
  for _, loss_rel, _, grad_rel in _rows_after("token-weighted (weight_fn)", stdout):
    assert loss_rel < PARITY_TOLERANCE and grad_rel < PARITY_TOLERANCE, stdout
  for _, loss_rel, _, grad_rel in _rows_after("mean of means (no weight_fn)", stdout):
    assert loss_rel > MEAN_OF_MEANS_MIN_DEVIATION, stdout
    assert grad_rel > MEAN_OF_MEANS_MIN_DEVIATION, stdout
  _check_loss_went_down(stdout)


def check_data_parallel(stdout: str) -> None:
  # Collectives in the compiled step: (inside the microbatch loop, after it).
  [[accum_in_loop, accum_after_loop]] = _rows_after("collectives, accum_jax:", stdout)
  assert accum_in_loop == 0 and accum_after_loop >= 1, stdout
  [[scan_in_loop, _]] = _rows_after("collectives, plain scan:", stdout)
  assert scan_in_loop > 0, stdout
  # Parity with one device on the full batch: (loss |diff|, gradient relative deviation).
  for name in ("accum_jax", "plain scan"):
    [[loss_diff, grad_rel]] = _rows_after(f"parity, {name}:", stdout)
    assert loss_diff < PARITY_TOLERANCE and grad_rel < PARITY_TOLERANCE, stdout
  _check_loss_went_down(stdout)


def check_flax_linen(stdout: str) -> None:
  assert _number_after("largest difference from sequential:", stdout) < LOSS_DIFFERENCE_TOLERANCE
  assert _number_after("test accuracy:", stdout) > 0.5, stdout


def check_flax_nnx_accumulate(stdout: str) -> None:
  calls = _number_after("calls of optimizer.update (nnx.Optimizer.step):", stdout)
  updates = _number_after("Adam updates (accum_jax.optimizer_step):", stdout)
  assert updates == math.ceil(calls / 4), stdout  # every_k=4, the last window flushed
  assert _number_after("test accuracy:", stdout) > 0.5, stdout


def check_flax_nnx_value_and_grad(stdout: str) -> None:
  assert _number_after("Adam updates (one per call):", stdout) > 0, stdout
  assert _number_after("test accuracy:", stdout) > 0.5, stdout


def check_resume(stdout: str) -> None:
  assert "mini_step 2" in stdout, stdout  # restored in the middle of a window
  assert "bitwise equal: True" in stdout, stdout


def check_contrastive(stdout: str) -> None:
  # cached_value_and_grad equals the full batch; value_and_grad over the same chunks does not.
  for when in ("at initialisation", "after training"):
    assert _number_after(f"gradient deviation {when}, cached:", stdout) < PARITY_TOLERANCE
    plain = _number_after(f"gradient deviation {when}, value_and_grad:", stdout)
    assert plain > MEAN_OF_MEANS_MIN_DEVIATION, stdout
  assert "verdict: exact and within budget: N = 8," in stdout, stdout
  _check_loss_went_down(stdout)


def check_dp_sgd(stdout: str) -> None:
  # Streamed in physical batches, the first logical batch gives what one call on it gives.
  difference = _number_after("largest difference from one call on the logical batch:", stdout)
  assert difference < PARITY_TOLERANCE, stdout
  # One Adam update (and one noise draw) per logical batch of about 4 calls of 64.
  calls = _number_after("calls of the train step:", stdout)
  steps = _number_after("optimizer steps (accum_jax.optimizer_step):", stdout)
  assert steps > 0 and 3 <= calls / steps <= 6, stdout
  assert _number_after("sampling rate q:", stdout) == round(256 / 1408, 4), stdout
  assert _number_after("test accuracy:", stdout) > 0.5, stdout


def check_moe(stdout: str) -> None:
  # stats_value_and_grad equals the full batch at initialisation and along training;
  # value_and_grad of the per-microbatch total loss balances each microbatch instead.
  for what in ("loss", "gradient", "router gradient", "router gradient of the balance loss"):
    assert _number_after(f"stats_value_and_grad, {what}:", stdout) < PARITY_TOLERANCE, stdout
  curve = "max loss-curve difference from the full batch,"
  assert _number_after(f"{curve} stats_value_and_grad:", stdout) < LOSS_DIFFERENCE_TOLERANCE
  plain_balance = _number_after("value_and_grad, router gradient of the balance loss:", stdout)
  assert plain_balance > 0.1, stdout
  assert _number_after(f"{curve} value_and_grad:", stdout) > MEAN_OF_MEANS_MIN_DEVIATION
  assert "verdict: stats_value_and_grad is exact:" in stdout, stdout
  # Ten Adam steps on the same batches: each door's loss went down.
  for name in ("full batch", "stats_value_and_grad", "value_and_grad"):
    first, last = re.search(rf"^{name}: first (\S+), last (\S+)$", stdout, re.M).groups()
    assert float(last) < float(first), stdout


EXAMPLES = [
    Example(
        script="quickstart.py",
        args=("--quick", "--plot", "{tmp}/x.png"),
        outputs=("x.png",),
        check=check_quickstart,
    ),
    Example(
        script="token_weighted_lm.py",
        args=("--quick",),
        outputs=(),
        check=check_token_weighted_lm,
    ),
    Example(
        # Under pytest, conftest.py gives the subprocess 8 CPU devices through XLA_FLAGS.
        script="data_parallel.py",
        args=("--quick",),
        outputs=(),
        check=check_data_parallel,
    ),


    Example("flax_linen.py", ("--quick",), (), check_flax_linen),
    Example("flax_nnx.py", ("--quick",), (), check_flax_nnx_accumulate),
    Example(
        "flax_nnx.py", ("--quick", "--door", "value_and_grad"), (), check_flax_nnx_value_and_grad
    ),
    Example("resume.py", ("--quick",), (), check_resume),
    Example("contrastive.py", ("--quick", "--plot", "{tmp}/c.png"), ("c.png",), check_contrastive),
    Example("moe.py", ("--quick", "--plot", "{tmp}/moe.png"), ("moe.png",), check_moe),
    Example("dp_sgd.py", ("--quick",), (), check_dp_sgd),
]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: " ".join((e.script, *e.args[1:])))
def test_example_runs(example: Example, tmp_path: Path) -> None:
  args = [arg.format(tmp=tmp_path) for arg in example.args]
  result = subprocess.run(
      [sys.executable, str(EXAMPLES_DIR / example.script), *args],
      capture_output=True,  # not a TTY, so tqdm (disable=None) stays quiet
      text=True,
      timeout=300,
  )
  assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
  for output in example.outputs:
    assert (tmp_path / output).is_file(), f"{example.script} did not write {output}"
  example.check(result.stdout)
