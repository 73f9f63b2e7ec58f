"""accum_jax.testing.host_syncs on tiny compiled programs.

Each program is compiled on CPU, whose compiler annotates trip counts as XLA:GPU's
does. Predicates and lengths depend on the data, and loops run at least twice,
so that XLA cannot simplify the loop or conditional under test away; each test
also checks that the HLO text still holds it.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import accum_jax
from accum_jax.testing import (
  Conditional,
  HostSyncs,
  Loop,
  assert_no_host_syncs_in_loops,
  host_syncs,
  opcode_counts,
)

X = jnp.arange(8.0) - 3.0


def compiled(f, x=X):
  return jax.jit(f).lower(x).compile()


def count(program, opcode):
  """How many ``opcode`` instructions the compiled program holds, in any computation."""
  return opcode_counts(program, "all")[opcode]


def scan_sum(x):
  return lax.scan(lambda c, xi: (c + xi, None), 0.0, x)[0]


# The conditionals below return an operand unchanged from one branch, which makes
# XLA:GPU keep them (a select would cost more than the branch): each makes the host
# wait, which is what these tests count.
def scan_cond(x):
  def body(c, xi):
    return lax.cond(xi > 0, lambda: c + xi, lambda: c), None

  return lax.scan(body, 0.0, x)[0]


def test_a_scan_has_a_known_trip_count_and_nothing_in_it():
  program = compiled(scan_sum)
  assert count(program, "while") == 1
  syncs = host_syncs(program)
  assert len(syncs.loops) == 1
  assert syncs.loops[0]._replace(name="") == Loop("", "jit(scan_sum)/while", 8, 0, False, False)
  assert syncs.conditionals == ()
  assert syncs.in_loops == () and syncs.unknown_trip_count == ()
  assert syncs.per_run == 0


def test_a_fori_loop_with_static_bounds_has_a_known_trip_count():
  program = compiled(lambda x: lax.fori_loop(0, 5, lambda i, c: c + x[i] * c, 1.0))
  assert count(program, "while") == 1
  syncs = host_syncs(program)
  assert [loop.trip_count for loop in syncs.loops] == [5]
  assert syncs.unknown_trip_count == () and syncs.per_run == 0


def test_a_while_loop_with_a_data_dependent_condition_has_no_trip_count():
  def f(x):
    return lax.while_loop(lambda c: c < 100.0, lambda c: c * 2.0 + x[0], x[1])

  program = compiled(f)
  assert count(program, "while") == 1
  syncs = host_syncs(program)
  (loop,) = syncs.loops
  assert loop.trip_count is None and not loop.in_loop
  assert syncs.unknown_trip_count == (loop,)
  assert syncs.in_loops == ()  # at top level: not inside another loop
  assert syncs.per_run is None


def test_a_cond_outside_loops_syncs_once_per_run():
  program = compiled(lambda x: lax.cond(x[0] > 0, lambda: x * 2.0, lambda: x))
  assert count(program, "conditional") == 1
  syncs = host_syncs(program)
  assert syncs.loops == ()
  assert [c._replace(name="") for c in syncs.conditionals] == [
      Conditional("", "jit(<lambda>)/cond", False, False, 1, gpu_kept=True)
  ]
  assert syncs.in_loops == () and syncs.per_run == 1


def test_a_cond_in_a_scan_body_syncs_once_per_iteration():
  program = compiled(scan_cond)
  assert count(program, "while") == 1 and count(program, "conditional") == 1
  syncs = host_syncs(program)
  (loop,) = syncs.loops
  (cond,) = syncs.conditionals
  assert loop.trip_count == 8 and loop.conditionals == 1
  assert cond.in_loop and not cond.in_branch and cond.runs == 8
  # The body's call is "closed_call" on JAX 0.10, "eval_jaxpr" on 0.12.
  assert re.fullmatch(r"jit\(scan_cond\)/while/body/\w+/cond", cond.op_name), cond.op_name
  assert syncs.in_loops == (cond,)
  assert syncs.per_run == 8


def test_a_cond_in_a_while_condition_is_in_the_loop():
  def f(x):
    def cond(c):
      i, s = c
      near = i < 3
      return lax.cond(s > 0, lambda: i < 5, lambda: near)

    return lax.while_loop(cond, lambda c: (c[0] + 1, c[1] + x[c[0]]), (0, x[0]))

  program = compiled(f)
  assert count(program, "while") == 1 and count(program, "conditional") == 1
  syncs = host_syncs(program)
  (loop,) = syncs.loops
  (cond,) = syncs.conditionals
  assert cond.op_name.endswith("/while/cond/cond")  # in the condition, not the body
  assert cond.in_loop and cond.runs is None
  assert loop.conditionals == 1 and loop.trip_count is None
  assert syncs.in_loops == (cond,)
  assert syncs.per_run is None


def test_a_while_loop_of_unknown_trip_count_in_a_scan_is_in_the_loop():
  def f(x):
    def body(c, xi):
      return lax.while_loop(lambda c: c < xi, lambda c: c * 2.0 + 1.0, c), None

    return lax.scan(body, 0.1, x)[0]

  program = compiled(f)
  assert count(program, "while") == 2
  syncs = host_syncs(program)
  outer = next(loop for loop in syncs.loops if loop.trip_count is not None)
  inner = next(loop for loop in syncs.loops if loop.trip_count is None)
  assert outer.trip_count == 8 and not outer.in_loop
  assert inner.in_loop and re.search(r"/while/body/\w+/while$", inner.op_name), inner.op_name
  assert syncs.in_loops == (inner,)
  assert syncs.unknown_trip_count == (inner,)
  assert syncs.per_run is None


def test_a_cond_in_a_cond_branch_is_in_a_branch():
  def f(x):
    inner = lambda: lax.cond(x[1] > 0, lambda: x * 2.0, lambda: x)  # noqa: E731
    return lax.cond(x[0] > 0, inner, lambda: x + 1.0)

  program = compiled(f)
  assert count(program, "conditional") == 2
  syncs = host_syncs(program)
  by_branch = {c.in_branch: c for c in syncs.conditionals}
  assert set(by_branch) == {False, True}
  assert by_branch[True].op_name.endswith("/cond/branch_1_fun/cond")
  assert not any(c.in_loop for c in syncs.conditionals)
  assert syncs.per_run == 2  # at most: the inner one runs only when its branch is taken
  assert "at most once a run" in str(syncs)


def test_nested_known_loops_multiply_their_trip_counts():
  def f(x):
    def inner(c, xi):
      return lax.cond(xi > c, lambda: c + xi, lambda: c), None

    def outer(c, row):
      return lax.scan(inner, c, row)[0], None

    return lax.scan(outer, 0.0, x.reshape(4, 2))[0]

  program = compiled(f)
  assert count(program, "while") == 2 and count(program, "conditional") == 1
  syncs = host_syncs(program)
  assert sorted(loop.trip_count for loop in syncs.loops) == [2, 4]
  assert sorted(loop.in_loop for loop in syncs.loops) == [False, True]
  assert [loop.conditionals for loop in syncs.loops] == [1, 1]
  assert syncs.per_run == 8


# Written by hand: a conditional on a pred, printed with true_computation= and
# false_computation=, and a conditional in the condition of a counted loop.
HAND_WRITTEN = """HloModule m

