"""Leaves that do not add up: reduction= and per-leaf aux_reduction=.

A hand-made statistic leaf (a custom_vjp whose "gradient" is a new value, as
Flax's FP8 amax histories are) beside an ordinary weight, a token-weighted loss,
a microbatch whose loss is NaN, two of zero weight at the end, and one of large
activations in the middle. With ``on_nonfinite="skip_microbatch"`` the NaN one is
skipped and each kind is checked against references
computed without accum_jax: the full batch's gradient for "mean" and "sum", the
kept microbatches' statistics (each from ``jax.grad`` on its own rows) for
"max" and "last". The same microbatches run on one device (16 of them), data
parallel on 8 devices (2 each) and with the weight FSDP-sharded over 8 devices,
where devices skip together (a gradient reduce-scattered per microbatch holds
every device's share): there the odd microbatches are all skipped with the
NaN one, and the last device keeps none. Across calls, ``accumulate`` takes the
same specs, one microbatch's ``jax.grad`` per call. By default the NaN one
skips the step whole, statistics included.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import normal, tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax

BATCH, ROWS = 64, 4  # 16 microbatches of 4 rows
SKIPPED = 3  # its loss is NaN
LOUD = 4  # the largest statistics
EMPTY = (14, 15)  # zero weight: the whole of the last device's rows under the mesh
KEPT = tuple(i for i in range(BATCH // ROWS) if i != SKIPPED and i not in EMPTY)
KEPT_TOGETHER = tuple(i for i in KEPT if i % 2 == 0)  # devices skipping together


@jax.custom_vjp
def observed(h, stat):
  del stat
  return h


def _observed_fwd(h, stat):
  del stat
  return h, h


def _observed_bwd(h, g):
  # The "gradient" of `stat` is a new statistic of the activations, whatever the
  # loss's scale: negative, so that an empty maximum of 0 would show.
  return g, jnp.max(h, axis=0) - 100.0


observed.defvjp(_observed_fwd, _observed_bwd)


def make_params() -> dict[str, np.ndarray]:
  return {"w": normal(0, (8, 8), 0.3), "stat": np.zeros(8, np.float32)}


def make_batch() -> dict[str, np.ndarray]:
  x, y = normal(1, (BATCH, 8)), normal(2, (BATCH, 8))
  mask = (normal(3, (BATCH, 8)) > -0.5).astype(np.float32)  # uneven tokens per microbatch
  rows = lambda i: slice(i * ROWS, (i + 1) * ROWS)  # noqa: E731
  x[rows(SKIPPED)] *= 30.0
  y[rows(SKIPPED)] = np.nan
  x[rows(LOUD)] *= 5.0
  for i in EMPTY:
    mask[rows(i)] = 0.0
  return {"x": x, "y": y, "mask": mask}


def loss_fn(params, batch):
  h = observed(batch["x"] @ params["w"], params["stat"])
  tokens = jnp.sum(batch["mask"])
  loss = jnp.sum((h - batch["y"]) ** 2 * batch["mask"]) / tokens
  aux = {
      "loss": loss,  # a token-weighted loss: "mean"
      "balance": jnp.var(jnp.mean(h, axis=0)),  # one per microbatch, added: "sum"
      "logits": h,  # per example: "concat"
      "peak": jnp.max(h),  # "max"
      "seen": batch["x"][0, 0],  # "last"
      "rows": jnp.sum(h, axis=1),  # per example too: "concat", the default refuses it
  }
  return loss, aux


AUX_REDUCTION = {"loss": "mean", "balance": "sum", "logits": "concat", "peak": "max",
                 "seen": "last", "rows": "concat"}


def weight_fn(batch):
  return jnp.sum(batch["mask"])


# Each spec, and the kind it gives "w" and "stat".
SPECS = {
    "pytree": ({"w": "sum", "stat": "max"}, "sum", "max"),
    "callable": (lambda path, leaf: "last" if path[0].key == "stat" else None, "mean", "last"),
}


def _microbatch(batch, i):
  return jax.tree.map(lambda x: x[i * ROWS:(i + 1) * ROWS], batch)


_ONE = jax.jit(jax.grad(loss_fn, has_aux=True))
_FULL = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


@functools.cache
def references(kept: tuple[int, ...] = KEPT) -> dict[str, Any]:
  """Without accum_jax: the full batch of the ``kept`` microbatches (and the
  zero-weight ones, which add nothing), and each kept microbatch's own gradient
  and aux."""
  params, batch = make_params(), make_batch()
  per = {i: _ONE(params, _microbatch(batch, i)) for i in kept}
  rows = np.concatenate([np.arange(i * ROWS, (i + 1) * ROWS) for i in sorted(kept + EMPTY)])
  (loss, _), mean = _FULL(params, jax.tree.map(lambda x: x[rows], batch))
  tokens = sum(float(weight_fn(_microbatch(batch, i))) for i in kept)
  each = [jax.jit(loss_fn)(params, _microbatch(batch, i))[1] for i in range(16)]
  logits = jnp.concatenate([aux["logits"] for aux in each])
  last = kept[-1]
  return {
      "loss": loss,
      "loss sum": loss * tokens,
      "mean": mean["w"],
      "sum": mean["w"] * tokens,
      "max": jnp.max(jnp.stack([per[i][0]["stat"] for i in kept]), axis=0),
      "last": per[last][0]["stat"],
      "aux": {
          "loss": loss,
          "balance": sum(per[i][1]["balance"] for i in kept),
          "logits": logits,
          "peak": max(per[i][1]["peak"] for i in kept),
          "seen": per[last][1]["seen"],
          "rows": jnp.concatenate([aux["rows"] for aux in each]),
      },
  }


def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


# Where the batch runs: the options of value_and_grad, how the weight is placed,
# which microbatches are kept and how many skips are counted.
LAYOUTS = {
    "one device": (dict(num_microbatches=16), None, KEPT, 1),
    "data parallel": (
        dict(num_microbatches=2, data_parallel=accum_jax.DataParallel(
            data_axis="data", param_sharding=P())),
        P(), KEPT, 1),
    "fsdp": (
        dict(num_microbatches=2, data_parallel=accum_jax.DataParallel(
            data_axis="data", param_sharding={"w": P("data", None), "stat": P()})),
        P("data", None), KEPT_TOGETHER, 8),
}


@functools.cache
def run(layout: str, spec: str):
  options, w_spec, _, _ = LAYOUTS[layout]
  params, batch = make_params(), make_batch()
  if w_spec is not None:
    mesh = _mesh()
    options = dict(options, data_parallel=dataclasses.replace(options["data_parallel"], mesh=mesh))
    params = {"w": jax.device_put(params["w"], NamedSharding(mesh, w_spec)),
              "stat": jax.device_put(params["stat"], NamedSharding(mesh, P()))}
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  vg = accum_jax.value_and_grad(
      loss_fn, has_aux=True, weight_fn=weight_fn, return_info=True,
      reduction=SPECS[spec][0], aux_reduction=AUX_REDUCTION, **options,
      on_nonfinite="skip_microbatch",
  )
  return jax.jit(vg)(params, batch)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_kind_equals_the_plain_computation_skipped_microbatches_left_out(layout, spec):
  (loss, _), grads, info = run(layout, spec)
  *_, kept, num_skipped = LAYOUTS[layout]
  ref = references(kept)
  _, w_kind, stat_kind = SPECS[spec]
  assert int(info.num_skipped) == num_skipped
  # Where every gradient leaf but the statistic sums, the value is the weighted sum too.
  tree_allclose(loss, ref["loss sum" if w_kind == "sum" else "loss"])
  tree_allclose(grads["w"], ref[w_kind])
  # A statistic is a value some microbatch returned: exactly that value.
  np.testing.assert_array_equal(grads["stat"], ref[stat_kind])


def test_by_default_the_nan_microbatch_skips_the_step_statistics_included():
  vg = accum_jax.value_and_grad(
      loss_fn, 16, has_aux=True, weight_fn=weight_fn, return_info=True,
      reduction=SPECS["pytree"][0], aux_reduction=AUX_REDUCTION,
  )
  params = dict(make_params(), stat=np.arange(8, dtype=np.float32))
  (loss, aux), grads, info = jax.jit(vg)(params, make_batch())
  assert bool(info.step_not_finite) and int(info.num_skipped) == 16
  # Only the NaN microbatch's loss is not finite; zero-weight padding counts as finite.
  np.testing.assert_array_equal(info.loss_finite, np.arange(16) != SKIPPED)
  # Every gradient leaf is NaN, "mean" and "sum" alike; a statistic ("max") is its
  # parameter as passed in, as the threaded state is; the loss and aux as they were.
  np.testing.assert_array_equal(grads["w"], np.full((8, 8), np.nan, np.float32))
  np.testing.assert_array_equal(grads["stat"], params["stat"])
  assert np.isnan(loss) and np.isnan(aux["loss"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_aux_reduced_per_leaf_as_the_pytree_says(layout):
  (_, aux), _, _ = run(layout, "pytree")
  tree_allclose(aux, references(LAYOUTS[layout][2])["aux"])


def test_a_per_example_leaf_left_at_the_default_is_refused_naming_concat():
  # Averaged, the microbatches' rows would give a result that changes with their number.
  vg = accum_jax.value_and_grad(
      loss_fn, 16, has_aux=True, weight_fn=weight_fn, reduction=SPECS["pytree"][0],
      aux_reduction=dict(AUX_REDUCTION, rows=None), on_nonfinite="skip_microbatch")
  with pytest.raises(ValueError, match="^" + re.escape(
      "The aux leaf ['rows'] has shape (4,) on a microbatch of 4 rows but (64,) on the whole"
      " batch: its shape depends on the microbatches") + ".*aux_reduction='concat'"):
    jax.jit(vg)(make_params(), make_batch())


def test_a_string_keeps_the_fp8_collection_at_max_and_the_collection_named_overrides_it():
  # The statistic leaf placed where Flax puts FP8 statistics.
  def fp8_loss(variables, batch):
    return loss_fn({"w": variables["params"]["w"],
                    "stat": variables["_overwrite_with_gradient"]["stat"]}, batch)

  params = make_params()
  variables = {"params": {"w": params["w"]}, "_overwrite_with_gradient": {"stat": params["stat"]}}
  ref = references()
  batch = make_batch()
  for spec, stat_kind in (("sum", "max"), (None, "max"),
                          ({"params": "sum", "_overwrite_with_gradient": "last"}, "last")):
    vg = accum_jax.value_and_grad(fp8_loss, 16, has_aux=True, weight_fn=weight_fn,
                                  reduction=spec, aux_reduction=AUX_REDUCTION,
                                  on_nonfinite="skip_microbatch")
    _, grads = jax.jit(vg)(variables, batch)
    np.testing.assert_array_equal(grads["_overwrite_with_gradient"]["stat"], ref[stat_kind])
    tree_allclose(grads["params"]["w"], ref["mean" if spec is None else "sum"])


def _as_fp8_collection(tree):
  """The statistic where Flax keeps FP8 statistics."""
  return {"params": {"w": tree["w"]}, "_overwrite_with_gradient": {"stat": tree["stat"]}}


# Across calls: each spec, how the gradient is laid out, and the kinds of "w" and "stat".
CALL_SPECS = {
    "pytree": (SPECS["pytree"][0], lambda tree: tree, "sum", "max"),
    "callable": (SPECS["callable"][0], lambda tree: tree, "mean", "last"),
    "fp8 default": ("mean", _as_fp8_collection, "mean", "max"),
}


@pytest.mark.parametrize("spec", CALL_SPECS)
def test_accumulate_combines_each_leaf_as_its_reduction_says_over_calls(spec):
  reduction, layout, w_kind, stat_kind = CALL_SPECS[spec]
  params, batch = make_params(), make_batch()
  # 16 calls, one skipped (not counted): the window closes on the last.
  opt = accum_jax.accumulate(optax.sgd(1.0), every_k=15, reduction=reduction,
                             on_nonfinite="skip_microbatch")
  update = jax.jit(opt.update)
  state = opt.init(layout(params))
  for i in range(16):
    microbatch = _microbatch(batch, i)
    grads, _ = _ONE(params, microbatch)
    updates, state = update(layout(grads), state, layout(params), weight=weight_fn(microbatch))
  ref = references()
  assert bool(accum_jax.has_updated(state)) and int(state.num_skipped) == 1
  stat, w = jax.tree.leaves(updates)  # in this order in either layout
  tree_allclose(-w, ref[w_kind])
  np.testing.assert_array_equal(-stat, ref[stat_kind])


def test_a_statistic_is_kept_in_its_own_dtype_beside_a_float32_sum():
  opt = accum_jax.accumulate(optax.sgd(-1.0), every_k=2, reduction={"peak": "max", "g": "mean"})
  params = {"peak": jnp.zeros(2, jnp.bfloat16), "g": jnp.zeros(2, jnp.bfloat16)}
  state = opt.init(params)
  total = accum_jax._across_calls._layout.tree_of(state.window_total)  # either layout
  assert total["peak"].dtype == jnp.bfloat16  # no float32 copy of it
  assert total["g"].dtype == jnp.float32
  update = jax.jit(opt.update)
  for peak in ([-3.015625, 1.0], [-5.0, 0.5]):  # exact in bfloat16
    grads = {"peak": jnp.array(peak, jnp.bfloat16), "g": jnp.ones(2, jnp.bfloat16)}
    updates, state = update(grads, state, params)
  assert accum_jax._across_calls._layout.tree_of(state.window_total)["peak"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(updates["peak"], np.float32), [-3.015625, 1.0])
