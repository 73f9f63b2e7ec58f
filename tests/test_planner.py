"""Tests of accum_jax._inside_step._planner: choosing num_microbatches from compiled memory."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import normal, tree_allclose
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
from accum_jax._inside_step import _planner
from accum_jax._inside_step._planner import MemoryBudgetError, MicrobatchPlan, plan_microbatches

BATCH_SIZE = 256
HUGE_BUDGET = 2**40


def mlp_loss(params, batch):
  """A wide, shallow MLP: its activations outweigh its parameters."""
  hidden = jnp.tanh(batch["x"] @ params["w1"])
  hidden = jnp.tanh(hidden @ params["w2"])
  return jnp.mean((hidden @ params["w3"] - batch["y"]) ** 2)


def mlp_args(batch_size=BATCH_SIZE):
  """Shapes only: planning compiles, it never needs data."""

  def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)

  params = {"w1": f32(4, 128), "w2": f32(128, 128), "w3": f32(128, 1)}
  batch = {"x": f32(batch_size, 4), "y": f32(batch_size, 1)}
  return params, batch


@pytest.fixture(scope="module")
def estimates():
  """The compiled estimate of each of a few num_microbatches, one compile each."""
  return {
      n: plan_microbatches(
          mlp_loss, *mlp_args(), memory_budget_bytes=HUGE_BUDGET, candidates=[n]
      ).estimates[n]
      for n in (1, 2, 4, 16)
  }


def count_compiles(monkeypatch, estimate=None):
  """Replaces the compile-and-measure step; returns the list of n it was asked for."""
  asked = []

  def fake(fun, num_microbatches, args, options):
    asked.append(num_microbatches)
    return estimate(num_microbatches)

  monkeypatch.setattr(_planner, "_estimate_bytes", fake)
  return asked


class FakeDevice:
  platform = "gpu"

  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats

  def __str__(self):
    return "gpu:0"


def test_estimates_decrease_as_microbatches_grow(estimates):
  assert estimates[1] > estimates[2] > estimates[4] > estimates[16] > 0


def test_picks_the_smallest_num_microbatches_that_fits_a_budget_between_two_estimates(
    estimates,
):
  budget = (estimates[2] + estimates[4]) // 2
  plan = plan_microbatches(mlp_loss, *mlp_args(), memory_budget_bytes=budget)
  assert isinstance(plan, MicrobatchPlan)
  assert plan.num_microbatches == 4
  assert plan.memory_budget_bytes == budget
  assert plan.estimates[4] == estimates[4] <= budget
  assert all(e > budget for n, e in plan.estimates.items() if n < 4)
  assert list(plan.estimates) == sorted(plan.estimates)


def test_plans_from_arrays_as_from_shapes(estimates):
  params, batch = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), mlp_args())
  plan = plan_microbatches(
      mlp_loss, params, batch, memory_budget_bytes=HUGE_BUDGET, candidates=[4]
  )
  assert plan.estimates == {4: estimates[4]}


def test_compiles_a_logarithmic_number_of_candidates(monkeypatch):
  asked = count_compiles(monkeypatch, lambda n: 1_000_000 // n)
  args = mlp_args(batch_size=1024)  # 11 divisors: 1, 2, ..., 1024
  for budget in (10, 1_000, 3_000, 50_000, 499_999, 500_000, 2_000_000):
    asked.clear()
    if budget < 1_000_000 // 1024:
      with pytest.raises(MemoryBudgetError):
        plan_microbatches(mlp_loss, *args, memory_budget_bytes=budget)
      assert len(asked) <= math.ceil(math.log2(11 + 1))
      continue
    plan = plan_microbatches(mlp_loss, *args, memory_budget_bytes=budget)
    smallest = min(n for n in (2**i for i in range(11)) if 1_000_000 // n <= budget)
    assert plan.num_microbatches == smallest
    assert len(asked) == len(set(asked)) == len(plan.estimates)
    assert len(asked) <= math.ceil(math.log2(11 + 1))


def test_default_budget_is_the_free_device_memory(monkeypatch):
  count_compiles(monkeypatch, lambda n: 10_000 // n)
  stats = {"bytes_limit": 1_000, "bytes_in_use": 200}
  monkeypatch.setattr(jax, "devices", lambda *a: [FakeDevice(stats)])
  plan = plan_microbatches(mlp_loss, *mlp_args())
  assert plan.memory_budget_bytes == 800
  assert plan.num_microbatches == 16  # 10_000 // 16 = 625 <= 800 < 10_000 // 8


@pytest.mark.parametrize(
    "stats", [None, {"bytes_in_use": 0}], ids=["no memory stats", "no bytes_limit"]
)
def test_a_backend_without_memory_stats_needs_an_explicit_budget(monkeypatch, stats):
  asked = count_compiles(monkeypatch, lambda n: 1)
  monkeypatch.setattr(jax, "devices", lambda *a: [FakeDevice(stats)])
  with pytest.raises(ValueError, match=re.escape("memory_budget_bytes=None, but device gpu:0")):
    plan_microbatches(mlp_loss, *mlp_args())
  with pytest.raises(ValueError, match=re.escape("Pass the budget in bytes")):
    plan_microbatches(mlp_loss, *mlp_args())
  assert asked == []


def test_a_full_device_needs_an_explicit_budget(monkeypatch):
  count_compiles(monkeypatch, lambda n: 1)
  stats = {"bytes_limit": 1_000, "bytes_in_use": 1_000}
  monkeypatch.setattr(jax, "devices", lambda *a: [FakeDevice(stats)])
  with pytest.raises(ValueError, match="has no free memory"):
    plan_microbatches(mlp_loss, *mlp_args())


def test_cpu_reports_no_free_memory():
  if jax.devices()[0].platform != "cpu":
    pytest.skip("the tests run on CPU")
  with pytest.raises(ValueError, match=re.escape("(cpu) reports no memory limit")):
    plan_microbatches(mlp_loss, *mlp_args())


def test_nothing_fits_names_the_smallest_estimate_and_what_to_try():
  with pytest.raises(MemoryBudgetError) as info:
    plan_microbatches(mlp_loss, *mlp_args(), memory_budget_bytes=1, candidates=[4, 8])
  message = str(info.value)
  assert isinstance(info.value, ValueError)
  assert info.value.memory_budget_bytes == 1
  assert list(info.value.estimates) == [8]  # bisection: 8 does not fit, so 4 cannot
  assert "fits memory_budget_bytes=1 (1 bytes)" in message
  assert "for num_microbatches=8" in message
  assert "The candidates stop at 8; up to 256 microbatches divide the batch" in message
  for remedy in ("smaller model", "jax.checkpoint", "sharding the parameters", "smaller batch"):
    assert remedy in message


def test_repr_is_a_table_in_mib(monkeypatch):
  count_compiles(monkeypatch, lambda n: 2**22 // n)
  plan = plan_microbatches(mlp_loss, *mlp_args(), memory_budget_bytes=2**20)
  text = repr(plan)
  assert text.splitlines()[0] == (
      "MicrobatchPlan(num_microbatches=4, memory_budget_bytes=1048576 (1.00 MiB))"
  )
  assert "estimate (MiB)" in text
  assert re.search(r"\s4\s+1\.000\s+fits  <- chosen", text), text
  assert re.search(r"\s2\s+2\.000\s+over budget", text), text


@pytest.mark.parametrize(
    "budget", [0, -5, 0.5, math.nan, math.inf, True, "8GiB"], ids=repr
)
def test_a_budget_that_is_not_a_positive_number_is_refused(budget):
  with pytest.raises(ValueError, match=re.escape(f"memory_budget_bytes={budget!r} must be")):
    plan_microbatches(mlp_loss, *mlp_args(), memory_budget_bytes=budget)


@pytest.mark.parametrize(
    "candidates, message",
    [
        ([3, 4], "[3] do not divide the batch size 256"),
        ([512], "[512] do not divide the batch size 256"),
        ([0, 2], "[0] are not ints >= 1"),
        ([True], "[True] are not ints >= 1"),
        ([2.0], "[2.0] are not ints >= 1"),
        ([], "candidates=[] leaves nothing to choose from"),
        (4, "candidates=4 must be an iterable of ints"),
    ],
    ids=repr,
)
def test_candidates_must_divide_the_batch(monkeypatch, candidates, message):
  asked = count_compiles(monkeypatch, lambda n: 1)
  with pytest.raises(ValueError, match=re.escape(message)):
    plan_microbatches(mlp_loss, *mlp_args(), memory_budget_bytes=HUGE_BUDGET,
                      candidates=candidates)
  assert asked == []


def test_candidates_are_deduplicated_and_sorted(monkeypatch):
  count_compiles(monkeypatch, lambda n: 100 // n)
  plan = plan_microbatches(mlp_loss, *mlp_args(), memory_budget_bytes=30,
                           candidates=[8, 2, 8, 4])
  assert plan.num_microbatches == 4
  assert set(plan.estimates) <= {2, 4, 8}


def test_num_microbatches_is_not_an_option():
  with pytest.raises(ValueError, match="num_microbatches is what plan_microbatches chooses"):
    plan_microbatches(mlp_loss, *mlp_args(), memory_budget_bytes=HUGE_BUDGET,
                      num_microbatches=4)


def test_value_and_grad_options_are_checked_before_compiling(monkeypatch):
  asked = count_compiles(monkeypatch, lambda n: 1)
  with pytest.raises(ValueError, match="aux_reduction='median' is not one of"):
    plan_microbatches(mlp_loss, *mlp_args(), memory_budget_bytes=HUGE_BUDGET,
                      aux_reduction="median")
  with pytest.raises(ValueError, match=re.escape("batch_argnums=(2,) names argument 2")):
    plan_microbatches(mlp_loss, *mlp_args(), memory_budget_bytes=HUGE_BUDGET,
                      batch_argnums=2)
  assert asked == []


def test_batch_argnums_choose_the_batch_that_is_split(monkeypatch):
  count_compiles(monkeypatch, lambda n: 100 // n)
  params, batch = mlp_args(batch_size=12)

  def swapped(batch, params):
    return mlp_loss(params, batch)

  plan = plan_microbatches(swapped, batch, params, memory_budget_bytes=20,
                           argnums=1, batch_argnums=0)
  assert plan.num_microbatches == 6  # divisors of 12: 1, 2, 3, 4, 6, 12


# Under a mesh: an MLP whose layers (a list) are sharded over the 8 devices of
# the data axis (FSDP) and whose head is replicated. The batch is sharded too,
# so that each device's argument holds its own rows.
MESH_BATCH, MESH_WIDTH = 2048, 128
MESH_SPECS = {"layers": [P(None, "data"), P("data", None), P("data", None)], "head": P()}


def deep_loss(params, batch):
  hidden = batch["x"]
  for w in params["layers"]:
    hidden = jnp.tanh(hidden @ w)
  return jnp.mean((hidden @ params["head"] - batch["y"]) ** 2)


@functools.cache
def data_mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def sharded_args(concrete=False):
  """The arguments with their shardings: shapes only, or arrays placed so."""
  mesh = data_mesh()
  width = MESH_WIDTH
  shapes = {"layers": [(16, width), (width, width), (width, width)], "head": (width, 1)}
  params = jax.tree.map(
      lambda shape, spec: (shape, NamedSharding(mesh, spec)), shapes, MESH_SPECS,
      is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x),
  )
  rows = NamedSharding(mesh, P("data"))
  batch = {"x": ((MESH_BATCH, 16), rows), "y": ((MESH_BATCH, 1), rows)}

  def make(shape_and_sharding, seed=[0]):  # noqa: B006 (a counter, for distinct values)
    shape, sharding = shape_and_sharding
    if not concrete:
      return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
    seed[0] += 1
    return jax.device_put(normal(seed[0], shape, 0.3), sharding)

  is_pair = lambda x: isinstance(x, tuple) and isinstance(x[1], NamedSharding)  # noqa: E731
  return jax.tree.map(make, (params, batch), is_leaf=is_pair)


MESH = accum_jax.DataParallel(data_mesh(), "data")
MESH_OPTIONS = {"data_parallel": MESH}


@pytest.fixture(scope="module")
def mode_estimates():
  """Each (gather, n)'s bytes from its own compile, with param_sharding given."""
  found = {}
  for gather in ("per_microbatch", "once"):
    for n in (1, 2, 16):
      vg = accum_jax.value_and_grad(deep_loss, n, data_parallel=dataclasses.replace(
          MESH, param_sharding=MESH_SPECS, gather=gather))
      stats = jax.jit(vg).lower(*sharded_args()).compile().memory_analysis()
      found[gather, n] = (
          stats.argument_size_in_bytes + stats.output_size_in_bytes
          + stats.temp_size_in_bytes - stats.alias_size_in_bytes
      )
  return found


