"""The arguments of one call of :func:`accum_jax.accumulate`'s ``update``, checked.

Each check runs at trace time and names the argument, the value and the fix.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from accum_jax import _core


def check_tree_matches(grads: Any, like: Any) -> None:
  structure: Any = jax.tree.structure(grads)
  expected: Any = jax.tree.structure(like)
  if structure != expected:
    raise ValueError(
        f"The gradients' tree structure {structure} differs from the"
        f" parameters' given to init, {expected}. Pass gradients taken with"
        " respect to the same parameters (jax.grad of the params pytree)."
    )
  for (path, g), t in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(like)):
    if jnp.shape(g) != jnp.shape(t):
      raise ValueError(
          f"The gradient at {jax.tree_util.keystr(path)} has shape"
          f" {jnp.shape(g)} but the parameter has shape {jnp.shape(t)}. Pass"
          " gradients with the parameters' shapes."
      )


def check_flag(value: Any, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name}={value!r} must be True or False.")
  return bool(value)


def check_packable(params: Any) -> None:
  """``pack_inner_state=True`` with parameters whose placement shows them sharded
  over several devices: refused, since a packed vector cannot be sharded like them."""
  for path, p in jax.tree.leaves_with_path(params):
    if _core.is_sharded(p):
      raise ValueError(
          f"pack_inner_state=True keeps the inner optimizer's state as one vector per"
          f" dtype, which cannot be sharded like the parameter at"
          f" {jax.tree_util.keystr(path)}: pass pack_inner_state=False for sharded"
          " parameters (their optimizer state then stays sharded like them).")


def check_weight(weight: Any) -> None:
  if weight is None:
    return
  if jnp.ndim(weight) != 0:
    raise ValueError(
        f"weight must be a scalar (e.g. this microbatch's number of valid"
        f" tokens), got an array of shape {jnp.shape(weight)}. Reduce it, e.g."
        " weight=mask.sum()."
    )
  if not isinstance(weight, jax.core.Tracer) and not 0 <= float(weight) < math.inf:
    raise ValueError(
        f"weight={float(weight)} must be a finite number >= 0 (e.g. a count of"
        " valid tokens). Under jit such a weight is skipped and counted in"
        " state.num_skipped instead."
    )


def check_flush(flush: Any) -> jax.Array:
  """``flush`` as a bool scalar; None (as for ``weight``) means no flush."""
  if flush is None:
    return jnp.array(False)
  if jnp.ndim(flush) != 0:
    raise ValueError(
        f"flush must be a scalar bool (True on the last call of an epoch), got an array"
        f" of shape {jnp.shape(flush)}."
    )
  dtype = jnp.result_type(flush)
  if not (jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(dtype, jnp.integer)):
    raise ValueError(
        f"flush must be a bool (True on the last call of an epoch), got a value of dtype"
        f" {dtype}: {flush!r}. Pass a Python bool or a bool array, e.g."
        " flush=step == steps_per_epoch - 1."
    )
  return jnp.asarray(flush, bool)


# Extra arguments of `update` that describe this call's batch: the inner optimizer
# gets the window's, not the emitting call's. `value` (the loss, for polyak_sgd,
# reduce_on_plateau, line searches) is reduced over the window's kept calls like
# the gradient; `grad` (line searches: the gradient at `params`) is the window's
# gradient itself. Every other extra argument (`value_fn`, hyperparameters...) is
# taken from the emitting call.
WINDOW_ARGS = ("value", "grad")


def check_value(value: Any) -> None:
  if jnp.ndim(value) != 0:
    raise ValueError(
        f"value must be a scalar loss (this call's), got an array of shape"
        f" {jnp.shape(value)}. Pass the mean loss of the microbatch, e.g."
        " value=loss where loss, grads = jax.value_and_grad(loss_fn)(params, batch)."
    )


# The on_nonfinite values accumulate takes (see _arguments.NONFINITE): "skip_window"
# judges the window's sums once, when it is applied (nothing per call);
# "skip_microbatch" checks each call's gradient (a reduction per call) and leaves the
# rest of the window; "unchecked" does neither.
ON_NONFINITE = ("skip_window", "skip_microbatch", "unchecked")


def check_apply(apply: Any, flush: Any) -> bool | None:
  """``apply`` as the host's decision: None (the device schedule) or a Python bool."""
  if apply is None:
    return None
  if not isinstance(apply, (bool, np.bool_)):
    raise ValueError(
        f"apply must be a Python bool decided on the host (True on the window's last"
        f" call), got {type(apply).__name__} {apply!r}. Make it a static argument of"
        " the jitted step, e.g. jax.jit(step, static_argnames='apply'), or leave it out"
        " for the device schedule (every_k).")
  if not (flush is None or flush is False):
    raise ValueError(
        f"flush={flush!r} with apply={apply}: with apply given, the host ends each"
        " window. Pass apply=True on the epoch's last call instead of flush=True.")
  return bool(apply)
