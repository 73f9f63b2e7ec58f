"""The host's schedule: ``update(..., apply=<Python bool>)`` and ``HostSchedule``.

The host says which call ends a window; two programs are compiled, one that only
adds and one that adds and applies. Each is checked against the device schedule
(``apply`` left out) and against means computed the plain way, through the forms
users write: ``jax.jit`` with a static ``apply``, ``nnx.Optimizer``, a Flax
``TrainState`` and Equinox.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_params, microbatch_grads, tree_allclose, tree_weighted_mean

import accum_jax
from accum_jax.testing import _hlo, opcode_counts

K = 4


def _nan_like(tree):
  return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), tree)


@functools.partial(jax.jit, static_argnames=("opt", "apply"), donate_argnums=(0, 1))
def _step(params, state, grads, weight, *, opt, apply):
  updates, state = opt.update(grads, state, params, weight=weight, apply=apply)
  return optax.apply_updates(params, updates), state


@functools.partial(jax.jit, static_argnames="opt", donate_argnums=(0, 1))
def _device_step(params, state, grads, weight, *, opt):
  updates, state = opt.update(grads, state, params, weight=weight)
  return optax.apply_updates(params, updates), state


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _run_host(opt, params, calls, flags, state=None):
  state = opt.init(params) if state is None else _copy(state)
  params = _copy(params)
  for (grads, weight), apply in zip(calls, flags):
    params, state = _step(params, state, grads, weight, opt=opt, apply=apply)
  return params, state


def _run_device(opt, params, calls, state=None):
  state = opt.init(params) if state is None else _copy(state)
  params = _copy(params)
  for grads, weight in calls:
    params, state = _device_step(params, state, grads, weight, opt=opt)
  return params, state


def _readable(result):
  """``(params, state)`` with the accumulator's sum as users read it (``acc_grads``):
  once a window closes, its raw buffers hold whatever the schedule left there."""
  params, state = result
  found = state if isinstance(state, accum_jax.AccumulationState) else None
  if found is None:
    return params, state
  return params, found._replace(window_total=found.acc_grads)


def _calls(n, nan_at=()):
  grads = microbatch_grads(make_params(), n)
  weights = [1.0 + (i % 3) for i in range(n)]
  return [(_nan_like(g) if i in nan_at else g, jnp.float32(w))
          for i, (g, w) in enumerate(zip(grads, weights))]


# One optimizer per configuration, shared, so that each compiles once.
ADAMW = accum_jax.accumulate(optax.adamw(1e-2, weight_decay=0.1), every_k=K)
IDENTITY = accum_jax.accumulate(optax.identity(), every_k=K)


@pytest.mark.parametrize("nan_at", [(), (5,), (7,)], ids=[
    "finite", "a NaN call in the second window", "a NaN on the second window's closing call"])
def test_the_host_schedule_equals_the_device_schedule(nan_at):
  calls = _calls(3 * K, nan_at)
  flags = [(i + 1) % K == 0 for i in range(3 * K)]
  host = _readable(_run_host(ADAMW, make_params(), calls, flags))
  device = _readable(_run_device(ADAMW, make_params(), calls))
  tree_allclose(host, device, rtol=0, atol=0)
  params, state = host
  assert int(state.optimizer_step) == 3 - len(nan_at)
  # The NaN window is skipped whole and its calls counted; the windows after it
  # stay aligned with the data: calls 8 to 11 make the third window.
  assert int(state.num_skipped) == K * len(nan_at)


def test_host_windows_of_3_5_and_2_calls_apply_their_weighted_means():
  calls = _calls(10)
  lengths = (3, 5, 2)  # every_k=5: windows of at most 5 calls, ended by the host
  flags = [i + 1 == n for n in lengths for i in range(n)]
  opt = accum_jax.accumulate(optax.identity(), every_k=5)
  state = opt.init(make_params())
  start = 0
  for n in lengths:
    for i, (grads, weight) in enumerate(calls[start:start + n]):
      updates, state = jax.jit(opt.update, static_argnames="apply")(
          grads, state, weight=weight, apply=flags[start + i])
      if i < n - 1:
        tree_allclose(updates, jax.tree.map(jnp.zeros_like, grads))
    window = calls[start:start + n]
    tree_allclose(updates, tree_weighted_mean([g for g, _ in window], [w for _, w in window]))
    start += n
  assert int(state.optimizer_step) == 3 and int(state.mini_step) == 0


@pytest.mark.parametrize("on_nonfinite", ["skip_window", "skip_microbatch", "unchecked"])
def test_the_two_programs_hold_no_conditional_and_the_adding_one_no_inner_update(on_nonfinite):
  params = make_params()
  opt = accum_jax.accumulate(optax.adam(1e-3), every_k=K, on_nonfinite=on_nonfinite)
  state = opt.init(params)
  grads, weight = _calls(1)[0]
  programs = {apply: _step.lower(params, state, grads, weight, opt=opt, apply=apply).compile()
              for apply in (False, True)}
  counts = {apply: opcode_counts(compiled, "all") for apply, compiled in programs.items()}
  for apply, found in counts.items():
    assert found["conditional"] == 0, apply
  # Adam's update divides by a square root; the call that only adds holds none.
  assert counts[True]["sqrt"] + counts[True]["rsqrt"] > 0
  assert counts[False]["sqrt"] + counts[False]["rsqrt"] == 0
  # ...and no reduction: with on_nonfinite="skip_window", nothing is checked per call.
  checked = on_nonfinite == "skip_microbatch"
  assert (counts[False]["reduce"] == 0) == (not checked), counts[False]["reduce"]


TREE = accum_jax.accumulate(optax.adamw(1e-2, weight_decay=0.1), every_k=K, layout="tree")
# What the default gives where JAX has one device (the tests run on eight).
PACKED = accum_jax.accumulate(optax.adamw(1e-2, weight_decay=0.1), every_k=K, layout="packed")


@pytest.mark.parametrize("opt", [PACKED, TREE], ids=["packed", "tree"])
def test_a_state_saved_mid_window_continues_under_either_schedule(opt):
  ocp = pytest.importorskip("orbax.checkpoint")
  import tempfile

  calls = _calls(3 * K)
  flags = [(i + 1) % K == 0 for i in range(3 * K)]
  reference = _run_host(opt, make_params(), calls, flags)
  middle = K + 2  # two calls into the second window
  params, state = _run_host(opt, make_params(), calls[:middle], flags[:middle])
  with tempfile.TemporaryDirectory() as directory:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(f"{directory}/state", (params, state))
    checkpointer.wait_until_finished()
    target = (make_params(), accum_jax.checkpoint.abstract_state(opt, make_params()))
    restored = checkpointer.restore(f"{directory}/state", target)
  schedule = accum_jax.HostSchedule(restored[1])
  assert (schedule.calls, schedule.optimizer_step) == (2, 1)
  resumed_flags = [schedule.next() for _ in calls[middle:]]
  assert resumed_flags == flags[middle:]
  host = _run_host(opt, restored[0], calls[middle:], resumed_flags, restored[1])
  device = _run_device(opt, restored[0], calls[middle:], restored[1])
  tree_allclose(_readable(host), _readable(reference), rtol=0, atol=0)
  tree_allclose(_readable(device), _readable(reference), rtol=0, atol=0)


def test_host_schedule_follows_every_k_schedules_and_ends_a_window_on_the_last_call():
  opt = accum_jax.accumulate(optax.identity(), every_k=accum_jax.piecewise_every_k({0: 2, 2: 3}))
  state = opt.init(make_params())
  schedule = accum_jax.HostSchedule(state)
  flags = [schedule.next() for _ in range(9)] + [schedule.next(last=True)]
  assert flags == [False, True, False, True, False, False, True, False, False, True]
  assert schedule.optimizer_step == 4 and schedule.calls == 0
  # As the device schedule, with the same every_k, ends the same windows.
  device_flags = []
  for grads, _ in _calls(9):
    _, state = jax.jit(opt.update)(grads, state)
    device_flags.append(bool(state.last_updated))
  assert device_flags == flags[:9]


def test_apply_must_be_a_python_bool_and_replaces_flush():
  params = make_params()
  state = IDENTITY.init(params)
  grads = microbatch_grads(params, 1)[0]
  with pytest.raises(ValueError, match=re.escape("static_argnames='apply'")):
    jax.jit(lambda a: IDENTITY.update(grads, state, apply=a))(True)
  with pytest.raises(ValueError, match=re.escape("Pass apply=True on the epoch's last call")):
    IDENTITY.update(grads, state, apply=False, flush=True)
  with pytest.raises(ValueError,
                     match=re.escape("accumulate does not take on_nonfinite='propagate'")):
    accum_jax.accumulate(optax.sgd(1.0), every_k=2, on_nonfinite="propagate")
  by_noise = accum_jax.accumulate(
      optax.sgd(1.0), every_k=accum_jax.noise.noise_scale_every_k(8, k_max=4))
  with pytest.raises(ValueError, match=re.escape("Leave apply= out of update for it")):
    accum_jax.HostSchedule(by_noise.init(params))


def test_nnx_optimizer_takes_apply_through_nnx_jit():
  nnx = pytest.importorskip("flax.nnx")
  results = []
  for host in (True, False):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, ADAMW, wrt=nnx.Param)
    schedule = accum_jax.HostSchedule(optimizer)

    @functools.partial(nnx.jit, static_argnames="apply")
    def step(model, optimizer, x, apply):
      grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
      if apply is None:
        optimizer.update(model, grads)
      else:
        optimizer.update(model, grads, apply=apply)

    for i in range(2 * K):
      x = jnp.full((4, 3), float(i + 1)) * jnp.arange(3.0)
      step(model, optimizer, x, schedule.next() if host else None)
    def arrays(tree):
      return jax.tree.map(jnp.asarray, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

    results.append(_readable((arrays(nnx.state(model, nnx.Param)), arrays(optimizer.opt_state))))
  # Two programs against one, compiled apart: float32 round-off apart at most.
  tree_allclose(*results)
  assert int(accum_jax.optimizer_step(results[0][1])) == 2


def test_train_state_and_equinox_take_apply():
  train_state = pytest.importorskip("flax.training.train_state")
  eqx = pytest.importorskip("equinox")
  import accum_jax.flax

  calls = _calls(2 * K)
  flags = [(i + 1) % K == 0 for i in range(2 * K)]
  reference, _ = _run_device(ADAMW, make_params(), calls)

  state = train_state.TrainState.create(apply_fn=None, params=make_params(), tx=ADAMW)
  apply_gradients = jax.jit(accum_jax.flax.apply_gradients, static_argnames="apply")
  for (grads, weight), apply in zip(calls, flags):
    state = apply_gradients(state, grads=grads, weight=weight, apply=apply)
  tree_allclose(state.params, reference, rtol=0, atol=0)
  assert int(state.step) == 2 * K and int(accum_jax.optimizer_step(state)) == 2

  @eqx.filter_jit
  def eqx_step(params, opt_state, grads, weight, apply):  # a Python bool is static here
    updates, opt_state = ADAMW.update(grads, opt_state, params, weight=weight, apply=apply)
    return eqx.apply_updates(params, updates), opt_state

  params, opt_state = make_params(), ADAMW.init(make_params())
  for (grads, weight), apply in zip(calls, flags):
    params, opt_state = eqx_step(params, opt_state, grads, weight, apply)
  tree_allclose(params, reference, rtol=0, atol=0)
  np.testing.assert_array_equal(int(accum_jax.optimizer_step(opt_state)), 2)


# The loop, not the program: the host decides without the device, and runs ahead of it.


@jax.jit
def _slow(x):
  """A computation long enough to be seen in flight (a chain of matmuls, about half a
  second on two cores): the host's few microseconds of Python after dispatching it
  finish first even when another test's computation shares the cores."""
  return jax.lax.fori_loop(0, 60, lambda i, y: jnp.tanh(y @ y), x)


