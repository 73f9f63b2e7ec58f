"""One `mesh=` call for every way parameters are sharded, on 8 CPU devices.

FSDP over a mesh of 8, HSDP over (replica 2, fsdp 4), FSDP x tensor over
(data 4, model 2) and explicit mesh axes: value and gradient equal the
single-device full batch, each gradient comes back sharded as its parameter,
and the compiled step holds the collectives each mode promises. The reference
is computed on one device without accum_jax.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal, tolerance_for, tree_allclose
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
from accum_jax.testing import collectives

BATCH = 32
NUM_MICROBATCHES = 2


def make_params() -> dict[str, np.ndarray]:
  return {
      "w1": normal(0, (16, 32), 0.25),
      "b1": normal(1, (32,), 0.1),
      "w2": normal(2, (32, 8), 0.25),
      "b2": normal(3, (8,), 0.1),
  }


def make_batch(seed: int = 10) -> dict[str, np.ndarray]:
  return {"x": normal(seed, (BATCH, 16)), "y": normal(seed + 1, (BATCH, 8))}


def loss_fn(params: Any, batch: Any) -> jax.Array:
  hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((hidden @ params["w2"] + params["b2"] - batch["y"]) ** 2)


# Each layout: mesh shape and axes, the data axes, and each parameter's spec.
LAYOUTS = {
    "fsdp": ((8,), ("data",), "data", {
        "w1": P(None, "data"), "b1": P("data"), "w2": P("data", None), "b2": P("data"),
    }),
    "hsdp": ((2, 4), ("replica", "fsdp"), ("replica", "fsdp"), {
        "w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None), "b2": P(),
    }),
    "fsdp x tensor": ((4, 2), ("data", "model"), "data", {
        "w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data"), "b2": P(),
    }),
}


def _mesh(shape, names, explicit=False):
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def _place(layout: str, explicit: bool = False):
  shape, names, data_axis, specs = LAYOUTS[layout]
  mesh = _mesh(shape, names, explicit)
  params = jax.device_put(make_params(), {k: NamedSharding(mesh, s) for k, s in specs.items()})
  axes = data_axis if isinstance(data_axis, tuple) else (data_axis,)
  batch = jax.device_put(make_batch(), NamedSharding(mesh, P(axes)))
  return mesh, data_axis, specs, params, batch


@functools.cache
def _reference():
  return jax.jit(jax.value_and_grad(loss_fn))(make_params(), make_batch())


def _assert_sharded_like(grads: Any, params: Any) -> None:
  for (path, g), p in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(params)):
    where = jax.tree_util.keystr(path)
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), f"{where}: {g.sharding} vs {p.sharding}"
    assert g.addressable_shards[0].data.shape == p.addressable_shards[0].data.shape, where


def _per_microbatch(found):
  """The collectives every microbatch runs (in the loop, not in a rarely taken branch)."""
  return sorted((c.kind, c.axes) for c in found if c.in_loop and not c.in_branch)


# Each layout under the default, and FSDP with on_nonfinite="skip_microbatch", whose
# loop agrees on each microbatch's skip over the data axes.
@pytest.mark.parametrize("layout, on_nonfinite", [
    *((layout, "propagate") for layout in LAYOUTS), ("fsdp", "skip_microbatch"),
])
def test_every_layout_equals_the_full_batch_with_gradients_sharded_as_the_parameters(
    layout, on_nonfinite
):
  mesh, data_axis, specs, params, batch = _place(layout)
  vg = accum_jax.value_and_grad(
      loss_fn, NUM_MICROBATCHES,
          data_parallel=accum_jax.DataParallel(
              mesh=mesh, data_axis=data_axis, param_sharding=specs), on_nonfinite=on_nonfinite,
  )
  compiled = jax.jit(vg).lower(params, batch).compile()
  value, grads = compiled(params, batch)
  tree_allclose((value, grads), _reference())
  _assert_sharded_like(grads, params)
  found = collectives(compiled.as_text(), mesh)
  axes = data_axis if isinstance(data_axis, tuple) else (data_axis,)
  scattered = sorted(
      ("reduce-scatter", over) for s in specs.values()
      if (over := tuple(a for a in axes if a in jax.tree.leaves(tuple(s))))
  )
  # Per microbatch: one reduce-scatter per sharded leaf, over its data axes; with
  # "skip_microbatch", the skip decision agreed over the data axes in one small
  # all-reduce (the default checks the sums once, after the loop).
  agreed = [("all-reduce", axes)] if on_nonfinite == "skip_microbatch" else []
  per_microbatch = [c for c in _per_microbatch(found) if c[1] is None or set(c[1]) & set(axes)]
  assert per_microbatch == sorted([*scattered, *agreed]), per_microbatch
  # Nothing is all-reduced over a data axis inside the loop but the few flags
  # (a tensor axis reduces activations, as it does without accum_jax).
  assert not [
      c for c in found
      if c.in_loop and c.kind == "all-reduce" and set(c.axes) & set(axes) and c.result_bytes > 16
  ]


def test_hsdp_reduce_scatters_over_fsdp_per_microbatch_and_all_reduces_over_replicas_once():
  mesh, data_axis, specs, params, batch = _place("hsdp")
  vg = accum_jax.value_and_grad(
      loss_fn, NUM_MICROBATCHES,
          data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis=data_axis, param_sharding=specs)
  )
  found = collectives(jax.jit(vg).lower(params, batch).compile().as_text(), mesh)
  after = [c for c in found if not c.in_loop and c.kind == "all-reduce"]
  # The sharded leaves' shards are summed over the replica axis after the loop;
  # the replicated bias over both data axes.
  assert any(c.axes == ("replica",) for c in after), after
  assert all(c.axes != ("fsdp",) for c in found if c.kind == "reduce-scatter" and not c.in_loop)


def test_gather_once_reduce_scatters_once_after_the_loop():
  mesh, data_axis, specs, params, batch = _place("fsdp")
  vg = accum_jax.value_and_grad(
      loss_fn, NUM_MICROBATCHES,
          data_parallel=accum_jax.DataParallel(
              mesh=mesh, data_axis=data_axis, param_sharding=specs, gather="once"))
  compiled = jax.jit(vg).lower(params, batch).compile()
  value, grads = compiled(params, batch)
  tree_allclose((value, grads), _reference())
  _assert_sharded_like(grads, params)
  found = collectives(compiled.as_text(), mesh)
  assert not [c for c in found if c.in_loop], [c for c in found if c.in_loop]
  scatters = [c for c in found if c.kind == "reduce-scatter"]
  assert len(scatters) == 4 and all(c.axes == ("data",) for c in scatters), scatters
  assert not [c for c in found if c.kind == "all-reduce" and c.result_bytes > 64]


def test_explicit_axes_are_read_from_the_parameters_types():
  mesh, data_axis, specs, params, batch = _place("hsdp", explicit=True)
  vg = accum_jax.value_and_grad(loss_fn, NUM_MICROBATCHES,
      data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis=data_axis))
  with jax.set_mesh(mesh):
    compiled = jax.jit(vg).lower(params, batch).compile()
    value, grads = compiled(params, batch)
  tree_allclose((value, grads), _reference())
  _assert_sharded_like(grads, params)
  per_microbatch = _per_microbatch(collectives(compiled.as_text(), mesh))
  assert ("reduce-scatter", ("fsdp",)) in per_microbatch, per_microbatch


def test_automatic_axes_under_jit_need_param_sharding_and_an_eager_call_reads_the_arrays():
  mesh, data_axis, specs, params, batch = _place("fsdp")
  vg = accum_jax.value_and_grad(loss_fn, NUM_MICROBATCHES,
      data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis=data_axis))
  # Under jax.jit the traced function cannot see automatic shardings: replicated,
  # and a warning says so and what to pass.
  with pytest.warns(accum_jax.UnknownShardingWarning, match=re.escape("param_sharding=")):
    _, grads = jax.jit(vg)(params, batch)
  assert all(g.sharding.is_fully_replicated for g in jax.tree.leaves(grads))
  value, grads = vg(params, batch)  # eagerly, the arrays say how they are sharded
  tree_allclose((value, grads), _reference())
  _assert_sharded_like(grads, params)


def _transported_types(lowered) -> list[str]:
  """The operand types of the program's gathers and reduce-scatters, as asked for."""
  return re.findall(r'"stablehlo.(?:all_gather|reduce_scatter)".*?: \(tensor<([^>]*)>\)',
                    lowered.as_text(), flags=re.DOTALL)


