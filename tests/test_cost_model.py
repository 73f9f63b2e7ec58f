"""The cost model of bench/sharded_model.py against what XLA compiles, on 8 CPU devices.

For three MLP sizes and each mode (data parallel, FSDP, gather once, HSDP, FSDP x
tensor) one step of ``value_and_grad(..., mesh=...)`` is compiled, not run, and
held to the model's formulas (the model lives in bench/ for the documentation's
projection; the tests import it from there, so it cannot rot):

- argument bytes: exactly the parameters' shard plus this device's rows of the batch;
- output bytes: exactly the gradient, plus the loss (4 bytes) and XLA's tuple of
  one 8-byte pointer per output (XLA's bookkeeping: in test_xla_facts.py, on these
  programs);
- the while loop's carry, exactly: the arrays it updates (rank >= 2, floating) are
  the accumulator, the rank-2 arrays it passes on unchanged are the gathered
  parameters (data parallel: the parameters);
- bytes sent (``accum_jax.testing.Collective.bytes_sent``) before the loop, per
  microbatch and after it, exactly, over the collectives of more than 64 bytes:
  the model leaves out scalars (loss, weights, counts, the agreed skip flags), and
  where XLA combines them into the gradient's all-reduce the step sends a few bytes
  more (at most 64 per such collective); a tensor axis's all-reduces carry
  activations, which the model leaves out too;
- temp bytes, which also hold activations, the split batch and XLA's scratch:
  at least the model's gathered parameters and accumulator, at most those plus one
  microbatch's gradient in flight plus a stated slack for the rest: twice this
  device's rows of the batch, four bytes per activation of a microbatch, twice,
  and 4 KiB of scalars and flags.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
from accum_jax.testing import collectives

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
  if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # the bench modules import _common as a sibling
  spec = importlib.util.spec_from_file_location(f"accum_jax_bench_{name}", BENCH / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


model = _load("sharded_model")
bench = _load("bench_sharded")

BATCH = 64
# (width, layers, microbatches): three sizes, every mode at each.
SIZES = [(32, 2, 2), (64, 3, 4), (128, 2, 2)]
# mode -> (mesh shape, axis names, data axes, spec of weight i)
MODES = {
    "data parallel": ((8,), ("data",), ("data",), lambda i: P()),
    "fsdp": ((8,), ("data",), ("data",), lambda i: P("data", None)),
    "gather once": ((8,), ("data",), ("data",), lambda i: P("data", None)),
    "hsdp": ((2, 4), ("replica", "fsdp"), ("replica", "fsdp"), lambda i: P("fsdp", None)),
    "fsdp x tensor": ((4, 2), ("data", "model"), ("data",),
                      lambda i: P("data", "model") if i % 2 == 0 else P("model", "data")),
}
SCALAR_BYTES = 64
SMALL_BUFFERS = 4096  # the loop's counters, flags, loss and weights


def loss_fn(params, batch):
  h = batch["x"]
  for i in range(len(params)):
    h = h @ params[f"w{i}"]
    if i < len(params) - 1:
      h = jnp.tanh(h)
  return jnp.mean((h - batch["y"]) ** 2)


@functools.cache
def _compiled(mode: str, width: int, layers: int, k: int):
  """The compiled step, its mesh, its data-axis devices and the model's cost."""
  shape, names, axes, spec = MODES[mode]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
  rng = np.random.default_rng(0)
  specs = {f"w{i}": spec(i) for i in range(layers)}
  params = jax.device_put(
      {k_: rng.standard_normal((width, width)).astype(np.float32) for k_ in specs},
      {k_: NamedSharding(mesh, s) for k_, s in specs.items()},
  )
  batch = jax.device_put(
      {"x": rng.standard_normal((BATCH, width)).astype(np.float32),
       "y": rng.standard_normal((BATCH, width)).astype(np.float32)},
      NamedSharding(mesh, P(axes)),
  )
  vg = accum_jax.value_and_grad(
      loss_fn, k,
          data_parallel=accum_jax.DataParallel(
              mesh=mesh, data_axis=axes if len(axes) > 1 else axes[0], param_sharding=specs,
              gather="once" if mode == "gather once" else "per_microbatch"))
  compiled = jax.jit(vg).lower(params, batch).compile()
  sizes = dict(zip(names, shape))
  devices = int(np.prod([sizes[a] for a in axes]))
  cost = model.cost(mode, model.Layout(
      params=layers * width * width, data=devices, replicas=sizes.get("replica", 1),
      tensor=sizes.get("model", 1), microbatches=k,
  ))
  return compiled, mesh, devices, cost


