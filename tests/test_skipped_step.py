"""A step that ``on_nonfinite="propagate"`` skips moves no optimizer, on every documented path.

The inside-step door never hands the optimizer a fake zero gradient: a step
whose summed loss or gradient is not finite comes back with a non-finite
gradient, as the full batch's would, with the threaded state passed back
unchanged and ``info`` saying which microbatches failed. Skipping the update is
then the optimizer's business, as everywhere in Optax: one line,
``optax.apply_if_finite(inner, 5)``, or ``accumulate``'s own window skip.

Each path runs one finite step (so that Adam's moments are not zero) and then a
step with a NaN in one microbatch. With the line, the parameters and the
optimizer's state are those of the finite step; without it, the step is as loud
as the full batch's. Models are tiny and each step is compiled once.
"""

from __future__ import annotations

import functools

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from helpers import normal, tree_allclose
from linen_model import Net as LinenNet
from linen_model import TrainState as LinenState
from linen_model import loss_fn as linen_loss

import accum_jax
import accum_jax.equinox
import accum_jax.flax
import accum_jax.testing

N = 4
B = 8
BAD_ROW = 2  # in microbatch 1 of 4


def _data(seed: int, width: int = 3, bad: bool = False) -> tuple[np.ndarray, np.ndarray]:
  x, y = normal(seed, (B, width)), normal(seed + 1, (B,))
  if bad:
    x[BAD_ROW, 0] = np.nan
  return x, y