def test_gather_and_reduce_dtypes_are_what_crosses_devices():
  mesh, data_axis, specs, params, batch = _place("fsdp")
  options = dict(
      data_parallel=accum_jax.DataParallel(
          mesh=mesh, data_axis=data_axis, param_sharding=specs, gather_dtype=jnp.bfloat16,
          reduce_dtype=jnp.bfloat16))
  lowered = jax.jit(accum_jax.value_and_grad(loss_fn, NUM_MICROBATCHES, **options)).lower(
      params, batch)
  value, grads = lowered.compile()(params, batch)
  tree_allclose((value, grads), _reference(), rtol=2e-2, atol=2e-2)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  # The program asks for bfloat16 gathers and reduce-scatters (XLA on CPU then
  # runs them in float32; accelerators run them as asked): 8 in the loop's body.
  operand_types = _transported_types(lowered)
  assert len(operand_types) == 8, operand_types
  assert all(t.endswith("bf16") for t in operand_types), operand_types
  # With "microbatch", 8 more in the recheck's body (the same pass, compiled again).
  recheck = accum_jax.value_and_grad(loss_fn, NUM_MICROBATCHES, on_nonfinite="skip_microbatch",
                                     **options)
  operand_types = _transported_types(jax.jit(recheck).lower(params, batch))
  assert len(operand_types) == 2 * 8, operand_types
  assert all(t.endswith("bf16") for t in operand_types), operand_types


