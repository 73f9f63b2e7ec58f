"""Direct tests of the accumulation core, accum_jax._core."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_params, microbatch_grads, tree_all_finite, tree_allclose

from accum_jax import _core

# One compiled function per core entry point; weights are always passed as
# arrays so that every call below reuses them.
_init = jax.jit(_core.init, static_argnames="accumulator_dtype")
_add = jax.jit(_core.add, static_argnames="skip_nonfinite")
_result = jax.jit(_core.result, static_argnames="reduction")


def _nan_like(tree):
  return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), tree)


def test_weighted_add_sums_weight_times_tree_in_float32():
  params = make_params(jnp.bfloat16)
  g1, g2 = microbatch_grads(params, 2)
  acc = _init(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(acc.total))
  acc, added1 = _add(acc, g1, jnp.float32(2.0))
  acc, added2 = _add(acc, g2, jnp.float32(0.5))
  assert bool(added1) and bool(added2)
  expected = jax.tree.map(
      lambda a, b: 2.0 * a.astype(jnp.float32) + 0.5 * b.astype(jnp.float32), g1, g2
  )
  tree_allclose(acc.total, expected)
  assert float(acc.weight) == 2.5
  assert int(acc.count) == 2
  assert int(acc.num_skipped) == 0


def test_zero_weight_nan_tree_adds_nothing_and_is_not_skipped():
  params = make_params()
  (g,) = microbatch_grads(params, 1)
  acc, _ = _add(_init(params), g, jnp.float32(1.0))
  acc, added = _add(acc, _nan_like(g), jnp.float32(0.0))
  assert not bool(added)
  tree_allclose(acc.total, g)
  assert tree_all_finite(acc.total)
  assert float(acc.weight) == 1.0
  # A zero-weight call is an accepted call that carries no weight: it is
  # counted, not skipped.
  assert int(acc.count) == 2
  assert int(acc.num_skipped) == 0


def test_nonfinite_tree_with_weight_is_skipped_and_counted():
  params = make_params()
  (g,) = microbatch_grads(params, 1)
  # NaN in one leaf only: the whole tree is refused, the finite leaves too.
  bad = {**g, "scale": jnp.asarray(jnp.inf, jnp.float32)}
  acc, added = _add(_init(params), bad, jnp.float32(1.0))
  assert not bool(added)
  tree_allclose(acc.total, jax.tree.map(jnp.zeros_like, g))
  assert (float(acc.weight), int(acc.count), int(acc.num_skipped)) == (0.0, 0, 1)


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf")], ids=str)
def test_negative_or_nonfinite_weight_is_skipped_and_counted(weight):
  params = make_params()
  (g,) = microbatch_grads(params, 1)
  acc, added = _add(_init(params), g, jnp.float32(weight))
  assert not bool(added)
  tree_allclose(acc.total, jax.tree.map(jnp.zeros_like, g))
  assert (float(acc.weight), int(acc.count), int(acc.num_skipped)) == (0.0, 0, 1)


def test_skip_nonfinite_false_adds_nan():
  params = make_params()
  acc, added = _add(_init(params), _nan_like(params), jnp.float32(1.0), skip_nonfinite=False)
  assert bool(added)
  assert np.isnan(np.asarray(acc.total["scale"]))
  assert int(acc.num_skipped) == 0


def test_accept_false_skips_a_finite_tree():
  params = make_params()
  (g,) = microbatch_grads(params, 1)
  acc, added = jax.jit(_core.add)(_init(params), g, jnp.float32(1.0), accept=jnp.array(False))
  assert not bool(added)
  assert (int(acc.count), int(acc.num_skipped)) == (0, 1)


def test_result_mean_and_sum_in_the_dtypes_of_like():
  params = make_params()
  g1, g2 = microbatch_grads(params, 2)
  acc, _ = _add(_init(params), g1, jnp.float32(1.0))
  acc, _ = _add(acc, g2, jnp.float32(3.0))
  like = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  mean = _result(acc, like, "mean")
  total = _result(acc, like, "sum")
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(mean))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(total))
  expected_total = jax.tree.map(lambda a, b: a + 3.0 * b, g1, g2)
  # Tolerances of one bfloat16 rounding.
  tree_allclose(total, expected_total, rtol=1e-2, atol=1e-2)
  tree_allclose(mean, jax.tree.map(lambda t: t / 4.0, expected_total), rtol=1e-2, atol=1e-2)
  tree_allclose(_result(acc, params, "mean"), jax.tree.map(lambda t: t / 4.0, expected_total))


def test_result_mean_of_an_empty_accumulator_is_zero_not_nan():
  params = make_params()
  mean = _result(_init(params), params, "mean")
  tree_allclose(mean, jax.tree.map(jnp.zeros_like, params))


def test_empty_clears_the_window_and_keeps_num_skipped():
  params = make_params(jnp.bfloat16)
  (g,) = microbatch_grads(params, 1)
  acc, _ = _add(_init(params), g, jnp.float32(1.0))
  acc, _ = _add(acc, _nan_like(g), jnp.float32(1.0))
  cleared = jax.jit(_core.empty)(acc)
  tree_allclose(cleared.total, jax.tree.map(jnp.zeros_like, acc.total))
  assert (float(cleared.weight), int(cleared.count), int(cleared.num_skipped)) == (0.0, 0, 1)
  assert jax.tree.map(lambda x: x.dtype, cleared) == jax.tree.map(lambda x: x.dtype, acc)


def test_all_finite():
  params = make_params()
  assert bool(_core.all_finite(params))
  assert not bool(_core.all_finite({**params, "scale": jnp.float32(jnp.nan)}))
  assert bool(_core.all_finite({}))


def test_accumulator_dtype_none_keeps_the_tree_dtype():
  params = make_params(jnp.bfloat16)
  acc = _init(params, accumulator_dtype=None)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(acc.total))


def test_canonicalize_accumulator_dtype():
  assert _core.canonicalize_accumulator_dtype(None) is None
  assert _core.canonicalize_accumulator_dtype("bfloat16") == jnp.bfloat16
  assert _core.canonicalize_accumulator_dtype(jnp.float32) == jnp.float32


@pytest.mark.parametrize(
    ("accumulator_dtype", "message"),
    [
        pytest.param(jnp.int32, "accumulator_dtype=int32 is not a floating dtype", id="int32"),
        pytest.param(bool, "accumulator_dtype=bool is not a floating dtype", id="bool"),
        pytest.param("not a dtype", "accumulator_dtype='not a dtype' is not a dtype", id="text"),
    ],
)
def test_canonicalize_accumulator_dtype_errors(accumulator_dtype, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    _core.canonicalize_accumulator_dtype(accumulator_dtype)


def test_a_large_weight_does_not_overflow_a_float16_accumulator_through_the_product():
  # 20 * 4096 = 81920 overflows float16 (max 65504) when multiplied there; the sum
  # divided by the weight does not.
  acc = _core.init({"w": jnp.zeros(2, jnp.float16)}, None)
  acc, kept = _core.add(acc, {"w": jnp.full(2, 2.0, jnp.float16)}, 4096.0)
  assert bool(kept)
  assert acc.total["w"].dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(acc.total["w"], np.float32), [8192.0, 8192.0])
  acc = _core.init({"w": jnp.zeros(2, jnp.float16)}, jnp.float32)
  acc, _ = _core.add(acc, {"w": jnp.full(2, 20.0, jnp.float16)}, 4096.0)
  np.testing.assert_array_equal(_core.result(acc, {"w": jnp.zeros(2, jnp.float16)})["w"], 20.0)


def test_positive_int_takes_python_numpy_and_concrete_jax_integers_only():
  for value in (3, np.int64(3), jnp.int32(3)):
    assert _core.positive_int(value) == 3
  for value in (0, -1, 2.0, True, jnp.float32(2), "2"):
    assert _core.positive_int(value) is None

