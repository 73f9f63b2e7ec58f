"""What ``gradient_noise=True`` costs: step time and XLA temp memory, with and without.

The estimate adds one squared norm of each microbatch's gradient to the loop (one
reduction per large leaf and one over the concatenated small leaves, a few scalars
in the carry) and one of the accumulator after it. Two models, each compiled both
ways:

- ``mlp``: the MLP of ``bench_microbatch.py`` (4 ReLU layers of 512 x 512 and a
  linear head, batch 8192, N=8): FLOPs set the step time; the extra pass is small
  beside the matrix products.
- ``many leaves``: the 2-block width-32 Transformer of ``bench_many_leaves.py``
  (26 small leaves, batch 64 x 16 tokens, N=8): per-leaf work sets the step time,
  so the extra pass over the leaves shows most here.

Both use ``accum_jax.value_and_grad(loss, N, return_info=True)`` with its defaults,
the one with ``gradient_noise=True``. Per model the two take turns, round after
round (``_common.time_interleaved``), and the median of the rounds is reported; a
call of the small model is ``--calls`` steps back to back. Beside the time, XLA's
compiled ``memory_analysis()`` temp bytes. The goal: at most 1.05x the time, the
same temp memory.

Run from the repository root::

  python bench/bench_noise.py                 # 1 to 2 minutes on 2 CPU cores
  python bench/bench_noise.py --quick         # a smaller MLP, fewer rounds
  python bench/bench_noise.py --batch-size 2048 --width 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import bench_many_leaves
import bench_microbatch
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

GOAL_TIME_RATIO = 1.05
PLAIN = "gradient_noise=False"
NOISE = "gradient_noise=True"


def build(loss: Callable, num_microbatches: int, params: Any, batch: Any) -> dict[str, Any]:
  """The two jitted steps, compiled for ``(params, batch)``, and their temp bytes."""
  out = {}
  for name, noise in ((PLAIN, False), (NOISE, True)):
    vg = accum_jax.value_and_grad(loss, num_microbatches, return_info=True, gradient_noise=noise)
    compiled = jax.jit(vg).lower(params, batch).compile()
    out[name] = {"compiled": compiled, "xla": memory_analysis_dict(compiled)}
  return out


def check_same_gradient(steps: dict[str, Any], params: Any, batch: Any) -> float:
  """Both compute the same loss and gradient: the noise is only looked at."""
  (plain_loss, plain_grads, _), (loss, grads, info) = (
      steps[name]["compiled"](params, batch) for name in (PLAIN, NOISE)
  )
  assert info.gradient_noise is not None
  deviation = max(
      float(jnp.max(jnp.abs(a - b))) for a, b in
      zip(jax.tree.leaves((plain_loss, plain_grads)), jax.tree.leaves((loss, grads)))
  )
  assert deviation < 1e-5, deviation
  return float(info.gradient_noise.simple_noise_scale)


def measure(name: str, loss, num_microbatches, params, batch, *, rounds, calls) -> dict[str, Any]:
  steps = build(loss, num_microbatches, params, batch)
  b_simple = check_same_gradient(steps, params, batch)

  def repeated(compiled):
    def run():
      for _ in range(calls):
        out = compiled(params, batch)
      return out
    return run

  samples = time_interleaved(
      {method: repeated(step["compiled"]) for method, step in steps.items()}, rounds=rounds
  )
  result = {"model": name, "num_microbatches": num_microbatches, "calls_per_sample": calls,
            "rounds": rounds, "b_simple_one_step": b_simple, "methods": {}}
  for method, step in steps.items():
    per_step = [s / calls for s in samples[method]]
    result["methods"][method] = {
        "median_seconds": statistics.median(per_step),
        "quartiles_seconds": quartiles(per_step),
        "xla": step["xla"],
    }
  plain, noise = result["methods"][PLAIN], result["methods"][NOISE]
  result["time_ratio"] = noise["median_seconds"] / plain["median_seconds"]
  # Per round, noise / plain of the same round: drift between rounds cancels.
  result["paired_ratio_median"] = statistics.median(
      n / p for n, p in zip(samples[NOISE], samples[PLAIN])
  )
  result["temp_bytes"] = {m: result["methods"][m]["xla"].get("temp_bytes") for m in steps}
  return result


def mlp(batch_size: int, width: int, num_layers: int) -> tuple[Callable, Any, Any]:
  params, batch = bench_microbatch.make_inputs(batch_size, width, num_layers)
  return bench_microbatch.loss_fn, params, batch


def many_leaves() -> tuple[Callable, Any, Any]:
  m = bench_many_leaves
  params = m.init_params()
  tokens = np.random.default_rng(1).integers(0, m.VOCAB, (m.BATCH, m.SEQ))
  return m.loss_fn, params, jnp.asarray(tokens, jnp.int32)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch-size", type=int, default=8192, help="MLP batch (default 8192)")
  parser.add_argument("--width", type=int, default=512, help="MLP width (default 512)")
  parser.add_argument("--num-layers", type=int, default=4, help="MLP hidden layers (default 4)")
  parser.add_argument("--num-microbatches", type=int, default=8, help="N for the MLP (default 8)")
  parser.add_argument("--rounds", type=int, default=21, help="timed rounds (median)")
  parser.add_argument("--calls", type=int, default=10,
                      help="steps per timed call of the many-leaves model (default 10)")
  parser.add_argument("--quick", action="store_true",
                      help="MLP batch 1024 width 256, 5 rounds: a smoke run")
  args = parser.parse_args(argv)
  if args.quick:
    args.batch_size, args.width, args.rounds = 1024, 256, 5

  results = [
      measure(f"mlp {args.num_layers}x{args.width}, batch {args.batch_size}",
              *_args(mlp(args.batch_size, args.width, args.num_layers), args.num_microbatches),
              rounds=args.rounds, calls=1),
      measure(f"many leaves, batch {bench_many_leaves.BATCH}x{bench_many_leaves.SEQ}",
              *_args(many_leaves(), bench_many_leaves.N), rounds=args.rounds, calls=args.calls),
  ]

  rows = []
  for r in results:
    plain, noise = r["methods"][PLAIN], r["methods"][NOISE]
    rows.append([
        r["model"], r["num_microbatches"],
        f"{plain['median_seconds'] * 1e3:.2f}", f"{noise['median_seconds'] * 1e3:.2f}",
        f"{r['time_ratio']:.3f}x", f"{r['paired_ratio_median']:.3f}x",
        f"{r['temp_bytes'][PLAIN] / 2**20:.2f}", f"{r['temp_bytes'][NOISE] / 2**20:.2f}",
    ])
  print(f"jax {jax.__version__} on {jax.devices()[0]}, {args.rounds} rounds interleaved,"
        f" load average {environment()['load_average']}")
  print(markdown_table(
      ["model", "microbatches", "ms/step, off", "ms/step, on", "time on/off", "paired on/off",
       "temp MiB, off", "temp MiB, on"], rows,
  ))
  for r in results:
    time_ok = r["time_ratio"] <= GOAL_TIME_RATIO
    plain_temp, noise_temp = r["temp_bytes"][PLAIN], r["temp_bytes"][NOISE]
    print(f"{r['model']}: time {r['time_ratio']:.3f}x (goal <= {GOAL_TIME_RATIO}x:"
          f" {'met' if time_ok else 'missed'}), temp bytes {plain_temp} -> {noise_temp}"
          f" ({noise_temp - plain_temp:+d} B, {noise_temp / plain_temp - 1:+.2%})")
  path = write_json("noise_quick" if args.quick else "noise",
                    {"environment": environment(), "args": vars(args), "results": results})
  print(f"wrote {path}")
  return 0


def _args(model: tuple[Callable, Any, Any], num_microbatches: int) -> tuple[Any, ...]:
  loss, params, batch = model
  return loss, num_microbatches, params, batch


if __name__ == "__main__":
  sys.exit(main())
