"""The state of :func:`accum_jax.accumulate` and the functions that read it.

The readers (:func:`has_updated`, :func:`optimizer_step`, and
:func:`accum_jax.noise.last_window` in ``noise``)
find the one :class:`AccumulationState` inside whatever holds it: an ``optax.chain``
state, a Flax ``TrainState``, an ``nnx.Optimizer``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from accum_jax import _core
from accum_jax._across_calls import _layout, _schedules

# The scalars of a state, one int32 vector (``AccumulationState.scalars``): a call
# passes one buffer for them all. First its int32 counters (``state.counts``), each
# read by the property of its name:
COUNTS = (
    "mini_step",  # calls in the current window: zero weights in, skipped calls out
    "optimizer_step",  # updates the inner optimizer applied
    "last_updated",  # 1 if the last call applied the inner optimizer, else 0
    "num_skipped",  # calls left out for non-finite data (their own, or their window's)
    "num_bad_weights",  # calls left out for a negative or non-finite traced weight
    "num_rejected",  # calls left out by MultiSteps' should_skip_update_fn
    "num_overflowed",  # calls of windows whose weighted sum overflows float16/bfloat16
    "num_empty_windows",  # windows that ended holding zero weight
)
# then its float32 sums (``state.sums``), each held as its 32 bits (a bitcast, exact
# both ways: ``lax.bitcast_convert_type``):
SUMS = (
    "weight",  # the current window's weight: calls (or weight= arguments) kept
    "value_total",  # the weighted sum of the current window's value= arguments
    "value_weight",  # their weight
    "window_value",  # the value the inner optimizer got on the last update (0 before)
)
COUNT = {name: i for i, name in enumerate(COUNTS)}
SUM = {name: i for i, name in enumerate(SUMS)}


def scalars(counts: Any, sums: Any) -> jax.Array:
  """A state's ``scalars``: its counters (int32, as ``COUNTS``), then its sums (float32,
  as ``SUMS``) bitcast to int32."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(sums, jnp.float32), jnp.int32)
  return jnp.concatenate([jnp.asarray(counts, jnp.int32), bits], axis=-1)


def counts_and_sums(scalars: Any) -> tuple[jax.Array, jax.Array]:
  """The counters and the sums that :func:`scalars` made ``scalars`` of."""
  scalars = jnp.asarray(scalars)  # unwraps the nnx.Variable of an nnx.Optimizer's state
  bits = scalars[..., len(COUNTS):]
  return scalars[..., :len(COUNTS)], jax.lax.bitcast_convert_type(bits, jnp.float32)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class Reductions:
  """How each gradient leaf combines ("mean", "sum", "max", "last"), kept in the
  state as static data (a pytree node with no leaves), hashed once."""

  kinds: tuple[str, ...]

  def __post_init__(self):
    object.__setattr__(self, "_hash", hash(self.kinds))

  def __hash__(self) -> int:
    return self._hash  # type: ignore[attr-defined]

  def __eq__(self, other: Any) -> bool:
    return self is other or (isinstance(other, Reductions) and self.kinds == other.kinds)


