"""Models of many small leaves: accum_jax against a hand-written lax.scan.

Two models where per-leaf work, not FLOPs, sets the cost: a 2-block Transformer
of width 32 (26 parameter leaves, most under 4 KiB) and a 12-layer tanh MLP of
width 128 (24 leaves), both at N=8 microbatches. Rows, each compiled and timed
interleaved with the others in one process:

* ``scan``: the hand-written loop every user could write (no skip, no weights);
* ``accum_jax``: ``value_and_grad`` with its defaults (``skip_nonfinite=True``);
* ``accum_jax, skip_nonfinite=False``;
* ``accum_jax, gradient_noise=True``: one squared norm per microbatch more.

For each: the median step time, the median compile time (``lower`` and
``compile`` after ``jax.clear_caches()``, rounds interleaved), XLA's temporary
bytes (``memory_analysis()``), and where a GPU would wait on the host
(:func:`accum_jax.testing.host_syncs`: conditionals per run, loops of unknown
trip count), each beside the scan's.

Run: ``python bench/bench_many_leaves.py [--rounds 30] [--compile-rounds 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import environment, markdown_table, write_json

import accum_jax
from accum_jax.testing import host_syncs

WIDTH, HEADS, BLOCKS, VOCAB, SEQ, BATCH, N = 32, 4, 2, 64, 16, 64, 8
MLP_WIDTH, MLP_LAYERS, MLP_BATCH = 128, 12, 256


def init_params(seed=0):
  rng = np.random.default_rng(seed)

  def dense(n_in, n_out):
    return jnp.asarray(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in), jnp.float32)

  blocks = []
  for _ in range(BLOCKS):
    blocks.append({
        "ln1": {"scale": jnp.ones(WIDTH), "bias": jnp.zeros(WIDTH)},
        "qkv": {"w": dense(WIDTH, 3 * WIDTH), "b": jnp.zeros(3 * WIDTH)},
        "out": {"w": dense(WIDTH, WIDTH), "b": jnp.zeros(WIDTH)},
        "ln2": {"scale": jnp.ones(WIDTH), "bias": jnp.zeros(WIDTH)},
        "mlp1": {"w": dense(WIDTH, 4 * WIDTH), "b": jnp.zeros(4 * WIDTH)},
        "mlp2": {"w": dense(4 * WIDTH, WIDTH), "b": jnp.zeros(WIDTH)},
    })
  return {"embed": dense(VOCAB, WIDTH), "pos": dense(SEQ, WIDTH), "blocks": blocks}


def layer_norm(p, x):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def block(p, x):
  b, t, _ = x.shape
  q, k, v = jnp.split(layer_norm(p["ln1"], x) @ p["qkv"]["w"] + p["qkv"]["b"], 3, axis=-1)
  heads = lambda z: z.reshape(b, t, HEADS, WIDTH // HEADS).transpose(0, 2, 1, 3)  # noqa: E731
  q, k, v = heads(q), heads(k), heads(v)
  mask = jnp.tril(jnp.ones((t, t), bool))
  att = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(WIDTH // HEADS), -1e9)
  y = (jax.nn.softmax(att) @ v).transpose(0, 2, 1, 3).reshape(b, t, WIDTH)
  x = x + y @ p["out"]["w"] + p["out"]["b"]
  h = jax.nn.gelu(layer_norm(p["ln2"], x) @ p["mlp1"]["w"] + p["mlp1"]["b"])
  return x + h @ p["mlp2"]["w"] + p["mlp2"]["b"]


def loss_fn(params, tokens):
  x = params["embed"][tokens[:, :-1]] + params["pos"][: SEQ - 1]
  for p in params["blocks"]:
    x = block(p, x)
  logits = x @ params["embed"].T
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def init_mlp(seed=0):
  rng = np.random.default_rng(seed)
  return [{"w": jnp.asarray(rng.standard_normal((MLP_WIDTH, MLP_WIDTH)) / np.sqrt(MLP_WIDTH),
                            jnp.float32),
           "b": jnp.zeros(MLP_WIDTH)} for _ in range(MLP_LAYERS)]


def mlp_loss(params, batch):
  h = batch["x"]
  for layer in params:
    h = jnp.tanh(h @ layer["w"] + layer["b"])
  return jnp.mean((h - batch["y"]) ** 2)


def scan_of(loss):
  """The hand-written loop: N microbatches, float32 sums carried, divided after."""

  def step(params, batch):
    micro = jax.tree.map(lambda x: x.reshape(N, x.shape[0] // N, *x.shape[1:]), batch)

    def body(carry, mb):
      value, grads = jax.value_and_grad(loss)(params, mb)
      return jax.tree.map(jnp.add, carry, (value, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), params))
    total, _ = jax.lax.scan(body, zeros, micro)
    return jax.tree.map(lambda x: x / N, total)

  return step


def steps_of(loss) -> dict[str, Any]:
  return {
      "scan": scan_of(loss),
      "accum_jax": accum_jax.value_and_grad(loss, N),
      "accum_jax, skip_nonfinite=False": accum_jax.value_and_grad(loss, N, skip_nonfinite=False),
      "accum_jax, gradient_noise=True": accum_jax.value_and_grad(
          loss, N, gradient_noise=True, return_info=True
      ),
  }


def problems() -> dict[str, tuple[Any, Any, Any]]:
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
  mlp_batch = {"x": jnp.asarray(rng.standard_normal((MLP_BATCH, MLP_WIDTH)), jnp.float32),
               "y": jnp.asarray(rng.standard_normal((MLP_BATCH, MLP_WIDTH)), jnp.float32)}
  return {
      f"Transformer, 26 leaves, batch {BATCH}x{SEQ}": (loss_fn, init_params(), tokens),
      f"MLP, 24 leaves, batch {MLP_BATCH}": (mlp_loss, init_mlp(), mlp_batch),
  }


def compile_seconds(steps, args, rounds: int) -> dict[str, list[float]]:
  """Seconds to lower and compile each step, from empty caches, rounds interleaved."""
  samples: dict[str, list[float]] = {name: [] for name in steps}
  for r in range(rounds):
    names = list(steps)
    for name in names[r % len(names):] + names[:r % len(names)]:
      jax.clear_caches()
      start = time.perf_counter()
      jax.jit(steps[name]).lower(*args).compile()
      samples[name].append(time.perf_counter() - start)
  return samples


def step_seconds(compiled, args, rounds: int, calls: int = 5) -> dict[str, list[float]]:
  samples: dict[str, list[float]] = {name: [] for name in compiled}
  for name, step in compiled.items():
    jax.block_until_ready(step(*args))
  for r in range(rounds):
    names = list(compiled)
    for name in names[r % len(names):] + names[:r % len(names)]:
      start = time.perf_counter()
      for _ in range(calls):
        out = compiled[name](*args)
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - start) / calls)
  return samples


def measure(loss, params, batch, rounds: int, compile_rounds: int) -> dict[str, dict[str, Any]]:
  steps = steps_of(loss)
  args = (params, batch)
  compiled = {name: jax.jit(step).lower(*args).compile() for name, step in steps.items()}
  reference = compiled["scan"](*args)
  for step in compiled.values():
    np.testing.assert_allclose(jax.tree.leaves(step(*args)[1])[0],
                               jax.tree.leaves(reference[1])[0], rtol=1e-4, atol=1e-6)
  times = step_seconds(compiled, args, rounds)
  compiles = compile_seconds(steps, args, compile_rounds)
  results = {}
  for name, program in compiled.items():
    syncs = host_syncs(program)
    results[name] = {
        "step_seconds": statistics.median(times[name]),
        "compile_seconds": statistics.median(compiles[name]),
        "temp_bytes": program.memory_analysis().temp_size_in_bytes,
        "conditionals_per_run": syncs.per_run,
        "loops_of_unknown_trip_count": len(syncs.unknown_trip_count),
        "syncs_in_loops": len(syncs.in_loops),
    }
  return results


def report(title: str, results: dict[str, dict[str, Any]]) -> None:
  scan = results["scan"]
  rows = [[
      name, f"{r['step_seconds'] * 1e3:.2f}", f"{r['step_seconds'] / scan['step_seconds']:.3f}",
      f"{r['compile_seconds']:.2f}", f"{r['compile_seconds'] / scan['compile_seconds']:.2f}",
      f"{r['temp_bytes'] / 2**10:.0f}", f"{r['temp_bytes'] / scan['temp_bytes']:.2f}",
      r["conditionals_per_run"], r["syncs_in_loops"] + r["loops_of_unknown_trip_count"],
  ] for name, r in results.items()]
  print(f"\n{title}, N={N}")
  print(markdown_table(
      ["step", "ms", "x scan", "compile s", "x scan", "temp KiB", "x scan",
       "conditionals per run", "waits in loops"], rows))


def main(rounds: int, compile_rounds: int) -> dict[str, Any]:
  results = {}
  for title, (loss, params, batch) in problems().items():
    results[title] = measure(loss, params, batch, rounds, compile_rounds)
    report(title, results[title])
  write_json("many_leaves", {"environment": environment(), "rounds": rounds,
                             "compile_rounds": compile_rounds, "results": results})
  return results


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--compile-rounds", type=int, default=7)
  args = parser.parse_args()
  main(args.rounds, args.compile_rounds)
