"""The Equinox front end, against ``eqx.filter_value_and_grad`` computed the plain way.

The references never use accum_jax: the full batch at once, or the microbatches
one after another with the State threaded and the keys folded by hand.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import accum_jax
import accum_jax.equinox
import accum_jax.testing
from tests.helpers import normal, tree_allclose

NUM_DEVICES = 8
NUM_MICROBATCHES = 2
BATCH_SIZE = 32  # 2 microbatches of 2 rows on each of 8 devices


def _microbatch(batch: Any, i: int, num_microbatches: int = NUM_MICROBATCHES) -> Any:
  size = jax.tree.leaves(batch)[0].shape[0] // num_microbatches
  return jax.tree.map(lambda x: x[i * size : (i + 1) * size], batch)


def _mean(trees: list[Any]) -> Any:
  return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((NUM_DEVICES,), ("data",))


def test_import_accum_jax_does_not_import_equinox():
  code = "import sys, accum_jax; print(sorted(m for m in sys.modules if m.startswith('equinox')))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout


# ---------------------------------------------------------------------------
# Models whose leaves are not all arrays: an MLP with jax.nn.relu and an
# eqx.nn.Lambda, a CNN with Conv2d and MaxPool2d.


class MLP(eqx.Module):
  mlp: eqx.nn.MLP
  head: eqx.nn.Lambda
  scale: float  # a Python float leaf
  shift: jax.Array  # an integer array: not differentiated, still an array

  def __init__(self, key):
    self.mlp = eqx.nn.MLP(4, 2, width_size=8, depth=1, activation=jax.nn.relu, key=key)
    self.head = eqx.nn.Lambda(lambda y: y[0] - jnp.tanh(y[1]))
    self.scale = 0.5
    self.shift = jnp.array(1, jnp.int32)

  def __call__(self, x):
    return self.scale * self.head(self.mlp(x)) + 0.1 * self.shift


class CNN(eqx.Module):
  layers: eqx.nn.Sequential

  def __init__(self, key):
    k1, k2 = jr.split(key)
    self.layers = eqx.nn.Sequential([
        eqx.nn.Conv2d(1, 3, kernel_size=3, key=k1),  # (1, 6, 6) -> (3, 4, 4)
        eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.MaxPool2d(kernel_size=2, stride=2),  # -> (3, 2, 2)
        eqx.nn.Lambda(jnp.ravel),
        eqx.nn.Linear(12, 1, key=k2),
    ])

  def __call__(self, x):
    return self.layers(x)[0]


def mse(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def mse_partitioned(params, static, x, y):
  """The loss as written for the partition/combine pattern: a static second argument."""
  return mse(eqx.combine(params, static), x, y)


MODELS = {
    "mlp": (MLP, (4,)),
    "cnn": (CNN, (1, 6, 6)),
}


def _problem(name: str):
  make, shape = MODELS[name]
  x = jnp.asarray(normal(1, (BATCH_SIZE, *shape)))
  y = jnp.asarray(normal(2, (BATCH_SIZE,)))
  return make(jr.key(0)), x, y


full_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(mse))


@pytest.mark.parametrize("on_mesh", [False, True], ids=["one device", "mesh of 8"])
@pytest.mark.parametrize("name", list(MODELS))
def test_filter_value_and_grad_matches_the_full_batch(name, on_mesh, mesh):
  model, x, y = _problem(name)
  # Data parallel: under filter_jit the replicated model says so (P() for all).
  options = {"data_parallel": accum_jax.DataParallel(mesh, param_sharding=P())} if on_mesh else {}
  vg = accum_jax.equinox.filter_value_and_grad(mse, NUM_MICROBATCHES, **options)
  loss, grads = eqx.filter_jit(vg)(model, x, y)
  full_loss, full_grads = full_value_and_grad(model, x, y)
  # Same structure as Equinox's: None at the activation, the Lambdas, the float.
  tree_allclose((loss, grads), (full_loss, full_grads))


@pytest.mark.parametrize("on_mesh", [False, True], ids=["one device", "mesh of 8"])
def test_a_static_argument_is_closed_over_also_with_a_mesh(on_mesh, mesh):
  model, x, y = _problem("mlp")
  params, static = eqx.partition(model, eqx.is_array)
  options = {"data_parallel": accum_jax.DataParallel(mesh, param_sharding=P())} if on_mesh else {}
  grad_fn = accum_jax.equinox.filter_grad(mse_partitioned, NUM_MICROBATCHES, **options)
  grads = eqx.filter_jit(grad_fn)(params, static, x, y)
  _, full_grads = full_value_and_grad(model, x, y)
  tree_allclose(grads, eqx.filter(full_grads, eqx.is_array))


def test_the_decorator_form_and_keyword_arguments_pass_through():
  model, x, y = _problem("mlp")

  @eqx.filter_jit
  @accum_jax.equinox.filter_value_and_grad(num_microbatches=4, has_aux=True)
  def loss_fn(model, x, y, *, offset, squash):
    pred = squash(jax.vmap(model)(x)) + offset
    loss = jnp.mean((pred - y) ** 2)
    return loss, {"mean_prediction": jnp.mean(pred)}

  (loss, aux), grads = loss_fn(model, x, y, offset=jnp.float32(0.25), squash=jax.nn.sigmoid)

  def reference(model, x, y):
    pred = jax.nn.sigmoid(jax.vmap(model)(x)) + 0.25
    return jnp.mean((pred - y) ** 2), {"mean_prediction": jnp.mean(pred)}

  full = eqx.filter_value_and_grad(reference, has_aux=True)(model, x, y)
  tree_allclose(((loss, aux), grads), full)


def masked_mse(model, batch):
  errors = (jax.vmap(model)(batch["x"]) - batch["y"]) ** 2
  return jnp.sum(errors * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1)


def test_weight_fn_sees_the_users_batch_and_gives_the_full_batch_token_mean():
  model, x, y = _problem("mlp")
  # Microbatches of 5 and 16 valid rows: the mean of microbatch means would differ.
  mask = jnp.asarray(np.arange(BATCH_SIZE) % 2 == 0, jnp.float32).at[:5].set(0).at[16:].set(1)
  batch = {"x": x, "y": y, "mask": mask}
  vg = accum_jax.equinox.filter_value_and_grad(
      masked_mse, 2, weight_fn=lambda batch: batch["mask"].sum()
  )
  out = eqx.filter_jit(vg)(model, batch)
  tree_allclose(out, eqx.filter_jit(eqx.filter_value_and_grad(masked_mse))(model, batch))


# ---------------------------------------------------------------------------
# eqx.nn.State: BatchNorm statistics threaded like sequential calls.


class BNModel(eqx.Module):
  linear: eqx.nn.Linear
  norm: eqx.nn.BatchNorm
  out: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jr.split(key)
    self.linear = eqx.nn.Linear(4, 6, key=k1)
    self.norm = eqx.nn.BatchNorm(6, axis_name="batch", mode="batch", momentum=0.9)
    self.out = eqx.nn.Linear(6, "scalar", key=k2)

  def __call__(self, x, state):
    x, state = self.norm(jax.nn.relu(self.linear(x)), state)
    return self.out(x), state


def compute_loss(model, state, xs, ys):
  """As in Equinox's stateful example: returns (loss, state)."""
  batch_model = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
  pred_ys, state = batch_model(xs, state)
  return jnp.mean((pred_ys - ys) ** 2), state