CASES = [
    pytest.param(mode, *size, id=f"{mode}, {size[0]}x{size[0]} x {size[1]} layers, N={size[2]}")
    for size in SIZES for mode in MODES
]


@pytest.mark.parametrize(("mode", "width", "layers", "k"), CASES)
def test_arguments_and_the_loop_carry_are_the_model_s_bytes_exactly(mode, width, layers, k):
  compiled, _, devices, cost = _compiled(mode, width, layers, k)
  stats = compiled.memory_analysis()
  local_batch = 2 * (BATCH // devices) * width * 4
  assert stats.argument_size_in_bytes == cost.param + local_batch
  carry = bench.loop_carry(compiled.as_text())
  assert carry.updated_bytes == cost.accumulator, carry
  gathered = sum(
      4 * int(np.prod([int(d) for d in s[4:-1].split(",")]))
      for s in carry.passed_shapes if s.count(",") == 1
  )
  assert gathered == (cost.gathered or cost.param), carry


@pytest.mark.parametrize(("mode", "width", "layers", "k"), CASES)
def test_bytes_sent_before_per_microbatch_and_after_the_loop_are_the_model_s(
    mode, width, layers, k
):
  compiled, mesh, _, cost = _compiled(mode, width, layers, k)
  found = [
      c for c in collectives(bench.explicit_groups(compiled.as_text()), mesh)
      if not c.in_branch and not (c.axes == ("model",) and c.kind == "all-reduce")
  ]
  big = [c for c in found if c.result_bytes > SCALAR_BYTES]
  before = sum(c.bytes_sent for c in big if not c.in_loop and c.kind == "all-gather")
  per_microbatch = sum(c.bytes_sent for c in big if c.in_loop)
  after = [c for c in big if not c.in_loop and c.kind != "all-gather"]
  assert (before, per_microbatch) == (cost.sent_before, cost.sent_per_microbatch)
  sent_after = sum(c.bytes_sent for c in after)
  assert 0 <= sent_after - cost.sent_after <= SCALAR_BYTES * len(after), after


@pytest.mark.xla_fact
@pytest.mark.parametrize(("mode", "width", "layers", "k"), CASES)
def test_temporaries_hold_the_model_s_resident_bytes_and_little_more(mode, width, layers, k):
  compiled, _, devices, cost = _compiled(mode, width, layers, k)
  temp = compiled.memory_analysis().temp_size_in_bytes
  resident = cost.gathered + cost.accumulator
  local_batch = 2 * (BATCH // devices) * width * 4
  activations = (BATCH // devices // k) * width * layers * 4
  slack = 2 * local_batch + 2 * activations + SMALL_BUFFERS
  # The default on_nonfinite="propagate" zeroes every gradient leaf on one check that
  # reads every accumulator, so no output is written before all are read; XLA:CPU
  # then keeps one leaf's accumulator shard apart from its output, in the
  # temporaries for the whole loop (fsdp x tensor, 128x128: 8 KiB, 253,096 bytes
  # under "microbatch", 240,016 under False, 270,672 under "step"; the same
  # whether the check sums x - x or takes min and max, inside shard_map or after).
  slack += cost.accumulator // layers
  assert resident <= temp <= resident + cost.in_flight + slack, (temp, resident, cost)


def test_the_formulas_scale_as_the_documentation_says():
  layout = model.Layout(params=2**20, data=8, microbatches=8)
  dp, fsdp, once = (model.cost(m, layout) for m in ("data parallel", "fsdp", "gather once"))
  assert dp.sent_per_step == 2 * 7 * 2**22 // 8 and dp.accumulator == 2**22
  assert fsdp.accumulator == 2**22 // 8 and fsdp.gathered == 2**22
  # A reduce-scatter per microbatch moves K/2 times the bytes of one all-reduce.
  assert fsdp.sent_per_step - fsdp.sent_before == 8 * dp.sent_per_step // 2
  assert once.sent_per_step == fsdp.sent_before + dp.sent_per_step // 2
  hsdp = model.cost("hsdp", layout._replace(replicas=2))
  assert hsdp.accumulator == 2**22 // 4
  kept = model.cost("fsdp x tensor", layout._replace(tensor=2, tensor_split_kept=True))
  assert kept.sent_per_step == fsdp.sent_per_step // 2
  assert model.hiding_tokens(4, 8, 1e9, flops=6e9) == pytest.approx(7 / 8 * 4)


def test_the_documentation_shows_the_model_s_projection_and_thresholds():
  page = (Path(__file__).resolve().parents[1] / "docs" / "multi_device.md").read_text()
  assert model.projection() in page
  for bandwidth in model.ASSUMED_BANDWIDTH.values():
    for reduce_bytes in (2, 4):
      assert f"{model.hiding_tokens(reduce_bytes, 64, bandwidth):,.0f} tokens" in page


# Defects found while measuring; strict: each flips to a failure once fixed, so that
# its marker (and the workaround in bench/bench_sharded.py) goes.


def test_param_sharding_as_a_list_shards_a_list_of_parameters():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  params = jax.device_put([np.ones((16, 4), np.float32)] * 2, NamedSharding(mesh, P("data")))
  batch = jax.device_put(np.ones((16, 16), np.float32), NamedSharding(mesh, P("data")))

  def loss(params, x):
    return jnp.mean((x @ params[0]) * (x @ params[1]))

  vg = accum_jax.value_and_grad(loss, 2,
      data_parallel=accum_jax.DataParallel(
          mesh=mesh, data_axis="data", param_sharding=[P("data", None)] * 2))
  _, grads = jax.jit(vg)(params, batch)
  assert all(not g.sharding.is_fully_replicated for g in grads)


@pytest.mark.xfail(strict=True, reason="an all-gather over the data axes inside shard_map"
                   " first gathers its operand over the automatic tensor axis (JAX 0.10)")
def test_fsdp_x_tensor_gathers_only_the_tensor_shard_over_the_data_axis():
  compiled, mesh, _, _ = _compiled("fsdp x tensor", 32, 2, 2)
  found = collectives(compiled.as_text(), mesh)
  data_gathers = [c for c in found if c.kind == "all-gather" and c.axes == ("data",)]
  assert data_gathers and all(c.result_bytes == 32 * 32 * 4 // 2 for c in data_gathers)


@pytest.mark.xfail(strict=True, reason="accum_jax.testing.collectives does not read"
                   " replica_groups=mesh[...], device_ids=(...) {...}")
def test_collectives_reads_replica_groups_given_with_device_ids():
  mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  hlo = (
      "ENTRY %main (p: f32[128,128]) -> f32[128,128] {\n"
      "  %p = f32[128,128]{1,0} parameter(0)\n"
      "  ROOT %all-reduce.1 = f32[128,128]{1,0} all-reduce(%p), channel_id=1,"
      " replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0))"
      " {'axis_1'}, use_global_device_ids=true, to_apply=%add\n"
      "}\n"
  )
  assert collectives(bench.explicit_groups(hlo), mesh)[0].axes == ("fsdp",)  # the workaround
  (found,) = collectives(hlo, mesh)
  assert (found.group_size, found.axes) == (4, ("fsdp",))

