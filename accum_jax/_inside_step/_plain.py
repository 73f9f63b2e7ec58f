"""The plain scan: what a call that uses no option runs.

A call with ``value_and_grad``'s defaults (no aux, weights, keys, state, mesh,
per-leaf reduction, info or noise; a float32 accumulator, or any accumulator at
least as wide) needs only what a hand-written scan does: each microbatch's loss,
scaled by ``1 / N`` before differentiation, and its gradient added into sums
made like the parameters; after the loop, one check of the sums
(``on_nonfinite="propagate"``), and a step that is not finite comes back with
its gradient NaN in every leaf, as the whole batch's would be.

No microbatch is traced before the loop: the scan traces ``fun`` once, and the
losses come out of it stacked (``N`` scalars), so that the value's dtype needs
no trace of its own. Every other call takes the loop of :mod:`._loop`, which
adds the options' work around the same arithmetic.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from accum_jax import _core
from accum_jax._inside_step import _batching, _call, _result, _trace


def takes(call: _call.Bound) -> bool:
  """Whether the plain scan runs a bound call: its options are plain
  (``Options.plain``, decided when the function is built), and every gradient
  leaf combines by "mean" (not so where Flax's FP8 statistics take their
  default "max")."""
  if not call.options.plain:
    return False
  return call.grad_kinds.count("mean") == len(call.grad_kinds)


def run(call: _call.Bound, grad_fun: _trace.Checked) -> tuple[jax.Array, Any]:
  """The call's value and gradient over its microbatches: one ``lax.scan``."""
  options, params = call.options, call.diff
  fun = _trace.Fun(grad_fun, options, call.batch_argnums, call.kwargs)
  n = options.num_microbatches
  split = functools.partial(_batching.split, num_microbatches=n, how=options.split)
  batch = {}
  for i in call.batch_argnums:
    batch[i] = jax.tree.map(split, call.args[i])
  share = 1.0 / jnp.float32(n)  # every microbatch weighs 1

  def step(sums, x):
    index, mb = x
    out = _trace.run(fun, call.args, None, index, mb, None, share, params)
    return jax.tree.map(_added, sums, out.grads), (out.value, out.raw_value)

  step = jax.named_call(step, name="accum_jax_microbatch")
  zeros = _core.init(params, options.accumulator_dtype, in_loop=True).total
  sums, (values, losses) = jax.lax.scan(step, zeros, (jnp.arange(n), batch))
  value = jnp.sum(values)  # the shares of the batch's mean, summed
  skipped = None
  if options.propagates:
    skipped = ~_core.all_finite_packed((value, sums), _result.STEP_PACK_LIMIT)
  grads = jax.tree.map(functools.partial(_returned, skipped=skipped), sums, params)
  return value.astype(losses.dtype), grads


def _added(total: jax.Array, grad: jax.Array) -> jax.Array:
  return total + grad.astype(total.dtype)


def _returned(total: jax.Array, param: Any, skipped: jax.Array | None) -> jax.Array:
  """A gradient leaf in its parameter's dtype; NaN where the step is ``skipped``
  (never zeros: a zero gradient is finite, and the optimizer would step on it)."""
  grad = total.astype(jnp.result_type(param))
  return grad if skipped is None else jnp.where(skipped, jnp.nan, grad)