@pytest.fixture
def compiled_once(monkeypatch, mode_estimates):
  """The planner's compiles replaced by the fixture's (the same programs), recorded."""
  asked = []

  def known(fun, num_microbatches, args, options):
    asked.append((_planner.data_parallel(options).gather, num_microbatches))
    return mode_estimates[_planner.data_parallel(options).gather, num_microbatches]

  monkeypatch.setattr(_planner, "_estimate_bytes", known)
  return asked


def test_sharded_parameters_give_two_modes_each_estimated_as_its_compiled_step(mode_estimates):
  # Parameters hold more than activations at 16 microbatches: the full-size sum
  # of gather="once" costs more than the sharded accumulator, at every n > 1 (of
  # one microbatch the sum is its gradient, which both hold).
  assert mode_estimates["once", 16] > mode_estimates["per_microbatch", 16]
  assert mode_estimates["once", 2] > mode_estimates["per_microbatch", 2]
  assert mode_estimates["per_microbatch", 1] > mode_estimates["per_microbatch", 16]
  budget = (mode_estimates["per_microbatch", 16] + mode_estimates["once", 16]) // 2
  # The shardings are read from the ShapeDtypeStructs: no param_sharding given.
  plan = plan_microbatches(
      deep_loss, *sharded_args(), memory_budget_bytes=budget, candidates=[16], **MESH_OPTIONS
  )
  assert (plan.gather, plan.num_microbatches) == ("per_microbatch", 16)
  assert plan.gather_estimates == {
      ("per_microbatch", 16): mode_estimates["per_microbatch", 16],
      ("once", 16): mode_estimates["once", 16],
  }
  assert plan.estimates == {16: mode_estimates["per_microbatch", 16]}


