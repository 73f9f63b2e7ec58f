"""The across-calls micro-step against the floor of the Optax contract, on many leaves.

A call of ``accumulate`` that only accumulates must add the gradient and return
zero updates; nothing more. Its floor is what a careful user writes by hand: a
float32 tree accumulator, ``lax.cond(emit, inner branch, skip branch)`` with the
inner branch kept on a GPU (an ``optimization_barrier`` in it: XLA:GPU turns a
conditional of cheap branches into selects and runs both), and the user's
``optax.apply_updates`` in the same jit, with the state donated and returned
first. The tree is shaped like ``bench_gpu.py``'s GPT-2 (148 leaves) at narrow
widths so that it runs on a CPU, and a 1,000-leaf tree beside it.

Each row is timed in interleaved rounds against the floor (the ratio is the median
of the rounds' ratios) and its compiled program is counted: top-level fusions
(on a GPU, about one kernel each, 10-15 us whatever its size) and conditionals.

Run from the repository root::

  python bench/bench_micro_step.py            # bench/results/micro_step.json
  python bench/bench_micro_step.py --quick    # a few rounds, smoke test
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _common import environment, markdown_table, write_json

import accum_jax

EVERY_K = 8


def gpt2_tree(layers: int = 12, width: int = 64, vocab: int = 512, context: int = 128) -> Any:
  """Parameters shaped like GPT-2's (148 leaves at 12 layers), narrow, in bfloat16."""
  def norm():
    return {"scale": jnp.ones(width), "bias": jnp.zeros(width)}

  def dense(n_in, n_out):
    return {"w": jnp.full((n_in, n_out), 0.01), "b": jnp.zeros(n_out)}

  params: dict[str, Any] = {
      "wte": jnp.full((vocab, width), 0.01), "wpe": jnp.full((context, width), 0.01),
      "ln_f": norm(),
  }
  for i in range(layers):
    params[f"h{i}"] = {
        "ln_1": norm(), "ln_2": norm(),
        "attn": {"qkv": dense(width, 3 * width), "proj": dense(width, width)},
        "mlp": {"fc": dense(width, 4 * width), "proj": dense(4 * width, width)},
    }
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)


def many_leaves(num_leaves: int = 1000, size: int = 256) -> Any:
  """``num_leaves`` bfloat16 vectors: per-leaf cost with nothing else."""
  return {f"p{i:04d}": jnp.full((size,), 0.01, jnp.bfloat16) for i in range(num_leaves)}


# ---------------------------------------------------------------------------
# The floor, and the rows: each an (init, step) pair; step(state, params, grads)
# returns (state, params), jitted with the state donated.


def floor(inner: optax.GradientTransformation) -> tuple[Callable, Callable]:
  """The hand-written accumulator: the reset folded into the add, the inner branch kept."""
  def init(params):
    acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return acc, inner.init(params), jnp.zeros((), jnp.int32)

  def step(state, params, grads):
    acc, inner_state, count = state
    first = count % EVERY_K == 0
    acc = jax.tree.map(
        lambda a, g: jnp.where(first, 0.0, a) + g.astype(jnp.float32), acc, grads)
    count = count + 1

    def apply(acc, inner_state):
      mean = jax.tree.map(lambda a, p: (a / EVERY_K).astype(p.dtype), acc, params)
      updates, inner_state = inner.update(mean, inner_state, params)
      return jax.lax.optimization_barrier(updates), inner_state

    def skip(acc, inner_state):
      del acc
      return jax.tree.map(jnp.zeros_like, params), inner_state

    updates, inner_state = jax.lax.cond(count % EVERY_K == 0, apply, skip, acc, inner_state)
    return (acc, inner_state, count), optax.apply_updates(params, updates)

  return init, step


def transformation(tx: optax.GradientTransformation) -> tuple[Callable, Callable]:
  """An Optax transformation's update and ``apply_updates`` in one step."""
  def step(state, params, grads):
    updates, state = tx.update(grads, state, params)
    return state, optax.apply_updates(params, updates)

  return tx.init, step


def flax_train_state(inner: optax.GradientTransformation) -> tuple[Callable, Callable]:
  """``accum_jax.flax.apply_gradients`` on a Flax ``TrainState``."""
  from flax.training import train_state

  import accum_jax.flax

  tx = accum_jax.accumulate(inner, every_k=EVERY_K)

  def init(params):
    return train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

  def step(state, params, grads):
    del params
    state = accum_jax.flax.apply_gradients(state, grads=grads)
    return state, state.params

  return init, step