class AccumulationState(NamedTuple):
  """State of :func:`accumulate`.

  The counters and sums are one small vector, ``scalars`` (a call passes one buffer
  for them), read by properties: ``mini_step``, ``optimizer_step`` (``gradient_step``, as
  ``optax.MultiStepsState`` names it), ``num_skipped``, ``window_value``, ...;
  ``acc_grads`` is the window's gradient so far, as the inner optimizer would get
  it (its mean, or with ``reduction="sum"`` its sum), as ``optax.MultiSteps``'
  ``acc_grads`` is.
  """

  # The window's running total (_core.Accumulator.total): with layout="packed" a
  # _layout.Packed of a few vectors, with layout="tree" the gradients' tree. Not
  # read while mini_step is 0: it may hold the last window's values then.
  window_total: Any
  inner_opt_state: Any  # the inner optimizer's state (packed likewise), advanced only on updates
  scalars: jax.Array  # shape=(len(COUNTS) + len(SUMS),), dtype=int32: see COUNTS, SUMS
  skip_state: Any = ()  # what MultiSteps' should_skip_update_fn reported
  # With gradient_noise (or a noise_scale_every_k schedule); () otherwise:
  noise: Any = ()  # _noise.NoiseSums of the current window's calls
  last_noise: Any = ()  # GradientNoise of the last applied window (NaN before)
  noise_ema: Any = ()  # NoiseScaleEMA, with a noise_scale_every_k schedule
  window_length: Any = ()  # shape=(), int32: k of the current window, likewise
  # The every_k given to accumulate, as static data (no leaf): HostSchedule reads it.
  every_k: _schedules.WindowSchedule = _schedules.WindowSchedule(None)
  # How each gradient leaf combines (_core.per_leaf), as static data: acc_grads reads it.
  reductions: Any = None  # a Reductions

  @property
  def counts(self) -> jax.Array:
    """The int32 counters, as ``_state.COUNTS`` names them; shape=(len(COUNTS),)."""
    return counts_and_sums(self.scalars)[0]

  @property
  def sums(self) -> jax.Array:
    """The float32 sums, as ``_state.SUMS`` names them; shape=(len(SUMS),)."""
    return counts_and_sums(self.scalars)[1]

  def counter(self, name: str) -> jax.Array:
    """The int32 counter ``name`` (one of ``_state.COUNTS``)."""
    return jnp.asarray(self.scalars)[..., COUNT[name]]

  @property
  def mini_step(self) -> jax.Array:
    """Calls accumulated in the current window; shape=(), dtype=int32."""
    return self.counter("mini_step")

  @property
  def optimizer_step(self) -> jax.Array:
    """Updates the inner optimizer has applied; shape=(), dtype=int32."""
    return self.counter("optimizer_step")

  @property
  def gradient_step(self) -> jax.Array:
    """Alias of ``optimizer_step``, the name ``optax.MultiSteps`` uses."""
    return self.optimizer_step

  @property
  def last_updated(self) -> jax.Array:
    """Whether the last call applied the inner optimizer; shape=(), dtype=bool."""
    return self.counter("last_updated") > 0

  @property
  def num_skipped(self) -> jax.Array:
    """Calls left out for non-finite data: a gradient or ``value`` holding a NaN or
    Inf (``on_nonfinite="skip_microbatch"``), or the calls of a window whose sum
    holds one (``"skip_window"``); int32 scalar. Calls left out for other causes
    have counters of their own: ``num_bad_weights``, ``num_rejected``,
    ``num_overflowed``."""
    return self.counter("num_skipped")

  @property
  def num_bad_weights(self) -> jax.Array:
    """Calls left out for a traced ``weight`` that was negative or not finite."""
    return self.counter("num_bad_weights")

  @property
  def num_rejected(self) -> jax.Array:
    """Calls that :class:`accum_jax.MultiSteps`' ``should_skip_update_fn`` rejected."""
    return self.counter("num_rejected")

  @property
  def num_overflowed(self) -> jax.Array:
    """Calls of windows dropped because their weighted sum (``reduction="sum"``)
    overflows the gradients' float16 or bfloat16 dtype."""
    return self.counter("num_overflowed")

  @property
  def num_empty_windows(self) -> jax.Array:
    """Windows that ended holding zero weight (nothing to apply)."""
    return self.counter("num_empty_windows")

  @property
  def window_weight(self) -> jax.Array:
    """The current window's weight: its kept calls, or their ``weight=``; float32."""
    return jnp.asarray(self.sums)[..., SUM["weight"]]

  @property
  def window_value(self) -> jax.Array:
    """The ``value=`` the inner optimizer got on the last update: the last applied
    window's loss, weighted as its gradient (0 until one is); float32 scalar."""
    return jnp.asarray(self.sums)[..., SUM["window_value"]]

  @property
  def acc_grads(self) -> Any:
    """The window's gradient so far, in the gradients' tree and the accumulator
    dtype: its weighted mean (its sum under ``reduction="sum"``), what the inner
    optimizer would get if the window ended now; zeros while it holds no call."""
    return window_gradient(self)


def window_gradient(state: AccumulationState) -> Any:
  """``state.acc_grads``: the window's result so far, zeros while it holds no call (of
  each state, for states stacked along a leading axis, e.g. by a ``lax.scan``)."""
  if jnp.ndim(state.scalars) > 1:
    return jax.vmap(window_gradient)(state)
  total = state.window_total
  kinds = state.reductions.kinds if state.reductions else None
  if isinstance(total, _layout.Packed):
    kinds = total.layout.keys
  sums = jnp.asarray(state.sums)
  acc = _core.Accumulator(total, sums[SUM["weight"]], state.mini_step, jnp.zeros((), jnp.int32))
  result = _core.result(acc, total, kinds)
  held = state.mini_step > 0
  return _layout.tree_of(jax.tree.map(lambda x: jnp.where(held, x, jnp.zeros((), x.dtype)), result))


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


def _check_nothing_after(state: Any, caller: str) -> None:
  """Refuses an accumulate state followed by other transformations in an
  ``optax.chain`` (a tuple of states): they would run on every call."""
  paths = [path for path, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_state)[0]
           if _is_state(x)]
  for path in paths:
    node = state
    for key in path:
      if type(node) is tuple and isinstance(key, jax.tree_util.SequenceKey) and (
          key.idx < len(node) - 1):
        after = ", ".join(type(x).__name__ for x in node[key.idx + 1:])
        raise ValueError(
            f"{caller} found the accum_jax.accumulate state followed in an optax.chain by"
            f" other transformations' states ({after}): those run on every call, on the"
            " zeros of a call that only adds as much as on the window's update (weight"
            " decay would decay the parameters at every microbatch). Put them inside:"
            " accumulate(optax.chain(inner, ...), every_k), so that they run once per"
            " window.")
      node = node[key.idx] if isinstance(key, jax.tree_util.SequenceKey) else (
          node[key.key] if isinstance(key, jax.tree_util.DictKey) else getattr(node, key.name))


def find_state(state: Any, caller: str) -> AccumulationState:
  _check_not_gated(state, caller)
  _check_nothing_after(state, caller)
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
