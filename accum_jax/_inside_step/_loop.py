"""The loop of the inside-step door: one device's microbatches, scanned.

:func:`local_sums` splits this device's batch into microbatches and runs a
``lax.scan`` over them (:func:`_pass`), each step (:func:`_step`) adding one
microbatch's share of the batch's mean into the sums of a :class:`_Carry`. What
it leaves (a :class:`_result.LocalSums`) is reduced across devices under a mesh
(:mod:`._across_devices`) and finalised by :func:`_result.finalise`.

The loop is a ``lax.scan``: XLA knows its trip count, and nothing inside it makes
a GPU wait on the host. By default (``on_nonfinite="propagate"``) it adds every
microbatch as the hand-written scan does (only a weight, for padding, selects),
records whether each loss is finite, and one check of the sums after the loop
finds a step that is not finite: its gradient comes back NaN, as the whole
batch's would, for the optimizer's own skip (``optax.apply_if_finite``,
``accumulate``) or a loss scale to see, and the threaded state comes back as it
went in. No conditional, one body.
With ``on_nonfinite="skip_microbatch"`` it judges each microbatch by its loss; a
gradient that is NaN under a finite loss shows in the sums, and only then, under
one conditional after the loop, does a recheck find which microbatches'
gradients are not finite and redo the sums without them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from accum_jax import _core, _noise
from accum_jax._inside_step import (
  _across_devices,
  _batching,
  _call,
  _options,
  _result,
  _sharding,
  _trace,
)


class _Device(NamedTuple):
  """What every microbatch of one device's loop needs."""

  call: _call.Call  # bound and traced
  options: _options.Options  # the call's
  shapes: _trace.Shapes  # the call's
  plan: _sharding.Plan | None  # the call's
  args: tuple[Any, ...]  # as this device holds them
  shard_index: jax.Array | None
  batch_weight: Any  # the whole batch's weight (every device's), float32, > 0
  gathered: Any  # the parameters gathered before the loop (gather="once"), or None


class _Carry(NamedTuple):
  """What the loop carries from one microbatch to the next: the sums it adds into."""

  acc: _core.Accumulator  # the weighted loss and gradient, with the kept weight and counts
  aux_sums: list[Any]  # per aux leaf its sum or statistic; None where stacked ("concat", "stack")
  state: Any  # the threaded state as the kept microbatches left it; None without state_argnums
  noise: Any  # the gradient noise's _noise.NoiseSums; None without gradient_noise


class _Inputs(NamedTuple):
  """What the loop reads of each microbatch: the scan's inputs, a leading axis of
  ``num_microbatches`` on every leaf (one slice of it inside a step)."""

  number: jax.Array  # the microbatch's index on this device, which its keys are folded with
  mb: dict[int, Any]  # its rows, by batch argnum
  weight: jax.Array | None  # its weight (float32); None without weight_fn
  known_bad: jax.Array  # left out by an earlier pass (the recheck's finding); False in the first


class _Decided(NamedTuple):
  """What a step decides about one microbatch before adding it."""

  grads: Any  # its gradient reduced as the plan says, zero where it is not kept
  admission: _core.Admission  # its weight, and whether it is kept or skipped
  finite: jax.Array  # recorded per microbatch: its loss finite (as is), or its gradient (recheck)
  state_kept: jax.Array  # whether the threaded state takes its new state


def _aux_sum_dtype(dtype: Any, reduction: str) -> Any:
  """Means in float32 at least; sums of integers in integers, exactly; statistics
  ("max", "last") in their own dtype."""
  if _core.is_statistic(reduction):
    return dtype
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.promote_types(dtype, jnp.float32)
  return jnp.float32 if reduction == "mean" else jnp.promote_types(dtype, jnp.int32)


def _aux_add(total: jax.Array, x: jax.Array, reduction: str, weight, kept, first) -> jax.Array:
  if _core.is_statistic(reduction):
    return _core.add_statistic(reduction, total, x, kept, first)
  x = x.astype(total.dtype)
  if reduction == "mean" and weight is not None:
    x = jnp.asarray(weight, jnp.float32).astype(total.dtype) * x
  # `where`, not a product with `kept`: a skipped microbatch's aux may be NaN.
  return total + jnp.where(kept, x, jnp.zeros_like(x))


