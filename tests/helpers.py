"""Shared tolerances, assertions and reference problems for the accum_jax tests.

The references here are computed without accum_jax, so that a test compares
accum_jax against the plain way of doing the same thing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from accum_jax.testing import copied_shapes, hlo_shape

# float32 round-off of a handful of additions and one division, with headroom.
RTOL = 1e-5
ATOL = 1e-6

FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def tolerance_for(*dtypes: Any) -> dict[str, float]:
  """``rtol``/``atol`` for results computed in the least precise of ``dtypes``.

  A few units in the last place of that dtype, and never tighter than
  ``RTOL``/``ATOL``: compiled in different contexts, XLA may round low-precision
  intermediates differently.
  """
  eps = max(float(jnp.finfo(d).eps) for d in dtypes)
  return {"rtol": max(RTOL, 4 * eps), "atol": max(ATOL, 4 * eps)}


def _leaf_to_numpy(x: Any) -> np.ndarray:
  x = np.asarray(x)
  # numpy cannot compare bfloat16 (an ml_dtypes type) with a tolerance.
  return x.astype(np.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _inexact(x: Any) -> bool:
  return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def tree_allclose(a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
  """Asserts that two pytrees have one structure, one shape per leaf, and close leaves.

  ``chex.assert_trees_all_close`` compares the leaves, NaNs in the same places
  counting as equal; shapes must match exactly (no broadcasting of a scalar),
  and integer and bool leaves (counts, flags) must be equal. The failure
  message names the leaf.

  Args:
    a: the value under test.
    b: the reference.
    rtol: relative tolerance.
    atol: absolute tolerance.
  """
  chex.assert_trees_all_equal_shapes(a, b)
  chex.assert_trees_all_close(a, b, rtol=rtol, atol=atol)
  exact = jax.tree.map(lambda x, y: not (_inexact(x) or _inexact(y)), a, b)
  chex.assert_trees_all_equal(
      *(jax.tree.map(lambda keep, x: x if keep else 0, exact, tree) for tree in (a, b))
  )


def plain_value_and_grad(fun: Callable[..., Any], *args: Any, **options: Any) -> Any:
  """``jax.value_and_grad(fun, **options)(*args)``, the plain way, jitted: compiled
  once as a whole rather than operation by operation, as an eager call would be."""
  return jax.jit(jax.value_and_grad(fun, **options))(*args)


def plain_grad(fun: Callable[..., Any], *args: Any, **options: Any) -> Any:
  """``jax.grad(fun, **options)(*args)``, jitted (see :func:`plain_value_and_grad`)."""
  return jax.jit(jax.grad(fun, **options))(*args)


def jit_traced_at_most(fun: Callable[..., Any], n: int = 1, **jit_options: Any) -> Any:
  """``jax.jit(fun)``, failing with chex's message when ``fun`` is traced more than ``n`` times.

  A trace is a compilation: ``n=1`` is the claim that later calls reuse the
  first call's program. ``chex.assert_max_traces`` keys its count on where the
  function was wrapped and its source, which a parametrised test or a
  hypothesis example repeats, so the count is cleared first.
  """
  chex.clear_trace_counter()
  return jax.jit(chex.assert_max_traces(fun, n), **jit_options)


def with_and_without_jit(test: Callable[..., None]) -> Callable[..., None]:
  """Runs ``test`` twice, as chex's ``variants(with_jit=True, without_jit=True)`` do.

  ``jit``: as written. ``eager``: inside ``chex.fake_jit()``, where every
  ``jax.jit`` (:func:`scan_updates` included) runs op by op and ``lax.scan`` and
  ``lax.cond`` run as Python, as in a training loop that never compiles.
  """

  @functools.wraps(test)
  def variant(*args: Any, jit: str, **kwargs: Any) -> None:
    if jit == "jit":
      return test(*args, **kwargs)
    with chex.fake_jit():
      return test(*args, **kwargs)

  signature = inspect.signature(test)
  variant.__signature__ = signature.replace(parameters=[  # type: ignore[attr-defined]
      *signature.parameters.values(), inspect.Parameter("jit", inspect.Parameter.KEYWORD_ONLY)
  ])
  return pytest.mark.parametrize("jit", ["jit", "eager"])(variant)


def full_size_copies(compiled: Any, like: Any) -> int:
  """``copy`` instructions anywhere in ``compiled`` of arrays shaped like ``like``'s
  largest leaves: passes over memory the step did not ask for."""
  leaves = jax.tree.leaves(like)
  largest = max(x.size for x in leaves)
  shapes = {hlo_shape(x) for x in leaves if x.size == largest}
  return sum(shape in shapes for shape in copied_shapes(compiled, "all"))


def tree_all_finite(tree: Any) -> bool:
  """Whether every leaf of ``tree`` is free of NaN and Inf."""
  return all(bool(np.all(np.isfinite(_leaf_to_numpy(x)))) for x in jax.tree.leaves(tree))


def shapes_and_dtypes(tree: Any, weak_type: bool = True) -> Any:
  """``(shape, dtype, weak_type)`` of each leaf, for comparing abstract values.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct`` (``jax.eval_shape``).
    weak_type: include the weak-type flag, which decides jit cache hits and
      scan-carry types; False leaves it out (reported as False).
  """

  def describe(x):
    aval = jax.typeof(x) if isinstance(x, jax.Array) else x
    weak = weak_type and bool(getattr(aval, "weak_type", False))
    return (tuple(aval.shape), jnp.dtype(aval.dtype), weak)

  return jax.tree.map(describe, tree)


def make_params(dtype: Any = jnp.float32) -> dict[str, Any]:
  """A tiny nested parameter pytree: a matrix, a vector and a scalar."""
  return {
      "linear": {
          "w": jnp.asarray(np.linspace(-1.0, 1.0, 6).reshape(3, 2), dtype),
          "b": jnp.asarray([0.5, -0.25], dtype),
      },
      "scale": jnp.asarray(1.0, dtype),
  }


def microbatch_grads(
    params: Any, k: int, *, seed: int = 0, scale: float = 1.0, dtype: Any = None
) -> list[Any]:
  """``k`` deterministic gradient pytrees shaped like ``params``.

  Args:
    params: the parameters the gradients belong to.
    k: how many gradients.
    seed: the numpy seed; the same seed gives the same gradients.
    scale: the standard deviation of the entries.
    dtype: the gradients' dtype (default: each parameter's).

  Returns:
    A list of ``k`` pytrees with the structure and shapes of ``params``.
  """
  rng = np.random.default_rng(seed)
  leaves, treedef = jax.tree.flatten(params)
  return [
      jax.tree.unflatten(
          treedef,
          [
              jnp.asarray(scale * rng.standard_normal(np.shape(p)), dtype or p.dtype)
              for p in leaves
          ],
      )
      for _ in range(k)
  ]


def stack_trees(trees: Sequence[Any]) -> Any:
  """Stacks pytrees of one structure along a new leading axis (for lax.scan)."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack_tree(tree: Any) -> list[Any]:
  """The inverse of :func:`stack_trees`."""
  n = jax.tree.leaves(tree)[0].shape[0]
  return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n)]


