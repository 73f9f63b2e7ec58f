"""Accumulation inside one step: ``value_and_grad`` over microbatches.

:func:`value_and_grad` is a short composition of the steps below::

  options = _options.make(...)                    # once, when it is built
  call = _call.bind(options, args, kwargs)        # per call: batch, sizes, gradient kinds,
                                                  # the plan under a mesh; checked
  if _plain.takes(call):                          # no option used, every leaf a "mean":
    return _plain.run(call, grad_fun)             # the hand-written scan and one check
  call = _call.traced(call, grad_fun)             # one microbatch traced (its shapes,
                                                  # aux reductions)
  sums = _loop.local_sums(call, ...)              # scan: each microbatch's share
         (or _across_devices.run(...))            # per device, reduced as planned
  return _result.finalise(sums, call)             # normalise, cast, reduce aux

Data go one way: after ``bind``, the loop and the finalisation read the
:class:`_call.Call` and call nothing above the modules they import. A call
without a mesh enters none of :mod:`._sharding` and :mod:`._across_devices`; a
call of plain options enters none of :mod:`._loop` and :mod:`._result`'s
functions either.
:func:`grad` and the other doors (cached, statistics, the framework front ends)
build on the same options and binding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from accum_jax import _arguments
from accum_jax._inside_step import (
  _across_devices,
  _call,
  _loop,
  _options,
  _plain,
  _result,
  _trace,
)
from accum_jax._inside_step._batching import Split, divisors  # noqa: F401  (re-exported for the planner)
from accum_jax._inside_step._options import AuxReduction


@_arguments.takes_options("value_and_grad")
def value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    has_aux: bool = False,
    weight_fn: Callable[..., jax.typing.ArrayLike] | None = None,
    rng_argnums: int | Sequence[int] | None = None,
    state_argnums: int | None = None,
    aux_reduction: AuxReduction | Any | None = None,
    reduction: Any = None,
    accumulator_dtype: Any = jnp.float32,
    gradient_dtype: Any = None,
    on_nonfinite: str = "propagate",
    data_parallel: _options.DataParallel | None = None,
    return_info: bool = False,
    gradient_noise: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` over a batch split into microbatches.

  The batch arguments are split along axis 0 into ``num_microbatches`` parts, and
  a ``lax.scan`` takes the value and gradient of ``fun`` on each in turn, so one
  microbatch's activations are alive at a time; the result is the full batch's
  mean. Each option is described in :doc:`/two_doors` (inside one step).

  Args:
    fun: the function to differentiate, as for ``jax.value_and_grad``.
    num_microbatches: an int >= 1 dividing the batch (on each device).
    argnums, has_aux: as for ``jax.value_and_grad``.
    batch_argnums: the argument(s) to split, as ``optax.microbatching``'s: 1 by
      default (``fun(params, batch)``); ``(1, 2)`` for ``fun(params, x, y)``.
      No other argument is split, whatever its shape.
    weight_fn: one microbatch's batch arguments to its scalar weight.
    rng_argnums: argument(s) holding PRNG keys, folded with each microbatch's index.
    state_argnums: an argument threaded through the microbatches (BatchNorm).
    aux_reduction: how each aux leaf combines ("mean", "sum", "max", "last",
      "concat", "stack", or a pytree prefix of them); None: "mean" for a leaf
      whose shape is the same on a microbatch as on the whole batch, and a
      ValueError for one whose shape is not (per-example outputs), which must
      name "concat" or another reduction.
    reduction: how each gradient leaf combines ("mean", "sum", "max", "last",
      a pytree prefix, or a callable); see :doc:`/guides/leaf_reductions`.
    accumulator_dtype: the sums' dtype (float32; None: the gradients' own).
    gradient_dtype: the returned gradient's dtype; None: the parameters'.
    on_nonfinite: what a NaN or Inf does: ``"propagate"`` (default: the
      step's gradient NaN in every leaf, as the full batch's would be, for
      ``optax.apply_if_finite`` to skip the step), ``"skip_microbatch"`` (leave
      out the bad microbatches, counted in ``info``) or ``"unchecked"``; the
      same words as :func:`accum_jax.accumulate`'s (:doc:`/two_doors`).
    data_parallel: a :class:`DataParallel`: the mesh and how gradients cross it.
    return_info: also return a :class:`~accum_jax.MicrobatchInfo`.
    gradient_noise: estimate the gradient noise, as ``info.gradient_noise``.

  Returns:
    A function with ``fun``'s signature returning what ``jax.value_and_grad``
    would (and a :class:`~accum_jax.MicrobatchInfo` with ``return_info``). Call it under
    ``jax.jit``.

  Examples:
    >>> import jax, jax.numpy as jnp, accum_jax
    >>> def loss(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> w, batch = jnp.ones(3), {"x": jnp.arange(24.0).reshape(8, 3) / 24, "y": jnp.ones(8)}
    >>> value, grads = jax.jit(accum_jax.value_and_grad(loss, num_microbatches=4))(w, batch)
    >>> bool(jnp.allclose(grads, jax.grad(loss)(w, batch)))
    True
  """
  options = _options.make(
      num_microbatches, argnums=argnums, batch_argnums=batch_argnums, has_aux=has_aux,
      weight_fn=weight_fn, rng_argnums=rng_argnums, state_argnums=state_argnums,
      aux_reduction=aux_reduction, reduction=reduction, accumulator_dtype=accumulator_dtype,
      gradient_dtype=gradient_dtype, on_nonfinite=on_nonfinite, data_parallel=data_parallel,
      return_info=return_info, gradient_noise=gradient_noise,
  )
  return of_options(fun, options)


