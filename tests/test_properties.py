"""Property tests: random pytrees, window lengths, weights, flushes and splits.

Every example compiles, so each property runs a few derandomized examples (the same
ones on every run) and draws shapes from a small set. The references are plain
float64 NumPy: the weighted mean of each window, then the inner optimizer written out.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ATOL, RTOL, jit_traced_at_most, tree_allclose
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import accum_jax

# No shrinking: each shrink step compiles again, and a failure would take many minutes
# to minimise. The derandomized failing example is printed as it was generated.
PROPERTY_SETTINGS = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
)

SHAPES = ((), (3,), (2, 3))
DTYPES = (jnp.float32, jnp.bfloat16)
LEARNING_RATE = 0.1
# A bfloat16 result is rounded twice against the float64 reference (the mean when
# cast back, the optimizer's product), each rounding within 2**-8 relative.
BF16_RTOL = 2**-7
BF16_ATOL = 2**-8


@dataclasses.dataclass(frozen=True)
class Leaf:
  shape: tuple[int, ...]
  dtype: Any


# Hypothesis starts from small trees; this one is always tried as well.
RICH_TREE = {
    "a": (Leaf((2, 3), jnp.float32), Leaf((), jnp.bfloat16)),
    "b": {"c": Leaf((3,), jnp.bfloat16), "a": Leaf((), jnp.float32)},
}


def _trees(dtypes: tuple[Any, ...] = DTYPES) -> st.SearchStrategy:
  """Nested dicts and tuples of leaves of a few shapes and dtypes."""
  leaves = st.builds(Leaf, st.sampled_from(SHAPES), st.sampled_from(dtypes))
  return st.recursive(
      leaves,
      lambda children: st.one_of(
          st.dictionaries(st.sampled_from("abc"), children, min_size=1, max_size=3),
          st.lists(children, min_size=1, max_size=2).map(tuple),
      ),
      max_leaves=4,
  )


def _build(spec: Any, make_leaf: Callable[[Leaf], Any]) -> Any:
  if isinstance(spec, Leaf):
    return make_leaf(spec)
  if isinstance(spec, dict):
    return {key: _build(value, make_leaf) for key, value in spec.items()}
  return tuple(_build(value, make_leaf) for value in spec)


def _random_trees(spec: Any, count: int, seed: int) -> list[Any]:
  rng = np.random.default_rng(seed)

  def make(leaf: Leaf) -> jax.Array:
    return jnp.asarray(rng.standard_normal(leaf.shape), leaf.dtype)

  return [_build(spec, make) for _ in range(count)]


def _as_float64(tree: Any) -> Any:
  return jax.tree.map(lambda x: np.asarray(x).astype(np.float64), tree)


def _assert_close_by_dtype(actual: Any, expected: Any) -> None:
  """Leaf by leaf, with the tolerance of the leaf's own dtype."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for (path, x), y in zip(jax.tree.leaves_with_path(actual), jax.tree.leaves(expected)):
    low = jnp.dtype(x.dtype) == jnp.bfloat16
    name = jax.tree_util.keystr(path)
    tree_allclose(
        {name: x}, {name: y}, rtol=BF16_RTOL if low else RTOL, atol=BF16_ATOL if low else ATOL
    )


def _sgd_step(mean: Any) -> Any:
  return jax.tree.map(lambda m: -LEARNING_RATE * m, mean)


