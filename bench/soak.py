"""Soak run of accum_jax.accumulate: many micro-steps, NaN/Inf, flushes, one compile.

``accumulate(optax.adam(...), every_k=k)`` runs inside a jitted ``lax.scan`` over a
stream of random micro-steps: random weights (some zero), gradients with NaN or Inf
injected into a random element at random steps, zero-weight "padding" steps whose
gradient is NaN, and random flushes (a traced bool). The scan is called chunk by
chunk, the state carried from one call to the next, so the whole run must compile
once. A float64 NumPy model of the same stream, written plainly below, gives the
reference: which calls update, the window means, Adam on them, the parameters.

Checked and printed:

- compiles: the jitted chunk's cache size (1: the state never changes type);
- drift: the largest relative deviation of the updates and of the parameters from
  the float64 reference (float32 round-off, not growing with the number of steps);
- skips: ``state.num_skipped`` against the reference's: under the default
  ``on_nonfinite="skip_window"`` the calls of each window whose sum is not finite, under
  ``"call"`` each injection (zero-weight padding steps are not skips: a zero weight
  adds nothing, NaN or not);
- nothing lost: the weights of the applied windows sum to the reference's (the last
  step flushes, so no window is left open).

Run from the repository root::

  python bench/soak.py                  # 10,000 micro-steps, bench/results/soak.json
  python bench/soak.py --steps 500      # what tests/test_soak.py runs
"""

from __future__ import annotations

import argparse
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accum_jax

LEARNING_RATE = 1e-2
B1, B2, EPS = 0.9, 0.999, 1e-8  # optax.adam's defaults
SHAPES = {"dense": {"w": (8, 4), "b": (4,)}, "scale": ()}


class Stream(NamedTuple):
  """The micro-steps, with a leading time axis; NumPy arrays."""

  grads: Any  # the pytree of SHAPES, float32, NaN/Inf where injected
  weights: np.ndarray  # float32, >= 0
  flushes: np.ndarray  # bool
  injected: np.ndarray  # bool: a NaN/Inf in a step of positive weight
  padding: np.ndarray  # bool: a NaN gradient with zero weight


class Report(NamedTuple):
  steps: int
  every_k: int
  compiles: int
  windows_match: bool  # the same calls updated as in the reference
  updates_applied: int
  reference_updates_applied: int
  update_max_rel_deviation: float  # over applied updates, relative to each one's max
  params_max_rel_deviation: float  # over chunk ends, relative to the params' max
  params_rel_deviation_first_chunk: float
  params_rel_deviation_last_chunk: float
  float32_model_update_max_rel_deviation: float  # the same, for the float32 NumPy model
  float32_model_params_max_rel_deviation: float
  num_skipped: int
  reference_num_skipped: int  # calls the reference skipped (a window's, or each bad one)
  injections: int
  padding_steps: int
  flushes: int
  empty_windows: int
  reference_empty_windows: int
  applied_weight: float
  reference_applied_weight: float
  compile_seconds: float
  run_seconds: float
  reference_seconds: float


def make_stream(steps: int, seed: int = 0) -> Stream:
  """A random stream of micro-steps; the last one flushes."""
  rng = np.random.default_rng(seed)
  # Gradient scales that wander over three orders of magnitude, as they do in training.
  scale = 10.0 ** np.cumsum(rng.normal(0, 0.05, steps)).clip(-2, 1)
  grads = jax.tree.map(
      lambda shape: (scale.reshape(-1, *[1] * len(shape)) * rng.standard_normal((steps, *shape)))
      .astype(np.float32),
      SHAPES,
      is_leaf=lambda x: isinstance(x, tuple),
  )
  weights = np.where(rng.random(steps) < 0.1, 0.0, rng.uniform(0.25, 4.0, steps)).astype(
      np.float32
  )
  injected = (rng.random(steps) < 0.01) & (weights > 0)
  padding = (rng.random(steps) < 0.3) & (weights == 0)
  leaves, treedef = jax.tree.flatten(grads)
  for t in np.flatnonzero(injected):
    leaf = leaves[rng.integers(len(leaves))]
    index = tuple(rng.integers(n) for n in leaf.shape[1:])
    leaf[(t, *index)] = rng.choice([np.nan, np.inf, -np.inf])
  for t in np.flatnonzero(padding):
    for leaf in leaves:
      leaf[t] = np.nan
  flushes = rng.random(steps) < 0.02
  flushes[-1] = True
  return Stream(jax.tree.unflatten(treedef, leaves), weights, flushes, injected, padding)


