"""The gradient noise scale, measured from the small batches that accumulation sees.

Every accumulated step already holds K small-batch gradients of the same
parameters. With weights (batch sizes) ``b_k``, their mean gradients ``g_k``,
``B = sum b_k`` and the combined gradient ``g = sum b_k g_k / B``, for a
per-example gradient of mean ``G`` and covariance ``Sigma`` (McCandlish et al.
2018, "An Empirical Model of Large-Batch Training", Appendix A)::

  E[sum b_k |g_k|^2 / B - |g|^2] = (K - 1) tr(Sigma) / B
  E[|g|^2] = |G|^2 + tr(Sigma) / B

so both estimates below are unbiased::

  trace_cov = (sum b_k |g_k|^2 / B - |g|^2) * B / (K - 1)
  grad_sq   = |g|^2 - trace_cov / B

The simple noise scale ``B_simple = tr(Sigma) / |G|^2`` is the batch size (in
the unit of the weights) past which a larger batch buys little; estimate it as a
ratio of averages over steps (:class:`NoiseScaleEMA`), not an average of ratios.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from accum_jax import _core


class GradientNoise(NamedTuple):
  """Unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` from one step's small batches.

  Attributes:
    grad_sq: the squared norm of the true gradient, ``|G|^2``; shape=(),
      dtype=float32. NaN with fewer than two kept small batches.
    trace_cov: the trace of the per-example gradient covariance, in the unit of
      the weights (per example, per token...); shape=(), dtype=float32.

  Examples:
    >>> import jax.numpy as jnp, accum_jax
    >>> loss = lambda w, x: jnp.mean((x * w - 1.0) ** 2)
    >>> vg = accum_jax.value_and_grad(loss, 2, gradient_noise=True, return_info=True)
    >>> _, _, info = vg(jnp.float32(0.0), jnp.array([1.0, 2.0, 3.0, 4.0]))
    >>> info.gradient_noise.grad_sq.shape, info.gradient_noise.trace_cov.shape
    ((), ())
  """

  grad_sq: jax.Array
  trace_cov: jax.Array

  @property
  def simple_noise_scale(self) -> jax.Array:
    """``trace_cov / grad_sq``: one step's (noisy, biased) ``B_simple``."""
    return self.trace_cov / self.grad_sq


class NoiseSums(NamedTuple):
  """What the noise estimate needs from the small batches, summed like gradients.

  Attributes:
    weighted_sq: ``sum b_k |g_k|^2``; shape=(), dtype=float32.
    weight: ``sum b_k``; shape=(), dtype=float32.
    count: ``K``, the small batches with a positive weight; shape=(), dtype=int32.
  """

  weighted_sq: jax.Array
  weight: jax.Array
  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count


# Real leaves of up to _SMALL_LEAF elements are squared and summed together, one
# pass over their concatenation per dtype (in groups of at most _SMALL_GROUP
# elements): a model of many small leaves (norms, biases, the embeddings of a small
# model) pays one reduction per microbatch rather than one per leaf, for a copy of
# at most _SMALL_GROUP elements. Larger leaves keep their own reduction, which reads
# them where they lie.
_SMALL_LEAF = 1 << 14
_SMALL_GROUP = 1 << 16


def _sum_sq(x: jax.Array) -> jax.Array:
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return jnp.sum(jnp.abs(x) ** 2).real.astype(jnp.float32)


def _small_groups(leaves: list[jax.Array]) -> list[list[jax.Array]]:
  """The small real leaves, by dtype, in groups of at most ``_SMALL_GROUP`` elements."""
  groups: dict[Any, list[list[jax.Array]]] = {}
  filled: dict[Any, int] = {}  # elements in each dtype's last group
  for x in leaves:
    open_groups = groups.setdefault(x.dtype, [[]])
    if filled.get(x.dtype, 0) + x.size > _SMALL_GROUP:
      open_groups.append([])
      filled[x.dtype] = 0
    open_groups[-1].append(jnp.ravel(x))
    filled[x.dtype] = filled.get(x.dtype, 0) + x.size
  return [g for by_dtype in groups.values() for g in by_dtype]


def squared_norm(tree: Any) -> jax.Array:
  """``sum |x|^2`` over the leaves of ``tree``, in float32 at least."""
  leaves = jax.tree.leaves(tree)
  is_small = [x.size <= _SMALL_LEAF and not jnp.iscomplexobj(x) for x in leaves]
  parts = [_sum_sq(x) for x, small in zip(leaves, is_small) if not small]
  for group in _small_groups([x for x, small in zip(leaves, is_small) if small]):
    # The barrier keeps XLA from splitting the sum of a concatenation back into
    # one sum per leaf.
    parts.append(_sum_sq(jax.lax.optimization_barrier(jnp.concatenate(group))))
  return sum(parts[1:], parts[0]) if parts else jnp.zeros((), jnp.float32)


def mean_squared_norm(totals: list[jax.Array], factor: jax.Array) -> jax.Array:
  """``|mean|^2`` of accumulated gradient leaves, without forming the mean (a copy
  of the gradient): a total is a sum, whose mean is ``factor`` times it, or holds
  the mean already (``_core.holds_mean``: a narrow accumulator)."""
  sums = squared_norm([t for t in totals if not _core.holds_mean(t)])
  means = squared_norm([t for t in totals if _core.holds_mean(t)])
  return factor * factor * sums + means


def zero_sums() -> NoiseSums:
  return NoiseSums(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
                   jnp.zeros((), jnp.int32))


def add(
    sums: NoiseSums, grads: Any, weight: Any, kept: jax.Array, scale: Any = 1.0
) -> NoiseSums:
  """Adds one small batch's mean gradient, ``grads / scale``, of weight ``weight`` if ``kept``.

  ``scale``: the factor ``grads`` carries (the small batch's share of the whole
  batch, when its loss was scaled before differentiation); positive where kept.
  """
  weight = jnp.asarray(weight, jnp.float32)
  keep = kept & (weight > 0)
  scale = jnp.asarray(scale, jnp.float32)
  sq = squared_norm(grads) / jnp.where(keep, scale * scale, 1.0)
  # `where`, not a product with `keep`: a skipped batch's gradient may be NaN.
  return NoiseSums(
      sums.weighted_sq + jnp.where(keep, weight * sq, 0.0),
      sums.weight + jnp.where(keep, weight, 0.0),
      sums.count + keep.astype(jnp.int32),
  )


def estimate(sums: NoiseSums, g_sq: jax.Array) -> GradientNoise:
  """The estimates from the sums and ``g_sq``, the squared norm of the combined
  (weighted mean) gradient (:func:`squared_norm`)."""
  batches = sums.count.astype(jnp.float32)
  total = sums.weight
  usable = (sums.count >= 2) & (total > 0)
  safe_total = jnp.where(usable, total, 1.0)
  trace_cov = (sums.weighted_sq / safe_total - g_sq) * safe_total / jnp.where(
      usable, batches - 1, 1.0)
  grad_sq = g_sq - trace_cov / safe_total
  nan = jnp.full((), jnp.nan, jnp.float32)
  return GradientNoise(jnp.where(usable, grad_sq, nan), jnp.where(usable, trace_cov, nan))


class NoiseScaleEMA(NamedTuple):
  """Exponential moving averages of ``grad_sq`` and ``trace_cov``, bias-corrected.

  A pure pytree: keep it in the training state, update it inside the jitted
  step, checkpoint it with the rest. ``simple_noise_scale`` is the ratio of the
  two averages, which is consistent where the average of per-step ratios is
  not. Steps whose estimate is NaN (fewer than two kept small batches) leave it
  as it was.

  Examples:
    >>> import jax.numpy as jnp, accum_jax
    >>> ema = accum_jax.noise.NoiseScaleEMA.create(decay=0.9)
    >>> for trace_cov in (8.0, 12.0):
    ...   ema = ema.update(accum_jax.noise.GradientNoise(jnp.float32(1.0), jnp.float32(trace_cov)))
    >>> round(float(ema.simple_noise_scale), 3)  # (0.9 * 0.1 * 8 + 0.1 * 12) / (0.19 * 1)
    10.105
  """

  grad_sq: jax.Array
  trace_cov: jax.Array
  decay: jax.Array
  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count

  @classmethod
  def create(cls, decay: float = 0.99) -> NoiseScaleEMA:
    """An empty average; ``decay`` in [0, 1): the weight of the past per update."""
    if not 0.0 <= float(decay) < 1.0:
      raise ValueError(
          f"NoiseScaleEMA.create(decay={decay!r}): decay must be in [0, 1), e.g. 0.99 to"
          " average over about 100 steps."
      )
    zero = jnp.zeros((), jnp.float32)
    return cls(zero, zero, jnp.asarray(decay, jnp.float32), jnp.zeros((), jnp.int32))

  def update(self, noise: GradientNoise) -> NoiseScaleEMA:
    """The average with one more step's estimate (skipped where it is NaN)."""
    ok = jnp.isfinite(noise.grad_sq) & jnp.isfinite(noise.trace_cov)
    d = self.decay

    def mix(old, new):
      return jnp.where(ok, d * old + (1 - d) * jnp.where(ok, new, 0.0), old)

    return self._replace(
        grad_sq=mix(self.grad_sq, noise.grad_sq),
        trace_cov=mix(self.trace_cov, noise.trace_cov),
        count=self.count + ok.astype(jnp.int32),
    )

  def average(self) -> GradientNoise:
    """The bias-corrected averages (NaN before the first finite update)."""
    correction = 1 - self.decay ** self.count.astype(jnp.float32)
    safe = jnp.where(self.count > 0, correction, jnp.nan)
    return GradientNoise(self.grad_sq / safe, self.trace_cov / safe)

  @property
  def simple_noise_scale(self) -> jax.Array:
    """The bias-corrected ``B_simple``: NaN before the first finite update."""
    # The bias corrections of the two averages are equal and cancel in the ratio.
    return jnp.where(self.count > 0, self.trace_cov / self.grad_sq, jnp.nan)


class NoiseScaleSchedule(NamedTuple):
  """A window length that follows the measured critical batch size.

  Made by :func:`noise_scale_every_k`; pass it as ``accumulate(every_k=...)``.

  Examples:
    >>> import accum_jax
    >>> schedule = accum_jax.noise.noise_scale_every_k(8, k_max=32)
    >>> schedule.k_min, schedule.k_max, schedule.monotone
    (2, 32, True)
  """

  microbatch_size: float
  k_min: int
  k_max: int
  decay: float
  monotone: bool

  def next_k(self, ema: NoiseScaleEMA, k: jax.Array) -> jax.Array:
    """``clip(round(B_simple / microbatch_size), k_min, k_max)``; ``k`` while unknown."""
    b_simple = ema.simple_noise_scale
    known = jnp.isfinite(b_simple) & (b_simple > 0)
    new = jnp.round(jnp.where(known, b_simple, 0.0) / self.microbatch_size)
    new = jnp.clip(new, self.k_min, self.k_max).astype(jnp.int32)
    if self.monotone:
      new = jnp.maximum(new, k)
    return jnp.where(known, new, k)


def noise_scale_every_k(
    microbatch_size: float,
    *,
    k_max: int,
    k_min: int = 2,
    decay: float = 0.9,
    monotone: bool = True,
) -> NoiseScaleSchedule:
  """``every_k`` for :func:`accum_jax.accumulate` that follows the gradient noise scale.

  The state keeps a :class:`accum_jax.noise.NoiseScaleEMA` of each window's
  :class:`accum_jax.noise.GradientNoise`; when a window is applied, the next one's
  length becomes ``k = clip(round(B_simple / microbatch_size), k_min, k_max)``
  (never less than before with ``monotone``): a batch-size warm-up that follows
  the critical batch size as training finds it. ``k`` is a traced value, so a
  change does not recompile; it changes only between windows. The learning
  rate stays per optimizer step (see the noise-scale guide).

  Args:
    microbatch_size: the weight of one call, in the unit of ``weight=``: its
      examples or tokens (1 when calls pass no weight: ``B_simple`` is then
      counted in calls).
    k_max: the longest window.
    k_min: the shortest window, and the first; at least 2, as the spread of
      the calls' gradients needs two of them.
    decay: of the moving averages, in [0, 1).
    monotone: never shorten the window.

  Returns:
    A :class:`NoiseScaleSchedule`, for ``accumulate(inner, every_k=...)``.

  Examples:
    >>> import optax, accum_jax
    >>> opt = accum_jax.accumulate(
    ...     optax.adam(1e-3), every_k=accum_jax.noise.noise_scale_every_k(32, k_max=16))
  """
  if not float(microbatch_size) > 0:
    raise ValueError(
        f"microbatch_size={microbatch_size!r} must be positive: the weight of one call"
        " (its examples or tokens; 1 when calls pass no weight=)."
    )
  k_min_, k_max_ = _core.positive_int(k_min), _core.positive_int(k_max)
  if k_min_ is None or k_max_ is None or not 2 <= k_min_ <= k_max_:
    raise ValueError(
        f"k_min={k_min!r} and k_max={k_max!r} must be ints with 2 <= k_min <= k_max: a"
        " window of one call shows no spread between gradients, so no noise scale."
    )
  NoiseScaleEMA.create(decay)  # checks decay
  return NoiseScaleSchedule(float(microbatch_size), k_min_, k_max_, float(decay), monotone)
