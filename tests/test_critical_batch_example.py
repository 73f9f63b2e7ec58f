"""The critical-batch example, run small: its noise scale, its schedule, its table, its plot.

The schedule is checked against its rule step by step, from the per-step record the
example writes: N starts at N_MIN and, after every step, becomes
``max(N, clip(2 ** round(log2(B_simple_ema / microbatch)), N_MIN, N_MAX))``. A schedule
that ignores the noise, or lets N shrink, fails here.
"""

from __future__ import annotations

import csv
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Runs the script in a fresh interpreter: out of the default run, in CI's own step.
pytestmark = pytest.mark.scripts

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "critical_batch.py"


def _match(pattern: str, stdout: str) -> re.Match:
  match = re.search(pattern, stdout, re.MULTILINE)
  assert match, f"no line matching {pattern!r} in the output:\n{stdout}"
  return match


def _expected_n(b_simple: float, current: int, microbatch: int, n_min: int, n_max: int) -> int:
  if not math.isfinite(b_simple) or b_simple <= 0:
    return current
  n = 2 ** round(math.log2(max(b_simple / microbatch, 1.0)))
  return max(current, min(max(n, n_min), n_max))


def test_the_example_measures_the_noise_and_follows_it(tmp_path: Path) -> None:
  result = subprocess.run(
      [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
      capture_output=True,  # not a TTY, so tqdm (disable=None) stays quiet
      text=True,
      timeout=300,
  )
  out = result.stdout
  assert result.returncode == 0, f"exit {result.returncode}\n{out}\n{result.stderr}"

  header = _match(r"^digits: .* microbatch (\d+) examples, (\d+) examples per run$", out)
  microbatch, budget = int(header.group(1)), int(header.group(2))
  first, largest, last = map(float, _match(
      r"^B_simple EMA \(examples\), warmup run: first (\S+)\s+max (\S+)\s+last (\S+)$", out
  ).groups())
  assert all(math.isfinite(b) and b > 0 for b in (first, largest, last)), out

  # The table: one fixed run and the warmup, each reaching the target, on equal examples.
  rows = {}
  for match in re.finditer(
      r"^(fixed\(N=(\d+)\)|warmup\(N=(\d+)\.\.(\d+)\))\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)"
      r"\s+([\d.]+)\s+([\d.]+)$", out, re.MULTILINE,
  ):
    rows[match.group(1)] = match
  fixed = [name for name in rows if name.startswith("fixed")]
  warmup = [name for name in rows if name.startswith("warmup")]
  assert fixed and len(warmup) == 1, out
  for match in rows.values():
    steps_to_target, steps, examples = int(match.group(6)), int(match.group(8)), int(
        match.group(9))
    accuracy = float(match.group(11))
    assert 0 < steps_to_target <= steps, out
    assert budget - microbatch * 32 < examples <= budget, out
    assert 0.5 < accuracy <= 1.0, out
  n_min, n_max = int(rows[warmup[0]].group(3)), int(rows[warmup[0]].group(4))

  # The schedule, step by step, against the rule and the EMA it saw.
  with open(tmp_path / "critical_batch.csv") as f:
    record = list(csv.DictReader(f))
  ns = [int(r["num_microbatches"]) for r in record]
  emas = [float(r["b_simple_ema"]) for r in record]
  assert ns[0] == n_min, ns[:5]
  for step in range(1, len(record)):
    expected = _expected_n(emas[step - 1], ns[step - 1], microbatch, n_min, n_max)
    assert ns[step] == expected, (step, ns[step - 1], emas[step - 1], ns[step], expected)
  assert all(n & (n - 1) == 0 and n_min <= n <= n_max for n in ns), sorted(set(ns))
  assert max(ns) > n_min, f"the batch never grew: {sorted(set(ns))}"
  printed = [round(b, 1) for b in (emas[0], max(emas), emas[-1])]
  assert printed == [first, largest, last], (printed, out)
  lengths = " ".join(f"{n}x{ns.count(n)}" for n in sorted(set(ns)))
  assert _match(r"^warmup schedule \(N x steps\): (.*)$", out).group(1) == lengths, out

  png = tmp_path / "critical_batch.png"
  assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
