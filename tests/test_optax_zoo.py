"""Every Optax optimizer through accumulate: k calls equal one full-batch step.

For each optimizer in ``optax`` and ``optax.contrib`` (the factories whose first
argument is ``learning_rate`` are enumerated from the modules, so that a new one
fails :func:`test_the_zoo_lists_every_optax_optimizer` until it is listed here)
and the common wrappers, ``accumulate(opt, every_k=4)`` over the 4 microbatches
of a batch, for 3 windows, must give the parameters that ``opt`` gives on the
whole batch, to float32 round-off. The microbatches are equal-sized and the loss
is their mean, so the mean of their gradients is the full batch's gradient; each
call also passes its loss as ``value=``, which accumulate reduces to the
window's (the full batch's) loss, as ``polyak_sgd``, ``momo`` and
``reduce_on_plateau`` need.

A line search (``lbfgs``) and ``sophia`` evaluate a function of the parameters
(``value_fn``, ``obj_fn``) at trial points: accumulate passes the emitting
call's, so they are exact only when it computes the loss of the whole window's
data, which is what the calls below pass. ``grad=`` is replaced by the window's
gradient.

One jitted function per optimizer, running both the accumulated loop and the
reference; the model is one 3x2 linear layer.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from helpers import tree_allclose

import accum_jax
from accum_jax.testing import gpu_conditionals

K = 4
WINDOWS = 3
LR = 1e-2


def _loss(params, batch):
  prediction = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((prediction - batch["y"]) ** 2) + 1e-3 * jnp.sum(params["w"] ** 2)


def _problem():
  rng = np.random.default_rng(0)
  params = {
      "w": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32),
      "b": jnp.asarray([0.5, -1.0], jnp.float32),
  }
  x = rng.standard_normal((4 * K, 3)).astype(np.float32)
  y = (x @ np.array([[1.0, -2.0], [0.5, 3.0], [-1.5, 1.0]]) + 2.0).astype(np.float32)
  return params, {"x": jnp.asarray(x), "y": jnp.asarray(y)}


# Optimizers that take a function of the parameters: it must compute the loss of
# the whole window's data. name -> the keyword arguments of `update`, given the
# parameters, the full batch and this call's gradient.
def _value_arg(batch, value, grad):
  del batch, grad
  return {"value": value}


def _line_search_args(batch, value, grad):
  return {"value": value, "value_fn": lambda p: _loss(p, batch), "grad": grad}


def _sophia_args(batch, value, grad):
  del value, grad
  return {"obj_fn": lambda p: _loss(p, batch)}


def _no_args(batch, value, grad):
  del batch, value, grad
  return {}


# name -> (factory, the builder of extra `update` arguments; None: value=).
Factory = Callable[[], optax.GradientTransformation]
ZOO: dict[str, tuple[Factory, Any]] = {
    # optax: factories whose first argument is learning_rate.
    "adabelief": (lambda: optax.adabelief(LR), None),
    "adadelta": (lambda: optax.adadelta(1.0), None),
    "adafactor": (lambda: optax.adafactor(LR), None),
    "adagrad": (lambda: optax.adagrad(LR), None),
    "adam": (lambda: optax.adam(LR), None),
    "adamax": (lambda: optax.adamax(LR), None),
    "adamaxw": (lambda: optax.adamaxw(LR), None),
    "adamw": (lambda: optax.adamw(LR), None),
    "adan": (lambda: optax.adan(LR), None),
    "amsgrad": (lambda: optax.amsgrad(LR), None),
    "fromage": (lambda: optax.fromage(LR), None),
    "lamb": (lambda: optax.lamb(LR), None),
    "lars": (lambda: optax.lars(LR), None),
    "lbfgs": (lambda: optax.lbfgs(), _line_search_args),
    "lion": (lambda: optax.lion(LR), None),
    "nadam": (lambda: optax.nadam(LR), None),
    "nadamw": (lambda: optax.nadamw(LR), None),
    "noisy_sgd": (lambda: optax.noisy_sgd(LR, key=jax.random.key(0)), None),
    "novograd": (lambda: optax.novograd(LR), None),
    "optimistic_adam_v2": (lambda: optax.optimistic_adam_v2(LR), None),
    "optimistic_gradient_descent": (lambda: optax.optimistic_gradient_descent(LR), None),
    "radam": (lambda: optax.radam(LR), None),
    "rmsprop": (lambda: optax.rmsprop(LR), None),
    "rprop": (lambda: optax.rprop(LR), None),
    "scale_by_learning_rate": (lambda: optax.scale_by_learning_rate(LR), None),
    "scale_by_rprop": (lambda: optax.scale_by_rprop(LR), None),
    "sgd": (lambda: optax.sgd(LR, momentum=0.9, nesterov=True), None),
    "sign_sgd": (lambda: optax.sign_sgd(LR), None),
    "signum": (lambda: optax.signum(LR), None),
    "sm3": (lambda: optax.sm3(LR), None),
    "yogi": (lambda: optax.yogi(LR), None),
    # optax.contrib: factories whose first argument is learning_rate.
    "contrib.acprop": (lambda: optax.contrib.acprop(LR), None),
    "contrib.ademamix": (lambda: optax.contrib.ademamix(LR), None),
    "contrib.adopt": (lambda: optax.contrib.adopt(LR), None),
    "contrib.cocob": (lambda: optax.contrib.cocob(), None),
    "contrib.dadapt_adamw": (lambda: optax.contrib.dadapt_adamw(), None),
    "contrib.dog": (lambda: optax.contrib.dog(), None),
    "contrib.dowg": (lambda: optax.contrib.dowg(), None),
    "contrib.galore": (lambda: optax.contrib.galore(LR, rank=1, update_proj_gap=2), None),
    "contrib.madgrad": (lambda: optax.contrib.madgrad(LR), None),
    "contrib.momo": (lambda: optax.contrib.momo(), None),
    "contrib.momo_adam": (lambda: optax.contrib.momo_adam(), None),
    "contrib.muon": (lambda: optax.contrib.muon(LR), None),
    "contrib.prodigy": (lambda: optax.contrib.prodigy(), None),
    "contrib.scale_by_madgrad": (lambda: optax.contrib.scale_by_madgrad(LR), None),
    "contrib.schedule_free_adamw": (lambda: optax.contrib.schedule_free_adamw(), None),
    "contrib.schedule_free_sgd": (lambda: optax.contrib.schedule_free_sgd(), None),
    "contrib.simplified_ademamix": (lambda: optax.contrib.simplified_ademamix(LR), None),
    "contrib.sophia": (lambda: optax.contrib.sophia(LR, update_interval=2), _sophia_args),
    # Optimizers with other first arguments, and wrappers.
    "polyak_sgd": (lambda: optax.polyak_sgd(max_learning_rate=1.0), None),
    "contrib.reduce_on_plateau(adam)": (
        lambda: optax.chain(
            optax.adam(LR), optax.contrib.reduce_on_plateau(patience=1, factor=0.5)
        ),
        None,
    ),
    "contrib.sam(sgd, sgd)": (
        lambda: optax.contrib.sam(optax.sgd(LR), optax.sgd(LR), sync_period=2),
        _no_args,  # its update takes no extra arguments
    ),
    "contrib.mechanize(adam)": (
        lambda: optax.contrib.mechanize(optax.adam(LR), s_init=1e-3),
        None,
    ),
    "contrib.schedule_free(adam)": (
        lambda: optax.contrib.schedule_free(optax.adam(LR), LR),
        None,
    ),
    "contrib.split_real_and_imaginary(adam)": (
        lambda: optax.contrib.split_real_and_imaginary(optax.adam(LR)),
        None,
    ),
    "chain(clip_by_global_norm, adam)": (
        lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(LR)),
        None,
    ),
    "chain(clip, adamw)": (lambda: optax.chain(optax.clip(0.1), optax.adamw(LR)), None),
    "apply_if_finite(adam)": (lambda: optax.apply_if_finite(optax.adam(LR), 3), None),
    "inject_hyperparams(adam) with a schedule": (
        lambda: optax.inject_hyperparams(optax.adam)(
            learning_rate=optax.linear_schedule(LR, 0.0, WINDOWS)
        ),
        None,
    ),
    "adam with a schedule": (
        lambda: optax.adam(optax.cosine_decay_schedule(LR, WINDOWS)),
        None,
    ),
    "MultiSteps(adam, 2)": (
        lambda: optax.MultiSteps(optax.adam(LR), 2).gradient_transformation(),
        None,
    ),
    "masked(adam)": (lambda: optax.masked(optax.adam(LR), {"w": True, "b": False}), None),
    "multi_transform(adam, sgd)": (
        lambda: optax.multi_transform(
            {"a": optax.adam(LR), "s": optax.sgd(LR)}, {"w": "a", "b": "s"}
        ),
        None,
    ),
    "chain(adam, add_decayed_weights, ema)": (
        lambda: optax.chain(optax.adam(LR), optax.add_decayed_weights(1e-2), optax.ema(0.9)),
        None,
    ),
    "zero_nans(adam)": (lambda: optax.chain(optax.zero_nans(), optax.adam(LR)), None),
}

# Optimizers the zoo leaves out, with the reason.
EXCLUDED: dict[str, str] = {
    "optimistic_adam": "deprecated by optax (a DeprecationWarning); optimistic_adam_v2 is tested.",
    "contrib.dpsgd": (
        "takes per-example gradients (a leading batch axis) to clip each example and adds"
        " noise: accumulate takes the gradient of a microbatch's mean loss. Use"
        " optax.contrib.dpsgd on per-example gradients inside one step instead."
    ),
}


def _enumerated_optimizers() -> set[str]:
  """The factories of optax and optax.contrib whose first argument is learning_rate."""
  names = set()
  for module, prefix in ((optax, ""), (optax.contrib, "contrib.")):
    for name in dir(module):
      obj = getattr(module, name)
      if name.startswith("_") or inspect.isclass(obj) or not callable(obj):
        continue
      try:
        parameters = list(inspect.signature(obj).parameters)
      except (TypeError, ValueError):
        continue
      if parameters[:1] == ["learning_rate"]:
        names.add(prefix + name)
  return names


def test_the_zoo_lists_every_optax_optimizer():
  enumerated = _enumerated_optimizers()
  assert len(enumerated) > 40, sorted(enumerated)
  missing = enumerated - set(ZOO) - set(EXCLUDED)
  assert not missing, f"not in the zoo nor excluded with a reason: {sorted(missing)}"


def _windows(make_opt: Factory, extra_args: Any, layout: str = "packed"):
  """Params after each window: accumulated over K microbatches, and on the full batch.
  By default in the layout accumulate's default gives parameters on one device (here
  its init runs traced, where several devices would make it keep a tree)."""
  opt = accum_jax.accumulate(make_opt(), K, layout=layout)
  reference = optax.with_extra_args_support(make_opt())
  value_and_grad = jax.value_and_grad(_loss)

  # Compiling is the cost of this file: LLVM's cheaper optimisation level saves a
  # third of it (XLA's own passes, and the float semantics, are unchanged).
  @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
  def run(params, batch):
    microbatches = jax.tree.map(lambda x: x.reshape(K, -1, *x.shape[1:]), batch)

    def extra(value, grad):
      return (extra_args or _value_arg)(batch, value, grad)

    def call(carry, microbatch):
      params, state = carry
      value, grad = value_and_grad(params, microbatch)
      updates, state = opt.update(grad, state, params, **extra(value, grad))
      return (optax.apply_updates(params, updates), state), None

    def window(carry, _):
      params, state, ref_params, ref_state = carry
      (params, state), _ = jax.lax.scan(call, (params, state), microbatches)
      value, grad = value_and_grad(ref_params, batch)
      updates, ref_state = reference.update(grad, ref_state, ref_params, **extra(value, grad))
      ref_params = optax.apply_updates(ref_params, updates)
      return (params, state, ref_params, ref_state), (params, ref_params)

    carry = (params, opt.init(params), params, reference.init(params))
    (_, state, _, _), (ours, theirs) = jax.lax.scan(window, carry, None, length=WINDOWS)
    return ours, theirs, accum_jax.optimizer_step(state)

  return run(*_problem())


@pytest.mark.parametrize("name", list(ZOO))
def test_k_calls_equal_one_full_batch_step(name):
  make_opt, extra_args = ZOO[name]
  ours, theirs, optimizer_step = _windows(make_opt, extra_args)
  assert int(optimizer_step) == WINDOWS
  params, _ = _problem()
  # The optimizer moved the parameters: the comparison is not of two no-ops.
  assert not np.allclose(np.asarray(theirs["w"][-1]), np.asarray(params["w"]))
  tree_allclose(ours, theirs)


# The state kept as a tree (layout="tree", the layout of sharded parameters) on
# optimizers of each kind: elementwise (sgd, adamw, lion), with reductions over a
# leaf (adafactor, lamb), with matrix products (muon), reading the loss
# (polyak_sgd), and keeping its hyperparameters in its state (inject_hyperparams).
# Both layouts hand the inner optimizer its own tree, so the windows equal the
# full batch's steps in either.
TREE_SAMPLE = ("sgd", "adamw", "lion", "adafactor", "lamb", "contrib.muon", "polyak_sgd",
               "inject_hyperparams(adam) with a schedule")


@pytest.mark.parametrize("name", TREE_SAMPLE)
def test_k_calls_equal_one_full_batch_step_with_the_state_kept_as_a_tree(name):
  make_opt, extra_args = ZOO[name]
  ours, theirs, optimizer_step = _windows(make_opt, extra_args, layout="tree")
  assert int(optimizer_step) == WINDOWS
  tree_allclose(ours, theirs)


def _one_update(make_opt: Factory, extra_args: Any):
  """One call of ``accumulate(opt).update`` and ``apply_updates``, jitted and lowered."""
  opt = accum_jax.accumulate(make_opt(), K)
  params, batch = _problem()

  def step(params, state, batch):
    value, grad = jax.value_and_grad(_loss)(params, batch)
    updates, state = opt.update(
        grad, state, params, **(extra_args or _value_arg)(batch, value, grad))
    return optax.apply_updates(params, updates), state

  return jax.jit(step).lower(params, opt.init(params), batch)


@pytest.mark.parametrize("name", list(ZOO))
def test_the_inner_update_sits_behind_a_conditional_a_gpu_keeps(name):
  # XLA:GPU replaces a conditional whose branches are all cheap (Adam's update is
  # elementwise) by selects, running the inner update on every call; accumulate's
  # skip branch passes its operands through, which keeps it. Lowering is enough:
  # the rule applies to the program before XLA optimises it.
  # Conditionals of the inner optimizer's own (novograd's) sit inside the emitting
  # branch, which runs once a window whatever becomes of them.
  make_opt, extra_args = ZOO[name]
  outermost = [c for c in gpu_conditionals(_one_update(make_opt, extra_args))
               if "/branch_" not in c.op_name]
  assert len(outermost) == 1, outermost
  assert outermost[0].kept, outermost[0]


# ---------------------------------------------------------------------------
# The optimizers that read the loss: what they derive from it is the full batch's.


def _polyak_step_sizes_and_plateau_losses(windows: int):
  """Per window, polyak_sgd's step size and reduce_on_plateau's scale and loss."""
  params, batch = _problem()
  microbatches = jax.tree.map(lambda x: x.reshape(K, -1, *x.shape[1:]), batch)
  value_and_grad = jax.value_and_grad(_loss)
  polyak = optax.polyak_sgd(max_learning_rate=100.0)
  plateau = optax.chain(optax.sgd(1.5), optax.contrib.reduce_on_plateau(patience=1, factor=0.5))

  def step_size(updates, grad):
    # polyak_sgd's update is -step_size * grad.
    return -optax.tree.vdot(updates, grad) / optax.tree.vdot(grad, grad)

  @jax.jit
  def run(params):
    out = {}
    for name, inner in (("polyak", polyak), ("plateau", plateau)):
      opt = accum_jax.accumulate(inner, K)

      def window(carry, _, opt=opt, inner=inner, name=name):
        params, state, ref_params, ref_state = carry
        grads = []
        for i in range(K):
          microbatch = jax.tree.map(lambda x, i=i: x[i], microbatches)
          value, grad = value_and_grad(params, microbatch)
          grads.append(grad)
          updates, state = opt.update(grad, state, params, value=value)
          params = optax.apply_updates(params, updates)
        window_grad = jax.tree.map(lambda *g: sum(g) / K, *grads)
        value, grad = value_and_grad(ref_params, batch)
        ref_updates, ref_state = inner.update(grad, ref_state, ref_params, value=value)
        new_ref_params = optax.apply_updates(ref_params, ref_updates)
        if name == "polyak":
          figures = (step_size(updates, window_grad), step_size(ref_updates, grad))
        else:
          scales = (state.inner_opt_state[1].scale, ref_state[1].scale)
          figures = scales + (_loss(params, batch), _loss(new_ref_params, batch))
        return (params, state, new_ref_params, ref_state), figures

      carry = (params, opt.init(params), params, inner.init(params))
      _, out[name] = jax.lax.scan(window, carry, None, length=windows)
    return out

  return run(params)


def test_polyak_sgd_step_sizes_and_reduce_on_plateau_losses_are_the_full_batchs():
  out = _polyak_step_sizes_and_plateau_losses(windows=6)
  ours, full_batch = out["polyak"]
  np.testing.assert_allclose(ours, full_batch, rtol=1e-5)
  our_scale, full_batch_scale, our_loss, full_batch_loss = out["plateau"]
  # The plateau was reached, and the learning rate cut, in both.
  assert float(full_batch_scale[-1]) < 1.0
  np.testing.assert_array_equal(our_scale, full_batch_scale)
  np.testing.assert_allclose(our_loss, full_batch_loss, rtol=1e-5)
