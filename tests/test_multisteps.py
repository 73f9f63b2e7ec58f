"""accum_jax.MultiSteps against optax.MultiSteps, the class it replaces."""

import functools
import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  make_params,
  microbatch_grads,
  scan_updates,
  shapes_and_dtypes,
  stack_trees,
  tolerance_for,
  tree_all_finite,
  tree_allclose,
  tree_weighted_mean,
  unstack_tree,
)

import accum_jax

# Magnitude-sensitive (unlike adam), so a sum and a mean give different updates.
_INNER = optax.sgd(0.1, momentum=0.9)


def _two_then_three(gradient_step):
  return jnp.where(gradient_step < 1, 2, 3)


_EVERY_K = {"every 3 mini-steps": 3, "2 then 3 mini-steps": _two_then_three}


@functools.cache
def _pair(every_k_name, use_grad_mean, should_skip_update_fn=None):
  """(accum_jax.MultiSteps, optax.MultiSteps) with the same arguments."""
  args = (_INNER, _EVERY_K[every_k_name], use_grad_mean, should_skip_update_fn)
  return accum_jax.MultiSteps(*args), optax.MultiSteps(*args)


def _ints(x):
  return [int(i) for i in np.asarray(x)]


def _bools(x):
  return [bool(b) for b in np.asarray(x)]


_INNERS = {"adam": optax.adam(0.1), "sgd with momentum": _INNER}


# Every pair of the four options' values, in five runs rather than all sixteen
# combinations (a covering array of strength 2): each option changes its own part of
# the state (the inner state, the windows, acc_grads, the rejected calls).
_PAIRWISE = [
    ("adam", "every 3 mini-steps", True, False),
    ("adam", "2 then 3 mini-steps", False, True),
    ("sgd with momentum", "every 3 mini-steps", False, True),
    ("sgd with momentum", "2 then 3 mini-steps", True, True),
    ("sgd with momentum", "2 then 3 mini-steps", False, False),
]


@pytest.mark.parametrize(
    ("inner_name", "every_k_name", "use_grad_mean", "skip"),
    [pytest.param(*row, id="-".join(
        [*row[:2], "grad mean" if row[2] else "grad sum",
         "skip_not_finite" if row[3] else "no skip function"])) for row in _PAIRWISE],
)
def test_matches_optax_multisteps_and_its_state_reads_the_same_after_every_call(
    inner_name, every_k_name, use_grad_mean, skip
):
  # The updates and parameters, and the fields optax.MultiStepsState has, read
  # after each call side by side: acc_grads the running mean (or sum) and zeros
  # after an update, the counters, the inner state, what the skip function
  # reported, and has_updated. Without a skip function every gradient is finite.
  args = (
      _INNERS[inner_name], _EVERY_K[every_k_name], use_grad_mean,
      optax.skip_not_finite if skip else None,
  )
  ours, theirs = accum_jax.MultiSteps(*args), optax.MultiSteps(*args)
  params = make_params()
  grads = microbatch_grads(params, 11, seed=3)
  if skip:
    # Rejected calls: one that would end the first window (every 3), one that
    # would start a window (2 then 3), one mid-window.
    nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), grads[0])
    grads[2] = grads[7] = nan
  our_params, our_updates, our_states = scan_updates(ours, params, stack_trees(grads))
  their_params, their_updates, their_states = scan_updates(
      theirs.gradient_transformation(), params, stack_trees(grads)
  )
  assert _ints(our_states.mini_step) == _ints(their_states.mini_step)
  assert _ints(our_states.gradient_step) == _ints(their_states.gradient_step)
  assert _bools(ours.has_updated(our_states)) == _bools(theirs.has_updated(their_states))
  assert shapes_and_dtypes(our_states.acc_grads) == shapes_and_dtypes(their_states.acc_grads)
  tree_allclose(our_states.acc_grads, their_states.acc_grads)
  tree_allclose(our_states.inner_opt_state, their_states.inner_opt_state)
  tree_allclose(our_states.skip_state, their_states.skip_state)
  tree_allclose(our_updates, their_updates)
  tree_allclose(our_params, their_params)
  # The last state alone (not stacked by the scan) reads the same.
  last = jax.tree.map(lambda x: x[-1], our_states)
  tree_allclose(last.acc_grads, jax.tree.map(lambda x: x[-1], their_states.acc_grads))