def test_a_budget_only_per_microbatch_fits_picks_it(mode_estimates, compiled_once):
  budget = (mode_estimates["per_microbatch", 16] + mode_estimates["once", 16]) // 2
  plan = plan_microbatches(
      deep_loss, *sharded_args(), memory_budget_bytes=budget, candidates=[1, 16], **MESH_OPTIONS
  )
  assert (plan.gather, plan.num_microbatches) == ("per_microbatch", 16)
  assert all(e > budget for (g, _), e in plan.gather_estimates.items() if g == "once")


def test_a_roomy_budget_picks_one_microbatch_gathered_once(mode_estimates, compiled_once):
  plan = plan_microbatches(
      deep_loss, *sharded_args(), memory_budget_bytes=HUGE_BUDGET, candidates=[1, 16],
      **MESH_OPTIONS,
  )
  assert (plan.gather, plan.num_microbatches) == ("once", 1)
  assert plan.estimates == {1: mode_estimates["once", 1]}
  # "once" is bisected only up to per_microbatch's choice, here 1.
  assert ("once", 16) not in compiled_once


def test_fewer_microbatches_win_over_gathering_once(mode_estimates, compiled_once):
  budget = (mode_estimates["per_microbatch", 2] + mode_estimates["once", 2]) // 2
  assert budget > mode_estimates["once", 16]  # gather="once" fits, with 16 microbatches
  plan = plan_microbatches(
      deep_loss, *sharded_args(), memory_budget_bytes=budget, candidates=[2, 16], **MESH_OPTIONS
  )
  assert (plan.gather, plan.num_microbatches) == ("per_microbatch", 2)


