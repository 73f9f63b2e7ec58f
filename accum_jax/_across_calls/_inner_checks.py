"""Inner optimizers that cannot run inside :func:`accum_jax.accumulate` as DP-SGD needs.

Below both ``accumulate``, which refuses them when it is built, and
:mod:`accum_jax.privacy`, whose public :func:`accum_jax.privacy.check_inner` this is
and whose noise state is declared here for that reason.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

RECIPE = (
    "accum_jax.privacy.accumulate_private(inner, ...), or"
    " accum_jax.accumulate(optax.chain(accum_jax.privacy.dp_aggregate(...), inner), every_k,"
    " reduction='sum')"
)


class GaussianNoiseState(NamedTuple):
  """State of :func:`accum_jax.privacy.add_gaussian_noise`: a base key and the draws so far.

  Draw ``t`` (from 0) uses ``jax.random.fold_in(key, t)``: the noise of every window
  follows from the key and the count, and a restored checkpoint continues it.

  Examples:
    >>> import jax, jax.numpy as jnp, accum_jax.privacy
    >>> noise = accum_jax.privacy.add_gaussian_noise(1.0, jax.random.key(0))
    >>> state = noise.init({"w": jnp.zeros(2)})
    >>> int(state.num_draws)
    0
  """

  key: jax.Array  # the base key, never changed: typed, shape=(), or raw uint32, (2,)
  num_draws: jax.Array  # shape=(), dtype=int32: noise draws so far


def nodes(tree: Any, kinds: tuple[type, ...]) -> list[Any]:
  """The outermost nodes of ``tree`` that are instances of ``kinds``."""
  def is_kind(x):
    return isinstance(x, kinds)

  return [x for x in jax.tree.leaves(tree, is_leaf=is_kind) if is_kind(x)]


DP_AGGREGATE_STATE = optax.contrib.DifferentiallyPrivateAggregateState


def check_inner(inner_state: Any, reduction: Any = "sum") -> None:
  """Refuses an inner optimizer of ``accumulate`` that breaks DP-SGD.

  Call it on the state of ``accumulate``'s inner optimizer (``state.inner_opt_state``)
  with ``accumulate``'s ``reduction``. It raises if the state holds:

  * an ``optax.contrib.differentially_private_aggregate``: it takes per-example
    gradients (a leading example axis), adds noise and divides by that axis's size;
    after accumulation there is no example axis. Clip per example before
    accumulating, and put :func:`accum_jax.privacy.dp_aggregate` in its place.
  * an :func:`accum_jax.privacy.add_gaussian_noise` while ``reduction`` is a string other than
    ``"sum"``: the noise would be added to the window's mean, whose divisor is the
    calls' total weight, the realised batch size. (A per-leaf pytree or callable
    ``reduction``, or None, is not checked.)

  Args:
    inner_state: the inner optimizer's state, or any pytree holding it.
    reduction: ``accumulate``'s ``reduction``.

  Raises:
    ValueError: with what to use instead.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax.privacy
    >>> inner = optax.chain(optax.contrib.differentially_private_aggregate(1.0, 1.0, key=0),
    ...                     optax.sgd(0.1))
    >>> accum_jax.privacy.check_inner(inner.init({"w": jnp.zeros(2)}))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: optax.contrib.differentially_private_aggregate cannot run inside ...
  """
  if nodes(inner_state, (DP_AGGREGATE_STATE,)):
    raise ValueError(
        "optax.contrib.differentially_private_aggregate cannot run inside"
        " accum_jax.accumulate: it takes per-example gradients (a leading example axis),"
        " adds noise and divides by that axis's size, but accumulate hands its inner"
        " optimizer the window's summed gradient, which has no example axis. Clip per"
        " example before accumulating (accum_jax.privacy.clipped_grad_sum) and replace it"
        f" with accum_jax.privacy.dp_aggregate: {RECIPE}."
    )
  if isinstance(reduction, str) and reduction != "sum" and nodes(
      inner_state, (GaussianNoiseState,)):
    raise ValueError(
        f"add_gaussian_noise is inside accum_jax.accumulate(..., reduction={reduction!r}):"
        " the noise would be added to the window's mean, divided by the calls' total"
        " weight (the realised batch size), not to its sum. Pass reduction='sum' (with"
        " MultiSteps, use_grad_mean=False) and divide by the expected batch size after"
        f" the noise: {RECIPE}."
    )
