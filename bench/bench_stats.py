"""A loss of whole-batch statistics: exactness and cost against plain accumulation.

The model is the tests' two-layer top-2 mixture of experts (``tests/moe_model.py``)
with the Switch/GShard load-balancing loss, tokens sorted by source as a packing
loader delivers them, token masks. For each N:

* deviation from the full batch (``jax.value_and_grad`` of the whole batch's loss
  plus the balance loss of its statistics), as the largest difference relative to
  the largest entry, on the first layer's router gradient:
  ``stats_value_and_grad`` against plain ``value_and_grad`` of the per-microbatch
  total loss (each microbatch balanced on its own, as MaxText does);
* the same for the balance term's gradient alone, plain: what the per-microbatch
  balance gets wrong, without the cross-entropy beside it;
* step time of the two, compiled once and timed interleaved in one process
  (median of rounds): the price of the statistics pass.

Run: ``python bench/bench_stats.py [--batch 256] [--ns 2 8 32 64] [--rounds 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from _common import environment, markdown_table, write_json

import accum_jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import moe_model as moe  # noqa: E402


def full_batch_loss(params, batch):
  loss, stats = moe.loss_and_stats(params, batch)
  return loss + moe.balance_loss(stats)


def per_microbatch_loss(params, batch):
  return full_batch_loss(params, batch)


def balance_term(params, batch):
  return moe.balance_loss(moe.loss_and_stats(params, batch)[1])


def router(grads):
  return grads["layers"][0]["router"]


def deviation(grads, reference) -> float:
  return float(jnp.max(jnp.abs(router(grads) - router(reference))) /
               jnp.max(jnp.abs(router(reference))))


def steps(n: int) -> dict:
  return {
      "stats_value_and_grad": jax.jit(accum_jax.stats_value_and_grad(
          moe.loss_and_stats, moe.balance_loss, n, weight_fn=moe.tokens_of)),
      "value_and_grad, per-microbatch balance": jax.jit(accum_jax.value_and_grad(
          per_microbatch_loss, n, weight_fn=moe.tokens_of)),
  }


def measure(params, batch, n: int, rounds: int, reference) -> dict:
  compiled = {name: step.lower(params, batch).compile() for name, step in steps(n).items()}
  result = {name: {"deviation": deviation(step(params, batch)[1], reference[0])}
            for name, step in compiled.items()}
  plain_balance = jax.jit(accum_jax.grad(balance_term, n, weight_fn=moe.tokens_of))
  result["balance term, plain"] = {"deviation": deviation(plain_balance(params, batch),
                                                          reference[1])}
  times: dict[str, list[float]] = {name: [] for name in compiled}
  for r in range(rounds):
    names = list(compiled)
    for name in names[r % 2:] + names[:r % 2]:
      start = time.perf_counter()
      jax.block_until_ready(compiled[name](params, batch))
      times[name].append(time.perf_counter() - start)
  for name in compiled:
    result[name]["step_seconds"] = statistics.median(times[name])
  return result


def main(batch_size: int, ns: list[int], rounds: int) -> dict:
  params, batch = moe.init_params(), moe.make_batch(batch_size)
  reference = (jax.jit(jax.grad(full_batch_loss))(params, batch),
               jax.jit(jax.grad(balance_term))(params, batch))
  results = {n: measure(params, batch, n, rounds, reference) for n in ns}
  ours, plain = "stats_value_and_grad", "value_and_grad, per-microbatch balance"
  rows = [[
      n, f"{r[ours]['deviation']:.1e}", f"{r[plain]['deviation']:.1%}",
      f"{r['balance term, plain']['deviation']:.1%}",
      f"{r[ours]['step_seconds'] * 1e3:.1f}", f"{r[plain]['step_seconds'] * 1e3:.1f}",
      f"{r[ours]['step_seconds'] / r[plain]['step_seconds']:.2f}",
  ] for n, r in results.items()]
  print(f"MoE, {moe.LAYERS} layers of {moe.EXPERTS} experts, top-{moe.TOP_K}, batch"
        f" {batch_size} x {moe.SEQ} tokens; router gradient against the full batch")
  print(markdown_table(
      ["N", "deviation, stats door", "deviation, plain", "plain, balance term alone",
       "stats door ms", "plain ms",
       "time, stats door / plain"], rows))
  write_json("stats", {"environment": environment(), "batch": batch_size, "rounds": rounds,
                       "results": results})
  return results


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--ns", type=int, nargs="+", default=[2, 8, 32, 64])
  parser.add_argument("--rounds", type=int, default=20)
  args = parser.parse_args()
  main(args.batch, args.ns, args.rounds)
