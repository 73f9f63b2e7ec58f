"""The CPU benchmarks build their library rows with the current API.

``bench/bench_microbatch.py`` and ``bench/bench_sharded.py`` take minutes, so the
suite does not run them; a renamed option would break them unseen. Here each of
their rows is built and lowered (not run) on a tiny model, bench_sharded.py's on the
8 CPU devices of conftest.py; bench_step_memory.py's programs compile on 16 leaves.
Every loop of ``bench/bench_loop.py`` is built on three leaves in both containers
and run for a window: each trains as the others do; its memory section compiles on
four leaves. Timings are not checked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_loop  # noqa: E402
import bench_microbatch  # noqa: E402
import bench_sharded  # noqa: E402
import bench_step_memory  # noqa: E402
import models  # noqa: E402

pytestmark = pytest.mark.bench  # left out of the README's command (conftest.py)

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


@pytest.mark.parametrize("method", bench_microbatch.METHODS)
def test_bench_microbatch_builds_each_method(method):
  step, args = bench_microbatch.build_step(method, 2, batch_size=16, width=8, num_layers=1)
  step.lower(*args)


def test_bench_step_memory_compiles_each_program_and_sets_it_beside_the_scan():
  result = bench_step_memory.measure({"layers": 1, "width": 8, "vocab": 16, "context": 4})
  assert set(result["rows"]) == set(bench_step_memory._programs())
  assert result["rows"]["hand-written lax.scan"]["vs_hand_written"] == 1.0
  assert result["tree"]["leaves"] == 16
  assert "| value_and_grad |" in bench_step_memory.table(result)


@needs_8
# Two rows leave param_sharding out on purpose, and warn.
@pytest.mark.filterwarnings("ignore::accum_jax.UnknownShardingWarning")
@pytest.mark.parametrize("method", [m for m in bench_sharded.METHODS
                                    if m.startswith("accum_jax")])
def test_bench_sharded_builds_each_library_row(method):
  problem = bench_sharded.make_problem("fsdp", width=16, num_layers=2, batch_size=32)
  step, args = bench_sharded.build(method, problem, 2)
  step.lower(*args)


class _Tiny(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(16, 4, rngs=rngs)
    self.out = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, tokens):
    return self.out(self.embed(tokens))


def _tiny_problems() -> dict[str, bench_loop.Problem]:
  """Three leaves in both containers: plain arrays and ``nnx.State``."""

  def model_loss(model, tokens):
    return jnp.mean(model(tokens) ** 2)

  def array_loss(p, tokens):
    return jnp.mean((p["embed"]["embedding"][tokens] @ p["out"]["kernel"] + p["out"]["bias"])
                    ** 2)

  graphdef, state = nnx.split(_Tiny(rngs=nnx.Rngs(0)), nnx.Param)
  return {bench_loop.ARRAYS: bench_loop.Problem(bench_loop.ARRAYS, array_loss,
                                                nnx.to_pure_dict(state)),
          bench_loop.STATE: bench_loop.Problem(
              bench_loop.STATE, lambda p, t: model_loss(nnx.merge(graphdef, p), t), state,
              graphdef, model_loss)}


def test_every_loop_of_bench_loop_trains_alike_in_both_containers():
  groups = _tiny_problems()
  data = models.host_tokens(16, 4, 16)
  loops, results = bench_loop.build(groups, data, micro=1)
  for container, problem in groups.items():
    built = loops[container]
    assert set(built) == set(bench_loop.loop_builders(problem)), results[container]
    # A window each: the same 8 rows, one AdamW step on their mean gradient.
    floor = built[bench_loop.FLOOR]
    expected = jax.tree.leaves(floor.parameters(floor.carry))
    start = jax.tree.leaves(problem.params)
    assert not np.allclose(expected[0], start[0])
    for name, loop in built.items():
      assert loop.next_call == loop.calls, name
      found = jax.tree.leaves(loop.parameters(loop.carry))
      assert len(found) == len(expected), name
      for a, b in zip(found, expected):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=f"{container}: {name}")
    bench_loop.time_rounds(built, results[container], data, rounds=1, windows=1)
    entries = results[container]
    for name, entry in entries.items():
      assert entry["samples_per_s"] > 0 and entry["host_ms_per_call"] > 0, (name, entry)
      for door in bench_loop.doors(name):
        assert entry["ratio"][door] > 0, (name, entry)
    buffers = {name: entry["buffers"] for name, entry in entries.items()}
    # The default state passes fewer buffers than a buffer per leaf; the lean micro-step
    # returns no parameters.
    # The default packs where JAX has one device; on the tests' eight it keeps a tree.
  if jax.device_count() == 1:
    assert buffers[bench_loop.HOST]["adding_in"] < buffers[bench_loop.TREE]["adding_in"]
  else:
    assert buffers[bench_loop.HOST]["adding_in"] == buffers[bench_loop.TREE]["adding_in"]
    assert (buffers[bench_loop.LEAN]["adding_out"]
            == buffers[bench_loop.FLOOR]["adding_out"] - len(start))
    assert (buffers[bench_loop.HOST_LEAN]["adding_out"]
            == buffers[bench_loop.HOST]["adding_out"] - len(start))
  tables = bench_loop.tables(results[bench_loop.ARRAYS])
  assert bench_loop.SCAN in tables[bench_loop.INSIDE]
  assert bench_loop.SCAN not in tables[bench_loop.ACROSS]
  assert bench_loop.INSIDE not in bench_loop.tables(results[bench_loop.STATE])


def test_bench_loop_s_memory_section_compiles_every_program():
  memory = bench_loop.memory_section({"layers": 0, "width": 8, "vocab": 16, "context": 4})
  assert set(memory["rows"]) == {bench_loop.FLOOR, bench_loop.HOST, bench_loop.TREE,
                                 bench_loop.DEVICE, bench_loop.MULTISTEPS,
                                 bench_loop.HOST_LEAN}
  for name, entry in memory["rows"].items():
    for label in ("adding", "applying"):
      assert entry[label]["beyond_arguments_bytes"] >= 0, (name, entry)
  assert memory["rows"][bench_loop.FLOOR]["applying"]["to_floor"] == 1
  assert bench_loop.MULTISTEPS in bench_loop.memory_table(memory)