def microbatches(
    options: _options.Options, call: _call.Bound, args: Sequence[Any]
) -> tuple[dict[int, Any], jax.Array | None]:
  """This device's batch arguments split into microbatches (``(N, rows, ...)``, by
  argnum), and their weights (see :func:`_weights`)."""
  split = functools.partial(
      _batching.split, num_microbatches=options.num_microbatches, how=options.split
  )
  batch = {}
  for n in call.batch_argnums:
    batch[n] = jax.tree.map(split, args[n])
  return batch, None if options.weight_fn is None else _weights(options, call, batch)


def _weights(options, call, batch) -> jax.Array | None:
  """This device's microbatch weights, shape (N,), by ``weight_fn``.

  Computed before the loop from the batch alone, so that every microbatch's
  share of the whole batch is known when its loss is differentiated.
  """
  weights = jax.vmap(options.weight_fn)(*(batch[n] for n in call.batch_argnums))
  if jnp.ndim(weights) != 1:
    raise ValueError(
        f"weight_fn must return a scalar weight per microbatch, got shape"
        f" {jnp.shape(weights)[1:]}. Reduce it, e.g. lambda batch: batch['mask'].sum()."
    )
  return weights.astype(jnp.float32)


def _batch_weight(weights, options, plan) -> jax.Array:
  """The weight of the whole batch, every device's microbatches; > 0 (1 when 0)."""
  if weights is None:  # every microbatch of every device weighs 1
    shards = 1 if plan is None else plan.num_shards
    return jnp.float32(options.num_microbatches * shards)
  # Negative and non-finite weights are skipped: they count for nothing.
  total = jnp.sum(jnp.where(jnp.isfinite(weights) & (weights >= 0), weights, 0.0))
  if plan is not None:
    total = jax.lax.psum(total, plan.axes)
  return jnp.where(total > 0, total, 1.0)


def local_sums(call: _call.Call, args, shard_index) -> _result.LocalSums:
  """This device's microbatches (``args`` as it holds them), looped over; returns
  the un-normalised sums.

  One pass (:func:`_pass`) adds every microbatch; with ``"skip_microbatch"``,
  :func:`_skipping_passes` leave out the non-finite ones.
  """
  options, plan, shapes = call.options, call.plan, call.shapes
  batch, weights = microbatches(options, call, args)
  params = call.diff if shard_index is None else call.params(args)
  gathered = None
  if plan is not None and plan.gather == "once":
    gathered = _across_devices.gather(plan, params)
  batch_weight = jnp.float32(options.num_microbatches)  # every microbatch weighs 1
  if weights is not None or plan is not None:
    batch_weight = _batch_weight(weights, options, plan)
  dev = _Device(call, options, shapes, plan, args, shard_index, batch_weight, gathered)
  start = _initial_carry(dev, params if gathered is None else gathered)
  n = options.num_microbatches
  xs = _Inputs(jnp.arange(n), batch, weights, known_bad=jnp.zeros((n,), bool))
  if options.on_nonfinite == "skip_microbatch":
    end, stacked = _skipping_passes(dev, start, xs)
    loss_finite = None
  else:  # "propagate" (the step judged after the loop) or "unchecked": every microbatch added
    end, stacked, loss_finite = _pass(dev, _added_as_is, start, xs)
    loss_finite = loss_finite if options.propagates else None
  per_example = stacked
  if "concat" in shapes.reductions:
    per_example = [
        _batching.unsplit(x, options.split) if r == "concat" else x
        for x, r in zip(stacked, shapes.reductions)
    ]
  return _result.LocalSums(end.acc, end.aux_sums, end.state, per_example, end.noise,
                             dev.batch_weight, loss_finite)


def _initial_carry(dev: _Device, params: Any) -> _Carry:
  """Empty sums (accumulator, aux, gradient noise) and the state passed in.

  The accumulator is shaped like ``params`` as this device holds them (a shard of
  a sharded parameter, unless it is gathered once), and made from them to keep
  their sharding over the other mesh axes.
  """
  options, shapes = dev.options, dev.shapes
  value = jnp.zeros((), jnp.promote_types(shapes.value.dtype, jnp.float32))
  acc = _core.init((value, params), options.accumulator_dtype, shapes.kinds, in_loop=True)
  aux_sums = []
  if options.has_aux:
    aux_sums = [
        jnp.zeros(x.shape, _aux_sum_dtype(x.dtype, r)) if r not in ("concat", "stack") else None
        for x, r in zip(jax.tree.leaves(shapes.aux), shapes.reductions)
    ]
  state = dev.args[options.state_argnums[0]] if options.state_argnums else None
  noise = _noise.zero_sums() if options.gradient_noise else None
  return _Carry(acc, aux_sums, state, noise)