_SLOW_INPUT = np.full((512, 512), 1e-3, np.float32)


@pytest.mark.parametrize("every_k", [
    4, accum_jax.piecewise_every_k({0: 2, 3: 4}), lambda step: 2 if step < 3 else 4,
], ids=["an int", "piecewise_every_k", "a Python function of the step"])
def test_next_moves_no_data_and_returns_while_a_step_is_in_flight(every_k):
  schedule = accum_jax.HostSchedule(
      accum_jax.accumulate(optax.sgd(1.0), every_k=every_k).init(make_params()))
  _slow(_SLOW_INPUT).block_until_ready()  # compiled before
  in_flight = _slow(_SLOW_INPUT)
  with jax.transfer_guard("disallow"):
    flags = [schedule.next() for _ in range(14)]
  assert not in_flight.is_ready()  # next() never waited for it
  lengths = [2, 2, 2, 4, 4] if every_k != 4 else [4, 4, 4, 4]
  expected = [i + 1 == n for n in lengths for i in range(n)][:14]
  assert flags == expected


def test_a_schedule_that_answers_with_a_device_array_is_refused_with_the_fix():
  opt = accum_jax.accumulate(optax.sgd(1.0), every_k=lambda step: jnp.where(step < 3, 2, 4))
  with pytest.raises(TypeError, match="Write the schedule with Python arithmetic"):
    accum_jax.HostSchedule(opt.init(make_params()))


