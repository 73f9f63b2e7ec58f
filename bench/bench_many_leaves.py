"""Models of many small leaves: the inside-step door against a hand-written lax.scan.

Three models where per-leaf work and the size of the program, not FLOPs, set the
cost, each at N=8 microbatches:

* the JAX AI Stack miniGPT tutorial's shape, at a CPU's size: Flax NNX, token
  and position embeddings, 8 blocks of ``nnx.MultiHeadAttention`` (8 heads,
  causal), LayerNorm and a two-layer MLP, and an output layer: 132 leaves;
* a 12-layer tanh MLP of width 128: 24 leaves;
* a Transformer of width 32 written in plain JAX, 12 blocks: 146 leaves (the
  26-leaf 2-block one made deeper).

Rows, each compiled and timed interleaved with the others in one process:

* ``scan``: the hand-written loop every user could write (no skip, no weights);
* ``default``: ``value_and_grad`` with its defaults;
* ``on_nonfinite="skip_microbatch"``: exact recovery of each microbatch that is not
  finite;
* ``on_nonfinite="unchecked"``: no check.

For each: the median step time (rounds interleaved); the median compile time
(``lower`` and ``compile`` after ``jax.clear_caches()``, the persistent
compilation cache off, rounds interleaved, after one warm-up compile that takes
the process's one-time initialisation; the last round's programs are timed);
XLA's static memory (``memory_analysis()``: temp + output bytes); and where a
GPU would wait on the host (:func:`accum_jax.testing.host_syncs`), each beside
the scan's.

Run: ``python bench/bench_many_leaves.py``. XLA:CPU takes about 40 s to compile the
146-leaf Transformer's step, whatever the row, so that model's compiles take most of
the run: 11 minutes of CPU (about as long on 2 idle cores); ``--quick`` (one compile
of each row and fewer rounds) 5 minutes of CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import environment, markdown_table, write_json
from flax import nnx

import accum_jax
from accum_jax.testing import host_syncs

N = 8
WIDTH, HEADS, VOCAB, SEQ, BATCH = 32, 4, 64, 16, 64
SMALL_BLOCKS, DEEP_BLOCKS = 2, 12
MLP_WIDTH, MLP_LAYERS, MLP_BATCH = 128, 12, 256
# The tutorial's miniGPT: 8 blocks, 8 heads, feed-forward as wide as the embedding
# (256 there; vocabulary 50257, 256 tokens). Narrower here, so that a CPU runs it.
GPT_EMBED, GPT_HEADS, GPT_BLOCKS, GPT_VOCAB, GPT_SEQ, GPT_BATCH = 64, 8, 8, 512, 32, 32

ROWS: dict[str, dict[str, Any] | None] = {
    "scan": None,
    "default": {},
    "on_nonfinite='skip_microbatch'": {"on_nonfinite": "skip_microbatch"},
    "on_nonfinite='unchecked'": {"on_nonfinite": "unchecked"},
}


# The plain-JAX Transformer.


def init_params(blocks: int = SMALL_BLOCKS, seed: int = 0):
  rng = np.random.default_rng(seed)

  def dense(n_in, n_out):
    return jnp.asarray(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in), jnp.float32)

  def block():
    return {
        "ln1": {"scale": jnp.ones(WIDTH), "bias": jnp.zeros(WIDTH)},
        "qkv": {"w": dense(WIDTH, 3 * WIDTH), "b": jnp.zeros(3 * WIDTH)},
        "out": {"w": dense(WIDTH, WIDTH), "b": jnp.zeros(WIDTH)},
        "ln2": {"scale": jnp.ones(WIDTH), "bias": jnp.zeros(WIDTH)},
        "mlp1": {"w": dense(WIDTH, 4 * WIDTH), "b": jnp.zeros(4 * WIDTH)},
        "mlp2": {"w": dense(4 * WIDTH, WIDTH), "b": jnp.zeros(WIDTH)},
    }

  return {"embed": dense(VOCAB, WIDTH), "pos": dense(SEQ, WIDTH),
          "blocks": [block() for _ in range(blocks)]}


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


# The MLP.


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


# The miniGPT of the JAX AI Stack tutorial, in its structure.


class TransformerBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.attention = nnx.MultiHeadAttention(
        num_heads=GPT_HEADS, in_features=GPT_EMBED, qkv_features=GPT_EMBED, decode=False,
        rngs=rngs,
    )
    self.layer_norm1 = nnx.LayerNorm(GPT_EMBED, rngs=rngs)
    self.linear1 = nnx.Linear(GPT_EMBED, GPT_EMBED, rngs=rngs)
    self.linear2 = nnx.Linear(GPT_EMBED, GPT_EMBED, rngs=rngs)
    self.layer_norm2 = nnx.LayerNorm(GPT_EMBED, rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    x = self.layer_norm1(x + self.attention(x, mask=mask))
    return self.layer_norm2(x + self.linear2(nnx.relu(self.linear1(x))))


class MiniGPT(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.token_emb = nnx.Embed(GPT_VOCAB, GPT_EMBED, rngs=rngs)
    self.pos_emb = nnx.Embed(GPT_SEQ, GPT_EMBED, rngs=rngs)
    self.blocks = getattr(nnx, "List", list)([TransformerBlock(rngs) for _ in range(GPT_BLOCKS)])
    self.output_layer = nnx.Linear(GPT_EMBED, GPT_VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.token_emb(tokens) + self.pos_emb(jnp.arange(tokens.shape[1]))
    for transformer_block in self.blocks:
      x = transformer_block(x)
    return self.output_layer(x)


def minigpt() -> tuple[Callable[..., Any], Any]:
  """The loss of the split model, as the NNX functional API writes it, and its parameters."""
  graphdef, params = nnx.split(MiniGPT(nnx.Rngs(0)), nnx.Param)

  def loss(params, tokens):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return loss, params


# The rows.


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


def steps_of(loss) -> dict[str, Callable[..., Any]]:
  return {name: scan_of(loss) if options is None else accum_jax.value_and_grad(loss, N, **options)
          for name, options in ROWS.items()}


def problems() -> dict[str, tuple[Callable[..., Any], Any, Any]]:
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
  gpt_tokens = jnp.asarray(rng.integers(0, GPT_VOCAB, (GPT_BATCH, GPT_SEQ + 1)), jnp.int32)
  mlp_batch = {"x": jnp.asarray(rng.standard_normal((MLP_BATCH, MLP_WIDTH)), jnp.float32),
               "y": jnp.asarray(rng.standard_normal((MLP_BATCH, MLP_WIDTH)), jnp.float32)}
  gpt_loss, gpt_params = minigpt()
  deep = init_params(DEEP_BLOCKS)
  return {
      f"miniGPT (NNX), {len(jax.tree.leaves(gpt_params))} leaves, batch {GPT_BATCH}x{GPT_SEQ}":
          (gpt_loss, gpt_params, gpt_tokens),
      f"MLP, {MLP_LAYERS * 2} leaves, batch {MLP_BATCH}": (mlp_loss, init_mlp(), mlp_batch),
      f"Transformer, {len(jax.tree.leaves(deep))} leaves, batch {BATCH}x{SEQ}":
          (loss_fn, deep, tokens),
  }


# Measurements.


def _compile(step, args):
  return jax.jit(step).lower(*args).compile()


def compile_each(steps, args, rounds: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
  """Seconds to lower and compile each step from empty caches, rounds interleaved.

  Returns the samples and each step's last compiled program.
  """
  samples: dict[str, list[float]] = {name: [] for name in steps}
  compiled: dict[str, Any] = {}
  names = list(steps)
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      jax.clear_caches()
      start = time.perf_counter()
      compiled[name] = _compile(steps[name], args)
      samples[name].append(time.perf_counter() - start)
  return samples, compiled


def step_seconds(compiled, args, rounds: int, calls: int = 3) -> dict[str, list[float]]:
  """Seconds per call of each step, ``calls`` back to back per round, rounds interleaved."""
  samples: dict[str, list[float]] = {name: [] for name in compiled}
  for step in compiled.values():
    jax.block_until_ready(step(*args))
  names = list(compiled)
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      start = time.perf_counter()
      for _ in range(calls):
        out = compiled[name](*args)
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - start) / calls)
  return samples


def check_against_scan(compiled, args) -> dict[str, float]:
  """The largest gradient difference from the scan's, relative to its largest entry."""
  reference = jax.tree.leaves(compiled["scan"](*args)[1])
  diffs = {}
  for name, step in compiled.items():
    worst = 0.0
    for x, y in zip(jax.tree.leaves(step(*args)[1]), reference, strict=True):
      x, y = np.asarray(x), np.asarray(y)
      worst = max(worst, float(np.max(np.abs(x - y))) / (float(np.max(np.abs(y))) or 1.0))
    if worst > 1e-4:
      raise AssertionError(f"{name}: gradient differs from the scan's by {worst:.1e} (relative)")
    diffs[name] = worst
  return diffs


