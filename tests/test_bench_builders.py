"""The CPU benchmarks build their library rows with the current API.

``bench/bench_microbatch.py`` and ``bench/bench_sharded.py`` take minutes, so the
suite does not run them; a renamed option would break them unseen. Here each of
their accum_jax rows is built and lowered (not run) on a tiny model and the 8 CPU
devices of conftest.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_microbatch  # noqa: E402
import bench_sharded  # noqa: E402

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


@needs_8
def test_bench_microbatch_compiles_every_row_under_the_mesh(capsys):
  bench_microbatch.collectives_worker(2, batch_size=32, width=8, num_layers=1)
  printed = capsys.readouterr().out
  assert bench_microbatch.ACCUM in printed and "DataParallel" in printed


@pytest.mark.parametrize("method", bench_microbatch.METHODS)
def test_bench_microbatch_builds_each_method(method):
  step, args = bench_microbatch.build_step(method, 2, batch_size=16, width=8, num_layers=1)
  step.lower(*args)


@needs_8
# Two rows leave param_sharding out on purpose, and warn.
@pytest.mark.filterwarnings("ignore::accum_jax.UnknownShardingWarning")
@pytest.mark.parametrize("method", [m for m in bench_sharded.METHODS
                                    if m.startswith("accum_jax")])
def test_bench_sharded_builds_each_library_row(method):
  problem = bench_sharded.make_problem("fsdp", width=16, num_layers=2, batch_size=32)
  step, args = bench_sharded.build(method, problem, 2)
  step.lower(*args)