def _slow_loss(params, batch):
  return jnp.mean((_slow(batch["x"]) @ params["w"] - batch["y"]) ** 2)


@functools.partial(jax.jit, static_argnames=("opt", "apply"), donate_argnums=(0, 1))
def _readme_step(params, state, batch, *, opt, apply):
  loss, grads = jax.value_and_grad(_slow_loss)(params, batch)
  updates, state = opt.update(grads, state, params, apply=apply)
  return optax.apply_updates(params, updates), state, loss


def test_the_readme_loop_dispatches_ahead_of_the_device():
  opt = accum_jax.accumulate(optax.adamw(1e-3), every_k=3)
  params = {"w": jnp.zeros((512, 1))}
  state = opt.init(params)
  batch = {"x": _SLOW_INPUT, "y": np.zeros((512, 1), np.float32)}
  for apply in (False, True):  # both programs compiled, the state still new
    _readme_step.lower(params, state, batch, opt=opt, apply=apply).compile()
  schedule = accum_jax.HostSchedule(state)
  losses = []
  for call in range(6):
    params, state, loss = _readme_step(params, state, batch, opt=opt, apply=schedule.next())
    losses.append(loss)
  # The host asked for every flag and dispatched all six calls before the device
  # finished the first.
  assert not losses[0].is_ready()
  assert int(accum_jax.optimizer_step(state)) == 2