def _by_loss(options, out: _trace.Out, weight, known_bad) -> jax.Array:
  """Whether a microbatch is acceptable by its loss (and what an earlier pass
  found), before any pass over its gradient: known early, so that it can zero
  the gradient before anything crosses devices."""
  if not options.checks_finite:
    return jnp.array(True)
  # A zero weight counts for nothing, even with a NaN loss.
  zero = False if weight is None else weight == 0
  return (jnp.isfinite(out.raw_value) | zero) & ~known_bad


def _agreed(dev: _Device, *flags: jax.Array) -> tuple[jax.Array, ...]:
  """``flags`` agreed over the data axes where gradients are reduce-scattered per
  microbatch (a shard holds every device's share: all keep it or none does);
  one all-reduce of a few scalars. As they are elsewhere."""
  if dev.plan is None or not dev.plan.scatters_per_microbatch or not dev.options.checks_finite:
    return flags
  agreed = jax.lax.pmin(jnp.stack([f.astype(jnp.int32) for f in flags]), dev.plan.axes) > 0
  return tuple(agreed)


# A microbatch without a weight under "propagate" or "unchecked": weighs 1, kept, never
# skipped (what `_core.admit(None, None, refuse_nonfinite=False)` decides), known
# before the loop, so that nothing is selected.
_KEPT = _core.Admission(np.float32(1.0), np.bool_(True), np.bool_(False))  # type: ignore[arg-type]


# How a pass decides about each microbatch, given what it gives: one of
# :func:`_added_as_is`, :func:`_kept_by_loss`, :func:`_kept_by_loss_and_gradient`.
_Decide = Callable[[_Device, _trace.Out, _core.Accumulator, _Inputs], _Decided]


def _step(dev: _Device, decide: _Decide, carry: _Carry, x: _Inputs):
  """One microbatch into the sums: its loss scaled by its share of the batch,
  reduced across devices where the plan says so, added where ``decide`` keeps it.

  Also returns its per-example aux leaves, and what ``decide`` records of it.
  """
  acc, weight, call = carry.acc, x.weight, dev.call
  share = (1.0 if weight is None else weight) / dev.batch_weight
  if dev.shard_index is None:  # the jitted microbatch that `bind` traced, its trace reused
    out = call.microbatch(x.number, x.mb, carry.state, share, call.diff)
  else:
    out = _microbatch_out(dev, x.number, x.mb, carry.state, share)
  grads, admission, finite, state_kept = decide(dev, out, acc, x)
  kept, noise, state = admission.keep, carry.noise, carry.state
  if dev.options.gradient_noise:  # without weight_fn, a microbatch weighs its rows
    size = call.rows if weight is None else weight
    own = _result.gradients_only(out.grads, dev.shapes)
    noise = _noise.add(noise, own, size, kept, scale=share)
  value = out.value if admission is _KEPT else _core.masked(out.value, kept)
  first = acc.weight == 0  # nothing kept before this microbatch
  acc = _core.add_share(acc, (value, grads), admission, dev.batch_weight, dev.shapes.kinds)
  aux_sums, per_example = carry.aux_sums, []
  if dev.options.has_aux:
    aux_sums, per_example = _aux_added(dev, aux_sums, out.aux, weight, kept, first)
  if dev.options.state_argnums:
    # The state goes on as the final pass will have it: without the microbatches
    # whose gradient is not finite (a select of a small state, which holds no
    # gradient back).
    state = jax.tree.map(lambda new, old: jnp.where(state_kept, new, old), out.state, state)
  return _Carry(acc, aux_sums, state, noise), (per_example, finite)


