"""accum_jax.testing.gpu_conditionals: which conditionals XLA:GPU turns into selects.

One hand-written program per rule of XLA:GPU's conditional rewrite (openxla/xla
``conditional_simplifier.cc``, after the algebraic simplifier has made the index of
``lax.cond`` a boolean). Each test also checks that the unoptimised program holds
what the rule reads, so that a change in how JAX lowers cannot make it pass for
another reason. On a GPU (``JAX_PLATFORMS=cuda``), one more test compiles every
program there and checks that XLA:GPU kept exactly the conditionals predicted kept.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

from accum_jax.testing import (
  GpuConditional,
  assert_conditionals_kept,
  gpu_conditionals,
)

X = jnp.arange(16.0).reshape(4, 4) / 16
N = jnp.int32(3)


def lowered(f, *args):
  return jax.jit(f).lower(*(args or (X, N)))


def text(f, *args):
  return lowered(f, *args).as_text(dialect="hlo")


def cond(true_fun, false_fun=lambda x: x + 1.0):
  return lambda x, n: lax.cond(n > 0, true_fun, false_fun, x)


@jax.jit
def double(x):
  return 2.0 * x


@jax.named_call
def halve(x):
  return x / 2.0


def adafactor_like(x):
  # Factored second moments: row and column means of the square, then rsqrt.
  v = jnp.mean(x * x, axis=1, keepdims=True) * jnp.mean(x * x, axis=0, keepdims=True)
  return x * lax.rsqrt(v / jnp.mean(v) + 1e-30)


RULES = [
  # (id, program, kept, reason, an opcode the unoptimised program must hold)
  ("cheap elementwise branches", cond(lambda x: jnp.sin(x) * 2.0), False,
   "all instructions cheap: both branches run", "sine("),
  ("reductions count as cheap (Adafactor-like)", cond(adafactor_like), False,
   "all instructions cheap", "reduce("),
  ("a cheap closed call is inlined", cond(double), False, "all instructions cheap", "call("),
  ("a cheap named call", cond(halve), False, "all instructions cheap", "divide("),
  ("a dot", cond(lambda x: x @ x), True, r"branch 1 holds a dot \(dot", "dot("),
  ("a transpose", cond(lambda x: x.T + 1.0), True, "branch 1 holds a transpose", "transpose("),
  ("an iota", cond(lambda x: x * jnp.arange(4.0)), True, "branch 1 holds an iota", "iota("),
  ("a pass-through branch", cond(lambda x: x * 2.0, lambda x: x), True,
   "branch 0 only passes its operands through", "conditional("),
  ("a pass-through call", cond(lambda x: x * 2.0, jax.jit(lambda x: x)), True,
   "branch 0 only passes its operands through", "call("),
  ("an optimization barrier", cond(lambda x: lax.optimization_barrier(x * 2.0)), True,
   r"branch 1 holds an opt-barrier", "opt-barrier("),
  ("a while loop", cond(lambda x: lax.fori_loop(0, 3, lambda i, c: c * 2.0, x)), True,
   "branch 1 holds a while", "while("),
  ("a side effect, jax.debug.callback",
   cond(lambda x: (jax.debug.callback(lambda v: None, x), x * 2.0)[1]), True,
   r"custom-call\) has a side effect", "custom_call_has_side_effect=true"),
  ("a side effect in an otherwise cheap branch, rng",
   cond(lambda x: x + lax.rng_uniform(0.0, 1.0, x.shape)), True, r"\(rng\) has a side effect",
   "rng("),
  ("three branches", lambda x, n: lax.switch(n, [jnp.sin, jnp.cos, jnp.tanh], x), True,
   "3 branches: only two can become selects", "conditional("),
  ("two branches of lax.switch: a clamped integer index",
   lambda x, n: lax.switch(n, [jnp.sin, jnp.cos], x), True,
   "its index clamp.* is an integer clamp", "clamp("),
]


@pytest.mark.parametrize(("program", "kept", "reason", "holds"),
                         [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_each_rule_of_the_rewrite(program, kept, reason, holds):
  assert holds in text(program)
  (found,) = gpu_conditionals(lowered(program))
  assert found.kept is kept
  assert re.search(reason, found.reason), found.reason
  assert found.op_name.startswith("jit(") and found.op_name.endswith(("/cond", "/switch"))


def test_a_cond_nested_in_a_cond_is_judged_first():
  def nested(inner):
    return lambda x, n: lax.cond(
        n > 0, lambda x: lax.cond(n > 1, inner, jnp.cos, x), lambda x: x + 1.0, x)

  inner, outer = gpu_conditionals(lowered(nested(jnp.sin)))
  assert (inner.kept, outer.kept) == (False, False)  # the inner's selects are cheap
  inner, outer = gpu_conditionals(lowered(nested(lambda x: x @ x)))
  assert inner.kept and re.search("holds a dot", inner.reason)
  assert outer.kept and outer.reason == f"branch 1 holds {inner.name}, a conditional XLA:GPU keeps"


# Written by hand: JAX removes dead code itself. A dot whose result no one uses is
# removed by XLA before the rule runs; a conditional already on a pred needs no rewrite.
DEAD_DOT = """HloModule m

