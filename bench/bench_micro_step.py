"""Across calls, as users write a train step: the gradient, ``tx.update`` and the update, one jit.

Each row is one jitted step that takes the gradient of one microbatch (a narrow
GPT-2-shaped Transformer, 148 leaves, bfloat16 parameters), gives it to the
optimizer and applies the updates, with the parameters and the optimizer state
donated. A *micro-step* is a call that only accumulates; a *window* is the
``every_k`` = 8 calls whose last one applies AdamW. Two floors:

- the **acc-only floor**: the two-program form a careful user writes by hand, a
  jitted gradient plus a float32 tree add, with no optimizer in the program;
- the **interface's floor**: the same with AdamW's state passed through untouched,
  as the Optax interface hands the whole state to every call (each buffer passed
  to a jitted call costs its dispatch).

The rows: the floors; the host schedule (``accumulate(adamw)`` with
``apply=False`` on 7 calls and ``apply=True`` on the 8th, two compiled programs),
also with the inner state packed by ``optax.flatten``; the device schedule
(``apply`` left out: one program, a kept conditional), also with
``on_nonfinite="skip_microbatch"``; a hand-written
``lax.cond`` accumulator; a plain AdamW step; ``optax.MultiSteps(adamw)``.

The rows take turns, a window each per round, so that machine noise falls on all
alike; a row's micro-step is the median of its calls 1-7, its window the median of
its windows' sums. Its compiled micro-step is counted (``accum_jax.testing.kernel_counts``):
top-level fusions (on a GPU about one kernel each, 10-15 us whatever its size),
copies and conditionals.

Run from the repository root::

  python bench/bench_micro_step.py            # bench/results/micro_step.json
  python bench/bench_micro_step.py --quick    # a few rounds, smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from _common import environment, git_commit, markdown_table, write_json

import accum_jax
from accum_jax.testing import copied_shapes, kernel_counts

EVERY_K = 8
ACC_FLOOR = "acc-only floor: gradient + f32 tree add"
FLOOR = "interface's floor: the same, AdamW state passed through"
HOST = "accumulate(adamw), host schedule"
DEVICE = "accumulate(adamw), device schedule"
MULTISTEPS = "optax.MultiSteps(adamw)"


def gpt2_tree(layers: int = 12, width: int = 64, vocab: int = 128, context: int = 16) -> Any:
  """Parameters shaped like GPT-2's (148 leaves at 12 layers), narrow, in bfloat16."""
  keys = iter(jax.random.split(jax.random.key(0), 8 * layers + 4))

  def norm():
    return {"scale": jnp.ones(width), "bias": jnp.zeros(width)}

  def dense(n_in, n_out):
    return {"w": 0.02 * jax.random.normal(next(keys), (n_in, n_out)), "b": jnp.zeros(n_out)}

  params: dict[str, Any] = {
      "wte": 0.02 * jax.random.normal(next(keys), (vocab, width)),
      "wpe": 0.02 * jax.random.normal(next(keys), (context, width)),
      "ln_f": norm(),
  }
  for i in range(layers):
    params[f"h{i:02d}"] = {
        "ln_1": norm(), "ln_2": norm(),
        "attn": {"qkv": dense(width, 3 * width), "proj": dense(width, width)},
        "mlp": {"fc": dense(width, 4 * width), "proj": dense(4 * width, width)},
    }
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)