def compute_loss_with_metrics(model, state, xs, ys):
  loss, state = compute_loss(model, state, xs, ys)
  return loss, {"state": state, "loss_again": loss}


plain_state_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(compute_loss, has_aux=True))


def _sequential_state_reference(model, state, x, y):
  """Microbatch after microbatch with eqx.filter_value_and_grad, threading the state."""
  losses, grads = [], []
  for i in range(4):
    (loss, state), g = plain_state_value_and_grad(
        model, state, _microbatch(x, i, 4), _microbatch(y, i, 4)
    )
    losses.append(loss)
    grads.append(g)
  return _mean(losses), state, _mean(grads)


def test_state_is_threaded_like_sequential_calls():
  model, state = eqx.nn.make_with_state(BNModel)(jr.key(0))
  _, x, y = _problem("mlp")
  grad_fn = accum_jax.equinox.filter_grad(compute_loss, 4, has_aux=True)
  grads, new_state = eqx.filter_jit(grad_fn)(model, state, x, y)
  model, state = eqx.nn.make_with_state(BNModel)(jr.key(0))  # the call consumed `state`
  _, ref_state, ref_grads = _sequential_state_reference(model, state, x, y)
  tree_allclose((grads, new_state), (ref_grads, ref_state))
  # Four updates of the counter, not one.
  assert int(new_state.get(model.norm.batch_counter)) == 4


