"""What XLA:CPU chooses, pinned: counts and bytes read off compiled programs.

Each test here reads a number off a program that XLA:CPU compiled (how many
fusions, copies or all-reduces it makes, how many bytes its output tuple takes)
that the library's design does not fix: a JAX or jaxlib upgrade may change it with
nothing wrong. Each says which fact it pins, what it was measured at, and what to
do when an upgrade changes it. The design properties that the same programs show
(no conditional in a micro-step, no all-reduce in the loop, no leaf copied) stay
with their modules' tests, which compile these programs once for both: the
programs are the cached ones of those modules, imported from them. The facts of
bench/bench_micro_step.py's micro-steps are pinned in test_bench_micro_step.py,
marked alike: its programs take the longest to compile, and a test here would build
them again on the other worker of ``-n 2``.

All are marked ``xla_fact``: ``python -m pytest -m "not xla_fact"`` leaves them out,
on a new JAX, until they are measured again (docs/development.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
import test_cached as cached
import test_cost_model as cost_model
import test_sharding as sharding
import test_step_cost as step_cost
from helpers import full_size_copies

import accum_jax
from accum_jax.testing import collective_counts, collectives, kernel_counts

# ---------------------------------------------------------------------------
# Fusions.


@pytest.fixture(scope="module")
def step_fusions():
  """Top-level fusions of test_step_cost.py's step (24 layers, 48 leaves), by mode."""
  args = (step_cost._params(), jnp.ones((step_cost.BATCH, step_cost.WIDTH)))
  return {
      mode: kernel_counts(jax.jit(accum_jax.value_and_grad(step_cost._loss, step_cost.N, **kwargs))
                          .lower(*args).compile()).fusions
      for mode, kwargs in (("default", {}), ("no skip", {"on_nonfinite": "unchecked"}))
  }


@pytest.mark.xla_fact
def test_the_step_check_after_the_loop_is_a_few_fusions_not_one_per_leaf(step_fusions):
  """XLA:CPU makes the default's step at most 8 top-level fusions more than
  ``on_nonfinite="unchecked"``'s, besides one select per leaf: the NaN a skipped
  step's gradient takes, which the unchecked step does not write (its result is the
  sums as they are). The 8 are the check of the packed sums after the loop (a copy
  and a reduction, which it may split): 100 against 48 for 48 leaves on JAX 0.10.2.
  Unpacked, a reduction per leaf would add 48 or more (two each where XLA:CPU splits
  them).

  On a JAX upgrade that changes it: print ``step_fusions``; if the difference less
  the leaves still does not grow with them (set ``test_step_cost.LAYERS`` to 48 and
  compare), update the 8; if it does, the check is no longer packed, a regression.
  """
  leaves = len(jax.tree.leaves(step_cost._params()))
  assert step_fusions["default"] - step_fusions["no skip"] - leaves <= 8, step_fusions


# ---------------------------------------------------------------------------
# Copies.

# test_transform.py holds the forms in which each state leaf keeps its buffer (no copy
# at all); in these the state's buffers go to other outputs, or are not donated, and
# how many copies XLA inserts then is its buffer assignment's choice.
PARTIAL_DONATION = {
    "jax.jit(tx.update, donate_argnums=1)": 1,
    "jax.jit(tx.update), nothing donated": (),
}


def _bare_add(grads, acc, params=None):
  """The floor: add the gradient to a sum, return zero updates; nothing else."""
  del params
  return jax.tree.map(jnp.zeros_like, grads), jax.tree.map(jnp.add, acc, grads)


@pytest.mark.xla_fact
@pytest.mark.parametrize("form", list(PARTIAL_DONATION))
def test_a_call_that_only_accumulates_copies_only_what_the_form_moves(form):
  """XLA:CPU's full-size copies (``helpers.full_size_copies``) in a call of
  ``accumulate(adam)`` that only accumulates, jitted with less than the state donated.

  With the state donated but not the gradient, the updates come first and take the
  accumulator's buffers, and each state leaf the next one's: XLA copies Adam's
  moments, which move on every call, and the gradient held as the updates (the
  conditional's skip branch passes the window's sum through, so that XLA:GPU keeps
  it), at most one copy each more than the floor (a bare jitted add, whose zero
  updates take its accumulator's buffers). With nothing donated every output is a
  new buffer: the moments passed through and the gradient held are copied, and
  nothing else. 12 and 6 full-size copies on JAX 0.10.2. From tests/test_transform.py.

  On a JAX upgrade that changes it: see which shapes are copied
  (``accum_jax.testing.copied_shapes(compiled, "all")``); if XLA now copies what
  no output needs moved, raise the bound here and say why; fewer copies need no
  change.
  """
  # Several parameters share a shape, as in most models.
  params = {f"layer{i}": {"w": jnp.ones((32, 32)), "b": jnp.ones(32)} for i in range(3)}
  grads = jax.tree.map(lambda x: 0.5 * x, params)
  opt = accum_jax.accumulate(optax.adam(1e-3), every_k=4)
  state = opt.init(params)
  donate = PARTIAL_DONATION[form]
  copies = full_size_copies(
      jax.jit(opt.update, donate_argnums=donate).lower(grads, state, params).compile(), params)
  largest = max(x.size for x in jax.tree.leaves(params))
  moments = sum(x.size == largest for x in jax.tree.leaves(state.inner_opt_state))
  held = sum(x.size == largest for x in jax.tree.leaves(grads))
  if donate == 1:
    floor = full_size_copies(
        jax.jit(_bare_add, donate_argnums=1).lower(grads, params, None).compile(), params)
    assert copies <= floor + moments + held, (copies, floor, moments, held)
  else:
    assert copies <= moments + held, (copies, moments, held)