def tree_weighted_mean(trees: Sequence[Any], weights: Sequence[float] | None = None) -> Any:
  """``sum(w_i * t_i) / sum(w_i)`` in float64 numpy, cast to the trees' dtypes."""
  weights = [1.0] * len(trees) if weights is None else list(weights)
  total = sum(weights)

  def mean(*xs):
    acc = sum(w * np.asarray(x, np.float64) for w, x in zip(weights, xs))
    return jnp.asarray(acc / total, xs[0].dtype)

  return jax.tree.map(mean, *trees)


@functools.partial(jax.jit, static_argnames=("opt", "apply_updates"))
def scan_updates(
    opt: Any,
    params: Any,
    grads: Any,
    extra_args: dict[str, Any] | None = None,
    state: Any = None,
    apply_updates: bool = True,
) -> tuple[Any, Any, Any]:
  """Calls ``opt.update`` once per leading index of ``grads``, in one jitted scan.

  With a plain optimizer this is the reference training loop; with an
  accumulating one, the loop under test. One compile per ``opt`` object and
  argument shapes: build optimizers once (e.g. in a cached factory) to share it.

  Args:
    opt: anything with Optax's ``init``/``update`` (static, so hashable).
    params: the initial parameters.
    grads: the gradients of the calls, stacked along axis 0 (:func:`stack_trees`).
    extra_args: keyword arguments of ``update``, each stacked along axis 0,
      e.g. ``{"weight": jnp.array([...])}``.
    state: the initial state (default: ``opt.init(params)``, inside the jit).
    apply_updates: apply each call's updates to the parameters.

  Returns:
    The final parameters, and the updates and states after each call, stacked.
  """
  if state is None:
    state = opt.init(params)

  def call(carry, xs):
    params, state = carry
    g, kwargs = xs
    updates, state = opt.update(g, state, params, **kwargs)
    if apply_updates:
      params = optax.apply_updates(params, updates)
    return (params, state), (updates, state)

  (params, _), (updates, states) = jax.lax.scan(
      call, (params, state), (grads, extra_args or {})
  )
  return params, updates, states


# The inner optimizers the transformation is checked against, by readable name.
INNER_OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd with momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "global norm clipping then adam": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(1e-2)
    ),
}

# `@pytest.mark.parametrize("inner_name", INNER_OPTIMIZER_PARAMS)`; build with
# `INNER_OPTIMIZERS[inner_name]()`.
INNER_OPTIMIZER_PARAMS = [pytest.param(name, id=name) for name in INNER_OPTIMIZERS]


def dtype_id(dtype: Any) -> str:
  """A short test id for a dtype: ``float32``, ``bfloat16``..."""
  return jnp.dtype(dtype).name


# A small regression problem for the microbatching tests: a one-hidden-layer
# tanh MLP with a mean squared error. Data are made with numpy, since every eager
# jax operation on a new shape is one more compilation.


def normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
  return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def mlp(params: Any, x: Any) -> jax.Array:
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return (h @ params["w2"] + params["b2"])[..., 0]


def mse_loss(params: Any, batch: Any) -> jax.Array:
  return jnp.mean((mlp(params, batch["x"]) - batch["y"]) ** 2)