def test_the_chosen_plan_runs_and_equals_the_full_batch(mode_estimates, compiled_once):
  budget = (mode_estimates["per_microbatch", 16] + mode_estimates["once", 16]) // 2
  params, batch = sharded_args(concrete=True)
  plan = plan_microbatches(
      deep_loss, params, batch, memory_budget_bytes=budget, candidates=[1, 16], **MESH_OPTIONS
  )
  assert (plan.gather, plan.num_microbatches) == ("per_microbatch", 16)
  vg = accum_jax.value_and_grad(deep_loss, plan.num_microbatches, data_parallel=dataclasses.replace(
      MESH, param_sharding=MESH_SPECS, gather=plan.gather))
  value, grads = jax.jit(vg)(params, batch)
  on_one_device = jax.device_put((params, batch), jax.devices()[0])
  tree_allclose((value, grads), jax.jit(jax.value_and_grad(deep_loss))(*on_one_device))
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim)


def gather_of(asked_options):
  return [_planner.data_parallel(options).gather for options in asked_options]


def record_modes(monkeypatch, estimate):
  """A fake compile by (gather, n); returns the (gather, n) asked for, in order."""
  asked = []

  def fake(fun, num_microbatches, args, options):
    asked.append((_planner.data_parallel(options).gather, num_microbatches))
    return estimate(_planner.data_parallel(options).gather, num_microbatches)

  monkeypatch.setattr(_planner, "_estimate_bytes", fake)
  return asked