# How many scalars the device schedule's micro-step copies, against the leaves a
# hand-written conditional copies, is pinned in test_bench_micro_step.py beside the
# programs it is read from, with those programs' fusions against the floor's.


# ---------------------------------------------------------------------------
# All-reduces.


@pytest.mark.xla_fact
def test_a_data_parallel_step_reduces_in_one_all_reduce():
  """XLA (JAX 0.10 and later) keeps the one ``psum`` of the sums, weights and counts
  after the loop as one all-reduce of a tuple; older XLA split it into one per
  array. On test_sharding.py's data-parallel step of 4 microbatches; that none
  runs in the loop is checked there.

  On a JAX upgrade that changes it: list them
  (``accum_jax.testing.collectives(hlo)``); several all-reduces after the loop,
  none inside, is XLA splitting the reduction: update the 1.
  """
  counts = collective_counts(sharding.data_parallel_step_hlo())
  assert counts.outside_loop == 1, counts


@pytest.mark.xla_fact
def test_the_cached_door_reduces_in_one_all_reduce():
  """As above, for ``cached_value_and_grad`` on 8 devices (test_cached.py's CLIP
  step with dropout): XLA makes its loss, gradient and weight one all-reduce.

  On a JAX upgrade that changes it: as above; that none runs in the chunks' loops
  is checked in test_cached.py.
  """
  found = collectives(cached.data_parallel_program().as_text())
  all_reduces = [c for c in found if c.kind == "all-reduce"]
  assert len(all_reduces) == 1, found


# ---------------------------------------------------------------------------
# Bytes.


@pytest.mark.xla_fact
@pytest.mark.parametrize(("mode", "width", "layers", "k"), cost_model.CASES)
def test_output_bytes_are_the_gradient_the_loss_and_a_pointer_per_output(mode, width, layers, k):
  """XLA:CPU's ``memory_analysis().output_size_in_bytes`` of test_cost_model.py's
  steps: the gradient's shard, the loss (4 bytes), and its output tuple's table of
  one 8-byte pointer per output (the layers' gradients and the loss).

  On a JAX upgrade that changes it: if ``output_size_in_bytes - cost.output - 4``
  is still the same for every mode at a size, XLA counts its tuple differently:
  update the ``8 * (layers + 1)``; if it differs between modes, the gradient's
  shard is not the model's, which test_cost_model.py's other checks should show.
  """
  compiled, _, _, cost = cost_model._compiled(mode, width, layers, k)
  output = compiled.memory_analysis().output_size_in_bytes
  assert output == cost.output + 4 + 8 * (layers + 1), (output, cost.output)


@pytest.mark.xla_fact
def test_reading_the_optax_state_adds_no_kernel_to_the_micro_step():
  # The conversions between optax.MultiStepsState and accumulate's window are
  # elementwise, and fuse into the add: a jitted train step of a 16-leaf model
  # launches no more top-level fusions or copies than accumulate's own, but for a
  # pass a leaf: optax's state holds acc_grads zeroed where a window ended, where
  # accumulate writes nothing into its sum, and its counters and sums are two
  # vectors, where accumulate's are one (on XLA:CPU, JAX 0.10.2, 55 fusions and 2
  # copies against 36 and 2; before accumulate stopped emptying its sum, 55 and 1
  # against 57 and 2).
  from accum_jax.testing import kernel_counts

  params = {f"layer{i}": jnp.zeros((8, 4)) for i in range(16)}
  counts = {}
  for name, opt in {
      "MultiSteps": accum_jax.MultiSteps(optax.adam(1e-3), 4),
      "accumulate": accum_jax.accumulate(optax.adam(1e-3), 4),
  }.items():
    def step(params, state, grads, opt=opt):
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    program = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt.init(params), params)
    counts[name] = kernel_counts(program.compile())
  leaves = len(jax.tree.leaves(params))
  assert counts["MultiSteps"].fusions <= counts["accumulate"].fusions + leaves + 3, counts
  assert counts["MultiSteps"].copies <= counts["accumulate"].copies, counts
  assert counts["MultiSteps"].conditionals == 1, counts


