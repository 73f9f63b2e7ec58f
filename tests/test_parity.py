"""Tests of accum_jax._inside_step._parity: the full-batch check and its diagnoses."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_sharded as sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
from accum_jax._inside_step._diagnosis import _default_rtol
from accum_jax._inside_step._parity import LeafDeviation, ParityReport, check_parity

BATCH_SIZE = 8
NUM_MICROBATCHES = 4


def make_params():
  keys = jax.random.split(jax.random.key(0), 2)
  return {
      "w1": jax.random.normal(keys[0], (3, 16)) / 2,
      "b1": jnp.zeros(16),
      "w2": jax.random.normal(keys[1], (16, 1)) / 4,
  }


def make_batch():
  """Sequences of 5 tokens with 3 features; 0 to 5 of them valid per row."""
  rng = np.random.default_rng(0)
  lengths = np.array([5, 1, 4, 4, 2, 5, 3, 1])  # 6, 8, 7, 4 per microbatch of 2
  return {
      "x": jnp.asarray(rng.standard_normal((BATCH_SIZE, 5, 3)), jnp.float32),
      "y": jnp.asarray(rng.standard_normal((BATCH_SIZE, 5)), jnp.float32),
      "mask": jnp.asarray(np.arange(5) < lengths[:, None], jnp.float32),
  }


def predict(params, x):
  hidden = jnp.tanh(x @ params["w1"] + params["b1"])
  return (hidden @ params["w2"])[..., 0]


def mse_loss(params, batch):
  """A plain mean over all tokens: microbatching reproduces it exactly."""
  return jnp.mean((predict(params, batch["x"]) - batch["y"]) ** 2)


def token_mean_loss(params, batch):
  """The mean over valid tokens: a mean of means unless weighted by their count."""
  err = (predict(params, batch["x"]) - batch["y"]) ** 2
  return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


def dropout_loss(params, batch, key, rate=0.5):
  keep = jax.random.bernoulli(key, 1 - rate, batch["x"].shape)
  x = jnp.where(keep, batch["x"] / (1 - rate), 0.0)
  return jnp.mean((predict(params, x) - batch["y"]) ** 2)


def dropout_key():
  # The rbg generator compiles in half the time of threefry; the draws do not matter.
  return jax.random.key(1, impl="rbg")


def batchnorm_loss(params, batch, stats):
  """Normalises with the batch's statistics and updates their running means."""
  x = batch["x"]
  mean, var = x.mean(axis=(0, 1)), x.var(axis=(0, 1))
  x = (x - mean) / jnp.sqrt(var + 1e-5)
  new_stats = {"mean": 0.9 * stats["mean"] + 0.1 * mean, "var": 0.9 * stats["var"] + 0.1 * var}
  loss = jnp.mean((predict(params, x) - batch["y"]) ** 2)
  return loss, (new_stats, {})


def check(fun, *args, **options):
  return check_parity(fun, *args, num_microbatches=NUM_MICROBATCHES, **options)


def unmasked_batch():
  """The batch without its mask: no mask-like leaf for the diagnosis to try."""
  return {k: v for k, v in make_batch().items() if k != "mask"}


@pytest.fixture(scope="module")
def mean_of_means_report():
  return check(token_mean_loss, make_params(), make_batch())


def test_a_plain_mean_loss_passes():
  report = check(mse_loss, make_params(), make_batch())
  assert isinstance(report, ParityReport)
  assert report.ok, report
  assert report.hints == ()
  assert list(report.per_leaf) == ["loss", "grads['b1']", "grads['w1']", "grads['w2']"]
  assert all(isinstance(leaf, LeafDeviation) and leaf.ok for leaf in report.per_leaf.values())
  assert report.max_rel <= 1e-5
  assert report.max_abs == max(leaf.max_abs for leaf in report.per_leaf.values())
  assert report.num_microbatches == NUM_MICROBATCHES
  assert set(report.rtol.values()) == {1e-5}


def test_a_mean_of_means_over_masked_tokens_fails_and_the_hint_gives_the_weight_fn(
    mean_of_means_report,
):
  report = mean_of_means_report
  assert not report.ok
  assert not report.per_leaf["loss"].ok
  assert report.max_rel > 1e-3  # a real difference, far beyond round-off
  assert len(report.hints) == 1, report
  hint = report.hints[0]
  assert "mean over the valid elements of batch['mask']" in hint
  assert "it sums to 6, 8, 7, 4 in the 4 microbatches" in hint
  assert "Pass weight_fn=lambda batch: batch['mask'].sum() (checked: it restores parity)" in hint