def test_the_window_length_is_said_once_and_the_hosts_flag_ends_each_window():
  state = IDENTITY.init(make_params())
  for given in ((8, state), (state, 8), (K,)):
    with pytest.raises(TypeError, match=re.escape("HostSchedule takes the optimizer state alone")):
      accum_jax.HostSchedule(*given)
  schedule = accum_jax.HostSchedule(state)
  assert [schedule.next() for _ in range(2 * K)] == [(i + 1) % K == 0 for i in range(2 * K)]
  # A hand-written flag is the host's word: it ends each window, whatever every_k
  # says. Windows of 3, 5 (past every_k) and 2 calls each apply their own mean,
  # and no call is left out.
  lengths = (3, 5, 2)
  calls = _calls(sum(lengths))
  step = jax.jit(IDENTITY.update, static_argnames="apply")
  start, applied = 0, []
  for length in lengths:
    for i in range(start, start + length):
      updates, state = step(calls[i][0], state, weight=calls[i][1], apply=i == start + length - 1)
    window = calls[start:start + length]
    tree_allclose(updates, tree_weighted_mean([g for g, _ in window], [w for _, w in window]))
    applied.append(int(state.optimizer_step))
    start += length
  assert applied == [1, 2, 3] and int(state.num_skipped) == 0


def test_a_flag_past_every_k_drops_no_gradient():
  # Eight calls at every_k=4 with one flag, on the eighth: one window of all eight.
  opt = accum_jax.accumulate(optax.sgd(1.0), every_k=4)
  params = {"w": jnp.zeros(())}
  state = opt.init(params)
  step = jax.jit(opt.update, static_argnames="apply")
  for call in range(8):
    updates, state = step({"w": jnp.asarray(float(call))}, state, params, apply=call == 7)
  np.testing.assert_allclose(updates["w"], -3.5)  # the mean of 0..7, not of 0..3
  assert int(state.num_skipped) == 0 and int(state.optimizer_step) == 1


def _skip_fn_multisteps(inner):
  return optax.MultiSteps(inner, 2, should_skip_update_fn=optax.skip_not_finite)


@pytest.mark.parametrize("gate", [
    lambda inner: optax.apply_if_finite(inner, 5),
    lambda inner: _skip_fn_multisteps(inner).gradient_transformation(),
    lambda inner: optax.conditionally_transform(inner, lambda step: step % 2 == 0),
], ids=["apply_if_finite", "MultiSteps with a skip function", "conditionally_transform"])
def test_a_gate_around_accumulate_is_refused_on_either_schedule(gate):
  state = gate(ADAMW).init(make_params())
  with pytest.raises(ValueError, match="Put no gate around accumulate"):
    accum_jax.HostSchedule(state)  # the host schedule
  for read in (accum_jax.optimizer_step, accum_jax.has_updated):  # the device schedule's readers
    with pytest.raises(ValueError, match="Put no gate around accumulate"):
      read(state)
  # Inside, a gate acts on the window's update and is welcome.
  inside = accum_jax.accumulate(optax.apply_if_finite(optax.adamw(1e-3), 5), every_k=K)
  assert accum_jax.HostSchedule(inside.init(make_params())).window_length == K