def test_exposes_the_optax_multisteps_interface():
  inner = optax.adam(1e-2)
  multisteps = accum_jax.MultiSteps(inner, every_k_schedule=2)
  params = make_params()
  state = jax.jit(multisteps.init)(params)

  assert (int(state.mini_step), int(state.gradient_step)) == (0, 0)
  assert not bool(multisteps.has_updated(state))
  assert shapes_and_dtypes(state.inner_opt_state) == shapes_and_dtypes(
      jax.eval_shape(inner.init, params)
  )
  tree_allclose(state.acc_grads, jax.tree.map(jnp.zeros_like, params))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.acc_grads))

  assert isinstance(multisteps.inner_opt, optax.GradientTransformationExtraArgs)
  assert shapes_and_dtypes(jax.eval_shape(multisteps.inner_opt.init, params)) == (
      shapes_and_dtypes(state.inner_opt_state)
  )
  transformation = multisteps.gradient_transformation()
  assert isinstance(transformation, optax.GradientTransformationExtraArgs)
  assert shapes_and_dtypes(jax.eval_shape(transformation.init, params)) == (
      shapes_and_dtypes(state)
  )

  g1, g2 = microbatch_grads(params, 2)
  _, updates, states = scan_updates(
      transformation, params, stack_trees([g1, g2]), apply_updates=False
  )
  assert _ints(states.mini_step) == [1, 0]
  assert _ints(states.gradient_step) == [0, 1]
  assert _bools(multisteps.has_updated(states)) == [False, True]
  expected, _ = jax.jit(inner.update)(tree_weighted_mean([g1, g2]), inner.init(params), params)
  tree_allclose(unstack_tree(updates)[1], expected)


_SKIP_FNS = {
    "skip_not_finite": optax.skip_not_finite,
    "skip_large_updates": functools.partial(optax.skip_large_updates, max_squared_norm=50.0),
}


@pytest.mark.parametrize("skip_name", list(_SKIP_FNS))
def test_optax_skip_functions_match_optax_multisteps(skip_name):
  ours, theirs = _pair("every 3 mini-steps", True, _SKIP_FNS[skip_name])
  params = make_params()
  g = microbatch_grads(params, 5)
  nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), g[0])
  # Squared norm about 1000: refused by skip_large_updates, finite.
  large = jax.tree.map(lambda x: 10.0 * x, g[1])
  sequence = [g[0], nan, g[1], large, g[2], g[3], g[4]]
  _, our_updates, our_states = scan_updates(
      ours, params, stack_trees(sequence), apply_updates=False
  )
  _, their_updates, their_states = scan_updates(
      theirs.gradient_transformation(), params, stack_trees(sequence), apply_updates=False
  )
  tree_allclose(our_updates, their_updates)
  tree_allclose(our_states.skip_state, their_states.skip_state)
  assert _ints(our_states.mini_step) == _ints(their_states.mini_step)
  assert _ints(our_states.gradient_step) == _ints(their_states.gradient_step)

  rejected = [1, 3] if skip_name == "skip_large_updates" else [1]
  assert _bools(our_states.skip_state["should_skip"]) == [i in rejected for i in range(7)]
  # A rejected mini-step is not accumulated: the first window is g0, g1 and
  # the next accepted gradient.
  first_window = [g[0], g[1], g[2] if 3 in rejected else large]
  expected, _ = jax.jit(_INNER.update)(
      tree_weighted_mean(first_window), _INNER.init(params), params
  )
  emitting_call = 4 if 3 in rejected else 3
  tree_allclose(unstack_tree(our_updates)[emitting_call], expected)


def test_works_inside_optax_chain():
  multisteps = accum_jax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
  ours = optax.chain(optax.clip_by_global_norm(1.0), multisteps.gradient_transformation())
  theirs = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2).gradient_transformation(),
  )
  params = make_params()
  grads = stack_trees(microbatch_grads(params, 4, scale=2.0))
  our_params, our_updates, our_states = scan_updates(ours, params, grads)
  their_params, their_updates, _ = scan_updates(theirs, params, grads)
  tree_allclose(our_updates, their_updates)
  tree_allclose(our_params, their_params)
  assert _bools(multisteps.has_updated(our_states[1])) == [False, True, False, True]


def test_every_k_schedule_errors():
  with pytest.raises(ValueError, match=re.escape("every_k_schedule=0 must be an int >= 1")):
    accum_jax.MultiSteps(_INNER, every_k_schedule=0)