def measure(loss, params, batch, rounds: int, compile_rounds: int) -> dict[str, dict[str, Any]]:
  args = (params, batch)
  compiles, compiled = compile_each(steps_of(loss), args, compile_rounds)
  diffs = check_against_scan(compiled, args)
  times = step_seconds(compiled, args, rounds)
  results = {}
  for name, program in compiled.items():
    syncs = host_syncs(program)
    memory = program.memory_analysis()
    results[name] = {
        "step_seconds": statistics.median(times[name]),
        "step_samples": times[name],
        "compile_seconds": statistics.median(compiles[name]),
        "compile_samples": compiles[name],
        "temp_bytes": memory.temp_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "grad_rel_diff_vs_scan": diffs[name],
        "conditionals_per_run": syncs.per_run,
        "loops_of_unknown_trip_count": len(syncs.unknown_trip_count),
        "syncs_in_loops": len(syncs.in_loops),
    }
  return results


def report(title: str, results: dict[str, dict[str, Any]]) -> str:
  scan = results["scan"]
  scan_memory = scan["temp_bytes"] + scan["output_bytes"]
  rows = []
  for name, r in results.items():
    memory = r["temp_bytes"] + r["output_bytes"]
    rows.append([
        name, f"{r['step_seconds'] * 1e3:.2f}",
        f"{r['step_seconds'] / scan['step_seconds']:.3f}",
        f"{r['compile_seconds']:.2f}", f"{r['compile_seconds'] / scan['compile_seconds']:.2f}",
        f"{memory / 2**10:.0f}", f"{memory / scan_memory:.2f}",
        r["conditionals_per_run"], r["syncs_in_loops"] + r["loops_of_unknown_trip_count"],
    ])
  return f"\n{title}, N={N}\n" + markdown_table(
      ["row", "step ms", "x scan", "compile s", "x scan", "temp + output KiB", "x scan",
       "conditionals per run", "waits in loops"], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke run")
  parser.add_argument("--rounds", type=int, default=None,
                      help="timed rounds of 3 calls each (default 10; --quick 3)")
  parser.add_argument("--compile-rounds", type=int, default=None,
                      help="timed compiles of each row (default 2; --quick 1)")
  args = parser.parse_args(argv)
  rounds = args.rounds or (3 if args.quick else 10)
  compile_rounds = args.compile_rounds or (1 if args.quick else 2)
  # Compile times must be of real compiles, never of a cache hit.
  jax.config.update("jax_enable_compilation_cache", False)
  start = time.perf_counter()
  models = problems()
  # The warm-up compile: the process's one-time initialisation falls on no row.
  loss, params, batch = models[next(t for t in models if t.startswith("MLP"))]
  _compile(scan_of(loss), (params, batch))
  results = {}
  for title, (loss, params, batch) in models.items():
    results[title] = measure(loss, params, batch, rounds, compile_rounds)
    print(report(title, results[title]), flush=True)
  seconds = time.perf_counter() - start
  path = write_json("many_leaves_quick" if args.quick else "many_leaves", {
      "environment": environment(), "num_microbatches": N, "rounds": rounds,
      "compile_rounds": compile_rounds, "seconds": seconds, "results": results})
  print(f"\nwrote {path} in {seconds:.0f} s")
  return results


if __name__ == "__main__":
  main()
