"""Losses built from whole-batch statistics: exact over any number of microbatches.

A mixture-of-experts load-balancing loss (Switch, GShard) is ``alpha * E * sum_i
f_i * P_i``: the fraction of the batch's tokens routed to expert ``i`` times the
batch's mean router probability for it. It is a function of batch means, not a
mean of per-microbatch losses, so averaging it over microbatches is wrong (and
balances each microbatch, not the batch). :func:`stats_value_and_grad` makes it
exact with the two-pass shape of the cached door::

  stats = _statistics(...)                # pass 1: lax.scan, forward only: the batch's
                                          #   statistics, a weighted mean (psum'd under a mesh)
  coupling = jax.grad(stats_loss)(stats)  # the statistics' loss, linearised there
  value, grads = value_and_grad(fun + <coupling, microbatch stats>)   # pass 2
  value += stats_loss(stats) - <coupling, stats>

Pass 2 is the inside-step door itself: its options, skip, loop and sharding plan.
The gradient is exact because the batch's statistics are the weighted mean of the
microbatches', so ``d stats_loss(S) = <grad stats_loss(S), sum_j share_j dS_j>``;
the value is exact because pass 1 and pass 2 see the same microbatches with the
same keys.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from accum_jax import _arguments, _core
from accum_jax._inside_step import _across_devices, _call, _loop, _microbatch, _options, _trace
from accum_jax._inside_step._trace import describe as _describe


def _split_out(out: Any, has_aux: bool) -> tuple[Any, Any, Any]:
  """``fun``'s output as ``(loss, stats, aux)``, checked."""
  fix = (" fun must return (loss, stats), or (loss, (stats, aux)) with has_aux=True, where"
         " stats is a pytree of the microbatch's statistics (means over its tokens).")
  if not isinstance(out, (tuple, list)) or len(out) != 2:
    raise ValueError(f"fun returned {_describe(out)}.{fix}")
  loss, stats = out
  aux: Any = ()
  if has_aux:
    if not isinstance(stats, (tuple, list)) or len(stats) != 2:
      raise ValueError(
          f"With has_aux=True, fun's second output is {_describe(stats)}.{fix}")
    stats, aux = stats
  for path, leaf in jax.tree.leaves_with_path(stats):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise ValueError(
          f"The statistic {jax.tree_util.keystr(path) or '(the stats)'} has dtype"
          f" {jnp.result_type(leaf)}: statistics are means over the microbatch's tokens,"
          " floating arrays of one shape for every microbatch (a count is a fraction"
          " of its tokens, e.g. jnp.mean(jax.nn.one_hot(expert, E), axis=0)).")
  return loss, stats, aux


def _check_stats_shapes(fun, call: _call.Bound) -> None:
  """Statistics are means over a microbatch's tokens: their shapes cannot depend on
  how many rows it has. Per-token values returned unreduced would be averaged
  position by position over the microbatches, silently wrong; one abstract trace
  of a single-row microbatch (no compile) catches them."""
  if call.rows == 1:
    return
  options, args = call.options, call.args

  def shapes(rows):
    mb = {n: jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype),
                          args[n]) for n in call.batch_argnums}
    params = call.params()

    def stats(mb):
      call_args = _trace.microbatch_args(options, call.batch_argnums, args, jnp.int32(0), mb,
                                         None, params, None)
      return _split_out(fun(*call_args, **call.kwargs), options.has_aux)[1]

    return jax.eval_shape(stats, mb)

  for (path, one), many in zip(jax.tree.leaves_with_path(shapes(1)),
                               jax.tree.leaves(shapes(call.rows))):
    if one.shape != many.shape:
      raise ValueError(
          f"The statistic {jax.tree_util.keystr(path) or '(the stats)'} has shape"
          f" {many.shape} for a microbatch of {call.rows} rows and {one.shape} for one of"
          " 1: statistics are means over the microbatch's tokens, of one shape whatever"
          " its size. Reduce it over the tokens (e.g. jnp.mean(x, axis=0), weighted by"
          " the token mask as the loss is).")


def _local_statistics(fun, call: _call.Bound, args, shard_index):
  """This device's weighted sums of its microbatches' statistics, and their weight.

  A forward pass per microbatch, with the rows and keys pass 2 gives it. A
  microbatch whose loss or statistics are not finite, or whose weight is zero or
  bad, adds nothing: pass 2 leaves it out too (its loss is not finite, or it
  weighs nothing). The statistics of each microbatch, a few numbers, are stacked
  and summed after the loop.
  """
  options, plan = call.options, call.plan
  batch, weights = _loop.microbatches(options, call, args)
  params = call.params(args)
  if plan is not None and plan.gather == "once":
    params = _across_devices.gather(plan, params)

  def forward(_, x):
    index, mb, weight = x
    seen = params if plan is None or plan.gather == "once" else _across_devices.gather(plan, params)
    call_args = _trace.microbatch_args(options, call.batch_argnums, args, index, mb, None, seen,
                                       shard_index)
    loss, stats, _ = _split_out(fun(*call_args, **call.kwargs), options.has_aux)
    w = jnp.float32(1.0) if weight is None else weight
    keep = jnp.isfinite(loss) & _core.all_finite(stats) & jnp.isfinite(w) & (w > 0)
    w = jnp.where(keep, w, 0.0)
    stats = jax.tree.map(lambda s: jnp.where(keep, w * s.astype(jnp.float32), 0.0), stats)
    return (), (stats, w)

  xs = (jnp.arange(options.num_microbatches), batch, weights)
  _, (stats, w) = jax.lax.scan(jax.named_call(forward, name="accum_jax_statistics"), (), xs)
  return jax.tree.map(lambda s: jnp.sum(s, axis=0), stats), jnp.sum(w)


