"""The time budget of bench_gpu.py: each phase starts new work until its share is spent.

A configuration that starts before its phase's deadline runs to its end, so the
run ends, with its JSON written, a configuration's time after the budget at most.
"""

from __future__ import annotations

import time


class Budget:
  """Deadlines: each phase may start new work until its share of ``seconds`` is spent.

  ``seconds`` 0 means no limit.
  """

  # Cumulative shares of the budget at which the phases stop starting new work
  # (the loop only where --sections names it).
  SHARES = {"memory": 0.4, "step": 0.75, "across_calls": 0.85, "loop": 0.92, "fit": 1.0}
  # --quick: the inside-step pairs, then across calls, both doors in one table, then
  # the training loop.
  # By the times of a run on an H200 (245 s): the pairs 8x1 and 8x4, the four rows
  # of the across-calls figures, the loop's first six loops.
  QUICK_SHARES = {"step": 0.36, "across_calls": 0.54, "loop": 0.93}

  def __init__(self, seconds: float, shares: dict[str, float] | None = None):
    self.start = time.perf_counter()
    self.seconds = seconds
    self.shares = shares or self.SHARES

  def left(self, phase: str) -> bool:
    if not self.seconds:
      return True
    return time.perf_counter() - self.start < self.seconds * self.shares[phase]
