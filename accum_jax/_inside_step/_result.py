"""What one call of the inside-step door returns: the sums finalised.

:func:`finalise` turns the loop's sums (on each device under a mesh, reduced as
planned) into what ``jax.value_and_grad`` returns: the gradient normalised and
cast, the step judged (``on_nonfinite``), the aux reduced, and with
``return_info`` a :class:`MicrobatchInfo`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from accum_jax import _core, _noise
from accum_jax._inside_step import _call, _trace


class MicrobatchInfo(NamedTuple):
  """What happened to the microbatches of one call (``return_info=True``).

  Attributes:
    num_skipped: microbatches left out; shape=(), dtype=int32. Those of a
      negative or non-finite weight, and: with ``on_nonfinite="propagate"`` (the
      default), every microbatch of the call (``num_microbatches`` times the
      devices of the data axes) when the step is skipped; with
      ``"skip_microbatch"``, those whose loss or gradient was not finite. With
      dynamic loss scaling, a non-zero count is an overflow the scaler must see.
    total_weight: the sum of the kept microbatches' weights (their number when
      there is no ``weight_fn``); 0 when the step is skipped; shape=(),
      dtype=float32.
    gradient_noise: with ``gradient_noise=True``, the :class:`accum_jax.noise.GradientNoise`
      estimated from the microbatches' gradients (per unit of weight; per
      example without ``weight_fn``); else None.
    step_not_finite: whether the step's gradient came back NaN: its summed loss
      or gradient was not finite (``"propagate"``: nothing was skipped, a gate
      such as ``optax.apply_if_finite`` skips the update), or no microbatch was
      kept (``"skip_microbatch"``); shape=(), dtype=bool. False with
      ``on_nonfinite="unchecked"``.
    loss_finite: with ``on_nonfinite="propagate"``, whether each microbatch's loss
      was finite (zero-weight padding counts as finite); shape
      (num_microbatches,), or (devices x num_microbatches,) in device order
      under a mesh; dtype=bool. Else None.
  """

  num_skipped: jax.Array
  total_weight: jax.Array
  gradient_noise: _noise.GradientNoise | None = None
  step_not_finite: jax.Array | None = None
  loss_finite: jax.Array | None = None



class LocalSums(NamedTuple):
  """What one device's scan over its microbatches leaves, before normalisation.

  Attributes:
    acc: the sums of ``(value, grads)``, an ``_core.Accumulator`` filled by
      ``_core.add_share``.
    aux_sums: per aux leaf, its running sum, or None for a per-example leaf.
    state: the threaded state after the last microbatch (None without one).
    per_example: per aux leaf, its outputs in batch order (``"concat"``), or
      stacked by microbatch (``"stack"``), or None for a summed leaf.
    noise: the sums of the gradient-noise estimate, an ``_noise.NoiseSums``, or
      None without ``gradient_noise``.
    batch_weight: the weight of the whole batch (every device's), float32.
    loss_finite: with ``on_nonfinite="propagate"``, whether each microbatch's loss
      is finite (padding counts as finite), shape (N,), in device order under a
      mesh; else None.
  """

  acc: Any
  aux_sums: Any  # a list of arrays and None (or, as out_specs, one spec)
  state: Any
  per_example: Any  # likewise
  noise: Any = None
  batch_weight: Any = None
  loss_finite: Any = None  # per microbatch, whether its loss is finite (on_nonfinite="propagate")



def _aux_result(total, per_example, like, reduction, weight, call) -> jax.Array:
  if _core.is_statistic(reduction):
    return _core.statistic_result(total, like.dtype, weight)
  if reduction in ("concat", "stack"):
    return per_example
  if reduction == "mean":
    total = total / jnp.where(weight > 0, weight, 1.0).astype(total.dtype)
  return total.astype(like.dtype) if jnp.issubdtype(like.dtype, jnp.inexact) else total


def finalise(sums: LocalSums, call: _call.Call) -> Any:
  """Normalises the sums into what ``jax.value_and_grad`` returns."""
  options, shapes, acc = call.options, call.shapes, sums.acc
  returned = shapes.grads
  if options.gradient_dtype is not None:
    returned = _returned(shapes.grads, options.gradient_dtype)
  # Without a weight_fn, and with no microbatch left out on its own, every one is
  # kept: the sums are the batch's mean as they are.
  every_kept = options.weight_fn is None and options.on_nonfinite != "skip_microbatch"
  value, grads = _core.share_result(acc, (shapes.value, returned), sums.batch_weight,
                                    shapes.kinds, every_kept)
  # Every microbatch skipped: NaN, as on the whole batch, rather than a loss of
  # 0 that hides it (accumulate, apply_if_finite... then skip the step too).
  nothing_kept = (acc.weight == 0) & (acc.num_skipped > 0)
  value = jnp.where(nothing_kept, jnp.nan, value)
  grads, state, skip = _skipped(call, acc, grads, sums.state, nothing_kept)
  aux = shapes.aux
  if options.has_aux:
    aux = jax.tree.unflatten(jax.tree.structure(shapes.aux), [
        _aux_result(total, per_example, like, r, acc.weight, call)
        for total, per_example, like, r in zip(
            sums.aux_sums, sums.per_example, jax.tree.leaves(shapes.aux), shapes.reductions
        )
    ])
  if options.state_argnums:
    aux = (state, aux)
  out = (value, aux) if options.has_aux else value
  if options.return_info:
    return out, grads, MicrobatchInfo(
        skip.num_skipped, skip.total_weight, _noise_estimate(sums, shapes), skip.skipped,
        sums.loss_finite,
    )
  return out, grads


class _StepSkip(NamedTuple):
  """What :class:`MicrobatchInfo` says about skipping."""

  skipped: jax.Array
  num_skipped: jax.Array
  total_weight: jax.Array


def _skipped(call: _call.Call, acc, grads, state, nothing_kept) -> tuple[Any, Any, _StepSkip]:
  """The gradient, the threaded state and what ``info`` says, by ``on_nonfinite``:
  with ``"propagate"``, a step that is not finite comes back with a NaN gradient and
  the state passed in (selects, no conditional). See :func:`_skipped_grads`."""
  options = call.options
  skip = _StepSkip(nothing_kept, acc.num_skipped, acc.weight)
  if options.propagates:
    skip = _whole_step(acc, call.plan)
    if options.state_argnums:
      old = call.args[options.state_argnums[0]]
      state = jax.tree.map(lambda new, old: jnp.where(skip.skipped, old, new), state, old)
  elif not options.checks_finite:
    skip = skip._replace(skipped=jnp.array(False))
  return _skipped_grads(call, grads, skip.skipped | nothing_kept), state, skip


def _skipped_grads(call: _call.Call, grads: Any, skipped: jax.Array) -> Any:
  """``grads``, or where the step is ``skipped``, NaN in every gradient leaf and
  the statistics ("max", "last" leaves) as they were passed in.

  NaN, never zeros: a zero gradient is finite, so the optimizer would take a step
  on it (Adam's moments decay and its count advances) and neither
  ``optax.apply_if_finite``, ``accumulate`` nor a loss scale would see the step
  fail. In every leaf, not only those the sums hold NaN in: a step is skipped for
  a loss that is not finite as well, and a gate over some of the leaves
  (``optax.multi_transform``) must see it too. A statistic is no gradient: it is
  the new value of its parameter (Flax's FP8 amax histories and scales, which
  ``TrainState.apply_gradients`` writes over the old ones, past the optimizer),
  so a skipped step leaves it where it was, as it leaves the threaded state: a
  NaN scale would make every later step NaN.
  """

  def nan(g, old, kind):
    return jnp.where(skipped, jnp.nan, g) if jnp.issubdtype(g.dtype, jnp.inexact) else g

  def unchanged(g, old, kind):
    return jnp.where(skipped, jnp.asarray(old).astype(g.dtype), g)

  # The parameters are structured as their gradient is (`_call.diff_args`).
  return _core.map_kinds(nan, call.shapes.grad_kinds, grads, call.diff, statistic=unchanged)


# The largest leaf (in elements) the step's check packs with the others.
STEP_PACK_LIMIT = 1 << 12


def _whole_step(acc: _core.Accumulator, plan: Any) -> _StepSkip:
  """``on_nonfinite="propagate"``: one check of the summed loss and gradient after the
  loop (the sums are the whole batch's, every device's), no conditional. A step
  that is skipped leaves out every microbatch of the call.

  On one device the leaves of at most :data:`STEP_PACK_LIMIT` elements are
  checked packed (:func:`_core.all_finite_packed`): one reduction for the norms
  and biases rather than one each, which would take most of the compile time a
  many-leaf model's step adds to the hand-written scan's (XLA:CPU, miniGPT: 6.5 s
  to compile, 3.6 s packed). The packed copy is their bytes, after the loop. The
  limit is lower than across calls, where the check runs on every call: here it
  runs once a step, and a copy of larger leaves would raise the step's static
  memory (on a 24-leaf MLP of 128 x 128 weights, 1.28x the hand-written scan's
  with every leaf packed, 1.00x with the weights checked where they lie). Under a
  mesh each leaf is checked where it lies: packing a sharded one would gather it.
  """
  if plan is None:
    skipped = ~_core.all_finite_packed(acc.total, STEP_PACK_LIMIT)
  else:
    skipped = ~_core.all_finite(acc.total)
  return _StepSkip(
      skipped,
      jnp.where(skipped, acc.count + acc.num_skipped, acc.num_skipped),
      jnp.where(skipped, 0.0, acc.weight),
  )


def _returned(grads: Any, gradient_dtype: Any) -> Any:
  """The gradient's leaves as they are returned: in ``gradient_dtype`` where it is
  given (real floating leaves; complex ones keep their own), else as the parameters."""
  if gradient_dtype is None:
    return grads
  return jax.tree.map(
      lambda x: _trace.abstract(x, gradient_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
      grads,
  )


def _noise_estimate(
    sums: LocalSums, shapes: _trace.Shapes
) -> _noise.GradientNoise | None:
  """From the sums, the combined gradient's norm read off the accumulator."""
  if sums.noise is None:
    return None
  # The noise is that of the microbatches' mean gradients, "sum" leaves included;
  # statistics ("max", "last") are left out.
  totals = jax.tree.leaves(gradients_only(sums.acc.total[1], shapes))
  factor = _core.share_factor(sums.acc, sums.batch_weight)
  return _noise.estimate(sums.noise, _noise.mean_squared_norm(totals, factor))


def gradients_only(grads: Any, shapes: _trace.Shapes) -> Any:
  """The leaves of ``grads`` that are gradients: "max" and "last" leaves are
  statistics, which no gradient-noise estimate should see."""
  return grads if shapes.grad_kinds is None else _core.gradient_leaves(grads, shapes.grad_kinds)