def initial_params() -> Any:
  rng = np.random.default_rng(12345)
  return jax.tree.map(
      lambda shape: rng.standard_normal(shape).astype(np.float32),
      SHAPES,
      is_leaf=lambda x: isinstance(x, tuple),
  )


def make_chunk_fn(opt: optax.GradientTransformation):
  """A jitted scan over one chunk of the stream; returns per-step records."""

  def step(carry, xs):
    params, state = carry
    grads, weight, flush = xs
    weight_before = state.window_weight
    skipped_before = state.num_skipped
    updates, state = opt.update(grads, state, params, weight=weight, flush=flush)
    params = optax.apply_updates(params, updates)
    updated = accum_jax.has_updated(state)
    kept = state.num_skipped == skipped_before
    # The weight of the window just applied: what it held plus this call's.
    applied_weight = jnp.where(updated, weight_before + jnp.where(kept, weight, 0.0), 0.0)
    return (params, state), (updates, updated, applied_weight)

  @jax.jit
  def run_chunk(params, state, grads, weights, flushes):
    return jax.lax.scan(step, (params, state), (grads, weights, flushes))

  return run_chunk


def reference(stream: Stream, params: Any, every_k: int, chunk: int, dtype: Any = np.float64,
              on_nonfinite: str = "skip_window"):
  """accumulate + Adam in ``dtype`` (float64), written out call by call.

  With ``dtype=np.float32`` it is a baseline: how far float32 arithmetic alone strays
  from float64 on the same stream. ``on_nonfinite``: "skip_window" skips a window whose
  sum is not finite when it ends, "skip_microbatch" a bad call alone. Returns the per-step
  updates (zeros where none), whether each step updated, the parameters at each
  chunk's end, the weights of the applied windows, the number of windows that ended
  empty, and the number of calls skipped.
  """
  leaves, treedef = jax.tree.flatten(stream.grads)
  steps = len(stream.weights)
  p = [np.asarray(x, dtype) for x in jax.tree.leaves(params)]
  mu = [np.zeros_like(x) for x in p]
  nu = [np.zeros_like(x) for x in p]
  total = [np.zeros_like(x) for x in p]
  weight, count, adam_count, empty_windows, skipped, poisoned = dtype(0), 0, 0, 0, 0, False
  updates = [np.zeros((steps, *x.shape), dtype) for x in p]
  updated = np.zeros(steps, bool)
  params_at_chunk_end, applied_weights = [], []
  for t in range(steps):
    g = [leaf[t].astype(dtype) for leaf in leaves]
    w = dtype(stream.weights[t])
    finite = all(np.isfinite(x).all() for x in g)
    if w > 0 and not finite and on_nonfinite == "skip_microbatch":
      skipped += 1  # skipped: not added, not counted
    else:
      count += 1
      if w > 0:  # a zero weight adds nothing, NaN or not
        total = [s + w * x for s, x in zip(total, g)]
        weight += w
        poisoned = poisoned or not finite
    if count >= every_k or stream.flushes[t]:
      if poisoned:  # on_nonfinite="skip_window": the window is skipped whole
        skipped += count
      elif weight > 0:
        # NumPy keeps float32 with Python-float coefficients (NEP 50).
        mean = [s / weight for s in total]
        adam_count += 1
        mu = [B1 * m + (1 - B1) * x for m, x in zip(mu, mean)]
        nu = [B2 * v + (1 - B2) * x * x for v, x in zip(nu, mean)]
        # In float32, 1 - 0.999**t cancels: optax's own round-off in early steps.
        b1_correction = 1 - dtype(B1) ** dtype(adam_count)
        b2_correction = 1 - dtype(B2) ** dtype(adam_count)
        for i, (m, v) in enumerate(zip(mu, nu)):
          m_hat, v_hat = m / b1_correction, v / b2_correction
          updates[i][t] = -LEARNING_RATE * m_hat / (np.sqrt(v_hat) + EPS)
          p[i] = p[i] + updates[i][t]
        updated[t] = True
        applied_weights.append(float(weight))
      elif count > 0:
        empty_windows += 1
      total = [np.zeros_like(x) for x in p]
      weight, count, poisoned = dtype(0), 0, False
    if (t + 1) % chunk == 0:
      params_at_chunk_end.append(jax.tree.unflatten(treedef, [x.copy() for x in p]))
  return (
      jax.tree.unflatten(treedef, updates),
      updated,
      params_at_chunk_end,
      applied_weights,
      empty_windows,
      skipped,
  )


