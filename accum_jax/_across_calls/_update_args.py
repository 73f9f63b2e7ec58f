"""The arguments of one call of :func:`accum_jax.accumulate`'s ``update``, checked.

Each check runs at trace time and names the argument, the value and the fix.
"""

from __future__ import annotations

import difflib
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from accum_jax import _arguments, _core
from accum_jax._across_calls import _layout


def check_tree_matches(grads: Any, like: Any) -> None:
  """The gradients have the structure and shapes the state was made for: ``like`` is
  that tree, or the :class:`_layout.Layout` of a packed window."""
  structure: Any = jax.tree.structure(grads)
  if isinstance(like, _layout.Layout):
    expected: Any = like.treedef
    if structure != expected and "flax.nnx" in sys.modules:  # planned with Variables unwrapped
      structure = jax.tree.structure(_layout.unwrapped(grads))
    shapes = list(like.shapes)
  else:
    expected = jax.tree.structure(like)
    shapes = [jnp.shape(t) for t in jax.tree.leaves(like)]
  if structure != expected:
    raise ValueError(
        f"The gradients' tree structure {structure} differs from the"
        f" parameters' given to init, {expected}. Pass gradients taken with"
        " respect to the same parameters (jax.grad of the params pytree)."
    )
  for (path, g), shape in zip(jax.tree.leaves_with_path(grads), shapes):
    if jnp.shape(g) != shape:
      raise ValueError(
          f"The gradient at {jax.tree_util.keystr(path)} has shape"
          f" {jnp.shape(g)} but the parameter has shape {shape}. Pass"
          " gradients with the parameters' shapes."
      )


def check_layout(layout: Any, layouts: tuple[str, ...]) -> str:
  if layout == "flat":
    raise ValueError(
        "layout='flat' was removed: optax.flatten(inner) runs the inner optimizer on one"
        " vector, for elementwise optimizers; layout='packed' (the default on one device)"
        " keeps the state in a few vectors for any optimizer.")
  if layout not in layouts:
    raise ValueError(
        f"layout={layout!r} is not one of {layouts}: 'packed' keeps the accumulator and the"
        " inner optimizer's state in a few vectors, 'tree' a buffer per leaf, 'auto' (the"
        " default) packed unless the parameters may be sharded.")
  return layout


def packs(layout: str, params: Any) -> bool:
  """Whether ``init`` keeps the state packed: ``layout="packed"``, or ``"auto"`` where
  there is one device. With several, ``"auto"`` keeps a tree: the parameters may be
  sharded, an ``init`` traced under ``jax.jit`` cannot tell, and a state whose
  layout followed what ``init`` saw would restore into another layout's target
  (``jax.eval_shape(init)``). ``"packed"`` with a parameter placed over several
  devices is refused: a vector cannot be sharded like it."""
  if layout == "packed":
    for path, p in jax.tree.leaves_with_path(params):
      if _core.is_sharded(p):
        raise ValueError(
            "layout='packed' keeps the state in a few vectors, which cannot be sharded like"
            f" the parameter at {jax.tree_util.keystr(path)}: pass layout='tree' (or leave"
            " layout='auto') for sharded parameters, whose state then stays sharded like"
            " them.")
    return True
  return layout == "auto" and jax.device_count() == 1


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
        " valid tokens). Under jit such a weight is left out and counted in"
        " state.num_bad_weights instead."
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


# The keywords of accumulate's update; a misspelt one would reach the inner
# optimizer, which ignores keywords it does not take.
OWN_KEYWORDS = ("apply", "flush", "weight")


def check_extra_args(extra_args: Any) -> None:
  """Refuses a keyword of ``update`` close to one of its own (``aplly=``): the inner
  optimizer would ignore it, and the call would silently do something else."""
  for name in extra_args:
    close = difflib.get_close_matches(name, OWN_KEYWORDS, n=1, cutoff=0.75)
    if close:
      raise ValueError(
          f"update got {name}={_arguments._shown(extra_args[name])}: did you mean"
          f" {close[0]}=? accumulate's update takes {', '.join(OWN_KEYWORDS)} itself and"
          " hands other keywords to the inner optimizer, which ignores those it does not"
          " take.")


def check_same_every_k(stored: Any, given: Any) -> None:
  """The state was made by an accumulate with this ``every_k`` (static: at trace time)."""
  if stored is not None and given is not None and stored != given:
    raise ValueError(
        f"This state was made by accumulate(every_k={_every_k_shown(stored)}) and is updated"
        f" by accumulate(every_k={_every_k_shown(given)}): one state, one window length. Use"
        " the same transformation for init and update; to change the length of a restored"
        " run, restore into a target made by the new transformation's init (the open window"
        " then ends at its next call if it already holds the new length).")


def _every_k_shown(schedule: Any) -> str:
  return str(schedule.k) if hasattr(schedule, "k") else repr(schedule)