def _summed_loss(params, batch):
  # A gradient that takes no memory of its own: the step's buffers are the sums'.
  leaves = jax.tree.leaves(params)
  total = sum(jnp.sum(x.astype(jnp.float32)) * (i + 1) for i, x in enumerate(leaves))
  return total * jnp.mean(batch)


def _beyond_arguments(fun, params, batch) -> int:
  stats = jax.jit(fun).lower(params, batch).compile().memory_analysis()
  return stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes


@pytest.mark.xla_fact
@pytest.mark.parametrize("options", [{}, {"return_info": True}], ids=["plain", "the loop"])
def test_the_step_needs_no_more_memory_than_the_hand_written_scan(options):
  """XLA:CPU's memory beyond the arguments (temp + output - alias) of
  ``value_and_grad(loss, 4)`` on 24 bfloat16 leaves of 128 x 128, at most the
  hand-written scan's (float32 sums started from constant zeros, ``jax.value_and_grad``
  in the body, divided after): the plain scan and the loop each hold one float32
  sum, as it does. Measured on JAX 0.10.2: 0.99x both; 1.62x when the sums
  started from zeros made as an expression of the parameters (a buffer of their
  own beside the loop's). bench/bench_step_memory.py measures GPT-2 small's tree.

  On a JAX upgrade that changes it: compare both programs' ``memory_analysis()``
  field by field; a sum's worth more in accum_jax's temp is a second copy of the
  sums, which its HLO shows as a buffer of the float32 leaves' shapes.
  """
  params = {f"w{i:02d}": jnp.zeros((128, 128), jnp.bfloat16) for i in range(24)}
  batch = jnp.ones((8, 2))

  def hand_written(params, batch):
    def body(total, microbatch):
      value, grads = jax.value_and_grad(_summed_loss)(params, microbatch)
      return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), total, (value, grads)), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (jnp.zeros(()), params))
    (value, grads), _ = jax.lax.scan(body, zeros, batch.reshape(4, 2, 2))
    return value / 4, jax.tree.map(lambda g, p: (g / 4).astype(p.dtype), grads, params)

  floor = _beyond_arguments(hand_written, params, batch)
  ours = _beyond_arguments(accum_jax.value_and_grad(_summed_loss, 4, **options), params, batch)
  assert ours <= 1.01 * floor, (ours / floor, ours, floor)


def _tanh_loss(params, batch):
  x = batch["x"]
  for name in sorted(params):
    x = jnp.tanh(x @ params[name])
  return jnp.mean((x - batch["y"]) ** 2)


@pytest.mark.xla_fact
def test_under_automatic_sharding_the_step_needs_the_constrained_scans_memory():
  """XLA:CPU's memory beyond the arguments, per device, of
  ``value_and_grad(loss, 8, data_parallel=DataParallel(split="strided"))`` without a
  mesh, the parameters sharded over 8 devices under automatic sharding: at most the
  hand-written scan's whose carry is constrained to the parameters' shardings (the
  reference of bench/bench_sharded.py). The trace cannot see the parameters'
  placement, so the sums start as an expression of them, placed as they are
  (``_arrays.loop_zeros``). Measured on JAX 0.10.2 at 4 x 256: 1.00x; 1.14x with
  constant zeros, which XLA placed otherwise (at bench_sharded.py's 4 x 1024, 30.7
  against 26.9 MiB).

  On a JAX upgrade that changes it: compare both programs' ``memory_analysis()``
  and the while loop's carry shardings in the compiled HLO.
  """
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  rows, shard = NamedSharding(mesh, P("d")), NamedSharding(mesh, P("d", None))
  params = {f"w{i}": jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=shard)
            for i in range(4)}
  batch = {"x": jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=rows),
           "y": jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=rows)}
  by_microbatch = NamedSharding(mesh, P(None, "d"))

  def constrained_scan(params, batch):
    def constrain(tree):
      return jax.lax.with_sharding_constraint(tree, {k: shard for k in tree})

    def split(x):  # microbatch i: rows i, i + 8, ...
      x = x.reshape(x.shape[0] // 8, 8, *x.shape[1:]).swapaxes(0, 1)
      return jax.lax.with_sharding_constraint(x, by_microbatch)

    def body(carry, microbatch):
      total, grads = carry
      value, g = jax.value_and_grad(_tanh_loss)(params, microbatch)
      return (total + value, constrain(jax.tree.map(jnp.add, grads, g))), None

    zeros = constrain(jax.tree.map(jnp.zeros_like, params))
    (total, grads), _ = jax.lax.scan(body, (jnp.float32(0), zeros), jax.tree.map(split, batch))
    return total / 8, jax.tree.map(lambda g: g / 8, grads)

  strided = accum_jax.value_and_grad(
      _tanh_loss, 8, data_parallel=accum_jax.DataParallel(split="strided"))
  floor = _beyond_arguments(constrained_scan, params, batch)
  ours = _beyond_arguments(strided, params, batch)
  assert ours <= 1.01 * floor, (ours / floor, ours, floor)