def _max_rel(actual: list[np.ndarray], expected: list[np.ndarray]) -> float:
  deviation = max(float(np.max(np.abs(a - e))) for a, e in zip(actual, expected))
  scale = max(float(np.max(np.abs(e))) for e in expected)
  return deviation / scale


def run(steps: int = 10_000, every_k: int = 4, chunk: int = 250, seed: int = 0,
        on_nonfinite: str = "skip_window") -> Report:
  """Runs the soak and its reference; see the module docstring."""
  if steps % chunk:
    raise ValueError(f"steps={steps} must be a multiple of chunk={chunk}.")
  stream = make_stream(steps, seed)
  params = jax.tree.map(jnp.asarray, initial_params())
  opt = accum_jax.accumulate(optax.adam(LEARNING_RATE, b1=B1, b2=B2, eps=EPS), every_k=every_k,
                             on_nonfinite=on_nonfinite)
  state = opt.init(params)
  run_chunk = make_chunk_fn(opt)

  def chunk_of(i):
    part = slice(i * chunk, (i + 1) * chunk)
    grads = jax.tree.map(lambda x: x[part], stream.grads)
    return grads, stream.weights[part], stream.flushes[part]

  start = time.perf_counter()
  run_chunk.lower(params, state, *chunk_of(0)).compile()
  compile_seconds = time.perf_counter() - start

  start = time.perf_counter()
  records, chunk_params = [], []
  for i in range(steps // chunk):
    (params, state), record = run_chunk(params, state, *chunk_of(i))
    records.append(record)
    chunk_params.append(params)
  jax.block_until_ready((params, state))
  run_seconds = time.perf_counter() - start

  updates = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]),
                         *[r[0] for r in records])
  updated = np.concatenate([np.asarray(r[1]) for r in records])
  applied_weight = np.concatenate([np.asarray(r[2], np.float64) for r in records])

  start = time.perf_counter()
  ref_updates, ref_updated, ref_params, ref_weights, ref_empty, ref_skipped = reference(
      stream, initial_params(), every_k, chunk, on_nonfinite=on_nonfinite
  )
  reference_seconds = time.perf_counter() - start

  f32_updates, f32_updated, f32_params, *_ = reference(
      stream, initial_params(), every_k, chunk, np.float32, on_nonfinite
  )

  def update_deviation(actual, actual_updated):
    if not np.array_equal(actual_updated, ref_updated):
      return float("inf")  # the windows themselves differ
    return max(
        _max_rel([np.asarray(a[t], np.float64) for a in jax.tree.leaves(actual)],
                 [e[t] for e in jax.tree.leaves(ref_updates)])
        for t in np.flatnonzero(ref_updated)
    )

  def params_deviation(actual):
    return [
        _max_rel([np.asarray(x, np.float64) for x in jax.tree.leaves(a)], jax.tree.leaves(e))
        for a, e in zip(actual, ref_params)
    ]

  deviation = params_deviation(chunk_params)
  return Report(
      steps=steps,
      every_k=every_k,
      compiles=run_chunk._cache_size(),
      windows_match=bool(np.array_equal(updated, ref_updated)),
      updates_applied=int(accum_jax.optimizer_step(state)),
      reference_updates_applied=len(ref_weights),
      update_max_rel_deviation=update_deviation(updates, updated),
      params_max_rel_deviation=max(deviation),
      params_rel_deviation_first_chunk=deviation[0],
      params_rel_deviation_last_chunk=deviation[-1],
      float32_model_update_max_rel_deviation=update_deviation(f32_updates, f32_updated),
      float32_model_params_max_rel_deviation=max(params_deviation(f32_params)),
      num_skipped=int(state.num_skipped),
      reference_num_skipped=ref_skipped,
      injections=int(stream.injected.sum()),
      padding_steps=int(stream.padding.sum()),
      flushes=int(stream.flushes.sum()),
      empty_windows=int(state.num_empty_windows),
      reference_empty_windows=ref_empty,
      applied_weight=float(applied_weight.sum()),
      reference_applied_weight=float(sum(ref_weights)),
      compile_seconds=compile_seconds,
      run_seconds=run_seconds,
      reference_seconds=reference_seconds,
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=10_000, help="micro-steps (default 10000)")
  parser.add_argument("--every-k", type=int, default=4, help="calls per update (default 4)")
  parser.add_argument("--chunk", type=int, default=250, help="scan length per call")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  # Imported here: tests/test_soak.py loads this module without bench/ on sys.path.
  from _common import environment, write_json

  start = time.perf_counter()
  report = run(args.steps, args.every_k, args.chunk, args.seed)
  wall = time.perf_counter() - start
  print(f"accum_jax soak: {report.steps} micro-steps, every_k={report.every_k},"
        f" jax {jax.__version__} on {jax.default_backend()}")
  print(f"compiles (jit cache size):        {report.compiles}")
  print(f"updates applied:                  {report.updates_applied}"
        f" (reference {report.reference_updates_applied}; same calls:"
        f" {report.windows_match})")
  print(f"update max relative deviation:    {report.update_max_rel_deviation:.3e}")
  print(f"params max relative deviation:    {report.params_max_rel_deviation:.3e}"
        f" (first chunk {report.params_rel_deviation_first_chunk:.3e},"
        f" last chunk {report.params_rel_deviation_last_chunk:.3e})")
  print(f"float32 NumPy model, same figures: {report.float32_model_update_max_rel_deviation:.3e},"
        f" {report.float32_model_params_max_rel_deviation:.3e}")
  print(f"skipped calls / reference:        {report.num_skipped} /"
        f" {report.reference_num_skipped} ({report.injections} NaN-Inf injected, and"
        f" {report.padding_steps} zero-weight NaN padding steps, not skips)")
  print(f"flushes:                          {report.flushes}")
  print(f"empty windows:                    {report.empty_windows}"
        f" (reference {report.reference_empty_windows})")
  print(f"weight applied / reference:       {report.applied_weight:.6f}"
        f" / {report.reference_applied_weight:.6f}")
  print(f"compile {report.compile_seconds:.2f} s, run {report.run_seconds:.2f} s"
        f" ({report.steps / report.run_seconds:,.0f} micro-steps/s),"
        f" float64 reference {report.reference_seconds:.2f} s, wall {wall:.2f} s")
  path = write_json(
      "soak", {"environment": environment(), "wall_seconds": wall, **report._asdict()}
  )
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
