"""Flax helpers: a Linen ``TrainState`` and an NNX model, microbatched or accumulated.

This is the only module of accum_jax that imports flax; ``import accum_jax`` does not.

Most of Flax needs nothing from here:

* ``nnx.Optimizer(model, accum_jax.accumulate(inner, every_k=4), wrt=nnx.Param)``
  works as it is, and ``optimizer.update(model, grads, weight=..., flush=...)``
  forwards the keyword arguments to :func:`accum_jax.accumulate`.
* A Linen ``TrainState`` holds an ``accumulate`` state like any Optax state, and
  :func:`accum_jax.value_and_grad` takes Linen's ``batch_stats`` through
  ``state_argnums`` and a dropout key through ``rng_argnums``.

What is here fills two gaps: ``TrainState.apply_gradients`` does not forward
keyword arguments to ``tx.update`` (:func:`apply_gradients` does), and an NNX
model is a mutable object, not the pure pytree :func:`accum_jax.value_and_grad`
threads through a ``lax.scan`` (:func:`nnx_value_and_grad` splits and merges it).

Step counters: ``TrainState.step`` and ``nnx.Optimizer.step`` count calls;
:func:`accum_jax.optimizer_step` counts the updates actually applied.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import optax
from flax import nnx
from flax.training import train_state

from accum_jax import _microbatch

TrainStateT = TypeVar("TrainStateT", bound=train_state.TrainState)

__all__ = ("apply_gradients", "nnx_value_and_grad")


def apply_gradients(state: TrainStateT, *, grads: Any, **update_kwargs: Any) -> TrainStateT:
  """``state.apply_gradients(grads=grads)``, passing ``update_kwargs`` to ``tx.update``.

  Flax's ``TrainState.apply_gradients`` reads its keyword arguments as fields
  to replace, so ``weight`` and ``flush`` cannot reach
  :func:`accum_jax.accumulate` through it. This runs the same method (a
  subclass's override included) with ``state.tx.update`` given
  ``update_kwargs``. ``state.step`` still counts calls; the updates applied are
  :func:`accum_jax.optimizer_step`.

  Args:
    state: a ``flax.training.train_state.TrainState``, or a subclass.
    grads: the gradients, as for ``TrainState.apply_gradients``.
    **update_kwargs: keyword arguments for ``state.tx.update``, such as
      ``weight`` and ``flush``.

  Returns:
    The new state, of the same class and with the same ``tx``.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax, accum_jax.flax
    >>> from flax.training.train_state import TrainState
    >>> state = TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)},
    ...                           tx=accum_jax.accumulate(optax.sgd(1.0), every_k=4))
    >>> for g, tokens in ((1.0, 3), (5.0, 1)):
    ...   state = accum_jax.flax.apply_gradients(
    ...       state, grads={"w": jnp.full(2, g)}, weight=tokens, flush=g == 5.0)
    >>> state.params["w"], int(state.step), int(accum_jax.optimizer_step(state))
    (Array([-2., -2.], dtype=float32), 2, 1)
  """
  tx = state.tx
  # Swapping tx, rather than repeating apply_gradients, keeps what Flax's method
  # (or a subclass's) does besides calling tx.update.
  bound = optax.GradientTransformation(tx.init, functools.partial(tx.update, **update_kwargs))
  return state.replace(tx=bound).apply_gradients(grads=grads).replace(tx=tx)


def _shift(argnums: int | Sequence[int] | None, name: str) -> tuple[int, ...] | None:
  """Renumbers argnums of ``fun(model, *args)`` for ``pure(params, rest, *args)``."""
  if argnums is None:
    return None
  nums = _microbatch._as_tuple(argnums, name)
  if 0 in nums:
    raise ValueError(
        f"{name}={argnums!r} names argument 0, the model. The model is split into"
        " its parameters (differentiated) and its other state (threaded through the"
        " microbatches); name the arguments after it."
    )
  return tuple(n + 1 for n in nums)


def nnx_value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
    batch_argnums: int | Sequence[int] = 1,
    rng_argnums: int | Sequence[int] | None = None,
    **options: Any,
) -> Callable[..., Any]:
  """``nnx.value_and_grad(fun)`` over microbatches, for ``fun(model, *args)``.

  The model is split into the variables ``wrt`` selects (differentiated) and
  all its other state (BatchNorm statistics, ``nnx.Rngs`` counters...), which
  :func:`accum_jax.value_and_grad` threads through the microbatches in order
  and which is written back into the model afterwards, as
  ``nnx.value_and_grad`` writes back what ``fun`` changed::

    graphdef, params, rest = nnx.split(model, wrt, ...)
    for mb in split(batch, num_microbatches):       # a lax.scan
      model_i = nnx.merge(graphdef, params, rest)
      L_i, g_i = value_and_grad(fun)(model_i, mb)   # w.r.t. params
      rest = the state of model_i after the call
    nnx.update(model, rest)
    return mean(L_i), mean(g_i)

  Dropout driven by the model's own ``nnx.Rngs`` therefore draws a new key
  for each microbatch, exactly as ``num_microbatches`` sequential calls would.

  Args:
    fun: ``fun(model, *args)`` returning a scalar loss, or ``(loss, aux)`` with
      ``has_aux``. It may update the model's non-``wrt`` state, but not add or
      remove variables (no ``sow``), as the state is a ``lax.scan`` carry.
    num_microbatches: the number of microbatches, an int >= 1 dividing the batch.
    wrt: the filter of the variables to differentiate, as for
      ``nnx.Optimizer(..., wrt=...)``; ``nnx.Param`` by default.
    has_aux: ``fun`` returns ``(loss, aux)``.
    batch_argnums: which arguments of ``fun`` are batches (never 0, the model).
    rng_argnums: arguments of ``fun`` holding a PRNG key to fold the microbatch
      index into, for randomness passed by argument rather than held in the model.
    **options: other options of :func:`accum_jax.value_and_grad`, such as
      ``weight_fn``, ``aux_reduction``, ``accumulator_dtype``, ``return_info``.

  Returns:
    A function of ``(model, *args)`` returning ``loss, grads`` (or
    ``(loss, aux), grads``), with ``grads`` an ``nnx.State`` of the ``wrt``
    variables, ready for ``nnx.Optimizer.update``; a
    :class:`accum_jax.MicrobatchInfo` third with ``return_info=True``.

  Raises:
    ValueError: for ``argnums`` or ``state_argnums`` in ``options`` (the model
      fixes both), and ``batch_argnums`` or ``rng_argnums`` naming the model;
      otherwise as :func:`accum_jax.value_and_grad`.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> def loss_fn(model, x, y):
    ...   return jnp.mean((model(x)[:, 0] - y) ** 2)
    >>> x, y = jnp.arange(24.0).reshape(8, 3) / 24, jnp.ones(8)
    >>> vg = accum_jax.flax.nnx_value_and_grad(loss_fn, 4, batch_argnums=(1, 2))
    >>> loss, grads = nnx.jit(vg)(model, x, y)
    >>> full_loss, full_grads = nnx.value_and_grad(loss_fn)(model, x, y)
    >>> bool(jnp.allclose(loss, full_loss)), bool(jnp.allclose(grads["kernel"][...],
    ...                                                         full_grads["kernel"][...]))
    (True, True)
  """
  for fixed in ("argnums", "state_argnums"):
    if fixed in options:
      raise ValueError(
          f"nnx_value_and_grad got {fixed}={options[fixed]!r}: it differentiates the"
          f" model's {wrt!r} variables and threads the rest of the model's state, so"
          f" {fixed} is fixed. Choose the variables with wrt=..., or call"
          " accum_jax.value_and_grad on nnx.split's states."
      )
  shifted_batch = _shift(batch_argnums, "batch_argnums")
  shifted_rng = _shift(rng_argnums, "rng_argnums")

  def wrapped(model, *args):
    graphdef, params, rest = nnx.split(model, wrt, ...)

    def pure(params, rest, *args):
      model = nnx.merge(graphdef, params, rest)
      out = fun(model, *args)
      loss, aux = out if has_aux else (out, ())
      _, _, new_rest = nnx.split(model, wrt, ...)
      return loss, (nnx.as_pure(new_rest), aux)

    vg = _microbatch.value_and_grad(
        pure,
        num_microbatches,
        argnums=0,
        batch_argnums=shifted_batch,
        rng_argnums=shifted_rng,
        state_argnums=1,
        has_aux=True,
        **options,
    )
    # Plain arrays, not Variables, go into the scan: a Variable may only be
    # changed at the trace level that made it.
    (loss, (new_rest, aux)), grads, *info = vg(params, nnx.as_pure(rest), *args)
    nnx.update(model, new_rest)
    return ((loss, aux) if has_aux else loss), grads, *info

  return wrapped
