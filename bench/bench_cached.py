"""A contrastive loss over chunks: compiled memory, step time and exactness against N.

A two-tower model (each tower a token-wise MLP over a short sequence, mean-pooled
and projected to a unit embedding) trained with symmetric InfoNCE and a learned
temperature, as CLIP is. Three ways of taking the gradient of one batch:

- ``full batch``: ``jax.value_and_grad`` of the loss on the whole batch;
- ``cached``: ``accum_jax.cached_value_and_grad(embed, loss, N)``, the same
  gradient with one chunk's activations alive at a time;
- ``value_and_grad``: ``accum_jax.value_and_grad`` of the same loss over N
  microbatches: each microbatch's loss sees only its own negatives, so this is
  the mean of N smaller contrastive losses, another gradient.

Measured, for N in 1, 2, 4, 8, 16:

- compiled memory, ``memory_analysis()``: temp + output + argument - alias bytes
  (what the step needs on the device, its inputs included);
- step time: the median of calls blocked on, every (method, N) taking turns in one
  interleaved run (``_common.time_interleaved``); reported as ratios, of the medians
  and of the fastest rounds (the least disturbed on a shared machine), and the time
  ``cached`` takes over ``value_and_grad`` in units of one forward pass of the towers
  over the whole batch (timed in the same run): the extra pass costs about 1;
- the gradient's deviation from the full batch's, ``|g - g_full| / |g_full|``.

Run from the repository root::

  python bench/bench_cached.py            # about a minute on 2 CPU cores
  python bench/bench_cached.py --quick    # smoke run: smaller batch, fewer rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import (
    environment,
    markdown_table,
    memory_analysis_dict,
    quartiles,
    time_interleaved,
    write_json,
)

import accum_jax

FULL = "full batch"
CACHED = "cached"
PLAIN = "value_and_grad"
FORWARD = "towers forward"  # embed_fn on the whole batch, no gradient: the unit of extra cost
_MIB = 2**20


def make_inputs(batch_size: int, tokens: int, features: int, hidden: int, embed: int,
                seed: int = 0) -> tuple[Any, Any]:
  """Parameters and a paired batch (two views of the same examples), made with NumPy."""
  rng = np.random.default_rng(seed)

  def dense(n_in, n_out):
    return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

  def tower():
    return {"w1": dense(features, hidden), "b1": np.zeros(hidden, np.float32),
            "w2": dense(hidden, hidden), "b2": np.zeros(hidden, np.float32),
            "out": dense(hidden, embed)}

  params = {"image": tower(), "text": tower(), "log_t": np.float32(np.log(10.0))}
  shared = rng.standard_normal((batch_size, tokens, features)).astype(np.float32)
  noise = 0.5 * rng.standard_normal((2, batch_size, tokens, features)).astype(np.float32)
  batch = {"image": shared + noise[0], "text": shared + noise[1]}
  return jax.device_put(params), jax.device_put(batch)


def tower(params: Any, x: jax.Array) -> jax.Array:
  h = jax.nn.gelu(x @ params["w1"] + params["b1"])
  h = jax.nn.gelu(h @ params["w2"] + params["b2"])
  z = jnp.mean(h, axis=1) @ params["out"]
  return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def embed(params: Any, batch: Any) -> Any:
  return {"image": tower(params["image"], batch["image"]),
          "text": tower(params["text"], batch["text"])}


def clip_loss(params: Any, emb: Any, batch: Any) -> jax.Array:
  """Symmetric InfoNCE with a learned temperature."""
  logits = jnp.exp(params["log_t"]) * emb["image"] @ emb["text"].T
  diagonal = jnp.arange(logits.shape[0])
  image_to_text = jax.nn.log_softmax(logits, axis=1)[diagonal, diagonal]
  text_to_image = jax.nn.log_softmax(logits, axis=0)[diagonal, diagonal]
  return -jnp.mean(image_to_text + text_to_image) / 2


def whole_loss(params: Any, batch: Any) -> jax.Array:
  return clip_loss(params, embed(params, batch), batch)


def build(method: str, num_microbatches: int) -> Callable[..., Any]:
  if method == FORWARD:
    return jax.jit(embed)
  if method == FULL:
    return jax.jit(jax.value_and_grad(whole_loss))
  if method == CACHED:
    return jax.jit(accum_jax.cached_value_and_grad(embed, clip_loss, num_microbatches))
  return jax.jit(accum_jax.value_and_grad(whole_loss, num_microbatches))


def compiled_bytes(stats: dict[str, int]) -> int:
  """What the step needs on the device: temporaries, outputs and arguments, less aliasing."""
  return (stats["temp_bytes"] + stats["output_bytes"] + stats["argument_bytes"]
          - stats.get("alias_bytes", 0))


def relative_deviation(grads: Any, reference: Any) -> float:
  a = jax.flatten_util.ravel_pytree(grads)[0]
  b = jax.flatten_util.ravel_pytree(reference)[0]
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch-size", type=int, default=512)
  parser.add_argument("--tokens", type=int, default=16)
  parser.add_argument("--features", type=int, default=32)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--embed", type=int, default=64)
  parser.add_argument("--num-microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--quick", action="store_true", help="batch 128, 3 rounds")
  args = parser.parse_args(argv)
  if args.quick:
    args.batch_size, args.rounds = 128, 3

  params, batch = make_inputs(args.batch_size, args.tokens, args.features, args.hidden,
                              args.embed)
  runs = [(FULL, 1), (FORWARD, 1)] + [
      (m, n) for n in args.num_microbatches for m in (CACHED, PLAIN)]
  compiled, memory = {}, {}
  for method, n in runs:
    compiled[method, n] = build(method, n).lower(params, batch).compile()
    memory[method, n] = memory_analysis_dict(compiled[method, n])

  _, full_grads = compiled[FULL, 1](params, batch)
  deviation = {
      key: relative_deviation(fn(params, batch)[1], full_grads)
      for key, fn in compiled.items() if key[0] in (CACHED, PLAIN)
  }
  samples = time_interleaved(
      {f"{m} N={n}": call(compiled[m, n], params, batch) for m, n in runs},
      rounds=args.rounds,
  )
  seconds = {key: statistics.median(samples[f"{key[0]} N={key[1]}"]) for key in runs}
  # On a machine shared with other work, the fastest round is the least disturbed one.
  fastest = {key: min(samples[f"{key[0]} N={key[1]}"]) for key in runs}

  full_mib = compiled_bytes(memory[FULL, 1]) / _MIB
  rows, records = [], []
  for n in args.num_microbatches:
    cached_mib = compiled_bytes(memory[CACHED, n]) / _MIB
    plain_mib = compiled_bytes(memory[PLAIN, n]) / _MIB
    record = {
        "num_microbatches": n,
        "memory_mib": {FULL: full_mib, CACHED: cached_mib, PLAIN: plain_mib},
        "memory_analysis": {FULL: memory[FULL, 1], CACHED: memory[CACHED, n],
                            PLAIN: memory[PLAIN, n]},
        "seconds": {FULL: seconds[FULL, 1], CACHED: seconds[CACHED, n],
                    PLAIN: seconds[PLAIN, n], FORWARD: seconds[FORWARD, 1]},
        "fastest_seconds": {FULL: fastest[FULL, 1], CACHED: fastest[CACHED, n],
                            PLAIN: fastest[PLAIN, n]},
        "seconds_quartiles": {m: quartiles(samples[f"{m} N={k}"])
                              for m, k in ((FULL, 1), (CACHED, n), (PLAIN, n))},
        "deviation_from_full_batch": {CACHED: deviation[CACHED, n], PLAIN: deviation[PLAIN, n]},
    }
    records.append(record)
    rows.append([
        n, f"{full_mib:.1f}", f"{cached_mib:.1f}", f"{plain_mib:.1f}",
        f"{cached_mib / full_mib:.2f}x",
        f"{seconds[CACHED, n] / seconds[PLAIN, n]:.2f}x",
        f"{fastest[CACHED, n] / fastest[PLAIN, n]:.2f}x",
        f"{(seconds[CACHED, n] - seconds[PLAIN, n]) / seconds[FORWARD, 1]:.2f}",
        f"{seconds[CACHED, n] / seconds[FULL, 1]:.2f}x",
        f"{deviation[CACHED, n]:.1e}", f"{deviation[PLAIN, n]:.1%}",
    ])

  print(f"two towers, symmetric InfoNCE with a learned temperature, batch {args.batch_size};"
        f" {jax.default_backend()}, {len(jax.devices())} device(s)")
  print(markdown_table(
      ["N", "full MiB", "cached MiB", "value_and_grad MiB", "cached / full memory",
       "cached / value_and_grad time", "(fastest rounds)",
       "(cached - value_and_grad) / towers forward", "cached / full time", "cached deviation",
       "value_and_grad deviation"],
      rows,
  ))
  path = write_json("cached_quick" if args.quick else "cached", {
      "config": vars(args), "environment": environment(), "results": records,
  })
  print(f"wrote {path}")
  return 0


def call(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
  return lambda: fn(*args)


if __name__ == "__main__":
  sys.exit(main())