%t (p: s32[]) -> s32[] {
  ROOT %p = s32[] parameter(0)
}

%f (q: s32[]) -> s32[] {
  %q = s32[] parameter(0)
  %k = pred[] compare(%q, %q), direction=EQ
  %in = s32[] conditional(%k, %q, %q), true_computation=%t, false_computation=%t
  ROOT %n = s32[] negate(%in)
}

%b (x: s32[]) -> s32[] {
  %x = s32[] parameter(0)
  %k.1 = pred[] compare(%x, %x), direction=EQ
  ROOT %out = s32[] conditional(%k.1, %x, %x), true_computation=%t, false_computation=%f
}

%c (y: s32[]) -> pred[] {
  %y = s32[] parameter(0)
  %k.2 = pred[] compare(%y, %y), direction=EQ
  %z = s32[] conditional(%k.2, %y, %y), true_computation=%t, false_computation=%t
  ROOT %lt = pred[] compare(%z, %y), direction=LT
}

ENTRY %main (a: pred[], s: s32[]) -> s32[] {
  %a = pred[] parameter(0)
  %s = s32[] parameter(1)
  %w = s32[] while(%s), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %top = s32[] conditional(%a, %w, %w), true_computation=%t, false_computation=%t
}
"""


def test_true_and_false_computations_are_followed_as_branches():
  syncs = host_syncs(HAND_WRITTEN)
  assert syncs == HostSyncs((Loop("w", "", 3, 3, False, False),), (
      Conditional("in", "", True, True, 3),  # in the false branch of the loop body's
      Conditional("out", "", True, False, 3),
      Conditional("z", "", True, False, 0),  # XLA:GPU skips a counted loop's condition
      Conditional("top", "", False, False, 1),
  ))
  assert syncs.per_run == 7


def test_assert_no_host_syncs_in_loops():
  assert_no_host_syncs_in_loops(compiled(scan_sum))
  with pytest.raises(AssertionError, match=r"jit\(scan_cond\)/while/body/\w+/cond"):
    assert_no_host_syncs_in_loops(compiled(scan_cond))


def test_assert_no_host_syncs_in_loops_names_a_loop_of_unknown_trip_count():
  def f(x):
    return lax.while_loop(lambda c: c < 100.0, lambda c: c * 2.0 + x[0], x[1])

  with pytest.raises(AssertionError, match=r"jit\(f\)/while\).*trip count"):
    assert_no_host_syncs_in_loops(compiled(f))


def test_a_program_that_is_not_lowered_is_refused():
  with pytest.raises(TypeError, match=r"pass f\.lower\(\*args\) or f\.lower\(\*args\)\.compile"):
    host_syncs(jax.jit(scan_sum))
  with pytest.raises(TypeError, match="int"):
    host_syncs(3)


# Host waits per step: the default skips a non-finite step with selects after the
# loop; "skip_microbatch" has the recheck's one conditional after it.
@pytest.mark.parametrize("on_nonfinite, per_run", [("propagate", 0), ("skip_microbatch", 1)])
def test_value_and_grad_waits_for_the_host_at_most_once_per_step_and_never_in_its_loops(
    on_nonfinite, per_run
):
  def loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] - y) ** 2)

  step = accum_jax.value_and_grad(loss, num_microbatches=4, on_nonfinite=on_nonfinite)
  batch = (jnp.ones((16, 4)), jnp.ones((16, 1)))
  program = jax.jit(step).lower({"w": jnp.ones((4, 1))}, batch).compile()
  assert_no_host_syncs_in_loops(program)
  syncs = host_syncs(program)
  assert [loop.trip_count for loop in syncs.loops if not loop.in_branch] == [4]
  assert syncs.per_run == per_run


def test_a_lowered_program_says_which_conditionals_xla_gpu_replaces_by_selects():
  def scan_of(branch):
    def f(x, n):
      body = lambda c, xi: (lax.cond(xi.sum() > n, branch, jnp.cos, c), None)  # noqa: E731
      return lax.scan(body, x, jnp.stack([x, x, x]))[0]

    return jax.jit(f).lower(jnp.ones((4, 4)), jnp.int32(3))

  cheap = host_syncs(scan_of(jnp.sin))
  (c,) = cheap.conditionals
  assert c.gpu_kept is False and c.in_loop and c.runs == 3
  assert c.op_name.endswith("/cond")
  assert cheap.in_loops == () and cheap.per_run == 0 and cheap.both_branches == (c,)
  assert "never: both branches run" in str(cheap)
  assert_no_host_syncs_in_loops(scan_of(jnp.sin))

  kept = host_syncs(scan_of(lambda x: x @ x))
  (c,) = kept.conditionals
  assert c.gpu_kept is True and kept.in_loops == (c,) and kept.per_run == 3
  assert kept.both_branches == () and "3 times a run" in str(kept)
  with pytest.raises(AssertionError, match="inside a loop"):
    assert_no_host_syncs_in_loops(scan_of(lambda x: x @ x))

  # The compiled program says the same; its text alone cannot say which compiler made it.
  assert host_syncs(scan_of(jnp.sin).compile()) == cheap
  assert host_syncs(scan_of(lambda x: x @ x).compile()) == kept
  text_only = host_syncs(scan_of(jnp.sin).compile().as_text())
  assert text_only.conditionals[0].gpu_kept is None and text_only.per_run == 3


def apply_if_finite_step():
  """A train step under ``optax.apply_if_finite``: its conditional's branches (Adam's
  update, or zeros) are all cheap, so XLA:GPU runs both as selects (seen on an H200)."""
  opt = optax.apply_if_finite(optax.adamw(1e-3), 5)
  params = {"w": jnp.ones((4, 8)), "b": jnp.zeros(8)}

  def step(params, state, x):
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step).lower(params, opt.init(params), jnp.ones((2, 4)))


def test_a_lowered_step_and_its_compiled_program_get_the_same_report():
  lowered = apply_if_finite_step()
  from_lowered, from_compiled = host_syncs(lowered), host_syncs(lowered.compile())
  assert str(from_compiled) == str(from_lowered)
  assert from_compiled == from_lowered
  (gate,) = from_compiled.conditionals
  assert gate.op_name == "jit(step)/cond" and gate.gpu_kept is False
  assert from_compiled.per_run == 0 and from_compiled.both_branches == (gate,)


M = jnp.arange(16.0).reshape(4, 4) / 16
N = jnp.int32(3)


def in_a_scan(branch):
  def f(x, n):
    body = lambda c, xi: (lax.cond(xi.sum() > n, branch, jnp.cos, c), None)  # noqa: E731
    return lax.scan(body, x, jnp.stack([x, x, x]))[0]

  return f


ACCUMULATE = accum_jax.accumulate(optax.adamw(1e-3), 4)


def accumulate_adamw(x, state):
  return ACCUMULATE.update({"w": x}, state, {"w": x})


# A conditional of each kind: XLA:GPU keeps it or runs both branches, for each reason.
PROGRAMS = {
    "cheap branches": lambda x, n: lax.cond(n > 0, jnp.sin, jnp.cos, x),
    "a dot in a branch": lambda x, n: lax.cond(n > 0, lambda x: x @ x, jnp.cos, x),
    "a transpose in a branch": lambda x, n: lax.cond(n > 0, lambda x: x.T + 1.0, jnp.cos, x),
    "a pass-through branch": lambda x, n: lax.cond(n > 0, lambda x: 2.0 * x, lambda x: x, x),
    "lax.switch": lambda x, n: lax.switch(n, [jnp.sin, jnp.cos], x),
    "a side effect": lambda x, n: lax.cond(
        n > 0, lambda x: (jax.debug.callback(lambda v: None, x), 2.0 * x)[1], jnp.cos, x),
    "a cheap cond in a cond": lambda x, n: lax.cond(
        n > 0, lambda x: lax.cond(n > 1, jnp.sin, jnp.cos, x), lambda x: x + 1.0, x),
    "a cheap cond in a scan": in_a_scan(jnp.sin),
    "a kept cond in a scan": in_a_scan(lambda x: x @ x),
    "accumulate(adamw)": accumulate_adamw,
    "an optimization barrier": lambda x, n: lax.cond(
        n > 0, lambda x: lax.optimization_barrier(2.0 * x), jnp.cos, x),
}
BARRIER = pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "XLA:CPU drops an optimization barrier before its compiled program is printed: from a"
    " Compiled, host_syncs judges the conditional to run as selects, which XLA:GPU keeps"))


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=BARRIER) if name == "an optimization barrier" else name
    for name in PROGRAMS])
def test_a_lowered_program_and_its_compiled_program_get_the_same_answer(name):
  args = (M, ACCUMULATE.init({"w": M})) if name == "accumulate(adamw)" else (M, N)
  lowered = jax.jit(PROGRAMS[name]).lower(*args)
  from_lowered = host_syncs(lowered)
  assert from_lowered.conditionals and None not in [c.gpu_kept for c in from_lowered.conditionals]
  assert host_syncs(lowered.compile()) == from_lowered


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="compiles for XLA:GPU: run with JAX_PLATFORMS=cuda on a GPU")
def test_on_a_gpu_the_conditionals_left_are_those_xla_gpu_kept():
  lowered = apply_if_finite_step()
  assert host_syncs(lowered.compile()) == host_syncs(lowered)
  assert host_syncs(lowered).conditionals == ()  # replaced by selects
  kept = jax.jit(PROGRAMS["a kept cond in a scan"]).lower(M, N)
  (c,) = host_syncs(kept.compile()).conditionals
  assert c.gpu_kept is True and host_syncs(kept).conditionals == (c,)