def _gate(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """The one line a user adds."""
  return optax.apply_if_finite(inner, 5)


def _assert_skipped(info) -> None:
  assert bool(info.step_not_finite)
  assert int(info.num_skipped) == N and float(info.total_weight) == 0.0
  np.testing.assert_array_equal(info.loss_finite, np.arange(N) != BAD_ROW // (B // N))


def _assert_loud(grads, full_grads) -> None:
  """Non-finite where the full batch's gradient is, never a silent zero."""
  for g, full in zip(jax.tree.leaves(grads), jax.tree.leaves(full_grads), strict=True):
    assert not np.isfinite(full).all()
    np.testing.assert_array_equal(np.isfinite(g), np.isfinite(full))


def mse(w, x, y):
  return jnp.mean((x @ w - y) ** 2)


# Plain Optax: value_and_grad, then update and apply_updates.


@functools.cache
def _optax_step(opt: optax.GradientTransformation):
  vg = accum_jax.value_and_grad(mse, N, batch_argnums=(1, 2), return_info=True)

  @jax.jit
  def step(w, opt_state, x, y):
    _, grads, info = vg(w, x, y)
    updates, opt_state = opt.update(grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state, grads, info

  return step


GATED_ADAM = _gate(optax.adam(0.1))
ADAM = optax.adam(0.1)


def test_plain_optax_with_apply_if_finite_leaves_params_and_adam_state_on_a_nan_step():
  step, w = _optax_step(GATED_ADAM), jnp.asarray(normal(9, (3,)))
  w, state, _, _ = step(w, GATED_ADAM.init(w), *_data(0))
  new_w, new_state, _, info = step(w, state, *_data(1, bad=True))
  _assert_skipped(info)
  np.testing.assert_array_equal(new_w, w)
  tree_allclose(new_state.inner_state, state.inner_state, rtol=0, atol=0)
  assert int(new_state.notfinite_count) == 1 and int(new_state.total_notfinite) == 1


def test_plain_optax_without_the_gate_gets_the_full_batch_s_non_finite_gradient():
  step, w = _optax_step(ADAM), jnp.asarray(normal(9, (3,)))
  w, state, _, _ = step(w, ADAM.init(w), *_data(0))
  x, y = _data(1, bad=True)
  new_w, _, grads, info = step(w, state, x, y)
  _assert_skipped(info)
  _assert_loud(grads, jax.grad(mse)(w, x, y))
  assert not np.isfinite(new_w).any()  # as loud as the full batch's step


# A Linen TrainState with BatchNorm statistics, through accum_jax.flax.apply_gradients.


@jax.jit
def _linen_step(state, x, y, key):
  vg = accum_jax.value_and_grad(linen_loss, N, batch_argnums=2, state_argnums=1, rng_argnums=3,
                                has_aux=True, return_info=True)
  (_, (batch_stats, _)), grads, info = vg(state.params, state.batch_stats, {"x": x, "y": y}, key)
  state = accum_jax.flax.apply_gradients(state, grads=grads).replace(batch_stats=batch_stats)
  return state, grads, info


def _linen_state(tx):
  variables = LinenNet().init(jax.random.key(0), jnp.ones((1, 5)), train=False)
  return LinenState.create(apply_fn=LinenNet().apply, params=variables["params"],
                           batch_stats=variables["batch_stats"], tx=tx)


def _labels(seed: int, bad: bool = False):
  x, _ = _data(seed, width=5, bad=bad)
  return x, np.arange(B, dtype=np.int32) % 3


@pytest.mark.parametrize("gated", [True, False], ids=["apply_if_finite", "no gate"])
def test_a_train_state_keeps_params_stats_and_optimizer_state_on_a_nan_step(gated):
  state = _linen_state(_gate(optax.adam(1e-2)) if gated else optax.adam(1e-2))
  state, _, _ = _linen_step(state, *_labels(0), jax.random.key(1))
  new, grads, info = _linen_step(state, *_labels(1, bad=True), jax.random.key(2))
  _assert_skipped(info)
  # The threaded state is passed back as it came in, gate or none.
  tree_allclose(new.batch_stats, state.batch_stats, rtol=0, atol=0)
  if gated:
    tree_allclose(new.params, state.params, rtol=0, atol=0)
    tree_allclose(new.opt_state.inner_state, state.opt_state.inner_state, rtol=0, atol=0)
    assert int(new.opt_state.notfinite_count) == 1
  else:
    assert not any(np.isfinite(g).all() for g in jax.tree.leaves(grads))


class _Fp8Dense(linen.Module):
  @linen.compact
  def __call__(self, x):
    fp8 = functools.partial(linen.Fp8DirectDotGeneralOp, amax_history_length=4)
    return linen.Dense(2, dot_general_cls=fp8)(x)


_FP8 = _Fp8Dense()
_FP8_VG = accum_jax.value_and_grad(lambda v, x: jnp.mean(_FP8.apply(v, x) ** 2), N,
                                   return_info=True)


@jax.jit
def _fp8_step(state, x):
  loss, grads, info = _FP8_VG(state.params, x)
  return accum_jax.flax.apply_gradients(state, grads=grads), loss, info


def test_a_train_state_with_fp8_statistics_keeps_them_on_a_nan_step_and_trains_on():
  """TrainState writes the FP8 statistics' "gradient" (their new value) over them,
  past the optimizer: a skipped step gives them back as they were, not NaN (a NaN
  scale would make every later step NaN) nor zero."""
  state = TrainState.create(apply_fn=None, params=_FP8.init(jax.random.key(0), jnp.ones((1, 3))),
                            tx=_gate(optax.adam(0.1)))
  x, _ = _data(0)
  bad, _ = _data(0, bad=True)
  state, _, _ = _fp8_step(state, x)
  new, _, info = _fp8_step(state, bad)
  _assert_skipped(info)
  tree_allclose(new.params, state.params, rtol=0, atol=0)
  tree_allclose(new.opt_state.inner_state, state.opt_state.inner_state, rtol=0, atol=0)
  for _ in range(2):
    new, loss, info = _fp8_step(new, x)
    assert np.isfinite(loss) and not bool(info.step_not_finite)


# Flax NNX: nnx_value_and_grad, then nnx.Optimizer.update, with no Python `if`
# and no nnx.cond: the gate is in the optimizer.


class _NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.BatchNorm(3, momentum=0.9, rngs=rngs)
    self.linear = nnx.Linear(3, 1, rngs=rngs)

  def __call__(self, x):
    return self.linear(self.norm(x))[:, 0]


def _nnx_loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


_NNX_VG = accum_jax.flax.nnx_value_and_grad(_nnx_loss, N, return_info=True)


@nnx.jit
def _nnx_step(model, optimizer, x, y):
  _, grads, info = _NNX_VG(model, x, y)
  optimizer.update(model, grads)
  return grads, info


def _nnx_values(node, *filters):
  return jax.tree.map(np.asarray, nnx.state(node, *filters))


@pytest.mark.parametrize("gated", [True, False], ids=["apply_if_finite", "no gate"])
def test_an_nnx_optimizer_keeps_the_model_and_its_state_on_a_nan_step(gated):
  model = _NnxNet(nnx.Rngs(0))
  tx = _gate(optax.adamw(1e-2)) if gated else optax.adamw(1e-2)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  _nnx_step(model, optimizer, *_data(0))
  params, stats = _nnx_values(model, nnx.Param), _nnx_values(model, nnx.BatchStat)
  opt_state = _nnx_values(optimizer, nnx.OptState)
  x, y = _data(1, bad=True)
  grads, info = _nnx_step(model, optimizer, x, y)
  _assert_skipped(info)
  tree_allclose(_nnx_values(model, nnx.BatchStat), stats, rtol=0, atol=0)
  if gated:
    tree_allclose(_nnx_values(model, nnx.Param), params, rtol=0, atol=0)
    new_state = _nnx_values(optimizer, nnx.OptState)
    tree_allclose(new_state["opt_state"]["inner_state"], opt_state["opt_state"]["inner_state"],
                  rtol=0, atol=0)
    assert int(new_state["opt_state"]["notfinite_count"][...]) == 1
  else:
    assert not any(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert not all(np.isfinite(p).all() for p in jax.tree.leaves(_nnx_values(model, nnx.Param)))


# Equinox: filter_value_and_grad, then Optax on the model's arrays.


@functools.cache
def _eqx_step(opt: optax.GradientTransformation):
  vg = accum_jax.equinox.filter_value_and_grad(
      lambda model, x, y: jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2), N, return_info=True)

  @eqx.filter_jit
  def step(model, opt_state, x, y):
    _, grads, info = vg(model, x, y)
    updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, grads, info

  return step


@pytest.mark.parametrize("gated", [True, False], ids=["apply_if_finite", "no gate"])
def test_an_equinox_model_keeps_its_arrays_and_optimizer_state_on_a_nan_step(gated):
  opt = GATED_ADAM if gated else ADAM
  step = _eqx_step(opt)
  model = eqx.nn.Linear(3, 1, key=jax.random.key(0))
  model, state, _, _ = step(model, opt.init(eqx.filter(model, eqx.is_array)), *_data(0))
  new_model, new_state, grads, info = step(model, state, *_data(1, bad=True))
  _assert_skipped(info)
  if gated:
    tree_allclose(eqx.filter(new_model, eqx.is_array), eqx.filter(model, eqx.is_array),
                  rtol=0, atol=0)
    tree_allclose(new_state.inner_state, state.inner_state, rtol=0, atol=0)
    assert int(new_state.notfinite_count) == 1
  else:
    assert not any(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert not np.isfinite(new_model.weight).any()


# value_and_grad feeding accumulate: accumulate's own window skip is the gate.


ACCUMULATE = accum_jax.accumulate(optax.adam(0.1), every_k=2)


@jax.jit
def _accumulate_call(w, opt_state, x, y):
  _, grads = accum_jax.value_and_grad(mse, N, batch_argnums=(1, 2))(w, x, y)
  updates, opt_state = ACCUMULATE.update(grads, opt_state, w)
  return optax.apply_updates(w, updates), opt_state


def test_accumulate_skips_a_window_holding_a_nan_step_whole():
  w = jnp.asarray(normal(9, (3,)))
  state = ACCUMULATE.init(w)
  for seed in (0, 2):  # one finite window: Adam's moments are not zero
    w, state = _accumulate_call(w, state, *_data(seed))
  assert int(accum_jax.optimizer_step(state)) == 1
  new_w, new_state = _accumulate_call(w, state, *_data(4))
  new_w, new_state = _accumulate_call(new_w, new_state, *_data(5, bad=True))
  np.testing.assert_array_equal(new_w, w)
  tree_allclose(new_state.inner_opt_state, state.inner_opt_state, rtol=0, atol=0)
  assert int(accum_jax.optimizer_step(new_state)) == 1
  assert int(new_state.num_skipped) > 0


def test_the_nnx_gate_makes_no_host_wait_and_the_hlo_readers_take_nnx_jit_s_stages():
  """``optax.apply_if_finite``'s conditional is cheap in both branches: XLA:GPU
  turns it into selects, so gating a step costs no host round trip. The HLO
  readers take ``nnx.jit``'s ``Lowered`` and ``Compiled``, which wrap JAX's."""
  model = _NnxNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, _gate(optax.adamw(1e-2)), wrt=nnx.Param)
  lowered = _nnx_step.lower(model, optimizer, *_data(0))
  assert not isinstance(lowered, jax.stages.Lowered)
  (gate,) = accum_jax.testing.gpu_conditionals(lowered)
  assert not gate.kept, gate
  assert accum_jax.testing.host_syncs(lowered).per_run == 0
  compiled = accum_jax.testing.host_syncs(lowered.compile())
  assert len(compiled.conditionals) == 1  # XLA:CPU keeps every conditional
  assert compiled == accum_jax.testing.host_syncs(lowered)  # the answer is XLA:GPU's