@pytest.mark.skipif(
    "accumulator_dtype" not in inspect.signature(optax.MultiSteps).parameters,
    reason="this optax.MultiSteps has no accumulator_dtype to compare with",
)
@pytest.mark.parametrize("accumulator_dtype", [None, jnp.float16], ids=["None", "float16"])
def test_float16_gradients_match_optax_multisteps_where_it_is_finite(accumulator_dtype):
  # Four gradients of 30000: their float16 sum overflows, their mean does not.
  # optax.MultiSteps keeps a running mean, so a float16 accumulator suits it; so
  # must it suit this drop-in. (optax's own accumulator_dtype=None fails to
  # trace: its two branches disagree on the accumulator's dtype.)
  ours = accum_jax.MultiSteps(optax.sgd(1.0), 4, True, None, accumulator_dtype)
  theirs = optax.MultiSteps(optax.sgd(1.0), 4, True, None, jnp.float16)
  params = {"w": jnp.zeros(3, jnp.float16)}
  grads = {
      "w": jnp.array(
          [[30000.0, -1.0, 0.5]] * 4 + [[60000.0, 1000.0, -0.25], [-60000.0, 3.0, 7.0]] * 2,
          jnp.float16,
      )
  }
  _, our_updates, our_states = scan_updates(ours, params, grads, apply_updates=False)
  _, their_updates, their_states = scan_updates(
      theirs.gradient_transformation(), params, grads, apply_updates=False
  )
  assert our_states.acc_grads["w"].dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(our_updates["w"][3], np.float32), [-30000.0, 1.0, -0.5])
  finite = np.isfinite(np.asarray(their_updates["w"], np.float32))
  assert finite[3].all()
  tree_allclose(
      np.asarray(our_updates["w"], np.float32)[finite],
      np.asarray(their_updates["w"], np.float32)[finite],
      rtol=1e-3,
      atol=1e-3,
  )
  assert tree_all_finite(our_updates)
  # The running mean of the window is optax's acc_grads too, where optax's is
  # finite (its float16 difference 60000 - (-60000) is not).
  their_acc = np.asarray(their_states.acc_grads["w"], np.float32)
  finite = np.isfinite(their_acc)
  assert finite[:4].all()
  np.testing.assert_allclose(
      np.asarray(our_states.acc_grads["w"], np.float32)[finite],
      their_acc[finite],
      rtol=1e-3,
      atol=1e-3,
  )


@pytest.mark.skipif(
    "accumulator_dtype" not in inspect.signature(optax.MultiSteps).parameters,
    reason="this optax.MultiSteps has no accumulator_dtype to compare with",
)
def test_a_float16_accumulator_reads_the_sum_as_optax_does():
  # The narrow accumulator holds the running mean; use_grad_mean=False reads it
  # as Optax's float16 sum.
  ours = accum_jax.MultiSteps(optax.sgd(1.0), 3, False, None, jnp.float16)
  theirs = optax.MultiSteps(optax.sgd(1.0), 3, False, None, jnp.float16)
  params = {"w": jnp.zeros(3, jnp.float16)}
  grads = {"w": jnp.array([[1.5, -2.0, 0.25], [2.25, 4.0, -0.5]] * 2, jnp.float16)}
  _, our_updates, our_states = scan_updates(ours, params, grads, apply_updates=False)
  _, their_updates, their_states = scan_updates(
      theirs.gradient_transformation(), params, grads, apply_updates=False
  )
  assert our_states.acc_grads["w"].dtype == jnp.float16
  tree_allclose(our_states.acc_grads, their_states.acc_grads, **tolerance_for(jnp.float16))
  tree_allclose(our_updates, their_updates, **tolerance_for(jnp.float16))


def test_the_state_survives_donation_in_a_chain_and_restores_into_abstract_state():
  opt = accum_jax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
  chained = optax.chain(optax.clip(1.0), opt.gradient_transformation())
  params = make_params()
  g1, g2, g3 = microbatch_grads(params, 3)
  step = jax.jit(chained.update, donate_argnums=1)
  state = chained.init(params)
  for g in (g1, g2, g3):
    _, state = step(g, state, params)
  multisteps_state = state[1]
  assert type(multisteps_state) is optax.MultiStepsState
  assert not bool(opt.has_updated(multisteps_state))
  assert (int(multisteps_state.mini_step), int(multisteps_state.gradient_step)) == (1, 1)
  # optax.clip(1.0) runs first: the window holds g3, clipped.
  tree_allclose(multisteps_state.acc_grads, jax.tree.map(lambda x: jnp.clip(x, -1.0, 1.0), g3))

  target = accum_jax.checkpoint.abstract_state(opt, params)
  assert type(target) is optax.MultiStepsState
  assert jax.tree.structure(target) == jax.tree.structure(multisteps_state)
  assert shapes_and_dtypes(target.acc_grads, weak_type=False) == shapes_and_dtypes(
      params, weak_type=False
  )
  # Restored into the target's structure, the state takes the next update.
  restored = jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(multisteps_state))
  updates, restored = jax.jit(opt.update)(g1, restored, params)
  assert bool(opt.has_updated(restored)) and int(restored.gradient_step) == 2