class _Adam:
  """optax.adam's defaults, written out in float64."""

  def __init__(self, learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
    self.learning_rate, self.b1, self.b2, self.eps = learning_rate, b1, b2, eps
    self.mu = self.nu = None
    self.count = 0

  def __call__(self, mean: Any) -> Any:
    if self.mu is None:
      self.mu = jax.tree.map(np.zeros_like, mean)
      self.nu = jax.tree.map(np.zeros_like, mean)
    self.count += 1
    self.mu = jax.tree.map(lambda m, g: self.b1 * m + (1 - self.b1) * g, self.mu, mean)
    self.nu = jax.tree.map(lambda v, g: self.b2 * v + (1 - self.b2) * g * g, self.nu, mean)

    def update(m, v):
      m_hat = m / (1 - self.b1**self.count)
      v_hat = v / (1 - self.b2**self.count)
      return -self.learning_rate * m_hat / (np.sqrt(v_hat) + self.eps)

    return jax.tree.map(update, self.mu, self.nu)


def _reference_updates(
    grads: list[Any], weights: list[float], flushes: list[bool], k: int, inner_step: Callable
) -> list[Any]:
  """Per call: the expected update (float64), or None where nothing is emitted."""
  expected, window = [], []
  for g, w, flush in zip(grads, weights, flushes):
    window.append((w, _as_float64(g)))
    if len(window) < k and not flush:
      expected.append(None)
      continue
    total_weight = sum(w for w, _ in window)
    if total_weight > 0:
      mean = jax.tree.map(
          lambda *xs: sum(w * x for (w, _), x in zip(window, xs)) / total_weight,
          *(g for _, g in window),
      )
      expected.append(inner_step(mean))
    else:
      expected.append(None)
    window = []
  return expected


def _run_accumulate(
    opt: optax.GradientTransformation,
    params: Any,
    grads: list[Any],
    weights: list[float] | None,
    flushes: list[bool],
) -> list[tuple[Any, bool]]:
  """Runs opt.update under jit, call by call; the state never changes type (one trace)."""
  update = jit_traced_at_most(opt.update)
  state = opt.init(params)
  out = []
  for i, (g, flush) in enumerate(zip(grads, flushes)):
    weight = None if weights is None else jnp.float32(weights[i])
    updates, state = update(g, state, params, weight=weight, flush=jnp.array(flush))
    out.append((updates, bool(accum_jax.has_updated(state))))
  return out


def _check_against_reference(out, expected, grads) -> None:
  for (updates, updated), want, g in zip(out, expected, grads):
    assert updated == (want is not None)
    assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(lambda x: x.dtype, g)
    if want is None:
      assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(updates))
    else:
      _assert_close_by_dtype(updates, want)


WEIGHTS = [0.0, 0.5, 1.0, 2.0, 3.0]


@PROPERTY_SETTINGS
@example(
    spec=RICH_TREE,
    k=3,
    num_calls=7,
    weights=[1.0, 0.0, 2.0, 0.5, 3.0, 0.0, 0.0],
    flushes=[False, True, False, False, False, False, False],
    seed=0,
)
@given(
    spec=_trees(),
    k=st.integers(1, 4),
    num_calls=st.integers(1, 7),
    weights=st.none() | st.lists(st.sampled_from(WEIGHTS), min_size=7, max_size=7),
    flushes=st.lists(st.sampled_from([False, False, False, True]), min_size=7, max_size=7),
    seed=st.integers(0, 2**16),
)
def test_accumulate_with_sgd_is_the_weighted_mean_of_each_window_times_the_learning_rate(
    spec, k, num_calls, weights, flushes, seed
):
  params = _random_trees(spec, 1, seed)[0]
  grads = _random_trees(spec, num_calls, seed + 1)
  flushes = flushes[:num_calls]
  opt = accum_jax.accumulate(optax.sgd(LEARNING_RATE), every_k=k)
  out = _run_accumulate(opt, params, grads, weights and weights[:num_calls], flushes)
  reference_weights = [1.0] * num_calls if weights is None else weights[:num_calls]
  expected = _reference_updates(grads, reference_weights, flushes, k, _sgd_step)
  _check_against_reference(out, expected, grads)