def test_the_mask_counts_follow_a_strided_split():
  # Microbatch i holds rows i and i + 4: lengths 5+2, 1+5, 4+3, 4+1.
  report = check(token_mean_loss, make_params(), make_batch(),
      data_parallel=accum_jax.DataParallel(split="strided"))
  assert not report.ok
  assert "it sums to 7, 6, 7, 5 in the 4 microbatches" in report.hints[0]
  assert "(checked: it restores parity)" in report.hints[0]


def test_the_weight_fn_from_the_hint_restores_parity():
  report = check(token_mean_loss, make_params(), make_batch(),
                 weight_fn=lambda batch: batch["mask"].sum())
  assert report.ok, report
  assert report.hints == ()


def test_the_mask_is_found_among_several_batch_arguments():
  batch = make_batch()

  def loss(params, data, mask):
    return token_mean_loss(params, {**data, "mask": mask})

  data = {"x": batch["x"], "y": batch["y"]}
  report = check(loss, make_params(), data, batch["mask"].astype(bool), batch_argnums=(1, 2))
  assert not report.ok
  assert "Pass weight_fn=lambda *batches: batches[1].sum() (checked" in report.hints[0]


def test_dropout_keys_per_microbatch_are_named_as_the_cause():
  report = check(dropout_loss, make_params(), make_batch(), dropout_key(), rng_argnums=2)
  assert not report.ok
  assert any(
      "rng_argnums=(2,) gives microbatch i the key fold_in(key, i)" in hint
      and "dropout off (deterministic=True" in hint
      for hint in report.hints
  ), report.hints


def test_a_key_missing_from_rng_argnums_is_named_as_the_cause():
  report = check(dropout_loss, make_params(), make_batch(), dropout_key())
  assert not report.ok
  assert any("Argument(s) [2] hold a PRNG key not named in rng_argnums" in hint
             for hint in report.hints), report.hints


def test_dropout_off_passes():
  def loss(params, batch, key):
    return dropout_loss(params, batch, key, rate=0.0)

  report = check(loss, make_params(), make_batch(), dropout_key(), rng_argnums=2)
  assert report.ok, report


def test_batchnorm_statistics_per_microbatch_are_named_as_the_cause():
  stats = {"mean": jnp.zeros(3), "var": jnp.ones(3)}
  report = check(batchnorm_loss, make_params(), make_batch(), stats,
                 state_argnums=2, has_aux=True)
  assert not report.ok
  assert any(
      "each microbatch is normalised with its own batch statistics" in hint
      and "use_running_average=True" in hint
      for hint in report.hints
  ), report.hints


def test_batch_stats_in_the_aux_are_named_as_the_cause():
  def loss(params, batch):
    value, (new_stats, _) = batchnorm_loss(params, batch, {"mean": 0.0, "var": 1.0})
    return value, {"batch_stats": new_stats}

  report = check(loss, make_params(), make_batch(), has_aux=True)
  assert not report.ok
  assert any(hint.startswith("The aux holds batch_stats") for hint in report.hints)


def test_a_non_finite_example_is_named_as_the_cause():
  batch = make_batch()
  batch["x"] = batch["x"].at[3, 0, 0].set(jnp.nan)  # row 3: microbatch 1 of 4
  report = check(mse_loss, make_params(), batch)
  assert not report.ok
  assert report.max_abs == 0  # the skipped step's gradient is NaN where the full batch's is
  assert any("The full-batch loss or gradient is itself not finite" in h for h in report.hints)
  # By default the step is skipped whole; its microbatch is named from info.loss_finite.
  assert any(h.startswith("The loss of microbatch(es) 1 (of 4) is not finite, so the step was"
                          " skipped whole") for h in report.hints), report.hints
  report = check(mse_loss, make_params(), batch, on_nonfinite="skip_microbatch")
  assert any(h.startswith("1 microbatch(es) were skipped") for h in report.hints)


def test_a_non_finite_gradient_under_finite_losses_is_counted():
  def sqrt_loss(params, batch):
    # sqrt(|x w|) at x = 0: finite, but its gradient in w is 0 / 0.
    root = jnp.sqrt(jnp.abs(batch["x"][..., 0] * params["w1"][0, 0]))
    return mse_loss(params, batch) + 1e-3 * jnp.mean(root)

  batch = make_batch()
  batch["x"] = batch["x"].at[3, :, 0].set(0.0)  # row 3: microbatch 1 of 4
  report = check(sqrt_loss, make_params(), batch)
  assert not report.ok
  assert any(h.startswith("Every microbatch's loss is finite, but the gradient of 1"
                          " microbatch(es) is not") for h in report.hints), report.hints


def test_an_unrecognised_cause_gets_the_general_explanation():
  def loss(params, batch):  # normalised by the batch's largest target: couples examples
    return mse_loss(params, batch) / jnp.max(jnp.abs(batch["y"]))

  report = check(loss, make_params(), unmasked_batch())
  assert not report.ok
  assert len(report.hints) == 1
  assert report.hints[0].startswith("Microbatching reproduces the full batch when")