# ---------------------------------------------------------------------------
# The state is optax.MultiStepsState: its fields, its checkpoints, its methods.

_MIXED_PARAMS = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2, jnp.bfloat16)}
_HAS_ACCUMULATOR_DTYPE = "accumulator_dtype" in inspect.signature(optax.MultiSteps).parameters
_ACCUMULATOR_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "None": None}


@pytest.mark.parametrize("every_k_name", list(_EVERY_K))
@pytest.mark.parametrize(
    "accumulator_dtype", list(_ACCUMULATOR_DTYPES) if _HAS_ACCUMULATOR_DTYPE else ["default"])
def test_the_state_has_optax_structure_and_leaf_types_in_every_configuration(
    accumulator_dtype, every_k_name
):
  # Float32 and bfloat16 parameters side by side: acc_grads takes
  # accumulator_dtype (the parameters' dtype with None), as Optax's does.
  for use_grad_mean in (True, False):
    for skip in (None, optax.skip_not_finite):
      args = (optax.adam(0.1), _EVERY_K[every_k_name], use_grad_mean, skip)
      if accumulator_dtype != "default":
        args += (_ACCUMULATOR_DTYPES[accumulator_dtype],)
      ours, theirs = accum_jax.MultiSteps(*args), optax.MultiSteps(*args)
      state = jax.eval_shape(ours.init, _MIXED_PARAMS)
      expected = jax.eval_shape(theirs.init, _MIXED_PARAMS)
      assert type(state) is optax.MultiStepsState
      assert jax.tree.structure(state) == jax.tree.structure(expected)
      assert shapes_and_dtypes(state) == shapes_and_dtypes(expected)
      # ...and so after an update (the scan-carry type).
      _, after = jax.eval_shape(ours.update, _MIXED_PARAMS, state, _MIXED_PARAMS)
      assert jax.tree.structure(after) == jax.tree.structure(expected)
      assert shapes_and_dtypes(after) == shapes_and_dtypes(expected)


def test_the_state_is_an_optax_multisteps_state_that_replace_rebuilds():
  assert accum_jax.MultiStepsState is optax.MultiStepsState
  opt = accum_jax.MultiSteps(optax.sgd(1.0), every_k_schedule=3)
  params = {"w": jnp.zeros(2)}
  state = opt.init(params)
  assert isinstance(state, optax.MultiStepsState)
  # Two mini-steps in by hand, with their mean: the next call ends the window.
  state = state._replace(mini_step=jnp.asarray(2, jnp.int32), acc_grads={"w": jnp.ones(2)})
  updates, state = jax.jit(opt.update)({"w": jnp.full(2, 4.0)}, state, params)
  np.testing.assert_allclose(updates["w"], [-2.0, -2.0])  # -(1 + 1 + 4) / 3
  assert isinstance(state, optax.MultiStepsState)
  assert (int(state.mini_step), int(state.gradient_step)) == (0, 1)
  assert bool(opt.has_updated(state))


@functools.cache
def _checkpoint_pair():
  """(accum_jax.MultiSteps, optax.MultiSteps) of sgd with momentum, every 3 calls."""
  return accum_jax.MultiSteps(_INNER, 3), optax.MultiSteps(_INNER, 3)


def _save_and_restore(tree, target):
  ocp = pytest.importorskip("orbax.checkpoint")
  import tempfile

  with tempfile.TemporaryDirectory() as directory:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(f"{directory}/state", tree)
    checkpointer.wait_until_finished()
    return checkpointer.restore(f"{directory}/state", target)


