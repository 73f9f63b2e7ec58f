"""DP-SGD over a logical batch larger than memory: one noise draw per logical batch.

Differentially private SGD (Abadi et al. 2016) clips each example's gradient to an L2
norm ``l2_clip``, sums the clipped gradients of a logical batch, adds Gaussian noise of
standard deviation ``noise_multiplier * l2_clip`` once, and divides by the *expected*
logical batch size (with Poisson sampling the realised size varies, and dividing by it
would reveal it). The privacy guarantee comes from large logical batches, which do not
fit in memory; this module streams one through several calls of the train step, with
:func:`accum_jax.accumulate` summing the calls and running the noise once per window::

  opt = accumulate_private(inner, l2_clip=C, noise_multiplier=sigma,
                           expected_batch_size=B, key=key)
  grad_sum = clipped_grad_sum(per_example_loss, C)
  for each logical batch (each example drawn with probability q = B / N):
    for each physical batch of it (padded to a fixed size, at least one):
      g, _ = grad_sum(params, batch, mask)   # sum of the clipped per-example gradients
      # apply: a Python bool, static in the jitted step; the host knows the last batch
      updates, state = opt.update(g, state, params, apply=is_last_physical_batch)
      params = optax.apply_updates(params, updates)
  # On each applying call, once: inner((sum of the g + N(0, (sigma * C)^2)) / B).
  # accum_jax.optimizer_step(state) counts the noisy releases, for the accountant.

``optax.contrib.differentially_private_aggregate`` cannot do this: it adds noise on
every call and divides by the physical batch size. :func:`check_inner` and
:func:`check_state` refuse it, and noise placed where it would run on every call.

Not imported by ``import accum_jax``: ``import accum_jax.privacy``. See the guide
:doc:`/guides/differential_privacy`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from accum_jax._across_calls import _schedules, _state, _transform
from accum_jax._across_calls._inner_checks import (
  DP_AGGREGATE_STATE,
  RECIPE,
  GaussianNoiseState,
  check_inner,
  nodes,
)

__all__ = (
    "ClippedGradSum",
    "GaussianNoiseState",
    "accumulate_private",
    "add_gaussian_noise",
    "check_inner",
    "check_state",
    "clipped_grad_sum",
    "dp_aggregate",
    "poisson_batches",
)

# every_k=None: no window length, only the host's apply=True (or the device
# schedule's flush=True) ends a window (a count of calls never reaches it).
_UNBOUNDED = 2**31 - 1
# Arguments of accumulate's update that accumulate consumes: an inner transformation
# never receives them, so a noise transformation that does sits outside accumulate.
_ACCUMULATE_ARGUMENTS = ("flush", "weight")


def _number(value: Any, name: str, *, positive: bool, meaning: str) -> float:
  """``value`` as a finite float, > 0 (``positive``) or >= 0; a ValueError otherwise."""
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = math.nan
  if isinstance(value, bool) or not math.isfinite(number) or number < 0 or (
      positive and number == 0):
    bound = "> 0" if positive else ">= 0"
    raise ValueError(f"{name}={value!r} must be a finite number {bound}: {meaning}.")
  return number


# ----------------------------------------------------------------------------
# Clipped per-example gradient sums, for one physical batch.


class ClippedGradSum(NamedTuple):
  """What :func:`clipped_grad_sum`'s function returns for one physical batch.

  Attributes:
    grads: the sum, over the kept examples, of each one's gradient clipped to L2 norm
      ``l2_clip``; the parameters' tree and dtypes. Pass it to ``update`` of
      :func:`accumulate_private` as the call's gradient.
    num_examples: int32 scalar, the examples kept: mask true and a finite gradient.
      For logging only: it is the realised batch size, which the update must not
      depend on (do not pass it as ``weight=``).

  Examples:
    >>> import jax.numpy as jnp, accum_jax.privacy
    >>> out = accum_jax.privacy.ClippedGradSum(grads={"w": jnp.zeros(2)},
    ...                                        num_examples=jnp.int32(0))
    >>> grads, n = out
  """

  grads: Any
  num_examples: jax.Array


def _batch_size(batch: Any) -> int:
  leaves = jax.tree.leaves(batch)
  if not leaves or any(jnp.ndim(leaf) == 0 for leaf in leaves):
    raise ValueError(
        "clipped_grad_sum's function takes a batch of examples: a pytree of arrays with a"
        " leading example axis, got one with"
        f" {'no arrays' if not leaves else 'a scalar leaf'}."
    )
  return int(jnp.shape(leaves[0])[0])


def _keep_mask(mask: Any, size: int) -> jax.Array:
  if mask is None:
    return jnp.ones((size,), bool)
  if jnp.shape(mask) != (size,):
    raise ValueError(
        f"mask has shape {jnp.shape(mask)}, but the batch has {size} examples: pass one"
        f" entry per example, shape ({size},), true for a real example and false for"
        " padding."
    )
  return jnp.asarray(mask) != 0


def _clip(grads: Any, l2_clip: float) -> tuple[Any, jax.Array]:
  """``grads`` scaled to L2 norm at most ``l2_clip``, and whether they are finite."""
  leaves = jax.tree.leaves(grads)
  if not leaves:
    return grads, jnp.array(True)
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves]))
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))
  # A norm that overflows float32 scales by 0: the example adds nothing, and at most
  # l2_clip is still the bound. A NaN scale is dropped with the example.
  scale = l2_clip / jnp.maximum(norm, l2_clip)
  return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), finite


def _masked_sum(clipped: jax.Array, keep: jax.Array) -> jax.Array:
  """The sum over examples (axis 0) where ``keep``; a select, so NaNs weigh nothing."""
  wide = jnp.promote_types(clipped.dtype, jnp.float32)
  where = jnp.reshape(keep, keep.shape + (1,) * (clipped.ndim - 1))
  total = jnp.sum(jnp.where(where, clipped.astype(wide), 0), axis=0)
  return total.astype(clipped.dtype)


def clipped_grad_sum(
    loss_fn: Callable[..., Any],
    l2_clip: float,
    *,
    has_aux: bool = False,
) -> Callable[..., Any]:
  """The sum of per-example gradients, each clipped to L2 norm ``l2_clip``.

  For one physical batch, the returned function computes::

    for each example i (jax.vmap):
      g_i = jax.grad(loss_fn)(params, example_i)
      g_i = g_i * l2_clip / max(global_norm(g_i), l2_clip)
      keep_i = mask[i] and g_i is finite
    ClippedGradSum(grads=sum(g_i where keep_i), num_examples=sum(keep_i))

  Each example adds at most ``l2_clip`` to the sum (its sensitivity under adding or
  removing one example): padding (mask false) adds exactly nothing, whatever its
  loss, and so does an example whose gradient holds NaN or Inf, instead of making
  the whole physical batch non-finite. The per-example gradients of a physical batch
  are alive at once; pick its size for memory, and stream the logical batch through
  :func:`accumulate_private`. Norms and the sum are computed in float32 (at least)
  and cast back to the gradients' dtypes.

  Any other function that returns such a sum will do: jax_privacy's
  ``clipped_grad(loss_fn, l2_clip_norm=l2_clip)`` (padding marked with
  ``is_padding_example=``), or your own ``jax.vmap`` of ``jax.grad`` and a clip.

  Args:
    loss_fn: the loss of one example, ``loss_fn(params, example) -> scalar``
      (``(scalar, aux)`` with ``has_aux``), where ``example`` is one row of each leaf
      of the batch. It must not couple examples (no batch statistics).
    l2_clip: the largest L2 norm of an example's gradient over all parameters.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; the function then returns
      ``(ClippedGradSum, aux)`` with ``aux`` per example (padding included), e.g.
      the losses to log. It is not private.

  Returns:
    A function ``(params, batch, mask=None) -> ClippedGradSum`` (or
    ``(ClippedGradSum, aux)``), where ``batch`` is a pytree of arrays with a leading
    example axis and ``mask`` a vector over it, true for real examples.

  Raises:
    ValueError: for an ``l2_clip`` that is not a positive number; at trace time, for
      a ``mask`` whose shape is not ``(batch size,)``.

  Examples:
    >>> import jax.numpy as jnp, accum_jax.privacy
    >>> loss = lambda w, x: jnp.sum(w * x)  # the gradient of example x is x
    >>> grad_sum = accum_jax.privacy.clipped_grad_sum(loss, l2_clip=1.0)
    >>> x = jnp.array([[3.0, 4.0], [0.3, 0.4], [9.0, 9.0]])  # norms 5, 0.5, 12.7
    >>> grads, n = grad_sum(jnp.zeros(2), x, mask=jnp.array([True, True, False]))
    >>> grads, int(n)  # (0.6, 0.8) + (0.3, 0.4); the padding row adds nothing
    (Array([0.90000004, 1.2       ], dtype=float32), 2)
  """
  clip = _number(l2_clip, "l2_clip", positive=True,
                 meaning="the largest L2 norm of one example's gradient, e.g. 1.0")
  grad_fn = jax.grad(loss_fn, has_aux=has_aux)

  def one_example(params, example):
    out = grad_fn(params, example)
    grads, aux = out if has_aux else (out, None)
    clipped, finite = _clip(grads, clip)
    return clipped, finite, aux

  def grad_sum(params: Any, batch: Any, mask: Any = None) -> Any:
    keep = _keep_mask(mask, _batch_size(batch))
    clipped, finite, aux = jax.vmap(one_example, in_axes=(None, 0))(params, batch)
    keep = keep & finite
    result = ClippedGradSum(
        grads=jax.tree.map(lambda g: _masked_sum(g, keep), clipped),
        num_examples=jnp.sum(keep, dtype=jnp.int32),
    )
    return (result, aux) if has_aux else result

  return grad_sum


# ----------------------------------------------------------------------------
# Noise, once per window.


def _check_key(key: Any) -> jax.Array:
  if isinstance(key, numbers.Integral) and not isinstance(key, bool):
    return jax.random.key(int(key))
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if jnp.shape(key) == ():
      return key
  elif dtype == jnp.uint32 and jnp.shape(key) == (2,):
    return key  # a raw key, jax.random.PRNGKey(seed)
  raise ValueError(
      f"key={key!r} is not one PRNG key: pass jax.random.key(seed) (or an int seed), not"
      " a batch of keys. The noise must be drawn from a key that nothing else uses."
  )


def _refuse_accumulate_arguments(extra_args: dict[str, Any]) -> None:
  for name in _ACCUMULATE_ARGUMENTS:
    if name in extra_args:
      raise ValueError(
          f"add_gaussian_noise got {name}=, an argument of accum_jax.accumulate's update:"
          " it sits outside accumulate (before it in an optax.chain), where it adds noise"
          " to every call's gradient instead of once per logical batch. Put it inside, as"
          f" the first link of accumulate's inner optimizer: {RECIPE}."
      )


def _noised(leaf: jax.Array, key: jax.Array, stddev: float) -> jax.Array:
  dtype = jnp.result_type(leaf)
  if not jnp.issubdtype(dtype, jnp.floating):
    return leaf
  wide = jnp.promote_types(dtype, jnp.float32)
  noise = stddev * jax.random.normal(key, jnp.shape(leaf), wide)
  return (jnp.asarray(leaf, wide) + noise).astype(dtype)


def add_gaussian_noise(
    stddev: float, key: jax.Array | int
) -> optax.GradientTransformationExtraArgs:
  """Adds fresh Gaussian noise ``N(0, stddev^2)`` to every coordinate, each time it runs.

  Application ``t`` (``num_draws`` of its state, from 0) draws::

    keys = jax.random.split(jax.random.fold_in(key, t), len(jax.tree.leaves(updates)))
    leaf_j + stddev * jax.random.normal(keys[j], leaf_j.shape, float32)

  for each floating leaf ``j`` (in float32, or the leaf's dtype if wider, then cast
  back); other leaves pass through. Placed first in the inner optimizer of
  ``accumulate(..., reduction="sum")``, it runs once per window, on the window's sum:
  the noise of DP-SGD. :func:`dp_aggregate` is it followed by the division by the
  expected batch size.

  It refuses to run outside :func:`accum_jax.accumulate`, where it would run on every
  call, when it can tell: it raises if its ``update`` receives ``flush=`` or
  ``weight=``, which ``accumulate`` consumes and never passes on (it is then before
  ``accumulate`` in an ``optax.chain``). A chain given only ``apply=`` (the host
  schedule) does not show it there: :func:`check_state` finds it outside in a whole
  optimizer state, whatever the call passes.

  Args:
    stddev: the noise's standard deviation, ``noise_multiplier * l2_clip`` for DP-SGD.
    key: a PRNG key (``jax.random.key(seed)`` or ``jax.random.PRNGKey(seed)``) or an
      int seed, used for this noise only.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a :class:`GaussianNoiseState`.

  Raises:
    ValueError: for a negative ``stddev`` or a ``key`` that is not one key; at trace
      time, when ``update`` receives ``flush`` or ``weight``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, accum_jax, accum_jax.privacy
    >>> inner = optax.chain(accum_jax.privacy.add_gaussian_noise(1.0, jax.random.key(0)),
    ...                     optax.sgd(0.1))
    >>> opt = accum_jax.accumulate(inner, every_k=4, reduction="sum")
    >>> state = opt.init({"w": jnp.zeros(3)})
    >>> for _ in range(8):
    ...   _, state = opt.update({"w": jnp.ones(3)}, state)
    >>> int(optax.tree.get(state, "num_draws"))  # two windows, two draws
    2
  """
  sigma = _number(stddev, "stddev", positive=False,
                  meaning="the noise's standard deviation, noise_multiplier * l2_clip")
  base_key = _check_key(key)

  def init_fn(params):
    del params
    return GaussianNoiseState(key=base_key, num_draws=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    del params
    _refuse_accumulate_arguments(extra_args)
    leaves, treedef = jax.tree.flatten(updates)
    keys = jax.random.split(jax.random.fold_in(state.key, state.num_draws), max(len(leaves), 1))
    noised = [_noised(leaf, k, sigma) for leaf, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noised), GaussianNoiseState(state.key, state.num_draws + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dp_aggregate(
    *,
    l2_clip: float,
    noise_multiplier: float,
    expected_batch_size: float,
    key: jax.Array | int,
) -> optax.GradientTransformationExtraArgs:
  """The noise and the division of DP-SGD, for the sum of a logical batch's clipped gradients.

  ``optax.chain(add_gaussian_noise(noise_multiplier * l2_clip, key),
  optax.scale(1 / expected_batch_size))``: one noise draw, then the division by the
  expected (not the realised) logical batch size. Put it first in the inner optimizer
  of ``accum_jax.accumulate(..., reduction="sum")``; :func:`accumulate_private` does.

  Args:
    l2_clip: the clipping norm of the per-example gradients (the sum's sensitivity).
    noise_multiplier: the noise's standard deviation over ``l2_clip``: the ``sigma``
      of the accountant.
    expected_batch_size: the logical batch's expected size, ``q * dataset_size`` with
      Poisson sampling at rate ``q``; the batch size, with batches of fixed size.
    key: as for :func:`add_gaussian_noise`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    ValueError: for a non-positive ``l2_clip`` or ``expected_batch_size``, or a
      negative ``noise_multiplier``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, accum_jax, accum_jax.privacy
    >>> noise = accum_jax.privacy.dp_aggregate(
    ...     l2_clip=1.0, noise_multiplier=0.0, expected_batch_size=4, key=0)
    >>> opt = accum_jax.accumulate(optax.chain(noise, optax.sgd(1.0)), 2, reduction="sum")
    >>> state = opt.init({"w": jnp.zeros(1)})
    >>> _, state = opt.update({"w": jnp.array([1.0])}, state)
    >>> updates, state = opt.update({"w": jnp.array([3.0])}, state)
    >>> updates  # -(1 + 3) / 4, without noise
    {'w': Array([-1.], dtype=float32)}
  """
  clip = _number(l2_clip, "l2_clip", positive=True,
                 meaning="the largest L2 norm of one example's gradient, e.g. 1.0")
  sigma = _number(noise_multiplier, "noise_multiplier", positive=False,
                  meaning="the noise's standard deviation over l2_clip, e.g. 1.0")
  expected = _number(expected_batch_size, "expected_batch_size", positive=True,
                     meaning="the logical batch's expected size, sampling rate x dataset size;"
                     " the divisor of the noisy sum, never the realised size")
  return optax.chain(add_gaussian_noise(sigma * clip, key), optax.scale(1.0 / expected))


def accumulate_private(
    inner: optax.GradientTransformation,
    every_k: int | _schedules.EveryKSchedule | None = None,
    *,
    l2_clip: float,
    noise_multiplier: float,
    expected_batch_size: float,
    key: jax.Array | int,
    accumulator_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  """DP-SGD with a logical batch streamed through several calls.

  ``accumulate(optax.chain(dp_aggregate(...), inner), every_k, reduction="sum")``,
  whose ``init`` also refuses ``optax.contrib.differentially_private_aggregate`` in
  ``inner`` (:func:`check_inner`). Each call passes the sum of a physical batch's
  clipped per-example gradients (:func:`clipped_grad_sum`), without ``weight=``::

    for each call, with g its gradient:
      if g is not finite: skip it, count it in state.num_skipped
      total += g                                # in accumulator_dtype
      if apply:                                 # the host's flag, a Python bool
        noise = N(0, (noise_multiplier * l2_clip)^2), key fold_in(key, t)
        update = inner((total + noise) / expected_batch_size)
        t += 1; empty the window                # t is accum_jax.optimizer_step(state)
      else:
        update = 0

  The host knows which physical batch ends a logical batch, so it says so: pass
  ``apply=`` (a Python bool, static in the jitted step), ``True`` on that call and
  ``False`` on the others, which then compile to the gradient sum and one add. With
  Poisson sampling the logical batch's size varies, and so does the number of
  physical batches: leave ``every_k=None`` (no window length of its own) and pass
  ``apply=True`` on the last call of each logical batch (:func:`poisson_batches`
  gives the physical batches, at least one, so that an empty logical batch still
  releases its noise). With logical batches of a fixed number of calls, pass that
  number, and :class:`accum_jax.HostSchedule` gives the flags. Left out, ``apply``
  hands the decision to the device (``every_k`` counted, or ``flush=True``).

  Args:
    inner: the optimizer, e.g. ``optax.sgd(...)`` or ``optax.adam(...)``; it sees the
      noisy mean gradient once per logical batch.
    every_k: calls per logical batch, a schedule of it, or None: only
      ``apply=True`` (or ``flush=True`` on the device schedule) ends one.
    l2_clip: the clipping norm the gradient sums were clipped with.
    noise_multiplier: the noise's standard deviation over ``l2_clip``.
    expected_batch_size: the divisor, ``sampling_rate * dataset_size``.
    key: as for :func:`add_gaussian_noise`.
    accumulator_dtype: as for :func:`accum_jax.accumulate`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
    params=None, *, apply=None, flush=False, **extra_args)`` is ``accumulate``'s.
    :func:`accum_jax.optimizer_step` of its state counts the logical batches applied:
    the steps of the accountant. Its arguments are checked as
    :func:`dp_aggregate`'s and ``accumulate``'s; ``init`` as :func:`check_inner`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, accum_jax, accum_jax.privacy
    >>> opt = accum_jax.privacy.accumulate_private(
    ...     optax.sgd(0.1), l2_clip=1.0, noise_multiplier=1.1, expected_batch_size=64,
    ...     key=jax.random.key(0))
    >>> params = {"w": jnp.zeros(3)}
    >>> state = opt.init(params)
    >>> step = jax.jit(opt.update, static_argnames="apply")
    >>> for last in (False, False, True):  # one logical batch in three calls
    ...   updates, state = step({"w": jnp.ones(3)}, state, params, apply=last)
    >>> int(accum_jax.optimizer_step(state))
    1
  """
  opt = _transform.accumulate(
      optax.chain(
          dp_aggregate(l2_clip=l2_clip, noise_multiplier=noise_multiplier,
                       expected_batch_size=expected_batch_size, key=key),
          inner,
      ),
      _UNBOUNDED if every_k is None else every_k,
      reduction="sum",
      accumulator_dtype=accumulator_dtype,
      # A bad physical batch is dropped alone: the logical batch keeps the others,
      # and its noise is drawn once, as the accountant counts it.
      on_nonfinite="skip_microbatch",
  )

  def init_fn(params):
    state = opt.init(params)
    check_inner(state.inner_opt_state, "sum")
    return state

  return optax.GradientTransformationExtraArgs(init_fn, opt.update)


# ----------------------------------------------------------------------------
# Refusals: what silently breaks DP-SGD with accumulation.


def check_state(opt_state: Any) -> None:
  """Refuses an optimizer state in which DP-SGD's noise runs on every call.

  With an :func:`accum_jax.accumulate` state in ``opt_state``, an
  :func:`add_gaussian_noise` or ``optax.contrib.differentially_private_aggregate``
  state outside it (before or after ``accumulate`` in an ``optax.chain``) belongs to a
  transformation that runs on every call: it adds noise to each physical batch, and
  ``accumulate`` then sums or averages the noisy calls. Inside, :func:`check_inner`
  applies. Without ``accumulate`` every call is a logical batch, and nothing is
  refused. Call it once on the state ``init`` returned.

  Args:
    opt_state: an optimizer state, or any pytree holding one (a Flax ``TrainState``,
      an ``nnx.Optimizer``).

  Raises:
    ValueError: with the composition to use instead.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, accum_jax, accum_jax.privacy
    >>> noise = accum_jax.privacy.add_gaussian_noise(1.0, jax.random.key(0))
    >>> opt = optax.chain(noise, accum_jax.accumulate(optax.sgd(0.1), 4, reduction="sum"))
    >>> accum_jax.privacy.check_state(opt.init({"w": jnp.zeros(2)}))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: add_gaussian_noise sits outside accum_jax.accumulate: ...
  """
  accumulation = _state.AccumulationState
  found = nodes(opt_state, (accumulation, GaussianNoiseState, DP_AGGREGATE_STATE))
  accumulations = [x for x in found if isinstance(x, accumulation)]
  if not accumulations:
    return
  for outside in found:
    if isinstance(outside, accumulation):
      continue
    name = (
        "add_gaussian_noise" if isinstance(outside, GaussianNoiseState)
        else "optax.contrib.differentially_private_aggregate"
    )
    raise ValueError(
        f"{name} sits outside accum_jax.accumulate: it runs on every call, adding noise"
        " to each physical batch's gradient, which accumulate then combines: a window of"
        " k calls gets k draws instead of one, and the accountant's count of optimizer"
        f" steps no longer counts the draws. Put the noise inside: {RECIPE}."
    )
  for state in accumulations:
    check_inner(state.inner_opt_state, reduction=None)


# ----------------------------------------------------------------------------
# Poisson sampling, on the host.


def poisson_batches(
    rng: np.random.Generator,
    dataset_size: int,
    *,
    sampling_rate: float,
    physical_batch_size: int,
) -> list[tuple[np.ndarray, np.ndarray]]:
  """One Poisson-sampled logical batch, as padded physical batches of a fixed size.

  Each of the ``dataset_size`` examples is in the logical batch with probability
  ``sampling_rate``, independently (the sampling the accountant assumes). Its indices
  are cut into physical batches of ``physical_batch_size``, the last one padded with
  index 0 and mask false; an empty logical batch gives one batch of padding, so that
  its step still adds noise and counts. Pass ``apply=True`` with the last one
  (``flush=True`` on the device schedule), ``apply=False`` with the others.

  Args:
    rng: the generator that draws the sample.
    dataset_size: the number of examples to sample from.
    sampling_rate: each example's probability ``q``, in (0, 1]; ``expected_batch_size
      = q * dataset_size``.
    physical_batch_size: the examples per call, what fits in memory.

  Returns:
    A list of ``(indices, mask)`` pairs of int64 and bool arrays of shape
    ``(physical_batch_size,)``; at least one.

  Raises:
    ValueError: for a ``sampling_rate`` outside (0, 1], or a size that is not an int
      >= 1.

  Examples:
    >>> import numpy as np, accum_jax.privacy
    >>> batches = accum_jax.privacy.poisson_batches(
    ...     np.random.default_rng(0), 100, sampling_rate=0.1, physical_batch_size=4)
    >>> [int(mask.sum()) for _, mask in batches]
    [4, 4, 2]
  """
  for name, value in (("dataset_size", dataset_size),
                      ("physical_batch_size", physical_batch_size)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise ValueError(f"{name}={value!r} must be an int >= 1.")
  q = _number(sampling_rate, "sampling_rate", positive=True,
              meaning="each example's probability of being in the logical batch,"
              " expected_batch_size / dataset_size")
  if q > 1:
    raise ValueError(
        f"sampling_rate={sampling_rate!r} must be at most 1: it is each example's"
        " probability of being in the logical batch, expected_batch_size / dataset_size."
    )
  indices = np.flatnonzero(rng.random(dataset_size) < q)
  num_batches = max(1, -(-indices.size // physical_batch_size))
  padded = np.zeros(num_batches * physical_batch_size, np.int64)
  padded[: indices.size] = indices
  mask = np.arange(padded.size) < indices.size
  return list(zip(np.split(padded, num_batches), np.split(mask, num_batches)))
