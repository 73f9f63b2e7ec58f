"""Dynamic loss scaling (jmp) in float16 with both doors.

jmp's recipe, as its README writes it: scale the loss, unscale the gradients,
``loss_scale.adjust(jmp.all_finite(grads))``, and keep the old parameters when
the gradients are not finite. Inside one step an overflowing microbatch must
reach the scaler: the scale drops and the step is skipped, as on the whole batch.
"""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from helpers import normal

import accum_jax

N = 4
LR = 0.1


def loss_fn(params, x, y):
  """A float16 forward pass of a float32 model (jmp's half policy)."""
  pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
  return jnp.mean((pred - y.astype(jnp.float16)) ** 2)


def scaled_loss_fn(params, loss_scale, x, y):
  return loss_scale.scale(loss_fn(params, x, y))


def make_data(overflow):
  x, y = normal(0, (16, 4)), normal(1, (16, 3))
  if overflow:  # microbatch 2's loss is ~1e4: times the scale 2**15, inf in float16
    y[8:12] = 100.0
  return x, y


def make_step(on_nonfinite, use_info, closed_over=False):
  def closing_over(loss_scale):  # the scale is not among the arguments
    return accum_jax.value_and_grad(
        lambda params, x, y: scaled_loss_fn(params, loss_scale, x, y), N,
        batch_argnums=(1, 2), on_nonfinite=on_nonfinite, return_info=True)

  vg = accum_jax.value_and_grad(scaled_loss_fn, N, batch_argnums=(2, 3),
                                on_nonfinite=on_nonfinite, return_info=True)

  @jax.jit
  def train_step(params, loss_scale, x, y):
    if closed_over:
      _, grads, info = closing_over(loss_scale)(params, x, y)
    else:
      _, grads, info = vg(params, loss_scale, x, y)
    grads = loss_scale.unscale(grads)
    grads_finite = jmp.all_finite(grads)
    if use_info:
      grads_finite &= info.num_skipped == 0
    loss_scale = loss_scale.adjust(grads_finite)
    new_params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return jmp.select_tree(grads_finite, new_params, params), loss_scale, grads

  return train_step


@pytest.mark.parametrize("closed_over", [False, True], ids=["passed", "closed over"])
@pytest.mark.parametrize(
    "on_nonfinite, use_info",
    [("propagate", False), ("unchecked", False), ("skip_microbatch", True)],
    ids=["the default, jmp's recipe as it is", "on_nonfinite='unchecked'",
         "on_nonfinite='skip_microbatch' with info.num_skipped"],
)
def test_an_overflow_inside_a_step_lowers_the_scale_and_skips_the_step(
    on_nonfinite, use_info, closed_over
):
  train_step = make_step(on_nonfinite, use_info, closed_over)
  params = {"w": normal(2, (4, 3), 0.5)}
  loss_scale = jmp.DynamicLossScale(jnp.float32(2**15))

  # An overflowing step: the scale halves, the parameters stay.
  new_params, loss_scale, _ = train_step(params, loss_scale, *make_data(overflow=True))
  assert float(loss_scale.loss_scale) == 2**14
  np.testing.assert_array_equal(new_params["w"], params["w"])

  # A finite step: applied, with the float32 full-batch gradient.
  x, y = make_data(overflow=False)
  new_params, loss_scale, grads = train_step(params, loss_scale, x, y)
  assert float(loss_scale.loss_scale) == 2**14

  def float32_loss(params, x, y):
    return jnp.mean((x @ params["w"] - y) ** 2)

  expected = jax.grad(float32_loss)(params, x, y)
  np.testing.assert_allclose(grads["w"], expected["w"], rtol=5e-3, atol=5e-3)
  np.testing.assert_allclose(new_params["w"], params["w"] - LR * expected["w"], rtol=5e-3,
                             atol=5e-4)


@pytest.mark.parametrize("on_nonfinite", ["skip_window", "skip_microbatch"])
def test_across_calls_an_overflowing_call_lowers_the_scale_and_is_skipped(on_nonfinite):
  """The recipe per call: unscale, adjust, and let accumulate skip the bad window
  (as PyTorch's GradScaler skips the step) or, with "call", the bad call alone."""
  opt = accum_jax.accumulate(optax.sgd(LR), every_k=N, on_nonfinite=on_nonfinite)
  grad_fn = jax.grad(scaled_loss_fn)

  @jax.jit
  def call(params, opt_state, loss_scale, x, y):
    grads = loss_scale.unscale(grad_fn(params, loss_scale, x, y))
    loss_scale = loss_scale.adjust(jmp.all_finite(grads))
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss_scale

  params = {"w": normal(2, (4, 3), 0.5)}
  opt_state, loss_scale = opt.init(params), jmp.DynamicLossScale(jnp.float32(2**15))
  x, y = make_data(overflow=True)
  for i in range(N):
    rows = slice(4 * i, 4 * (i + 1))
    params, opt_state, loss_scale = call(params, opt_state, loss_scale, x[rows], y[rows])
  assert float(loss_scale.loss_scale) == 2**14  # the overflow of call 2 reached the scaler
  if on_nonfinite == "skip_window":  # the window is skipped whole: no update, N calls counted
    assert int(opt_state.num_skipped) == N and int(opt_state.optimizer_step) == 0
    np.testing.assert_array_equal(params["w"], normal(2, (4, 3), 0.5))
  else:  # the bad call alone, not counted: the window waits for one more call
    assert int(opt_state.num_skipped) == 1 and int(opt_state.mini_step) == N - 1