@pytest.mark.parametrize("saved_by", ["optax", "accum_jax"])
def test_a_checkpoint_saved_mid_window_restores_into_the_other_multisteps(saved_by):
  # Four calls (one window of 3 and one mini-step) by one, saved with Orbax,
  # restored into the other's init as the target, five more calls by both: the
  # same training, to float32 round-off (the running mean of a window is
  # Welford's in Optax, a sum divided by the count here).
  ours, theirs = _checkpoint_pair()
  saver, loader = (theirs, ours) if saved_by == "optax" else (ours, theirs)
  params = make_params()
  grads = microbatch_grads(params, 9, seed=5)
  params, _, states = scan_updates(saver, params, stack_trees(grads[:4]))
  saved = jax.tree.map(lambda x: x[-1], states)
  assert (int(saved.mini_step), int(saved.gradient_step)) == (1, 1)
  target = (make_params(), jax.eval_shape(loader.init, make_params()))
  restored_params, restored = _save_and_restore((params, saved), target)
  assert type(restored) is optax.MultiStepsState

  rest = stack_trees(grads[4:])
  their_params, their_updates, their_states = scan_updates(saver, params, rest, state=saved)
  our_params, our_updates, our_states = scan_updates(loader, restored_params, rest, state=restored)
  assert _ints(our_states.mini_step) == _ints(their_states.mini_step) == [2, 0, 1, 2, 0]
  assert _ints(our_states.gradient_step) == _ints(their_states.gradient_step)
  tree_allclose(our_states.acc_grads, their_states.acc_grads)
  tree_allclose(our_states.inner_opt_state, their_states.inner_opt_state)
  tree_allclose(our_updates, their_updates)
  tree_allclose(our_params, their_params)


def _echo_extra_args():
  """An inner optimizer whose update is ``value * grad``, of its extra arguments."""

  def update(updates, state, params=None, *, value, grad):
    del updates, params
    return jax.tree.map(lambda g: value * g, grad), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("inner_name", ["polyak_sgd", "value times grad"])
def test_value_and_grad_reach_the_inner_optimizer_as_the_applying_call_gives_them(inner_name):
  # optax.MultiSteps passes the applying call's extra arguments to the inner
  # optimizer as they are; polyak_sgd's step size reads `value`.
  inner = {"polyak_sgd": optax.polyak_sgd(max_learning_rate=10.0),
           "value times grad": _echo_extra_args()}[inner_name]
  ours, theirs = accum_jax.MultiSteps(inner, 2), optax.MultiSteps(inner, 2)
  params = make_params()
  grads = stack_trees(microbatch_grads(params, 4, seed=2))
  extra_args = {"value": jnp.array([4.0, 1.0, 0.5, 3.0])}
  if inner_name == "value times grad":
    extra_args["grad"] = stack_trees(microbatch_grads(params, 4, seed=6))
  _, our_updates, _ = scan_updates(ours, params, grads, extra_args, apply_updates=False)
  _, their_updates, _ = scan_updates(
      theirs.gradient_transformation(), params, grads, extra_args, apply_updates=False)
  tree_allclose(our_updates, their_updates)
  assert tree_all_finite(our_updates) and any(
      bool(jnp.any(u[1] != 0)) for u in jax.tree.leaves(our_updates))


def test_flush_applies_the_window_so_far_and_needs_no_state():
  opt = accum_jax.MultiSteps(optax.sgd(1.0), 4)
  params = {"w": jnp.zeros(2)}
  step = jax.jit(lambda g, state, flush: opt.update({"w": g}, state, params, flush=flush))
  state = opt.init(params)
  _, state = step(jnp.array([1.0, 2.0]), state, False)
  updates, state = step(jnp.array([3.0, -2.0]), state, True)
  np.testing.assert_allclose(updates["w"], [-2.0, 0.0])
  assert (int(state.mini_step), int(state.gradient_step)) == (0, 1)
  np.testing.assert_array_equal(state.acc_grads["w"], [0.0, 0.0])


def test_weight_is_refused_with_the_fix():
  opt = accum_jax.MultiSteps(optax.sgd(1.0), 3)
  params = {"w": jnp.zeros(2)}
  with pytest.raises(ValueError, match=re.escape(
      "accum_jax.MultiSteps takes no weight=: its state, optax.MultiStepsState,")) as error:
    opt.update(params, opt.init(params), params, weight=2.0)
  assert "accum_jax.accumulate(opt, every_k, reduction=" in str(error.value)


def test_the_readers_of_accumulate_state_refuse_a_multisteps_state():
  opt = accum_jax.MultiSteps(optax.sgd(1.0), 2)
  params = {"w": jnp.zeros(2)}
  state = opt.init(params)
  for reader in (accum_jax.has_updated, accum_jax.optimizer_step, accum_jax.HostSchedule):
    with pytest.raises(ValueError, match=r"found an optax.MultiStepsState .* opt.has_updated"):
      reader(state)
  # optax's own readers answer instead.
  _, state = opt.update(params, state, params)
  _, state = opt.update(params, state, params)
  assert bool(opt.has_updated(state)) and int(state.gradient_step) == 1


