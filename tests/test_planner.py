"""Tests of accum_jax._planner: choosing num_microbatches from compiled memory."""

import math
import re

import jax
import jax.numpy as jnp
import pytest

from accum_jax import _planner
from accum_jax._planner import MemoryBudgetError, MicrobatchPlan, plan_microbatches

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


def test_with_pad_batch_any_number_of_microbatches_is_a_candidate(monkeypatch):
  asked = count_compiles(monkeypatch, lambda n: 100 // n)
  plan = plan_microbatches(mlp_loss, *mlp_args(batch_size=10), memory_budget_bytes=30,
                           pad_batch=True, weight_fn=lambda batch: batch["y"].size,
                           candidates=[3, 4])
  assert plan.num_microbatches == 4 and asked  # 4 does not divide 10: the batch is padded
  plan = plan_microbatches(mlp_loss, *mlp_args(batch_size=10), memory_budget_bytes=30,
                           pad_batch=True, weight_fn=lambda batch: batch["y"].size)
  assert plan.num_microbatches == 4  # the first n with 100 // n <= 30, among 1..10