def _microbatch_out(dev: _Device, index, mb, state, share) -> _trace.Out:
  """What microbatch ``index`` gives on each device of a mesh: ``fun`` traced
  there, with the parameters gathered where they are sharded. (On one device,
  :func:`_step` calls the jitted microbatch that ``bind`` traced: ``fun`` is
  traced once.)"""
  call = dev.call
  params = dev.gathered
  if params is None:
    params = _across_devices.gather(dev.plan, call.params(dev.args))
  return _trace.run(call.fun, dev.args, dev.shard_index, index, mb, state, share, params)


def _added_as_is(dev: _Device, out: _trace.Out, acc: _core.Accumulator, x: _Inputs) -> _Decided:
  """``on_nonfinite="propagate"`` or ``"unchecked"``: a microbatch's gradient reduced as the
  plan says, added as it is (the whole step is judged after the loop, or nothing
  is): the hand-written scan's add, which XLA fuses into the gradient's last
  product. Records whether its loss is finite, not acted on: a scalar per
  microbatch, for ``info.loss_finite``.

  Only a weight masks it: a zero-weight (padding) microbatch must add nothing
  even where its gradient is NaN, so with a ``weight_fn`` each leaf is selected
  by the weight, a scalar known before the gradient. Without one, no select.
  """
  weight = x.weight
  if weight is None and dev.plan is None:  # added as it is, nothing to select or reduce
    return _Decided(out.grads, _KEPT, jnp.isfinite(out.raw_value), _KEPT.keep)
  admission = _core.admit(None, weight, refuse_nonfinite=False)
  grads = out.grads
  if weight is not None:
    counts = jnp.isfinite(weight) & (weight > 0)
    grads = _across_devices.masked(dev.plan, grads, counts, admission.keep)
  grads = _across_devices.scatter(dev.plan, grads, acc.total[1])
  finite = jnp.isfinite(out.raw_value) | ~admission.keep
  return _Decided(grads, admission, finite, admission.keep)


def _kept_by_loss(dev: _Device, out: _trace.Out, acc: _core.Accumulator, x: _Inputs) -> _Decided:
  """``on_nonfinite="skip_microbatch"``, the first pass: a microbatch is kept by its
  loss alone; its gradient is not looked at (recorded as finite)."""
  return _kept_if(dev, out, acc, x, lambda grads: jnp.array(True))


def _kept_by_loss_and_gradient(
    dev: _Device, out: _trace.Out, acc: _core.Accumulator, x: _Inputs
) -> _Decided:
  """``on_nonfinite="skip_microbatch"``, the recheck: a microbatch is kept by its
  loss and what the recheck found so far, and records whether its gradient is
  finite (for the pass that adds the others)."""
  return _kept_if(dev, out, acc, x, _core.all_finite)


def _kept_if(
    dev: _Device, out: _trace.Out, acc: _core.Accumulator, x: _Inputs,
    gradient_finite: Callable[[Any], jax.Array],
) -> _Decided:
  """A microbatch's gradient reduced as the plan says, and what is decided about it.

  Returns the gradient (reduce-scattered where the plan says so, zero where it is
  not kept), its :class:`_core.Admission`, and what ``gradient_finite`` says of
  the reduced gradient. The admission reads the loss and ``known_bad`` alone,
  both known before the gradient: so the gradient's leaves are added as they
  come, and none waits for a check of the others.
  """
  options, weight = dev.options, x.weight
  grads = out.grads
  if weight is not None:
    # A zero (or bad) weight adds nothing, not even to other devices' shards,
    # whatever its gradient holds: padding never costs other rows. A select
    # before the reduction, on this device. Its gradient, zeros, is then finite:
    # padding is never judged.
    counts = jnp.isfinite(weight) & (weight > 0)
    grads = _across_devices.masked(dev.plan, grads, counts)
  grads = _across_devices.scatter(dev.plan, grads, acc.total[1])
  loss_ok = _by_loss(options, out, weight, x.known_bad)
  finite = gradient_finite(grads)
  if weight is not None:
    # Padding is never judged: its gradient is left out whatever it holds, and a
    # local leaf's is not zeroed above (only a scattered one's is).
    finite = finite | ~counts
  loss_ok, finite = _agreed(dev, loss_ok, finite)
  admission = _core.admit(None, weight, refuse_nonfinite=False, accept=loss_ok)
  # Selects, which XLA fuses into the additions: a shard reduced per microbatch
  # is dropped where the devices agree to skip; what stays local, where this
  # device's microbatch is not kept.
  grads = _across_devices.masked(dev.plan, grads, loss_ok, admission.keep)
  return _Decided(grads, admission, finite, admission.keep & finite)