def lean_and_fast(gather, n):
  """Falls with n; gathering once costs 20 more at every n."""
  return 100 // n + (20 if gather == "once" else 0)


@pytest.mark.parametrize(
    "budget, chosen",
    [
        (40, ("per_microbatch", 4)), (45, ("once", 4)), (200, ("once", 1)),
        (21, ("per_microbatch", 8)),
    ],
)
def test_the_rule_is_fewest_microbatches_then_gather_once(monkeypatch, budget, chosen):
  asked = record_modes(monkeypatch, lean_and_fast)
  plan = plan_microbatches(deep_loss, *sharded_args(), memory_budget_bytes=budget,
                           candidates=[1, 2, 4, 8, 16], **MESH_OPTIONS)
  assert (plan.gather, plan.num_microbatches) == chosen
  n = chosen[1]
  assert all(m <= n for g, m in asked if g == "once"), asked
  assert plan.gather_estimates == {k: lean_and_fast(*k) for k in asked}


def test_replicated_parameters_have_one_mode(monkeypatch):
  asked = record_modes(monkeypatch, lean_and_fast)
  plan = plan_microbatches(deep_loss, *sharded_args(), memory_budget_bytes=40,
                           data_parallel=dataclasses.replace(MESH, param_sharding=P()))
  assert plan.gather is None and plan.gather_estimates == {}
  assert {g for g, _ in asked} == {None}
  assert plan.num_microbatches == 4 and plan.estimates[4] == 25


def test_a_given_gather_is_the_only_mode_compiled(monkeypatch):
  asked = record_modes(monkeypatch, lean_and_fast)
  plan = plan_microbatches(deep_loss, *sharded_args(), memory_budget_bytes=40,
                           data_parallel=dataclasses.replace(MESH, gather="once"))
  assert {g for g, _ in asked} == {"once"}
  assert (plan.gather, plan.num_microbatches) == ("once", 8)  # 100 // 8 + 20 = 32


def test_repr_with_two_modes_names_the_gather_chosen(monkeypatch):
  record_modes(monkeypatch, lambda gather, n: 2**20 * lean_and_fast(gather, n) // 10)
  plan = plan_microbatches(deep_loss, *sharded_args(), memory_budget_bytes=45 * 2**20 // 10,
                           candidates=[2, 4], **MESH_OPTIONS)
  lines = repr(plan).splitlines()
  assert lines[0] == (
      "MicrobatchPlan(num_microbatches=4, gather='once',"
      " memory_budget_bytes=4718592 (4.50 MiB))"
  )
  assert re.fullmatch(r"\s+gather\s+num_microbatches\s+estimate \(MiB\)", lines[1])
  assert re.fullmatch(r"\s+per_microbatch\s+4\s+2\.500\s+fits", lines[3]), lines
  assert re.fullmatch(r"\s+once\s+2\s+7\.000\s+over budget", lines[4]), lines
  assert re.fullmatch(r"\s+once\s+4\s+4\.500\s+fits  <- chosen", lines[5]), lines


def test_nothing_fits_in_either_mode_lists_both(monkeypatch):
  record_modes(monkeypatch, lean_and_fast)
  with pytest.raises(MemoryBudgetError) as info:
    plan_microbatches(deep_loss, *sharded_args(), memory_budget_bytes=5, candidates=[8, 16],
                      **MESH_OPTIONS)
  message = str(info.value)
  assert "per device (8 devices) with either gather mode" in message
  assert "for num_microbatches=16, gather='per_microbatch'" in message
  assert "('per_microbatch', 16): 6 bytes" in message and "('once', 16): 26 bytes" in message
  assert info.value.estimates == {16: 6}
  assert info.value.gather_estimates[("once", 16)] == 26
