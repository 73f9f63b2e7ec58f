"""What the inner optimizer makes of one call of :func:`accum_jax.accumulate`'s update.

Three ways, one per schedule: a call the host says only adds gets zeros and the
inner state as it is (:func:`zero_updates`, nothing of the inner optimizer in its
program); the host's applying call runs the inner update with no conditional
(:func:`host_apply`); the device schedule runs it under a conditional that every
backend keeps (:func:`device_step`). The call's options, arguments and window
come from ``_transform``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from accum_jax import _core
from accum_jax._across_calls import _inner_state, _layout, _noise_fields


class Inner(NamedTuple):
  """What the inner optimizer made of this call."""

  updates: Any  # zeros unless applied
  state: Any  # the inner optimizer's state after this call
  last_noise: Any  # the last applied window's GradientNoise, () without gradient noise
  applied: Any  # bool: the window was applied (a Python bool where the host decided)
  total: Any = None  # the window's total after the call; None: the sum with this call


def _inner_update(options, call, inner_state, acc, value_window):
  """The inner optimizer's update on the window's gradient (and `value`)."""
  if isinstance(acc.total, _layout.Packed):  # its leaves: slices of its buckets
    acc = acc._replace(total=acc.total.unpack(jax.tree.structure(call.grads)))
  grads = _core.result(acc, call.grads, call.grad_kinds)
  window_args = {}
  if value_window is not None:
    window_args["value"] = _core.result(value_window, call.value, options.value_reduction)
  if call.window_grad:
    window_args["grad"] = grads
  return options.inner.update(grads, inner_state, call.params, **call.extra_args, **window_args)


def _window_finite(options, acc, value_window) -> Any:
  """With ``on_nonfinite="skip_window"``, whether the window's sums (and its
  ``value``s) are finite: one reduction per buffer when the window is applied,
  none per call. True where nothing is judged here."""
  if options.on_nonfinite != "skip_window":
    return True
  finite = _core.all_finite(acc.total)
  if value_window is not None:
    finite = finite & jnp.isfinite(value_window.total)
  return finite


def _emit(options, call, window, stored):
  """The inner update on the window: the updates, the inner state as stored, and the
  window's noise (``()`` without gradient noise)."""
  packed = isinstance(stored, _layout.Packed)
  # A plain jax.jit over an nnx.State hands the gradient (and so the state) Variables.
  total = window.accumulator.total
  wrapped = (packed and isinstance(total, _layout.Packed)
             and jax.tree.structure(call.grads) != total.layout.treedef
             and "flax.nnx" in sys.modules and _layout.has_variables(call.grads))
  tree = stored.unpack(wrapped=wrapped) if packed else stored
  new_updates, new_tree = _inner_update(options, call, tree, window.accumulator,
                                        window.value_accumulator)
  if packed:
    new_state = _inner_state.repack(stored, new_tree)  # its leaves cast in place
  else:
    new_state = _cast_like(new_tree, stored)
  noise = _noise_fields.window(window, call) if options.track_noise else ()
  return new_updates, new_state, noise


def _cast_like(new: Any, old: Any) -> Any:
  # Some optimizers return state leaves with wider or weak dtypes than init
  # made; the state keeps one type across calls.
  return jax.tree.map(
      lambda n, o: jax.lax.convert_element_type(n, jnp.result_type(o)), new, old)


def host_apply(options, call, state, window) -> Inner:
  """The host's applying call: the inner update with no conditional, kept where
  the window is applied (a select that fuses with the update)."""
  updates, inner_state, noise = _emit(options, call, window, state.inner_opt_state)
  applied = window.apply & _window_finite(options, window.accumulator, window.value_accumulator)
  if applied is True:
    return Inner(updates, inner_state, noise, True)

  keep = functools.partial(jnp.where, applied)
  return Inner(
      jax.tree.map(keep, updates, jax.tree.map(jnp.zeros_like, updates)),
      jax.tree.map(keep, inner_state, state.inner_opt_state),
      jax.tree.map(keep, noise, state.last_noise), applied)


def zero_updates(call: Any) -> Any:
  """The updates of a call that only adds: zeros that XLA folds (``params + 0`` in
  the caller's ``optax.apply_updates`` becomes ``params``, and donated parameters
  pass through untouched), of the updates' tree (``optax.lookahead``'s are of its
  ``LookaheadParams``); a type that carries an explicit sharding keeps it.""" 
  like = call.params if isinstance(call.params, optax.LookaheadParams) else call.grads
  return jax.tree.map(jnp.zeros_like, like)