def _statistics(fun, call: _call.Bound) -> Any:
  """Pass 1: the whole batch's statistics (every device's), float32."""
  local = functools.partial(_local_statistics, fun, call)
  if call.plan is None:
    total, weight = local(call.args, None)
  else:
    axes = call.plan.axes
    total, weight = _across_devices.map_devices(
        lambda args, shard_index: jax.lax.psum(local(args, shard_index), axes), call.args,
        batch_argnums=call.batch_argnums, param_argnums=call.options.argnums, plan=call.plan,
        out_specs=P(),
    )
  return jax.tree.map(lambda t: t / weight, total)


def _linearised(fun: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
  """``fun`` with its statistics' loss linearised at the batch's statistics: its
  loss plus ``<coupling, stats>``, ``coupling`` its last positional argument."""

  def linearised(*args, **kwargs):
    *fun_args, coupling = args
    loss, stats, aux = _split_out(fun(*fun_args, **kwargs), has_aux)
    term = sum(jnp.vdot(c, s.astype(jnp.float32)) for c, s in
               zip(jax.tree.leaves(coupling), jax.tree.leaves(stats)))
    value = jnp.asarray(loss).astype(jnp.promote_types(jnp.result_type(loss), jnp.float32))
    return (value + term, aux) if has_aux else value + term

  return linearised


def _stats_loss_at(stats_loss: Callable[[Any], Any], stats: Any) -> tuple[jax.Array, Any]:
  """``stats_loss(stats)`` and its gradient, checked."""
  shape = jax.eval_shape(stats_loss, stats)
  if not hasattr(shape, "shape") or shape.shape != ():
    raise ValueError(
        f"stats_loss must return a scalar loss of the whole batch's statistics, got"
        f" {_describe(shape)}. Sum it, e.g. alpha * E * jnp.sum(f * P).")
  return jax.value_and_grad(stats_loss)(stats)


_WHY = (
    "the statistics pass and the gradient pass must see the same microbatches, and"
    " the gradient combines only as the weighted mean; use value_and_grad for a loss"
    " without whole-batch statistics."
)
_REFUSED = {"state_argnums": _WHY, "gradient_noise": _WHY, "reduction": _WHY}


@_arguments.takes_options(
    "stats_value_and_grad", options_of=_microbatch.value_and_grad, refused=_REFUSED
)
def stats_value_and_grad(
    fun: Callable[..., Any],
    stats_loss: Callable[[Any], jax.typing.ArrayLike],
    num_microbatches: int,
    **options: Any,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of a loss with a term of whole-batch statistics, over
  microbatches, exact.

  ``fun(params, batch, ...)`` returns a microbatch's loss and its statistics (a
  pytree of means over its tokens, e.g. per MoE layer the fraction of tokens
  routed to each expert); ``stats_loss(stats)`` is the loss of the whole batch's
  statistics (the load-balancing loss). The result is ``jax.value_and_grad`` of
  ``loss(batch) + stats_loss(stats(batch))`` on the whole batch, at one more
  forward pass per microbatch. See the guide: :doc:`/guides/moe`.

  Args:
    fun: ``(params, *args) -> (loss, stats)``, or ``(loss, (stats, aux))`` with
      ``has_aux``; ``stats`` a pytree of floating arrays.
    stats_loss: ``stats -> scalar``, the loss of the whole batch's statistics.
    num_microbatches: as for :func:`value_and_grad`.
    **options: the options of :func:`value_and_grad`, but ``state_argnums``,
      ``gradient_noise`` and ``reduction``.

  Returns:
    A function with ``fun``'s arguments returning ``(value, grads)``, ``((value,
    aux), grads)`` with ``has_aux`` (and a :class:`MicrobatchInfo` with
    ``return_info``). Call it under ``jax.jit``.

  Examples:
    >>> import jax, jax.numpy as jnp, accum_jax
    >>> def fun(w, x):  # a loss, and the batch mean of a statistic
    ...   h = jnp.tanh(x @ w)
    ...   return jnp.mean(h ** 2), jnp.mean(h, axis=0)
    >>> stats_loss = lambda mean: jnp.sum(mean ** 2)  # couples the whole batch
    >>> w, x = jnp.ones((3, 2)) / 3, jnp.arange(24.0).reshape(8, 3) / 24
    >>> vg = jax.jit(accum_jax.stats_value_and_grad(fun, stats_loss, num_microbatches=4))
    >>> full = jax.grad(lambda w, x: fun(w, x)[0] + stats_loss(fun(w, x)[1]))
    >>> bool(jnp.allclose(vg(w, x)[1], full(w, x)))
    True
  """
  parsed = _options.make(
      num_microbatches, caller="stats_value_and_grad", refused=_REFUSED, **options
  )
  has_aux = parsed.has_aux
  linearised = _trace.checked(_linearised(fun, has_aux), parsed)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    call = _call.bind(parsed, args, kwargs)
    _check_stats_shapes(fun, call)
    stats = _statistics(fun, call)
    stats_value, coupling = _stats_loss_at(stats_loss, stats)
    # Pass 2 is the same call, with the coupling as one more (unsplit) argument.
    pass_2 = _call.traced(dataclasses.replace(call, args=(*call.args, coupling)), linearised)
    out, grads, *info = _microbatch.of_call(pass_2)
    correction = stats_value - sum(jnp.vdot(c, s) for c, s in
                                   zip(jax.tree.leaves(coupling), jax.tree.leaves(stats)))
    if has_aux:
      value, aux = out
      out = ((value + correction).astype(value.dtype), aux)
    else:
      out = (out + correction).astype(out.dtype)
    return (out, grads, *info)

  return wrapped
