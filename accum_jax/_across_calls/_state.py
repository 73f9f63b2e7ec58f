"""The state of :func:`accum_jax.accumulate` and the functions that read it.

The readers (:func:`has_updated`, :func:`optimizer_step`, and
:func:`accum_jax.noise.last_window` in ``noise``)
find the one :class:`AccumulationState` inside whatever holds it: an ``optax.chain``
state, a Flax ``TrainState``, an ``nnx.Optimizer``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from accum_jax import _core
from accum_jax._across_calls import _schedules


class AccumulationState(NamedTuple):
  """State of :func:`accumulate`.

  The names ``mini_step``, ``gradient_step`` and ``inner_opt_state`` read as in
  ``optax.MultiStepsState``; ``acc_grads`` is the window's weighted sum whatever
  the reduction. (:class:`accum_jax.MultiSteps`' state is optax's
  ``MultiStepsState`` itself, whose ``acc_grads`` is the running mean under
  ``use_grad_mean=True``.)
  """

  # The current window; see _core.Accumulator. `total` is the window's running
  # sum, zeros once the window has ended (applied, skipped or empty).
  accumulator: _core.Accumulator
  optimizer_step: jax.Array  # shape=(), dtype=int32: updates emitted so far
  inner_opt_state: Any  # the inner optimizer's state, advanced only on updates
  last_updated: jax.Array  # shape=(), dtype=bool: did the last call update
  num_empty_windows: jax.Array  # shape=(), dtype=int32: windows of zero weight
  # The window's `value=` arguments (losses) and their weights: the inner
  # optimizer gets their weighted mean; total shape=(), dtype=float32.
  value_accumulator: _core.Accumulator
  # The `value=` the inner optimizer got on the last update: the last applied
  # window's loss, weighted as its gradient (0 until one is); shape=(),
  # dtype=float32. What to log as the window's loss.
  window_value: jax.Array
  skip_state: Any = ()  # what MultiSteps' should_skip_update_fn reported
  # With gradient_noise (or a noise_scale_every_k schedule); () otherwise:
  noise: Any = ()  # _noise.NoiseSums of the current window's calls
  last_noise: Any = ()  # GradientNoise of the last applied window (NaN before)
  noise_ema: Any = ()  # NoiseScaleEMA, with a noise_scale_every_k schedule
  window_length: Any = ()  # shape=(), int32: k of the current window, likewise
  # The every_k given to accumulate, as static data (no leaf): HostSchedule reads it.
  every_k: _schedules.WindowSchedule = _schedules.WindowSchedule(None)

  @property
  def mini_step(self) -> jax.Array:
    """Calls accumulated in the current window; shape=(), dtype=int32."""
    return self.accumulator.count

  @property
  def gradient_step(self) -> jax.Array:
    """Alias of ``optimizer_step``, the name ``optax.MultiSteps`` uses."""
    return self.optimizer_step

  @property
  def acc_grads(self) -> Any:
    """The window's weighted gradient sum, in the accumulator dtype.

    For an accumulator narrower than float32 (``accumulator_dtype=None`` with
    float16 or bfloat16 gradients), the weighted mean, as ``optax.MultiSteps``
    keeps it: a float16 sum overflows where the mean does not. Zeros while the
    window holds no call.
    """
    return self.accumulator.total

  @property
  def num_skipped(self) -> jax.Array:
    """Calls skipped so far: a gradient or ``value`` that was not finite, a traced
    weight that was negative or not finite, a call a skip function rejected, or
    the calls of a window whose weighted sum (``reduction="sum"``) overflows the
    gradients' float16 or bfloat16 dtype; int32 scalar."""
    return self.accumulator.num_skipped


# Optax wrappers that may reject a call's whole new inner state: around accumulate,
# a rejected call is not counted, so the windows after it shift by a call, and a
# rejected closing call merges its window into the next one.
_GATES = tuple(
    getattr(optax, name) for name in (
        "ApplyIfFiniteState", "MultiStepsState", "ConditionallyTransformState",
        "ConditionallyMaskState",
    ) if hasattr(optax, name)
)