def test_state_inside_a_dict_of_aux_is_threaded_and_the_rest_reduced():
  model, state = eqx.nn.make_with_state(BNModel)(jr.key(0))
  _, x, y = _problem("mlp")
  vg = accum_jax.equinox.filter_value_and_grad(compute_loss_with_metrics, 4, has_aux=True)
  (loss, aux), grads = eqx.filter_jit(vg)(model, state, x, y)
  model, state = eqx.nn.make_with_state(BNModel)(jr.key(0))
  ref_loss, ref_state, ref_grads = _sequential_state_reference(model, state, x, y)
  tree_allclose(
      ((loss, aux), grads), ((ref_loss, {"state": ref_state, "loss_again": ref_loss}), ref_grads)
  )


def test_state_under_a_mesh_is_threaded_per_device_and_averaged(mesh):
  model, state = eqx.nn.make_with_state(BNModel)(jr.key(0))
  _, x, y = _problem("mlp")
  grad_fn = accum_jax.equinox.filter_grad(compute_loss, NUM_MICROBATCHES, has_aux=True,
      data_parallel=accum_jax.DataParallel(mesh=mesh, param_sharding=P()))
  grads, new_state = eqx.filter_jit(grad_fn)(model, state, x, y)
  # Reference: each device's shard, microbatch after microbatch; then the mean of all
  # the gradients and of the devices' floating-point statistics.
  rows = BATCH_SIZE // NUM_DEVICES
  all_grads, device_states = [], []
  for d in range(NUM_DEVICES):
    model, device_state = eqx.nn.make_with_state(BNModel)(jr.key(0))
    shard = (x[d * rows : (d + 1) * rows], y[d * rows : (d + 1) * rows])
    for i in range(NUM_MICROBATCHES):
      (_, device_state), g = plain_state_value_and_grad(
          model, device_state, *(_microbatch(part, i) for part in shard)
      )
      all_grads.append(g)
    device_states.append(device_state)
  ref_state = jax.tree.map(
      lambda *xs: sum(xs) / len(xs) if jnp.issubdtype(xs[0].dtype, jnp.inexact) else xs[0],
      *device_states,
  )
  tree_allclose((grads, new_state), (_mean(all_grads), ref_state))


# ---------------------------------------------------------------------------
# PRNG keys, positional (a raw jax.random.PRNGKey) or key= (a typed key).


class DropoutMLP(eqx.Module):
  linear: eqx.nn.Linear
  dropout: eqx.nn.Dropout
  out: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jr.split(key)
    self.linear = eqx.nn.Linear(4, 16, key=k1)
    self.dropout = eqx.nn.Dropout(0.5)
    self.out = eqx.nn.Linear(16, "scalar", key=k2)

  def __call__(self, x, *, key):
    return self.out(self.dropout(jax.nn.tanh(self.linear(x)), key=key))


def dropout_loss(model, x, y, key):
  keys = jr.split(key, x.shape[0])
  return jnp.mean((jax.vmap(model)(x, key=keys) - y) ** 2)


def dropout_loss_by_keyword(model, x, y, *, key):
  return dropout_loss(model, x, y, key)


plain_dropout_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(dropout_loss))


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional raw key", "key= typed"])
def test_keys_are_folded_per_microbatch_like_sequential_calls(by_keyword):
  model = DropoutMLP(jr.key(0))
  _, x, y = _problem("mlp")
  if by_keyword:
    key = jr.key(7)
    vg = accum_jax.equinox.filter_value_and_grad(dropout_loss_by_keyword, NUM_MICROBATCHES)
    loss, grads = eqx.filter_jit(vg)(model, x, y, key=key)
  else:
    key = jr.PRNGKey(7)
    vg = accum_jax.equinox.filter_value_and_grad(dropout_loss, NUM_MICROBATCHES)
    loss, grads = eqx.filter_jit(vg)(model, x, y, key)

  plain = plain_dropout_value_and_grad

  def sequential(keys):
    outs = [plain(model, _microbatch(x, i), _microbatch(y, i), k) for i, k in enumerate(keys)]
    return _mean(outs)

  folded = sequential([jr.fold_in(key, i) for i in range(NUM_MICROBATCHES)])
  tree_allclose((loss, grads), folded)
  # With one key for every microbatch the dropout masks would repeat; they do not.
  unfolded_loss, _ = sequential([key] * NUM_MICROBATCHES)
  assert not np.isclose(loss, unfolded_loss, rtol=1e-3), (loss, unfolded_loss)


# ---------------------------------------------------------------------------
# Across calls: the standard Equinox loop with accum_jax.accumulate.


