"""The CPU benchmarks build their library rows with the current API.

``bench/bench_microbatch.py`` and ``bench/bench_sharded.py`` take minutes, so the
suite does not run them; a renamed option would break them unseen. Here each of
their rows is built and lowered (not run) on a tiny model, bench_sharded.py's on the
8 CPU devices of conftest.py. Every loop of ``bench/bench_loop.py`` is built on two
leaves and run for a window: each trains as the others do, and its calls find the
programs compiled ahead. Timings are not checked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_loop  # noqa: E402
import bench_microbatch  # noqa: E402
import bench_sharded  # noqa: E402

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


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


def test_every_loop_of_bench_loop_trains_alike_and_runs_what_it_compiled():
  def loss(params, x):
    return jnp.mean((x @ params["w"] + params["b"]) ** 2)

  params = {"w": jnp.full((4, 3), 0.1, jnp.float32), "b": jnp.zeros(3, jnp.float32)}
  data = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
  loops, results = bench_loop.build(loss, params, data, micro=1)
  assert set(loops) == set(bench_loop.loop_builders(loss)), results
  # One window each: the same 8 rows, one AdamW step on their mean gradient.
  for name, loop in loops.items():
    assert loop.next_call == loop.calls == (bench_loop.EVERY_K if loop.sequences == 1 else 1)
    jax.tree.map(lambda a, b, name=name: np.testing.assert_allclose(
        a, b, rtol=1e-6, atol=1e-7, err_msg=name), loop.carry[0], loops[bench_loop.FLOOR].carry[0])
  assert not np.allclose(loops[bench_loop.HOST].carry[0]["b"], 0)
  bench_loop.time_rounds(loops, results, data, rounds=1, windows=1)
  for name, entry in results.items():
    assert entry["compiled_after_runs"] in (entry["programs"], None), (name, entry)
    assert entry["samples_per_s"] > 0 and entry["micro_step"]["buffers_in"] > 0, (name, entry)
    for door in bench_loop.doors(name):
      assert entry["ratio"][door] > 0, (name, entry)
  # The host schedule hands over its state on every call; the floor's micro-step does not.
  assert (results[bench_loop.HOST]["micro_step"]["buffers_in"]
          > results[bench_loop.FLOOR]["micro_step"]["buffers_in"])
  tables = bench_loop.tables(results)
  assert bench_loop.FULL in tables[bench_loop.ACROSS] and bench_loop.FULL in tables[
      bench_loop.INSIDE]
  assert bench_loop.SCAN not in tables[bench_loop.ACROSS]