def _aux_added(dev: _Device, aux_sums, aux, weight, kept, first):
  """The aux sums and statistics with this microbatch's aux, and its per-example
  (or per-microbatch) leaves to store."""
  reductions = dev.shapes.reductions
  aux = jax.tree.leaves(aux)
  aux_sums = [
      None if total is None else _aux_add(total, x, r, weight, kept, first)
      for total, x, r in zip(aux_sums, aux, reductions)
  ]
  per_example = [x if r in ("concat", "stack") else None for x, r in zip(aux, reductions)]
  return aux_sums, per_example


def _sums_not_finite(dev: _Device, acc: _core.Accumulator) -> jax.Array:
  """Whether the sums hold NaN or Inf. Where devices reduce inside the loop they
  must all loop alike, so the answer is agreed over the data axes."""
  bad = ~_core.all_finite(acc.total)
  if dev.plan is not None and dev.plan.scatters_per_microbatch:
    bad = jax.lax.pmax(bad.astype(jnp.int32), dev.plan.axes) > 0
  return bad


def _pass(dev: _Device, decide: _Decide, start: _Carry, xs: _Inputs):
  """One pass over the microbatches from ``start``, each decided by ``decide``:
  a ``lax.scan``, whose trip count XLA knows, with no conditional inside.

  Returns the sums, the per-example (or per-microbatch) aux leaves stacked by
  microbatch, and what ``decide`` recorded of each microbatch.
  """
  step = jax.named_call(functools.partial(_step, dev, decide), name="accum_jax_microbatch")
  carry, (stacked, finite) = jax.lax.scan(step, start, xs)
  return carry, stacked, finite


def _emptied(carry: _Carry, dev: _Device) -> _Carry:
  """``carry`` with its sums at zero and the state passed in: the start of a
  recheck pass. Zeros made here, in the recheck, rather than the first pass's
  ``start`` reused: that would keep a second set of sums alive beside the first
  pass's (its start buffers are the ones the first pass adds into)."""

  def zero(x):
    return None if x is None else jnp.zeros_like(x)

  state = carry.state
  if dev.options.state_argnums:
    state = dev.args[dev.options.state_argnums[0]]
  return _Carry(jax.tree.map(zero, carry.acc), [zero(x) for x in carry.aux_sums], state,
                jax.tree.map(zero, carry.noise))


def _skipping_passes(dev: _Device, start: _Carry, xs: _Inputs):
  """``on_nonfinite="skip_microbatch"``: the microbatches in one pass, and two more
  only where its sums are not finite. Returns the carry and the stacked
  per-example leaves.

  The first pass (:func:`_kept_by_loss`) judges each microbatch by its loss
  alone: a scalar, known before the gradient, so no leaf of the gradient waits
  for the others and nothing in the loop makes a GPU wait on the host. A
  gradient that is NaN or Inf under a finite loss shows in the sums. Only then,
  under one conditional after the loop, does the recheck run
  (:func:`_kept_by_loss_and_gradient`): a pass that finds which microbatches'
  gradients are not finite, and one that adds the others. The two are one loop
  of known trip count (2) around one pass, so the recheck compiles one more loop
  body, not two. (``"propagate"`` and ``"unchecked"`` make one pass that adds
  every microbatch as it is, :func:`_added_as_is`: see :func:`local_sums`.)
  """
  carry, stacked, _ = _pass(dev, _kept_by_loss, start, xs)

  def recheck(found):
    def again(_, loop):
      bad, (carry, _) = loop
      recheck_xs = xs._replace(known_bad=bad)
      carry, stacked, finite = _pass(
          dev, _kept_by_loss_and_gradient, _emptied(carry, dev), recheck_xs
      )
      return bad | ~finite, (carry, stacked)

    # The first pass's inputs left nothing out: the recheck starts from them.
    return jax.lax.fori_loop(0, 2, again, (xs.known_bad, found))[1]

  return jax.lax.cond(
      _sums_not_finite(dev, carry.acc), recheck, lambda found: found, (carry, stacked)
  )