# Adam hardly sees a gradient's scale; SGD shows a sum taken for a mean.
OPTIMIZERS = {"adam": lambda: optax.adam(1e-2), "sgd": lambda: optax.sgd(0.5)}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_standard_loop_with_accumulate_equals_one_full_batch_step(optimizer):
  # The CNN's arrays are all floating point, so eqx.filter(model, eqx.is_array) has the
  # gradients' structure (the MLP's integer leaf would need eqx.is_inexact_array).
  model, x, y = _problem("cnn")
  every_k = 4

  def train(opt, model, batches):
    opt_state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def make_step(model, opt_state, x, y):
      loss, grads = eqx.filter_value_and_grad(mse)(model, x, y)
      updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
      return eqx.apply_updates(model, updates), opt_state, loss

    for xb, yb in batches:
      model, opt_state, _ = make_step(model, opt_state, xb, yb)
    return model, opt_state

  micro = [(_microbatch(x, i, every_k), _microbatch(y, i, every_k)) for i in range(every_k)]
  inner = OPTIMIZERS[optimizer]
  accumulated, state = train(accum_jax.accumulate(inner(), every_k=every_k), model, micro)
  full, _ = train(inner(), model, [(x, y)])
  assert int(accum_jax.optimizer_step(state)) == 1
  assert not eqx.tree_equal(accumulated, model)  # the step happened
  tree_allclose(eqx.filter(accumulated, eqx.is_array), eqx.filter(full, eqx.is_array))


# ---------------------------------------------------------------------------
# Errors name the user's arguments.


def _two_states_loss(model, state, other, x):
  return mse(model, x, x[:, 0]), state