_MIGRATING = Path(__file__).resolve().parents[1] / "docs" / "migrating.md"
_EITHER = "either, with `skip_not_finite`"


def _nan_table_rows() -> dict[tuple[str, str], list[str]]:
  """docs/migrating.md's table of a NaN mini-step: (optimizer, call) -> the other cells."""
  text = _MIGRATING.read_text()
  table = re.search(r"<!-- nan-mini-step-table -->(.*?)<!-- /nan-mini-step-table -->", text,
                    re.DOTALL)
  assert table, "docs/migrating.md has no nan-mini-step-table"
  header, rule, *body = [line for line in table.group(1).splitlines() if line.startswith("|")]
  assert [c.strip() for c in header.strip("|").split("|")][:2] == ["optimizer", "after call"]
  rows = {}
  for line in body:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    rows[cells[0], cells[1]] = cells[2:]
  return rows


def _describe(params, initial, acc_grads, mini_step, gradient_step, skip_state, named):
  """One row of the table: what each field became, in the table's words."""
  def has_nan(tree):
    return any(bool(jnp.isnan(x).any()) for x in jax.tree.leaves(tree))

  def close(a, b):
    return all(np.allclose(x, y, rtol=1e-5) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

  if has_nan(params):
    parameters = "NaN"
  else:
    parameters = "unchanged" if close(params, initial) else "updated"
  if has_nan(acc_grads):
    acc = "NaN"
  elif all(not np.asarray(x).any() for x in jax.tree.leaves(acc_grads)):
    acc = "zeros"
  else:
    acc = next(name for name, tree in named.items() if close(acc_grads, tree))
  skip = "`()`" if skip_state == () else (
      f"`should_skip={bool(skip_state['should_skip'])},"
      f" num_not_finite={int(skip_state['num_not_finite'])}`")
  return [parameters, acc, str(int(mini_step)), str(int(gradient_step)), skip]


def test_a_nan_mini_step_does_what_the_migrating_guide_says():
  # Every 3 calls: g1, NaN, g3, g4. Optax's default applies the NaN window and
  # keeps the NaN; accum_jax's skips the window whole and empties acc_grads; with
  # skip_not_finite both reject the NaN call alone.
  params = make_params()
  g1, _, g3, g4 = microbatch_grads(params, 4, seed=1)
  nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), g1)
  named = {"`g1`": g1, "`g4`": g4, "mean of `g1`, `g3`": tree_weighted_mean([g1, g3])}
  inner = optax.sgd(0.1)
  optimizers = {
      "`optax.MultiSteps`": optax.MultiSteps(inner, 3).gradient_transformation(),
      "`accum_jax.MultiSteps`": accum_jax.MultiSteps(inner, 3),
      _EITHER: optax.MultiSteps(inner, 3, should_skip_update_fn=optax.skip_not_finite)
      .gradient_transformation(),
      "accum_jax.MultiSteps with skip_not_finite": accum_jax.MultiSteps(
          inner, 3, should_skip_update_fn=optax.skip_not_finite),
  }
  measured = {}
  for name, opt in optimizers.items():
    _, updates, states = scan_updates(
        opt, params, stack_trees([g1, nan, g3, g4]), apply_updates=False)
    # The parameters after each call, as optax.apply_updates makes them.
    after = jax.tree.map(lambda p, u: p + jnp.cumsum(u, axis=0), params, updates)
    for call in (2, 3, 4):
      at = functools.partial(jax.tree.map, lambda x, i=call - 1: x[i])
      measured[name, "2 (NaN)" if call == 2 else str(call)] = _describe(
          at(after), params, at(states.acc_grads), states.mini_step[call - 1],
          states.gradient_step[call - 1], at(states.skip_state), named)
  for call in ("2 (NaN)", "3", "4"):
    ours = measured.pop(("accum_jax.MultiSteps with skip_not_finite", call))
    assert ours == measured[_EITHER, call], call
  table = _nan_table_rows()
  # The window skipped is said so in the table.
  table["`accum_jax.MultiSteps`", "3"][0] = table["`accum_jax.MultiSteps`", "3"][0].replace(
      " (window skipped)", "")
  assert measured == table