def _non_finite_batch(where: str):
  """The batch's rows with one bad row, on device 1 under FSDP over 8, and the loss:
  its loss (``"loss"``) or only its gradient (``"gradient"``) is not finite there."""
  x, y = make_batch()["x"].copy(), make_batch()["y"]
  bad = 6  # device 1 (rows 4..7), its microbatch 1 (rows 6, 7)
  if where == "loss":
    x[bad] = np.nan

    def fun(params, batch):
      return loss_fn(params, batch)
  else:
    x[bad, 0] = 0.0

    def fun(params, batch):
      # sqrt(|x b|) at x = 0: finite, but its gradient in b is 0 / 0.
      root = jnp.sqrt(jnp.abs(batch["x"][:, 0] * params["b2"][0]))
      return loss_fn(params, batch) + 1e-3 * jnp.mean(root)
  return x, y, fun


def _non_finite_step(where, **options):
  """An FSDP step over ``_non_finite_batch(where)``: its batch, loss, outputs and params."""
  mesh, data_axis, specs, params, _ = _place("fsdp")
  x, y, fun = _non_finite_batch(where)
  batch = jax.device_put({"x": x, "y": y}, NamedSharding(mesh, P("data")))
  vg = accum_jax.value_and_grad(
      fun, NUM_MICROBATCHES,
          data_parallel=accum_jax.DataParallel(
              mesh=mesh, data_axis=data_axis, param_sharding=specs), return_info=True, **options,
  )
  return x, y, fun, jax.jit(vg)(params, batch), params


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_non_finite_microbatch_is_skipped_on_every_device_and_counted(where):
  x, y, fun, (value, grads, info), _ = _non_finite_step(where, on_nonfinite="skip_microbatch")
  # Microbatch 1 of every device is dropped: the other microbatches' mean.
  kept = np.concatenate([np.arange(d * 4, d * 4 + 2) for d in range(8)])
  expected = jax.value_and_grad(fun)(make_params(), {"x": x[kept], "y": y[kept]})
  assert int(info.num_skipped) == 8
  tree_allclose((value, grads), expected)


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_by_default_a_non_finite_microbatch_skips_the_step_on_every_device(where):
  x, y, fun, (value, grads, info), params = _non_finite_step(where)
  # The gradient is NaN, sharded as the parameters; the loss is the batch's, as it was.
  assert bool(info.step_not_finite)
  assert int(info.num_skipped) == 8 * NUM_MICROBATCHES
  tree_allclose(grads, jax.tree.map(lambda p: np.full_like(p, np.nan), make_params()))
  _assert_sharded_like(grads, params)
  full_value = jax.value_and_grad(fun)(make_params(), {"x": x, "y": y})[0]
  np.testing.assert_array_equal(np.isnan(value), where == "loss")
  tree_allclose(value, full_value)
  # Each device's losses, in device order: device 1's microbatch 1 is the bad one.
  expected_finite = np.ones(8 * NUM_MICROBATCHES, bool)
  expected_finite[1 * NUM_MICROBATCHES + 1] = where != "loss"
  np.testing.assert_array_equal(info.loss_finite, expected_finite)


