"""Direct tests of the accumulation core, accum_jax._core."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_params, microbatch_grads, tree_all_finite, tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum_jax import _core

# One compiled function per core entry point; weights are always passed as
# arrays so that every call below reuses them.
_init = jax.jit(_core.init, static_argnames="accumulator_dtype")
_add = jax.jit(_core.add, static_argnames="refuse_nonfinite")
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


def test_refuse_nonfinite_false_adds_nan():
  params = make_params()
  acc, added = _add(_init(params), _nan_like(params), jnp.float32(1.0), refuse_nonfinite=False)
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


def test_all_finite():
  params = make_params()
  assert bool(_core.all_finite(params))
  assert not bool(_core.all_finite({**params, "scale": jnp.float32(jnp.nan)}))
  assert bool(_core.all_finite({}))
  # Exact: large finite values whose sum overflows are finite all the same.
  assert bool(_core.all_finite({"big": jnp.full((1024,), 3e38, jnp.float32)}))
  assert not bool(_core.all_finite({"big": jnp.full((4,), 3e38).at[1].set(-jnp.inf)}))


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


def _f16(values):
  return {"w": jnp.asarray(values, jnp.float16)}


def test_a_large_weight_does_not_overflow_a_float16_accumulator():
  # 20 * 4096 = 81920 is beyond float16's 65504: a weighted sum kept in float16
  # overflows on the first call, although the gradient and the mean are finite.
  like = _f16([0.0, 0.0])
  acc, kept = _add(_init(like, None), _f16([20.0, -20.0]), jnp.float32(4096.0))
  assert bool(kept)
  assert acc.total["w"].dtype == jnp.float16
  np.testing.assert_array_equal(_result(acc, like, "mean")["w"], [20.0, -20.0])
  assert (float(acc.weight), int(acc.num_skipped)) == (4096.0, 0)
  # A float32 accumulator takes the same product in float32.
  acc, _ = _add(_init(like, jnp.float32), _f16([20.0, -20.0]), jnp.float32(4096.0))
  assert acc.total["w"].dtype == jnp.float32
  np.testing.assert_array_equal(_result(acc, like, "mean")["w"], [20.0, -20.0])


def test_a_float16_window_whose_sum_overflows_has_a_finite_exact_mean():
  # Four calls of -30000: the sum, -120000, is not a float16; the mean is.
  like = _f16([0.0])
  acc = _init(like, None)
  for _ in range(4):
    acc, kept = _add(acc, _f16([-30000.0]), None)
    assert bool(kept)
  np.testing.assert_array_equal(_result(acc, like, "mean")["w"], [-30000.0])
  assert (int(acc.count), int(acc.num_skipped)) == (4, 0)
  assert not bool(jax.jit(_core.sum_fits)(acc, like))


def test_a_float16_window_of_total_weight_1e5_gives_the_weighted_mean():
  # The total weight, 1e5, is itself beyond float16: it must stay float32.
  like = _f16([0.0, 0.0, 0.0])
  grads = [[1.0, -2.0, 3.0], [100.0, 0.5, -7.0], [-4.0, 8.0, 2.0], [0.25, 60000.0, -0.5]]
  weights = [40000.0, 30000.0, 20000.0, 10000.0]
  for accumulator_dtype in (None, jnp.float16, jnp.float32):
    acc = _init(like, accumulator_dtype)
    for g, w in zip(grads, weights):
      acc, _ = _add(acc, _f16(g), jnp.float32(w))
    assert float(acc.weight) == 1e5 and acc.weight.dtype == jnp.float32
    expected = np.average(np.asarray(grads, np.float64), axis=0, weights=weights)
    mean = np.asarray(_result(acc, like, "mean")["w"], np.float64)
    # Within float16 rounding of the exact mean: a few roundings of the running mean.
    np.testing.assert_allclose(mean, expected, rtol=4e-3, atol=1e-3)


def test_sum_fits_looks_at_the_sum_in_the_dtypes_of_like():
  acc = _init(_f16([0.0]), None)
  acc, _ = _add(acc, _f16([40000.0]), jnp.float32(2.0))
  assert not bool(_core.sum_fits(acc, _f16([0.0])))
  assert bool(_core.sum_fits(acc, {"w": jnp.zeros(1, jnp.float32)}))
  acc, _ = _add(_init(_f16([0.0]), jnp.float32), _f16([40000.0]), jnp.float32(2.0))
  assert not bool(_core.sum_fits(acc, _f16([0.0])))
  acc, _ = _add(acc, _f16([-40000.0]), jnp.float32(1.5))
  assert bool(_core.sum_fits(acc, _f16([0.0])))


def test_complex_leaves_accumulate_in_a_complex_dtype():
  like = {"z": jnp.zeros(2, jnp.complex64), "x": jnp.zeros(2, jnp.bfloat16)}
  acc = _init(like)
  assert acc.total["z"].dtype == jnp.complex64
  assert acc.total["x"].dtype == jnp.float32
  g1 = {"z": jnp.array([1 + 2j, -3j], jnp.complex64), "x": jnp.ones(2, jnp.bfloat16)}
  g2 = {"z": jnp.array([3 - 2j, 1 + 1j], jnp.complex64), "x": jnp.ones(2, jnp.bfloat16)}
  acc, _ = _add(acc, g1, jnp.float32(1.0))
  acc, _ = _add(acc, g2, jnp.float32(3.0))
  mean = _result(acc, like, "mean")
  assert mean["z"].dtype == jnp.complex64
  np.testing.assert_allclose(mean["z"], [(1 + 2j + 9 - 6j) / 4, (-3j + 3 + 3j) / 4], rtol=1e-6)
  nan = {"z": jnp.array([jnp.nan * 1j, 0], jnp.complex64), "x": jnp.ones(2, jnp.bfloat16)}
  acc, kept = _add(acc, nan, jnp.float32(1.0))
  assert not bool(kept) and int(acc.num_skipped) == 1


def test_accumulator_dtype_is_the_promotion_with_the_leaf_dtype():
  for leaf, accumulator_dtype, expected in [
      (jnp.bfloat16, jnp.float32, jnp.float32),
      (jnp.float16, None, jnp.float16),
      (jnp.complex64, jnp.float32, jnp.complex64),
      (jnp.float32, jnp.bfloat16, jnp.float32),
      (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
  ]:
    assert _core.accumulator_dtype_for(leaf, accumulator_dtype) == expected


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=str)
def test_merge_across_devices_equals_one_accumulator_over_all_calls(dtype):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(0)
  grads = jnp.asarray(rng.standard_normal((8, 2, 3)) * 1000, dtype)
  weights = jnp.asarray(rng.uniform(100.0, 9000.0, (8, 2)), jnp.float32)
  accumulator_dtype = None if dtype == jnp.float16 else jnp.float32

  def per_device(g, w):
    acc = _core.init(g[0, 0], accumulator_dtype)
    for i in range(2):
      acc, _ = _core.add(acc, g[0, i], w[0, i])
    return _core.result(_core.merge(acc, "d"), g[0, 0])[None]

  merged = jax.jit(
      jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  )(grads, weights)
  expected = np.einsum("dij,di->j", np.asarray(grads, np.float64), np.asarray(weights))
  expected /= float(np.sum(np.asarray(weights, np.float64)))
  rtol = 1e-5 if dtype == jnp.float32 else 4e-3
  for device in range(8):
    np.testing.assert_allclose(np.asarray(merged[device], np.float64), expected, rtol=rtol)


def test_zeros_like_keeps_the_sharding_and_ignores_nonfinite_values():
  auto = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  explicit = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = np.full((8, 2), np.inf, np.float32)
  for mesh in (auto, explicit):
    sharding = NamedSharding(mesh, P("d"))
    array = jax.device_put(x, sharding)
    with jax.set_mesh(mesh):
      zeros = jax.jit(lambda a: _core.zeros_like(a, jnp.bfloat16))(array)
    assert zeros.dtype == jnp.bfloat16
    assert zeros.sharding.is_equivalent_to(sharding, 2), zeros.sharding
    np.testing.assert_array_equal(np.asarray(zeros, np.float32), 0.0)
  struct = jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=NamedSharding(explicit, P("d")))
  with jax.set_mesh(explicit):
    zeros = jax.jit(lambda: _core.zeros_like(struct))()
  assert zeros.sharding.is_equivalent_to(NamedSharding(explicit, P("d")), 2)


def test_positive_int_takes_python_numpy_and_concrete_jax_integers_only():
  for value in (3, np.int64(3), jnp.int32(3)):
    assert _core.positive_int(value) == 3
  for value in (0, -1, 2.0, True, jnp.float32(2), "2"):
    assert _core.positive_int(value) is None



@pytest.mark.parametrize("where", ["small", "large", "none"])
def test_all_finite_packed_finds_a_nan_in_any_leaf_and_packs_only_the_small_ones(where):
  tree = {
      "small": [jnp.ones(3, jnp.bfloat16), jnp.ones((2, 2)), jnp.ones(5, jnp.bfloat16)],
      "large": jnp.ones(_core.PACK_LIMIT + 1),
      "count": jnp.arange(3),
  }
  if where == "small":
    tree["small"][2] = tree["small"][2].at[4].set(jnp.nan)
  elif where == "large":
    tree["large"] = tree["large"].at[-1].set(-jnp.inf)
  assert bool(_core.all_finite_packed(tree)) == (where == "none")
  # One concatenation, of the two small bfloat16 leaves; the large float32 leaf is
  # checked alone (packed, it would make a second, with the small float32 one).
  assert str(jax.make_jaxpr(_core.all_finite_packed)(tree)).count("concatenate") == 1