@PROPERTY_SETTINGS
@given(
    spec=_trees(dtypes=(jnp.float32,)),
    k=st.integers(1, 3),
    weights=st.lists(st.sampled_from(WEIGHTS), min_size=9, max_size=9),
    seed=st.integers(0, 2**16),
)
def test_accumulate_with_adam_matches_adam_on_the_window_means(spec, k, weights, seed):
  params = _random_trees(spec, 1, seed)[0]
  grads = _random_trees(spec, len(weights), seed + 1)
  flushes = [False] * len(weights)
  opt = accum_jax.accumulate(optax.adam(LEARNING_RATE), every_k=k)
  out = _run_accumulate(opt, params, grads, weights, flushes)
  expected = _reference_updates(grads, weights, flushes, k, _Adam(LEARNING_RATE))
  _check_against_reference(out, expected, grads)


INNER_OPTIMIZERS = {
    "sgd": lambda: optax.sgd(LEARNING_RATE),
    "sgd with momentum": lambda: optax.sgd(LEARNING_RATE, momentum=0.9),
    "adam": lambda: optax.adam(LEARNING_RATE),
    "clip then adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(LEARNING_RATE, weight_decay=0.1)
    ),
}


@PROPERTY_SETTINGS
@given(
    spec=_trees(),
    inner_name=st.sampled_from(sorted(INNER_OPTIMIZERS)),
    k=st.integers(1, 3),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_state_structure_dtypes_and_shapes_are_the_same_after_init_and_update(
    spec, inner_name, k, weighted, seed
):
  params = _random_trees(spec, 1, seed)[0]
  opt = accum_jax.accumulate(INNER_OPTIMIZERS[inner_name](), every_k=k)
  init_state = jax.eval_shape(opt.init, params)
  weight = jnp.float32(2.0) if weighted else None
  # Both branches (accumulate only, emit) are traced in one update.
  for flush in (jnp.array(False), jnp.array(True), False, True):
    _, state = jax.eval_shape(
        lambda g, s, p, flush=flush: opt.update(g, s, p, weight=weight, flush=flush),
        params, init_state, params,
    )
    assert jax.tree.structure(state) == jax.tree.structure(init_state)
    assert jax.tree.map(lambda s: (s.shape, s.dtype, s.weak_type), state) == jax.tree.map(
        lambda s: (s.shape, s.dtype, s.weak_type), init_state
    )


@PROPERTY_SETTINGS
@given(
    spec=_trees(),
    k=st.integers(2, 4),
    kinds=st.lists(st.sampled_from(["finite", "nan", "inf", "zero weight nan"]), min_size=3,
                   max_size=3),
    seed=st.integers(0, 2**16),
)
def test_updates_are_exact_zeros_on_calls_that_do_not_emit(spec, k, kinds, seed):
  params = _random_trees(spec, 1, seed)[0]
  grads = _random_trees(spec, k - 1, seed + 1)
  bad = {"nan": jnp.nan, "inf": jnp.inf, "zero weight nan": jnp.nan}
  weights = []
  for i in range(k - 1):
    kind = kinds[i % len(kinds)]
    if kind != "finite":
      grads[i] = jax.tree.map(lambda x, v=bad[kind]: jnp.full_like(x, v), grads[i])
    weights.append(0.0 if kind == "zero weight nan" else 1.0)
  opt = accum_jax.accumulate(optax.adam(LEARNING_RATE), every_k=k)
  out = _run_accumulate(opt, params, grads, weights, [False] * (k - 1))
  for (updates, updated), g in zip(out, grads):
    assert not updated
    assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(lambda x: x.dtype, g)
    for x in jax.tree.leaves(updates):
      np.testing.assert_array_equal(np.asarray(x, np.float64), 0.0)


@PROPERTY_SETTINGS
@given(
    spec=_trees(),
    flush_at=st.integers(0, 5),
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=6, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_a_flush_at_any_call_emits_the_mean_of_what_was_accumulated(
    spec, flush_at, weights, seed
):
  k = 8  # longer than any window below: only the flush emits
  params = _random_trees(spec, 1, seed)[0]
  grads = _random_trees(spec, flush_at + 2, seed + 1)
  weights = weights[: flush_at + 1] + [1.0]
  flushes = [i == flush_at for i in range(flush_at + 2)]
  opt = accum_jax.accumulate(optax.sgd(LEARNING_RATE), every_k=k)
  out = _run_accumulate(opt, params, grads, weights, flushes)
  window = [_as_float64(g) for g in grads[: flush_at + 1]]
  total = sum(weights[: flush_at + 1])
  mean = jax.tree.map(lambda *xs: sum(w * x for w, x in zip(weights, xs)) / total, *window)
  for i, (updates, updated) in enumerate(out):
    assert updated == (i == flush_at)
    if updated:
      _assert_close_by_dtype(updates, _sgd_step(mean))
  # The call after the flush starts a new window, which holds it alone.
  assert not out[-1][1]


BATCH_SIZE = 24
DIVISORS = [n for n in range(1, BATCH_SIZE + 1) if BATCH_SIZE % n == 0]


def _per_example_loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
  x, y = batch["x"][:, None], batch["y"][:, None]
  terms = [
      jnp.mean(jnp.tanh(x * p.astype(jnp.float32).reshape(1, -1) + y) ** 2, axis=1)
      for p in jax.tree.leaves(params)
  ]
  return sum(terms)


def _mean_loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
  return jnp.mean(_per_example_loss(params, batch))


def _masked_mean_loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
  # An all-padding microbatch gives 0 / 0 = NaN: its zero weight must drop it.
  return jnp.sum(batch["mask"] * _per_example_loss(params, batch)) / jnp.sum(batch["mask"])


def _batch(seed: int, mask: list[bool] | None = None) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  batch = {
      "x": jnp.asarray(rng.uniform(-1, 1, BATCH_SIZE), jnp.float32),
      "y": jnp.asarray(rng.uniform(-1, 1, BATCH_SIZE), jnp.float32),
  }
  if mask is not None:
    batch["mask"] = jnp.asarray(mask, jnp.float32)
  return batch


@PROPERTY_SETTINGS
@example(spec=RICH_TREE, num_microbatches=6, seed=0)
@given(spec=_trees(), num_microbatches=st.sampled_from(DIVISORS), seed=st.integers(0, 2**16))
def test_value_and_grad_over_any_dividing_split_equals_the_full_batch(
    spec, num_microbatches, seed
):
  params = _random_trees(spec, 1, seed)[0]
  batch = _batch(seed + 1)
  value, grads = jax.jit(accum_jax.value_and_grad(_mean_loss, num_microbatches))(params, batch)
  full_value, full_grads = jax.jit(jax.value_and_grad(_mean_loss))(params, batch)
  tree_allclose(value, full_value)
  _assert_close_by_dtype(grads, _as_float64(full_grads))


@PROPERTY_SETTINGS
@example(
    spec=RICH_TREE,
    num_microbatches=4,
    # The second microbatch (rows 6 to 11) is all padding.
    mask=[True, False, True, True, False, True] + [False] * 6 + [True, False] * 6,
    seed=0,
)
@given(
    spec=_trees(),
    num_microbatches=st.sampled_from(DIVISORS[1:]),
    mask=st.lists(st.booleans(), min_size=BATCH_SIZE, max_size=BATCH_SIZE),
    seed=st.integers(0, 2**16),
)
def test_weighted_value_and_grad_equals_the_full_batch_token_mean_with_empty_microbatches(
    spec, num_microbatches, mask, seed
):
  mask = list(mask)
  mask[seed % BATCH_SIZE] = True  # the full batch has a valid row
  params = _random_trees(spec, 1, seed)[0]
  batch = _batch(seed + 1, mask)
  vg = accum_jax.value_and_grad(
      _masked_mean_loss, num_microbatches, weight_fn=lambda b: b["mask"].sum(), return_info=True
  )
  value, grads, info = jax.jit(vg)(params, batch)
  full_value, full_grads = jax.jit(jax.value_and_grad(_masked_mean_loss))(params, batch)
  tree_allclose(value, full_value)
  _assert_close_by_dtype(grads, _as_float64(full_grads))
  assert int(info.num_skipped) == 0
  assert float(info.total_weight) == sum(mask)


AUX_BATCH_SIZES = (8, 16)
AUX_SPLITS = (1, 2, 4, 8)


def _loss_with_aux_of_every_shape(num_classes: int) -> Callable[..., Any]:
  """A loss whose aux holds a scalar, a per-class vector, a per-example vector and an
  8 x 3 table (whose leading axis is, by coincidence, the size of a batch or a
  microbatch of some splits)."""

  def loss(w: jax.Array, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    per_example = jnp.tanh(x @ w)
    value = jnp.mean(per_example**2)
    aux = {
        "scalar": jnp.max(per_example),
        "per_class": value * jnp.arange(num_classes, dtype=jnp.float32),
        "per_example": per_example,
        "table": jnp.outer(jnp.arange(8.0), w) * value,
    }
    return value, aux

  return loss


def _shapes(tree: Any) -> Any:
  return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), tree)


@PROPERTY_SETTINGS
@example(batch_size=8, num_microbatches=2, num_classes=4)
@example(batch_size=16, num_microbatches=2, num_classes=8)
@given(
    batch_size=st.sampled_from(AUX_BATCH_SIZES),
    num_microbatches=st.sampled_from(AUX_SPLITS),
    num_classes=st.sampled_from((1, 2, 4, 8, 16)),
)
def test_what_value_and_grad_returns_has_the_full_batchs_shapes_at_every_split(
    batch_size, num_microbatches, num_classes
):
  # Shapes only: traced abstractly, nothing compiles. Only the leaf asked for
  # "concat" comes back per example; every other leaf is averaged, whatever its shape.
  loss = _loss_with_aux_of_every_shape(num_classes)
  w = jax.ShapeDtypeStruct((3,), jnp.float32)
  x = jax.ShapeDtypeStruct((batch_size, 3), jnp.float32)
  vg = accum_jax.value_and_grad(
      loss, num_microbatches, has_aux=True, aux_reduction={"per_example": "concat"}
  )
  full = jax.eval_shape(jax.value_and_grad(loss, has_aux=True), w, x)
  assert _shapes(jax.eval_shape(vg, w, x)) == _shapes(full)


@PROPERTY_SETTINGS
@example(batch_size=16, num_microbatches=1, num_classes=4)
@example(batch_size=16, num_microbatches=4, num_classes=16)
@given(
    batch_size=st.sampled_from(AUX_BATCH_SIZES),
    num_microbatches=st.sampled_from(AUX_SPLITS),
    num_classes=st.sampled_from((1, 2, 4, 8, 16)),
)
def test_a_per_example_aux_leaf_left_at_the_default_is_refused_never_returned_split(
    batch_size, num_microbatches, num_classes
):
  # Every leaf at the default reduction. Whatever the split, what comes back has
  # the full batch's shapes; a split that would give the per-example leaf the
  # microbatch's shape is refused at trace time, naming the leaf and the fix.
  loss = _loss_with_aux_of_every_shape(num_classes)
  w = jax.ShapeDtypeStruct((3,), jnp.float32)
  x = jax.ShapeDtypeStruct((batch_size, 3), jnp.float32)
  vg = accum_jax.value_and_grad(loss, num_microbatches, has_aux=True)
  full = jax.eval_shape(jax.value_and_grad(loss, has_aux=True), w, x)
  if num_microbatches == 1:  # the microbatch is the whole batch
    assert _shapes(jax.eval_shape(vg, w, x)) == _shapes(full)
    return
  rows = batch_size // num_microbatches
  with pytest.raises(ValueError, match=re.escape(
      f"The aux leaf ['per_example'] has shape ({rows},) on a microbatch of {rows} rows but"
      f" ({batch_size},) on the whole batch")) as raised:
    jax.eval_shape(vg, w, x)
  assert "aux_reduction='concat'" in str(raised.value)