def device_step(options, call, state, window) -> Inner:
  """The inner update under a conditional that every backend keeps, so that it runs
  on the call that ends a window alone.

  XLA:GPU replaces a two-branch conditional whose branches hold only cheap
  operations (elementwise, broadcasts, reductions: Adam's whole update) by selects,
  and then runs both branches on every call; it keeps one whose other branch only
  passes its operands through (:func:`accum_jax.testing.gpu_conditionals` predicts
  which). So the branch that holds returns its operands as they are: the inner
  state, the last window's noise, the flag, and a carrier of the updates
  (:func:`_carrier`).
  """
  update_shapes = jax.eval_shape(
      lambda s: _emit(options, call, window, s)[0], state.inner_opt_state)
  carrier, is_sum = _carrier(update_shapes, call, window.accumulator.total)
  acc = window.accumulator
  if is_sum:  # the sum comes in once, as the carrier: twice, XLA would copy it
    acc = acc._replace(total=None)

  def emit(stored, acc, value_window, last_noise, carrier, applied):
    if is_sum:
      acc = acc._replace(total=carrier)
    branch = window._replace(accumulator=acc, value_accumulator=value_window)

    def update(stored, last_noise, carrier):
      updates, new_state, noise = _emit(options, call, branch, stored)
      if isinstance(carrier, _layout.Packed):
        return carrier.layout.pack(_cast_like(updates, update_shapes)), new_state, noise
      return _cast_like(updates, carrier), new_state, noise

    def refuse(stored, last_noise, carrier):
      return carrier, stored, last_noise

    finite = _window_finite(options, acc, value_window)
    if finite is True:
      return (*update(stored, last_noise, carrier), applied)
    # A conditional, not a select: a select of the inner state here would have XLA
    # copy it through the outer conditional on every call.
    return (*jax.lax.cond(finite, update, refuse, stored, last_noise, carrier), applied & finite)

  def hold(stored, acc, value_window, last_noise, carrier, applied):
    del acc, value_window
    return carrier, stored, last_noise, applied

  out, inner_state, noise, applied = jax.lax.cond(
      window.apply, emit, hold, state.inner_opt_state, acc, window.value_accumulator,
      state.last_noise, carrier, window.apply)
  total = out if is_sum else None
  if isinstance(out, _layout.Packed):
    out = out.unpack(jax.tree.structure(update_shapes))
  updates = jax.tree.map(lambda u, x: jnp.where(applied, u, jnp.zeros((), u.dtype)).astype(
      x.dtype), out, update_shapes)
  # Where the sum carried the updates, the state's next total is what came out: the
  # sum where the window holds; the updates where it ended (not read: its count
  # restarts).
  return Inner(updates, inner_state, noise, applied, total)


def _carrier(update_shapes: Any, call: Any, total: Any) -> tuple[Any, bool]:
  """What carries the updates through the device schedule's conditional, and whether
  it is the window's sum. A value passed through is free only if nothing reads it
  after. The window's sum kept as a tree is (the state's next total is what comes
  out of the conditional), where its dtypes hold the updates exactly: the inner
  update writes each leaf's update from that leaf's sum, in place. A packed sum is
  read back through slices, not in place: there buckets of zeros made for the updates
  carry them (the gradient would do, but the window's add reads it too, so XLA would
  write each of its leaves out for the conditional: a pass a leaf). Else zeros made
  outside, or the gradient."""
  structure: Any = jax.tree.structure(update_shapes)
  same_tree = structure == jax.tree.structure(call.grads)
  shapes = jax.tree.leaves(update_shapes)
  if same_tree and not isinstance(total, _layout.Packed) and all(
      jnp.promote_types(u.dtype, t.dtype) == t.dtype
      for u, t in zip(shapes, jax.tree.leaves(total))):
    return total, True
  if same_tree and isinstance(total, _layout.Packed):
    layout = _layout.plan(update_shapes)
    return _layout.packed_with(
        layout, [jnp.zeros(n, d) for n, d in zip(layout.sizes, _bucket_dtypes(layout))],
        [jnp.zeros(x.shape, x.dtype) for x, s in zip(shapes, layout.slots) if s is None]), False
  if same_tree and all(u.shape == jnp.shape(g) and u.dtype == jnp.result_type(g)
                       for u, g in zip(shapes, jax.tree.leaves(call.grads))):
    return call.grads, False
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), update_shapes), False


def _bucket_dtypes(layout: _layout.Layout) -> list[Any]:
  dtypes: list[Any] = [None] * len(layout.sizes)
  for slot in layout.slots:
    if slot is not None:
      dtypes[slot.bucket] = slot.dtype
  return dtypes