%skip (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4] parameter(0)
  %one = f32[] constant(1)
  %ones = f32[4,4] broadcast(%one), dimensions={}
  ROOT %plus = f32[4,4] add(%p, %ones)
}

%update (q: f32[4,4]) -> f32[4,4] {
  %q = f32[4,4] parameter(0)
  %unused = f32[4,4] dot(%q, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %twice = f32[4,4] add(%q, %q)
}

ENTRY %main (x: f32[4,4], k: pred[]) -> f32[4,4] {
  %x = f32[4,4] parameter(0)
  %k = pred[] parameter(1)
  ROOT %c = f32[4,4] conditional(%k, %x, %x), true_computation=%update, false_computation=%skip
}
"""


def test_dead_code_does_not_count_and_a_pred_index_needs_no_convert():
  assert gpu_conditionals(DEAD_DOT) == (
      GpuConditional("c", "", False, "all instructions cheap: both branches run"),)
  used = DEAD_DOT.replace("add(%q, %q)", "add(%q, %unused)")
  (found,) = gpu_conditionals(used)
  assert found.kept and found.reason == "branch 0 holds a dot (unused)"


def adamw_steps():
  params = {"w": X, "b": jnp.ones(4)}
  opt = optax.adamw(1e-3)

  def update(grads, state, count):
    return opt.update(grads, state, params)

  def zeros_in_the_skip_branch(grads, state, count):
    skip = lambda g, s: (jax.tree.map(jnp.zeros_like, g), s)  # noqa: E731
    return lax.cond(count % 8 == 0, lambda g, s: update(g, s, count), skip, grads, state)

  def zeros_outside(grads, state, count):
    emit = count % 8 == 0
    new_updates, new_state = lax.cond(
        emit, lambda g, s: update(g, s, count), lambda g, s: (g, s), grads, state)
    updates = jax.tree.map(lambda u: jnp.where(emit, u, 0.0), new_updates)
    return updates, new_state

  args = (params, opt.init(params), N)
  return lowered(zeros_in_the_skip_branch, *args), lowered(zeros_outside, *args)


def test_adamw_under_a_hand_written_cond_runs_on_every_call_unless_its_skip_passes_through():
  with_zeros, pass_through = adamw_steps()
  (found,) = gpu_conditionals(with_zeros)
  assert not found.kept and found.reason == "all instructions cheap: both branches run"
  (found,) = gpu_conditionals(pass_through)
  assert found.kept and found.reason == "branch 0 only passes its operands through"
  assert_conditionals_kept(pass_through)
  with pytest.raises(AssertionError, match=re.escape(
      f"{found.name} (jit(zeros_in_the_skip_branch)/cond): all instructions cheap")):
    assert_conditionals_kept(with_zeros)


def test_text_and_lowered_give_the_same_answer_and_compiled_programs_are_refused():
  program = lowered(cond(jnp.sin))
  assert gpu_conditionals(program.as_text(dialect="hlo", debug_info=True)) == (
      gpu_conditionals(program))
  with pytest.raises(TypeError, match=r"not its \.compile\(\)"):
    gpu_conditionals(program.compile())
  with pytest.raises(TypeError, match="int"):
    gpu_conditionals(3)



def every_program():
  """(id, lowered program) for each program above: each rule's, the nested ones, Adam's."""
  programs = [(r[0], lowered(r[1])) for r in RULES]
  for name, inner in (("nested, cheap", jnp.sin), ("nested, a dot", lambda x: x @ x)):
    programs.append((name, lowered(lambda x, n, inner=inner: lax.cond(
        n > 0, lambda x: lax.cond(n > 1, inner, jnp.cos, x), lambda x: x + 1.0, x))))
  with_zeros, pass_through = adamw_steps()
  return programs + [("adamw, zeros in the skip", with_zeros),
                     ("adamw, a pass-through skip", pass_through)]


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="compiles for XLA:GPU: run with JAX_PLATFORMS=cuda on a GPU")
def test_xla_gpu_keeps_exactly_the_conditionals_predicted_kept():
  for name, program in every_program():
    predicted = sum(c.kept for c in gpu_conditionals(program))
    assert program.compile().as_text().count(" conditional(") == predicted, name