@pytest.mark.parametrize("host", [True, False], ids=["host schedule", "device schedule"])
def test_acc_grads_reads_the_windows_mean_so_far_or_zeros_after_every_call(host):
  # Windows of K: the first applied, the second skipped (a NaN call), the third
  # applied; after every call acc_grads is the window's weighted mean so far, as
  # optax.MultiSteps' is, never the updates, and zeros once the window ended
  # (whatever its buffers hold then: the next call adds to zeros).
  opt = accum_jax.accumulate(optax.sgd(1.0), every_k=K)
  calls = _calls(3 * K, nan_at=(K + 1,))
  state, params = opt.init(make_params()), make_params()
  window: list[tuple] = []
  for i, (grads, weight) in enumerate(calls):
    if host:
      params, state = _step(params, state, grads, weight, opt=opt, apply=(i + 1) % K == 0)
    else:
      params, state = _device_step(params, state, grads, weight, opt=opt)
    window = [] if (i + 1) % K == 0 else window + [(grads, weight)]
    seen = state.acc_grads
    if not window:
      jax.tree.map(lambda t: np.testing.assert_array_equal(t, 0), seen)
    elif i // K == 1 and i > K:  # the NaN call is in the window
      assert all(np.isnan(t).any() for t in jax.tree.leaves(seen))
    else:
      tree_allclose(seen, tree_weighted_mean([g for g, _ in window], [w for _, w in window]))
  assert int(state.optimizer_step) == 2 and int(state.num_skipped) == K


# The packed layout (the default on one device): a call passes the state as a few buffers.


def test_the_packed_state_is_a_few_buffers_and_changes_no_arithmetic():
  calls = _calls(2 * K)
  flags = [(i + 1) % K == 0 for i in range(2 * K)]
  tree = _run_host(TREE, make_params(), calls, flags)
  ours = _run_host(PACKED, make_params(), calls, flags)
  # The same arithmetic: the parameters agree bit for bit, AdamW's moments and the
  # window's mean to float32 round-off (XLA fuses a bucket's mean otherwise than a
  # leaf's: a last bit may differ).
  tree_allclose(ours[0], tree[0], rtol=0, atol=0)
  tree_allclose(ours[1].inner_opt_state.unpack(), tree[1].inner_opt_state)
  tree_allclose(ours[1].acc_grads, tree[1].acc_grads)
  # AdamW's moments in one float32 vector and its count beside it, the window's
  # sum in one vector, the counters and sums in one: against a leaf per parameter
  # for the sum and two for the moments. A scalar parameter's sum and moments stay
  # scalars.
  leaves = len(jax.tree.leaves(make_params()))
  scalars = sum(jnp.ndim(x) == 0 for x in jax.tree.leaves(make_params()))
  assert len(jax.tree.leaves(tree[1].inner_opt_state)) == 2 * leaves + 1
  assert len(jax.tree.leaves(ours[1].inner_opt_state)) == 2 + 2 * scalars
  assert len(jax.tree.leaves(ours[1])) == 4 + 3 * scalars
  # optax.tree.get finds AdamW's count, and only it: no field of accumulate's own is
  # named count.
  assert int(optax.tree.get(ours[1], "count")) == 2


def test_the_packed_states_structure_does_not_grow_with_the_trees_leaves():
  # A jitted call flattens, compares and rebuilds its arguments' structure on every
  # call: the packed state's must not hold a node per leaf of the tree.
  def nodes(leaves):
    params = {f"w{i}": jnp.ones(3) for i in range(leaves)}
    state = PACKED.init(params)
    return jax.tree.structure(state).num_nodes, len(jax.tree.leaves(state))

  assert nodes(100) == nodes(4)


@pytest.mark.xla_fact
def test_the_windows_sum_is_one_bucket_each_leaf_added_where_it_lies():
  # Twelve leaves of 80 KiB, past the inner state's eight to a bucket: the sum holds
  # them in one, and a call adds each leaf into its slice in place, a
  # dynamic-update-slice that reads the bucket only at the offset it writes (a
  # static slice of it would make XLA write the whole bucket out for each leaf).
  params = {f"w{i}": jnp.ones((128, 160)) for i in range(12)}
  state = PACKED.init(params)
  assert len(state.window_total.vectors) == 1
  step = jax.jit(lambda g, s: PACKED.update(g, s, params, apply=False)[1],
                 donate_argnums=1)
  program = _hlo.parse(step.lower(params, state).compile().as_text())
  adds = [c for c in program.values()
          if c.root and c.instructions[c.root].opcode == "dynamic-update-slice"
          and c.instructions[c.root].shape.startswith("f32[245760]")]
  assert len(adds) == 12
  assert not [i.line for c in adds for i in c.instructions.values()
                 if i.opcode == "slice" and i.shape.startswith("f32")]