def test_a_tight_tolerance_fails_with_a_round_off_hint():
  report = check(mse_loss, make_params(), unmasked_batch(), rtol=0.0, atol=1e-12)
  assert not report.ok
  assert len(report.hints) == 1
  assert report.hints[0].startswith("The deviation is within round-off (max_rel at most")


def test_repr_shows_each_leaf_and_the_hints(mean_of_means_report):
  lines = repr(mean_of_means_report).splitlines()
  assert lines[0].startswith("ParityReport(ok=False, num_microbatches=4, max_abs=")
  assert re.fullmatch(r"\s+leaf\s+max_abs\s+max_rel\s+rtol", lines[1])
  assert re.fullmatch(r"\s+loss\s+\S+\s+\S+\s+1\.0e-05\s+FAIL", lines[2])
  assert lines[-2] == "hints:"
  assert lines[-1].startswith("  - The loss looks like a mean over the valid elements")


def test_default_rtol_follows_the_dtype():
  assert _default_rtol(jnp.float32) == 1e-5
  assert _default_rtol(jnp.float16) == 4 * 2.0**-10
  assert _default_rtol(jnp.bfloat16) == 4 * 2.0**-7


@pytest.mark.parametrize(
    "tolerances, message",
    [
        ({"rtol": -1e-3}, "rtol=-0.001 must be a finite number >= 0"),
        ({"atol": math.nan}, "atol=nan must be a finite number >= 0"),
        ({"rtol": True}, "rtol=True must be a finite number >= 0"),
    ],
    ids=repr,
)
def test_tolerances_are_checked(tolerances, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    check(mse_loss, make_params(), make_batch(), **tolerances)


def test_a_batch_that_does_not_split_is_refused():
  with pytest.raises(ValueError, match="does not split into num_microbatches=3"):
    check_parity(mse_loss, make_params(), make_batch(), num_microbatches=3)


def test_a_raw_key_missing_from_rng_argnums_is_named_as_the_cause():
  raw_key = jax.random.key_data(jax.random.key(1))  # uint32[2], as jax.random.PRNGKey makes
  report = check(dropout_loss, make_params(), make_batch(), raw_key)
  assert not report.ok
  assert any("Argument(s) [2] hold a PRNG key not named in rng_argnums" in hint
             for hint in report.hints), report.hints


# Under a mesh: the layouts of test_sharded.py (FSDP over 8 devices, HSDP over
# replica 2 x fsdp 4), the parameters' shardings read from the arrays.
@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_sharded_parameters_are_checked_against_the_single_device_full_batch(layout):
  mesh, data_axis, _, params, batch = sharded._place(layout)
  report = check_parity(sharded.loss_fn, params, batch, num_microbatches=2,
      data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis=data_axis))
  assert report.ok, report
  assert report.max_rel <= 1e-5
  assert len(report.per_leaf) == 1 + len(params)


def test_the_step_checked_gathers_the_sharded_parameters_as_it_would():
  # gather_dtype applies to parameters sharded over the data axis only: the
  # deviation is bfloat16's where the mode checked is FSDP's, and 0 where the
  # parameters were taken as replicated.
  mesh, data_axis, _, params, batch = sharded._place("fsdp")
  report = check_parity(sharded.loss_fn, params, batch, num_microbatches=2,
      data_parallel=accum_jax.DataParallel(
          mesh=mesh, data_axis=data_axis, gather_dtype=jnp.bfloat16))
  assert not report.ok
  assert 1e-4 < report.max_rel < 3e-2
  assert len(report.hints) == 1, report.hints
  assert report.hints[0].startswith("gather_dtype=bfloat16: the sharded parameters")


def test_the_mask_diagnosis_counts_each_devices_microbatches():
  mesh, data_axis, _, params, _ = sharded._place("fsdp")
  data = sharded.make_batch()
  mask = np.ones((sharded.BATCH, 1), np.float32)
  mask[[0, 2, 9]] = 0.0  # valid rows per microbatch (2 rows): 1, 1 on device 0; 1, 2 on 2
  batch = jax.device_put({**data, "mask": mask}, NamedSharding(mesh, P(data_axis)))

  def masked_loss(params, batch):
    errors = sharded.loss_fn_rows(params, batch)
    return jnp.sum(batch["mask"] * errors) / jnp.sum(batch["mask"] * jnp.ones_like(errors))

  report = check_parity(masked_loss, params, batch, num_microbatches=2,
      data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis=data_axis))
  assert not report.ok
  hint = report.hints[0]
  assert "it sums to 1, 1, 2, 2, 1, 2, 2, 2, ... in the 16 microbatches" in hint
  assert "(2 on each of 8 devices)" in hint
  assert "(checked: it restores parity)" in hint