def of_options(fun: Callable[..., Any], options: _options.Options) -> Callable[..., Any]:
  """The microbatched ``fun`` for options made by :func:`_options.make`: each call
  bound and traced once (:func:`_call.bind`), then looped and finalised."""
  grad_fun = _trace.checked(fun, options)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    call = _call.bind(options, args, kwargs)
    if _plain.takes(call):
      return _plain.run(call, grad_fun)
    return of_call(_call.traced(call, grad_fun))

  return wrapped


def of_call(call: _call.Call) -> Any:
  """What :func:`value_and_grad` returns for a call bound and traced by
  :func:`_call.bind`: the loop (on each device under a mesh), then the
  finalisation."""
  if call.plan is None:
    sums = _loop.local_sums(call, call.args, None)
  else:
    shapes = call.shapes
    sums = _across_devices.run(
        functools.partial(_loop.local_sums, call), call.args, batch_argnums=call.batch_argnums,
        param_argnums=call.options.argnums, plan=call.plan, grad_kinds=shapes.grad_kinds,
        aux_kinds=shapes.reductions,
    )
  return _result.finalise(sums, call)


@_arguments.takes_options("grad", options_of=value_and_grad)
def grad(fun: Callable[..., Any], num_microbatches: int, **options: Any) -> Callable[..., Any]:
  """``jax.grad`` over microbatches; the options of :func:`value_and_grad`.

  Returns ``grads``, or ``(grads, aux)`` with ``has_aux=True``, as ``jax.grad``
  does (and a :class:`~accum_jax.MicrobatchInfo` last with ``return_info=True``).

  Examples:
    >>> import jax.numpy as jnp, accum_jax
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> g = accum_jax.grad(loss, num_microbatches=2)(jnp.ones(2), jnp.eye(2))
    >>> g.tolist()
    [1.0, 1.0]
  """
  resolved = _options.make(num_microbatches, caller="grad", **options)
  return grad_of(of_options(fun, resolved), fun, resolved.has_aux, resolved.return_info)


def grad_of(
    vg: Callable[..., Any], fun: Callable[..., Any], has_aux: bool, return_info: bool
) -> Callable[..., Any]:
  """``vg`` (a microbatched value_and_grad) returning what ``jax.grad`` would."""

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    out, grads, *info = vg(*args, **kwargs)
    result = (grads, out[1]) if has_aux else grads
    return (result, *info) if return_info else result

  return wrapped