@pytest.mark.xla_fact
def test_a_run_of_small_leaves_is_one_part_of_a_bucket_of_large_ones():
  # Ten leaves of 80 KiB and thirty of 12 bytes: AdamW's twenty large moments and
  # its sixty small ones, which make one run, are 21 parts, in three buckets of at
  # most eight (the last holds four large moments and the run). The applying call
  # writes each bucket back with a concatenate of at most eight operands, which
  # XLA:CPU fuses into what computes them: the run is concatenated first, behind a
  # barrier, else XLA flattens it into its bucket's concatenate.
  params = {f"w{i}": jnp.ones((128, 160)) for i in range(10)}
  params.update({f"b{i}": jnp.ones(3) for i in range(30)})
  state = PACKED.init(params)
  sizes = state.inner_opt_state.layout.sizes
  assert sizes == (8 * 20480, 8 * 20480, 4 * 20480 + 60 * 3)
  step = jax.jit(lambda g, s: PACKED.update(g, s, params, apply=True)[1],
                 donate_argnums=1)
  program = _hlo.parse(step.lower(params, state).compile().as_text())
  written = [len(i.operands) for c in program.values() for i in c.instructions.values()
             if i.opcode == "concatenate" and i.shape.split("{")[0] in {
                 f"f32[{n}]" for n in sizes}]
  assert sorted(written) == [5, 8, 8], written


def test_sharded_parameters_keep_a_tree_placed_like_them_and_packed_is_refused():
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip("needs several devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  mesh = jax.make_mesh((len(devices),), ("data",))
  spec = jax.sharding.PartitionSpec
  params = {"w": jax.device_put(jnp.ones((len(devices), 3)),
                                jax.sharding.NamedSharding(mesh, spec("data")))}
  packed = accum_jax.accumulate(optax.adamw(1e-2), every_k=K, layout="packed")
  with pytest.raises(ValueError, match=re.escape("pass layout='tree'")):
    packed.init(params)
  # On several devices the default keeps a tree, eagerly and under jax.jit (where
  # init cannot tell the placement), each leaf sharded like its parameter: no
  # replicated parameter-sized leaf.
  for init in (ADAMW.init, jax.jit(ADAMW.init)):
    with jax.set_mesh(mesh):
      state = init(params)
    assert not isinstance(state.window_total, accum_jax._across_calls._layout.Packed)
    for leaf in jax.tree.leaves(state):
      if leaf.shape == params["w"].shape:
        assert not leaf.sharding.is_fully_replicated
  # Replicated parameters may be packed, when asked.
  replicated = jax.device_put(params, jax.sharding.NamedSharding(mesh, spec()))
  assert len(jax.tree.leaves(packed.init(replicated).inner_opt_state)) == 2


def test_a_state_restored_under_another_every_k_loses_no_call():
  # Three calls into a window of 4, restored into the state of an accumulate with
  # every_k=2 (what a restore into the new transformation's init gives): the open
  # window, already past the new length, ends at its next call, with all four calls.
  old, new = (accum_jax.accumulate(optax.sgd(1.0), every_k=k) for k in (4, 2))
  params = {"w": jnp.zeros(())}
  state = old.init(params)
  step = jax.jit(old.update, static_argnames="apply")
  for call in range(3):
    _, state = step({"w": jnp.asarray(float(call))}, state, params, apply=False)
  restored = new.init(params)._replace(**{
      name: getattr(state, name) for name in ("window_total", "inner_opt_state", "scalars")})
  schedule = accum_jax.HostSchedule(restored)
  flag = schedule.next()
  assert flag
  updates, restored = jax.jit(new.update, static_argnames="apply")(
      {"w": jnp.asarray(3.0)}, restored, params, apply=flag)
  np.testing.assert_allclose(updates["w"], -1.5)  # the mean of 0, 1, 2 and 3
  assert int(restored.num_skipped) == 0 and int(restored.optimizer_step) == 1
  # The old transformation's update refuses the new state: one state, one length.
  with pytest.raises(ValueError, match="one state, one window length"):
    step({"w": jnp.asarray(0.0)}, restored, params, apply=False)