ERROR_CASES = {
    "batch_argnums names the model": (
        dict(batch_argnums=0),
        (mse, "x", "y"),
        "batch_argnums=0 names argument 0, the model",
    ),
    "argnums is fixed": (
        dict(argnums=1),
        (mse, "x", "y"),
        "filter_value_and_grad does not take argnums=1",
    ),
    "batch sizes differ, in the user's numbering": (
        {},
        (mse, "x", "y[:6]"),
        "argument 1: 32, argument 2: 6",
    ),
    "rng_argnums out of range": (
        dict(rng_argnums=3),
        (mse, "x", "y"),
        "rng_argnums=(3,) names argument 3, but the function was called with 3",
    ),
    "no batch": (
        {},
        (mse, "x[0, 0]", "y[0]"),
        "None of the 2 argument(s) after the model is a batch",
    ),
    "state without has_aux": (
        {},
        (compute_loss, "state", "x", "y"),
        "Argument 1 is an eqx.nn.State, threaded through the microbatches",
    ),
    "state not returned in aux": (
        dict(has_aux=True),
        (lambda m, s, x, y: (compute_loss(m, s, x, y)[0], 0.0), "state", "x", "y"),
        "Argument 1 is an eqx.nn.State, so fun must return the updated State in its aux",
    ),
    "two states": (
        dict(has_aux=True),
        (_two_states_loss, "state", "state2", "x"),
        "Arguments [1, 2] are all eqx.nn.State objects",
    ),
    "a State named as a batch": (
        dict(has_aux=True, batch_argnums=(1, 2)),
        (compute_loss, "state", "x", "y"),
        "batch_argnums=(1, 2) and the eqx.nn.State argument both name argument(s) [1]",
    ),
    "raw key or batch of two": (
        {},
        (lambda m, x, k: mse(m, x, x[:, 0]), "x[:2]", "raw_key"),
        "Argument 2 is a uint32 array of shape (2,), a raw PRNG key or a batch of 2",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_name_the_users_arguments(case):
  options, (fun, *arg_names), message = ERROR_CASES[case]
  model, x, y = _problem("mlp")
  bn_model, state = eqx.nn.make_with_state(BNModel)(jr.key(0))
  _, state2 = eqx.nn.make_with_state(BNModel)(jr.key(1))
  model_for = bn_model if "state" in arg_names else model
  scope = {"x": x, "y": y, "state": state, "state2": state2, "raw_key": jr.PRNGKey(0)}
  args = [eval(name, {}, scope) for name in arg_names]  # noqa: S307
  with pytest.raises(ValueError, match=re.escape(message)):
    vg = accum_jax.equinox.filter_value_and_grad(fun, NUM_MICROBATCHES, **options)
    eqx.filter_eval_shape(vg, model_for, *args)  # traces, compiles nothing


# ---------------------------------------------------------------------------
# The example runs and reports parity with the full batch.

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "equinox_mlp.py"
# float32 round-off over a few training steps; a real accumulation error is percents.
EXAMPLE_TOLERANCE = 1e-4


@pytest.mark.scripts
def test_equinox_example_matches_the_full_batch(tmp_path):
  out = subprocess.run(
      [sys.executable, str(EXAMPLE), "--quick", "--out", str(tmp_path)],
      capture_output=True,
      text=True,
      check=True,
  )
  differences = {
      m.group(1): float(m.group(2))
      for m in re.finditer(r"^max \|param diff\| vs full batch, (.+?):\s+(\S+)$", out.stdout,
                           re.MULTILINE)
  }
  assert set(differences) == {"filter_value_and_grad", "accumulate"}, out.stdout
  assert all(d < EXAMPLE_TOLERANCE for d in differences.values()), out.stdout
  assert (tmp_path / "equinox_mlp.png").stat().st_size > 0


@pytest.mark.scripts
def test_equinox_cnn_example_matches_sequential_calls_and_learns():
  script = EXAMPLE.parent / "equinox_cnn.py"
  out = subprocess.run(
      [sys.executable, str(script), "--quick"], capture_output=True, text=True, check=True
  ).stdout
  differences = re.findall(r"^first batch vs sequential calls, (.+?): (\S+)$", out, re.MULTILINE)
  assert [name for name, _ in differences] == [
      "|loss diff|", "max |grad diff|", "max |state diff|"
  ], out
  assert all(float(d) < EXAMPLE_TOLERANCE for _, d in differences), out
  first = float(re.search(r"^first loss: (\S+)$", out, re.MULTILINE).group(1))
  last = float(re.search(r"^last loss: (\S+)$", out, re.MULTILINE).group(1))
  assert last < first, out


# ---------------------------------------------------------------------------
# Every ```python block of the Equinox guide runs as written.

# The guide's blocks run in tests/test_docs.py with every other docs page.


# ---------------------------------------------------------------------------
# FSDP: Equinox has no sharding metadata, so param_sharding is given, shaped
# like the model with a sharding at each floating array (None elsewhere).


def test_fsdp_param_sharding_shaped_like_the_model_passes_through():
  from jax.sharding import NamedSharding

  # Automatic axes: under jax.jit the traced arrays cannot say how they are sharded.
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  model = eqx.nn.MLP(16, 3, width_size=32, depth=1, activation=jnp.tanh, key=jr.key(0))
  specs = {(0, "weight"): P("data", None), (0, "bias"): P("data"), (1, "weight"): P(None, "data")}

  def sharding_of(path, x):
    index, name = path[-2].idx, path[-1].name
    return NamedSharding(mesh, specs.get((index, name), P()))

  # eqx.filter leaves None at the activation functions: a prefix of what is
  # differentiated (the floating arrays).
  shardings = jax.tree_util.tree_map_with_path(sharding_of, eqx.filter(model, eqx.is_array))
  model = eqx.filter_shard(model, shardings)
  rows = NamedSharding(mesh, P("data"))
  x = jax.device_put(normal(0, (BATCH_SIZE, 16)), rows)
  y = jax.device_put(normal(1, (BATCH_SIZE, 3)), rows)

  def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)

  vg = eqx.filter_jit(accum_jax.equinox.filter_value_and_grad(
      loss_fn, NUM_MICROBATCHES,
      data_parallel=accum_jax.DataParallel(mesh, "data", param_sharding=shardings)))
  loss, grads = vg(model, x, y)
  arrays, rest = eqx.partition((model, x, y), eqx.is_array)
  on_one_device = eqx.combine(jax.device_put(arrays, jax.devices()[0]), rest)
  expected = eqx.filter_value_and_grad(loss_fn)(*on_one_device)
  tree_allclose((loss, grads), expected)
  sharded = 0
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(eqx.filter(model, eqx.is_array))):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)
    sharded += not p.sharding.is_fully_replicated
  assert sharded == 3
  compiled = vg.lower(model, x, y).compile().compiled  # jax's, under Equinox's wrapper
  found = accum_jax.testing.collectives(compiled.as_text(), mesh)
  # A reduce-scatter per sharded leaf; the default checks finiteness after the loop.
  per_microbatch = [c.kind for c in found if c.in_loop and not c.in_branch]
  assert per_microbatch == ["reduce-scatter"] * 3, per_microbatch