def rows(inner: optax.GradientTransformation) -> dict[str, tuple[Callable, Callable]]:
  def acc(**kwargs):
    return transformation(accum_jax.accumulate(inner, every_k=EVERY_K, **kwargs))

  return {
      "floor: hand-written lax.cond, inner branch kept": floor(inner),
      "accumulate, skip_nonfinite=False": acc(skip_nonfinite=False),
      "accumulate (default)": acc(),
      "accumulate, layout='flat', skip_nonfinite=False": acc(layout="flat", skip_nonfinite=False),
      "accumulate, layout='flat'": acc(layout="flat"),
      "optax.MultiSteps": transformation(
          optax.MultiSteps(inner, EVERY_K).gradient_transformation()),
      "accum_jax.flax.apply_gradients (TrainState)": flax_train_state(inner),
  }


# ---------------------------------------------------------------------------
# Counting and timing.


def entry_counts(compiled: jax.stages.Compiled) -> dict[str, int]:
  """Fusions and conditionals at the top level of a compiled program."""
  text = compiled.as_text()
  entry = text[text.index("ENTRY"):]
  entry = entry[: entry.index("\n}")]
  return {
      "fusions": len(re.findall(r" fusion\(", entry)),
      "conditionals": len(re.findall(r" conditional\(", entry)),
  }


def grads_for(params: Any) -> Any:
  return jax.tree.map(lambda p: (p * 0.5).astype(p.dtype), params)


def compile_rows(
    params: Any, names: Any = None, inner: optax.GradientTransformation | None = None
) -> dict[str, list[Any]]:
  """``{row: [compiled micro-step, its state, its params]}``, for ``names`` (None: all),
  with ``inner`` inside (AdamW by default)."""
  built = {}
  for name, (init, step) in rows(inner or optax.adamw(1e-3)).items():
    if names is not None and name not in names:
      continue
    jitted = jax.jit(step, donate_argnums=0)
    compiled = jitted.lower(init(params), params, grads_for(params)).compile()
    built[name] = [compiled, init(params), jax.tree.map(jnp.copy, params)]
  return built


def measure(params: Any, rounds: int) -> list[dict[str, Any]]:
  """Each row's compiled micro-step, counted, and timed against the floor."""
  grads = grads_for(params)
  built = compile_rows(params)
  samples: dict[str, list[float]] = {name: [] for name in built}
  for r in range(rounds):
    names = list(built)
    names = names[r % len(names):] + names[: r % len(names)]  # rotate the order
    for name in names:
      compiled, state, p = built[name]
      start = time.perf_counter()
      state, p = compiled(state, p, grads)
      jax.block_until_ready((state, p))
      samples[name].append(time.perf_counter() - start)
      built[name][1:] = [state, p]
  base = samples[next(iter(built))]
  results = []
  for name, (compiled, *_) in built.items():
    warm = slice(2, None)  # the first calls allocate
    ratios = [t / b for t, b in zip(samples[name][warm], base[warm])]
    results.append({
        "row": name,
        "ms": 1e3 * statistics.median(samples[name][warm]),
        "ratio_to_floor": statistics.median(ratios),
        **entry_counts(compiled),
    })
  floor_fusions = results[0]["fusions"]
  for row in results:
    row["fusions_to_floor"] = row["fusions"] / floor_fusions
  return results


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few rounds")
  parser.add_argument("--rounds", type=int, default=200)
  args = parser.parse_args(argv)
  rounds = 8 if args.quick else args.rounds
  trees = {"GPT-2-shaped, 148 leaves": gpt2_tree(), "1,000 leaves of 256": many_leaves()}
  report: dict[str, Any] = {"environment": environment(), "rounds": rounds, "trees": {}}
  for tree_name, params in trees.items():
    results = measure(params, rounds)
    report["trees"][tree_name] = results
    print(f"\n{tree_name}: micro-step (AdamW inside, every_k={EVERY_K}), {rounds} rounds")
    print(markdown_table(
        ["row", "ms", "time / floor", "top-level fusions", "/ floor", "conditionals"],
        [[r["row"], f"{r['ms']:.3f}", f"{r['ratio_to_floor']:.2f}", r["fusions"],
          f"{r['fusions_to_floor']:.2f}", r["conditionals"]] for r in results]))
  print(f"\nwrote {write_json('micro_step', report)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