def _layer_norm(p: Any, x: jax.Array) -> jax.Array:
  mean = x.mean(-1, keepdims=True)
  x = (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
  return x * p["scale"] + p["bias"]


def _block(p: Any, x: jax.Array, heads: int = 4) -> jax.Array:
  t, width = x.shape
  q, k, v = jnp.split(_layer_norm(p["ln_1"], x) @ p["attn"]["qkv"]["w"]
                      + p["attn"]["qkv"]["b"], 3, axis=-1)
  q, k, v = (y.reshape(t, heads, width // heads) for y in (q, k, v))
  attention = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
  x = x + attention.reshape(t, width) @ p["attn"]["proj"]["w"] + p["attn"]["proj"]["b"]
  hidden = jax.nn.gelu(_layer_norm(p["ln_2"], x) @ p["mlp"]["fc"]["w"] + p["mlp"]["fc"]["b"])
  return x + hidden @ p["mlp"]["proj"]["w"] + p["mlp"]["proj"]["b"]


def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
  """Next-token cross-entropy of one sequence, in float32."""
  inputs, targets = tokens[:-1], tokens[1:]
  x = params["wte"][inputs] + params["wpe"][: inputs.shape[0]]
  for name in sorted(k for k in params if k.startswith("h")):
    x = _block(params[name], x)
  logits = (_layer_norm(params["ln_f"], x) @ params["wte"].T).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def gradient(params: Any, tokens: jax.Array) -> Any:
  return jax.grad(loss_fn)(params, tokens)


# ---------------------------------------------------------------------------
# The rows. Each is an init and a step(params, state, tokens, apply) -> (params,
# state); `apply` is a Python bool on rows that the host schedules (`host`), and
# ignored by the others.


class Row(NamedTuple):
  init: Callable[[Any], Any]
  step: Callable[..., tuple[Any, Any]]
  host: bool = False  # the host says which call applies: two compiled programs


def _zeros32(params: Any) -> Any:
  return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)


def acc_only_floor() -> Row:
  def step(params, acc, tokens, apply):
    del apply
    grads = gradient(params, tokens)
    return params, jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)

  return Row(_zeros32, step)


def interface_floor(inner: optax.GradientTransformation) -> Row:
  def step(params, state, tokens, apply):
    acc, inner_state = state
    params, acc = acc_only_floor().step(params, acc, tokens, apply)
    return params, (acc, inner_state)

  return Row(lambda p: (_zeros32(p), inner.init(p)), step)


def hand_written_cond(inner: optax.GradientTransformation) -> Row:
  """A careful user's accumulator: the inner update under a conditional XLA:GPU keeps."""
  def init(params):
    return _zeros32(params), inner.init(params), jnp.zeros((), jnp.int32)

  def step(params, state, tokens, apply):
    del apply
    acc, inner_state, count = state
    grads = gradient(params, tokens)
    first = count % EVERY_K == 0
    acc = jax.tree.map(lambda a, g: jnp.where(first, 0.0, a) + g.astype(jnp.float32), acc, grads)
    count = count + 1

    def emit(acc, inner_state):
      mean = jax.tree.map(lambda a, p: (a / EVERY_K).astype(p.dtype), acc, params)
      updates, inner_state = inner.update(mean, inner_state, params)
      return jax.lax.optimization_barrier(updates), inner_state

    def hold(acc, inner_state):
      del acc
      return jax.tree.map(jnp.zeros_like, params), inner_state

    updates, inner_state = jax.lax.cond(count % EVERY_K == 0, emit, hold, acc, inner_state)
    return optax.apply_updates(params, updates), (acc, inner_state, count)

  return Row(init, step)


def transformation(tx: optax.GradientTransformation, host: bool = False) -> Row:
  """The step users write: ``tx.update`` of the gradient, then ``apply_updates``."""
  def step(params, state, tokens, apply):
    extra = {"apply": apply} if host else {}
    updates, state = tx.update(gradient(params, tokens), state, params, **extra)
    return optax.apply_updates(params, updates), state

  return Row(tx.init, step, host)


def rows(inner: optax.GradientTransformation | None = None) -> dict[str, Row]:
  inner = inner or optax.adamw(1e-4)

  def acc(host, wrap=lambda x: x, **kwargs):
    return transformation(accum_jax.accumulate(wrap(inner), every_k=EVERY_K, **kwargs), host)

  return {
      ACC_FLOOR: acc_only_floor(),
      FLOOR: interface_floor(inner),
      HOST: acc(True),
      "accumulate(optax.flatten(adamw)), host schedule": acc(True, optax.flatten),
      DEVICE: acc(False),
      "accumulate(adamw, on_nonfinite='skip_microbatch'), device schedule": acc(
          False, on_nonfinite="skip_microbatch"),
      "hand-written lax.cond accumulator": hand_written_cond(inner),
      "plain AdamW step": transformation(inner),
      MULTISTEPS: transformation(optax.MultiSteps(inner, EVERY_K).gradient_transformation()),
  }


# ---------------------------------------------------------------------------
# Compiling, counting and timing.


def compile_rows(
    params: Any, tokens: jax.Array, names: Any = None,
    inner: optax.GradientTransformation | None = None,
) -> dict[str, dict[str, Any]]:
  """``{row: {"programs": {apply: compiled}, "carry": [params, state]}}`` for ``names``
  (None: all). A host row has two programs (``apply`` False and True); the others one,
  under ``None``."""
  built = {}
  for name, row in rows(inner).items():
    if names is not None and name not in names:
      continue
    own = jax.tree.map(jnp.copy, params)
    state = jax.jit(row.init)(own)
    jitted = jax.jit(row.step, static_argnames="apply", donate_argnums=(0, 1))
    applies = (False, True) if row.host else (None,)
    programs = {a: jitted.lower(own, state, tokens, apply=a).compile() for a in applies}
    built[name] = {"programs": programs, "carry": [own, state]}
  return built


def micro_step_program(entry: dict[str, Any]) -> Any:
  """The program of a call that only accumulates."""
  return entry["programs"].get(False, entry["programs"].get(None))


def _window(entry: dict[str, Any], tokens: jax.Array) -> list[float]:
  """Seconds of each call of one window; the carry is updated."""
  programs, carry = entry["programs"], entry["carry"]
  times = []
  for call in range(EVERY_K):
    program = programs[call == EVERY_K - 1] if len(programs) == 2 else programs[None]
    start = time.perf_counter()
    carry[:] = jax.block_until_ready(program(*carry, tokens))
    times.append(time.perf_counter() - start)
  return times


def measure(params: Any, tokens: jax.Array, rounds: int) -> list[dict[str, Any]]:
  built = compile_rows(params, tokens)
  names = list(built)
  for name in names:
    _window(built[name], tokens)  # the first calls allocate
  windows: dict[str, list[list[float]]] = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order
      windows[name].append(_window(built[name], tokens))
  results = []
  for name in names:
    micro = [1e3 * t for w in windows[name] for t in w[:-1]]
    results.append({
        "row": name,
        "micro_step_ms": statistics.median(micro),
        "window_ms": statistics.median(1e3 * sum(w) for w in windows[name]),
        "state_buffers": len(jax.tree.leaves(built[name]["carry"][1])),
        **kernel_counts(micro_step_program(built[name]))._asdict(),
        "leaf_copies": sum(not shape.endswith("[]")
                           for shape in copied_shapes(micro_step_program(built[name]))),
        "window_samples_ms": [[1e3 * t for t in w] for w in windows[name]],
    })
  return add_ratios(results)


def add_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Each row's micro-step against both floors (time, fusions) and its window against
  ``MultiSteps``' (the ratio of medians of the rows' interleaved rounds)."""
  by_name = {r["row"]: r for r in results}
  for row in results:
    for key, floor in (("acc_floor", by_name[ACC_FLOOR]), ("floor", by_name[FLOOR])):
      row[f"micro_step_to_{key}"] = row["micro_step_ms"] / floor["micro_step_ms"]
      row[f"fusions_to_{key}"] = row["fusions"] / floor["fusions"]
    row["window_to_multisteps"] = row["window_ms"] / by_name[MULTISTEPS]["window_ms"]
  return results


def table(results: list[dict[str, Any]]) -> str:
  return markdown_table(
      ["row", "micro-step ms", "/ interface's floor", "/ acc-only floor", "window ms",
       "window / MultiSteps", "fusions", "/ floor", "copies (of leaves)", "conditionals",
       "state buffers"],
      [[r["row"], f"{r['micro_step_ms']:.3f}", f"{r['micro_step_to_floor']:.2f}",
        f"{r['micro_step_to_acc_floor']:.2f}", f"{r['window_ms']:.2f}",
        f"{r['window_to_multisteps']:.2f}", r["fusions"], f"{r['fusions_to_floor']:.2f}",
        f"{r['copies']} ({r['leaf_copies']})", r["conditionals"], r["state_buffers"]]
       for r in results])


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few rounds")
  parser.add_argument("--rounds", type=int, default=40, help="windows of each row (default 40)")
  args = parser.parse_args(argv)
  rounds = 3 if args.quick else args.rounds
  params = gpt2_tree()
  tokens = jax.random.randint(jax.random.key(1), (17,), 0, 128)
  results = measure(params, tokens, rounds)
  report = {"environment": environment(), "commit": git_commit(), "rounds": rounds,
            "every_k": EVERY_K, "leaves": len(jax.tree.leaves(params)), "rows": results}
  print(f"GPT-2-shaped, {report['leaves']} bfloat16 leaves, width 64: gradient of one"
        f" sequence + update, one jit, donated; AdamW inside, every_k={EVERY_K}; {rounds}"
        " windows of each row, interleaved")
  print(table(results))
  print(f"\nwrote {write_json('micro_step_quick' if args.quick else 'micro_step', report)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