_MULTISTEPS = optax.MultiStepsState


def _is_state(x: Any) -> bool:
  return isinstance(x, AccumulationState)


def _check_not_gated(state: Any, caller: str) -> None:
  """Refuses an accumulate state that an Optax gate holds (see ``_GATES``)."""
  gates = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, _GATES))
           if isinstance(x, _GATES)]
  for gate in gates:
    if any(_is_state(x) for x in jax.tree.leaves(gate, is_leaf=_is_state)):
      name = type(gate).__name__
      raise ValueError(
          f"{caller} found the accum_jax.accumulate state inside an optax {name}: an"
          " Optax wrapper around accumulate that rejects a call (optax.apply_if_finite,"
          " optax.MultiSteps' should_skip_update_fn, a conditional transform) drops that"
          " call's count, so the windows after it shift, and a rejected window-closing call"
          " merges two windows. Put no gate around accumulate: its own"
          " on_nonfinite='skip_window' (the default) skips a window holding a NaN or Inf"
          " whole and counts it; a gate that must act on the applied update goes inside,"
          " e.g. accumulate(optax.apply_if_finite(inner, 5), every_k).")


def find_state(state: Any, caller: str) -> AccumulationState:
  _check_not_gated(state, caller)
  found = [x for x in jax.tree.leaves(state, is_leaf=_is_state) if _is_state(x)]
  multisteps = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, _MULTISTEPS))
                if isinstance(x, _MULTISTEPS)]
  if not found and multisteps:
    raise ValueError(
        f"{caller} reads accum_jax.accumulate's state, and found an optax.MultiStepsState"
        " (the state of accum_jax.MultiSteps or optax.MultiSteps): read"
        " opt.has_updated(state) for whether the last call updated, and"
        " state.gradient_step for the updates applied so far.")
  if not found:
    raise ValueError(
        f"{caller} found no accum_jax.accumulate state in {type(state).__name__}."
        " Pass the optimizer state that accumulate(...).init returned, or one"
        " that holds it (an optax.chain state, a Flax TrainState, an nnx.Optimizer)."
    )
  if len(found) > 1:
    raise ValueError(
        f"{caller} found {len(found)} accum_jax.accumulate states in"
        f" {type(state).__name__}, and cannot tell which one you mean. Pass that one"
        " (e.g. one branch of an optax.multi_transform state)."
    )
  return found[0]


def has_updated(state: Any) -> jax.Array:
  """Whether the last ``update`` applied the inner optimizer.

  Args:
    state: the state of :func:`accumulate`, or any pytree holding exactly one
      (an ``optax.chain`` state, a Flax ``TrainState`` or its ``opt_state``, an
      ``nnx.Optimizer`` or its ``opt_state``).

  Returns:
    A bool scalar; jit-friendly.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax
    >>> opt = optax.chain(optax.clip(1.0), accum_jax.accumulate(optax.sgd(0.1), every_k=2))
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> _, state = opt.update({"w": jnp.ones(2)}, state)
    >>> bool(accum_jax.has_updated(state))
    False
  """
  # asarray unwraps array-likes such as the nnx.Variables of an nnx.Optimizer.
  return jnp.asarray(find_state(state, "has_updated").last_updated)


def optimizer_step(state: Any) -> jax.Array:
  """The number of updates the inner optimizer has applied.

  Unlike Flax's ``TrainState.step`` and ``nnx.Optimizer.step``, which count
  calls, this counts real optimizer updates: what the inner optimizer's own
  schedules see.

  Args:
    state: as for :func:`accum_jax.has_updated`.

  Returns:
    An int32 scalar; jit-friendly.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax
    >>> opt = accum_jax.accumulate(optax.sgd(0.1), every_k=2)
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> for _ in range(5):
    ...   _, state = opt.update({"w": jnp.ones(2)}, state)
    >>> int(accum_jax.optimizer_step(state)), int(state.mini_step)
    (2, 1)
  """
  return jnp.asarray(find_state(state, "optimizer_step").optimizer_step)