def test_zero_weight_padding_never_drops_other_devices_rows():
  mesh, data_axis, specs, params, batch = _place("fsdp")
  mask = np.ones((BATCH,), np.float32)
  mask[6:8] = 0.0  # device 1's microbatch 1 is padding, whose masked mean is 0 / 0

  def masked_loss(params, batch):
    errors = jnp.mean((loss_fn_rows(params, batch)), axis=-1)
    return jnp.sum(batch["mask"] * errors) / jnp.sum(batch["mask"])

  data = {**make_batch(), "mask": mask}
  batch = jax.device_put(data, NamedSharding(mesh, P("data")))
  vg = accum_jax.value_and_grad(
      masked_loss, NUM_MICROBATCHES,
          data_parallel=accum_jax.DataParallel(
              mesh=mesh, data_axis=data_axis, param_sharding=specs),
      weight_fn=lambda batch: jnp.sum(batch["mask"]), return_info=True,
  )
  value, grads, info = jax.jit(vg)(params, batch)
  assert int(info.num_skipped) == 0
  tree_allclose((value, grads), jax.value_and_grad(masked_loss)(make_params(), data))


def loss_fn_rows(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return (hidden @ params["w2"] + params["b2"] - batch["y"]) ** 2


def test_narrow_accumulators_with_a_reduce_scatter_per_microbatch_are_refused():
  mesh, data_axis, specs, params, batch = _place("fsdp")
  low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  vg = accum_jax.value_and_grad(
      loss_fn, NUM_MICROBATCHES,
          data_parallel=accum_jax.DataParallel(
              mesh=mesh, data_axis=data_axis, param_sharding=specs), accumulator_dtype=None,
  )
  with pytest.raises(ValueError, match="gather='once'"):
    jax.jit(vg).lower(low, batch)


@pytest.mark.parametrize("sharded", [True, False], ids=["fsdp gathered once", "replicated"])
def test_the_devices_bfloat16_running_means_are_weighed_not_added(sharded):
  # accumulator_dtype=None keeps bfloat16 gradients' running mean, in bfloat16: after
  # the loop the devices' means combine weighed by their weights (a psum of them
  # would be 8 times the gradient), and each device keeps its parameters' shards.
  mesh, data_axis, specs, params, batch = _place("fsdp")
  if not sharded:
    specs = {k: P() for k in specs}
    params = jax.device_put(make_params(), NamedSharding(mesh, P()))
  low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  vg = accum_jax.value_and_grad(
      loss_fn, NUM_MICROBATCHES, accumulator_dtype=None,
      data_parallel=accum_jax.DataParallel(
          mesh=mesh, data_axis=data_axis, param_sharding=specs, gather="once"),
  )
  value, grads = jax.jit(vg)(low, batch)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  full = jax.jit(jax.value_and_grad(loss_fn))(
      jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params()), make_batch())
  tree_allclose((value, grads), full, rtol=8 * tolerance_for(jnp.bfloat16)["rtol"], atol=1e-3)
  _assert_sharded_like(grads, params)


def test_gradient_noise_aux_and_state_do_not_depend_on_how_parameters_are_sharded():
  mesh, data_axis, specs, params, batch = _place("fsdp")

  def fun(params, state, batch):
    loss = loss_fn(params, batch)
    return loss, (state + jnp.mean(batch["x"]), {"loss": loss, "rows": batch["y"][:, 0]})

  def run(param_sharding):
    vg = accum_jax.value_and_grad(
        fun, NUM_MICROBATCHES, has_aux=True, batch_argnums=2, state_argnums=1,
        return_info=True, gradient_noise=True, aux_reduction={"loss": "mean", "rows": "concat"},
        data_parallel=accum_jax.DataParallel(mesh, data_axis, param_sharding=param_sharding),
    )
    return jax.jit(vg)(params, jnp.float32(0.0), batch)

  (value, aux), grads, info = run(specs)
  # Taken as replicated: the data-parallel path.
  (value_r, aux_r), grads_r, info_r = run(P())
  tree_allclose((value, aux, grads, info), (value_r, aux_r, grads_r, info_r))
  assert bool(jnp.isfinite(info.gradient_noise.trace_cov))


def test_parameters_named_out_of_order_keep_their_own_shardings():
  mesh, data_axis, specs, params, batch = _place("fsdp")
  first = {k: params[k] for k in ("w1", "b1")}
  second = {k: params[k] for k in ("w2", "b2")}

  def fun(batch, second, first):
    return loss_fn({**first, **second}, batch)

  vg = accum_jax.value_and_grad(
      fun, NUM_MICROBATCHES, argnums=(2, 1), batch_argnums=0,
          data_parallel=accum_jax.DataParallel(
              mesh=mesh, data_axis=data_axis,
              param_sharding=({k: specs[k] for k in first}, {k: specs[k] for k in second})))
  value, (g_first, g_second) = jax.jit(vg)(batch, second, first)
  expected_value, expected = _reference()
  tree_allclose((value, {**g_first, **g_second}), (expected_value, expected))
  _assert_sharded_like({**g_first, **g_second}, params)
