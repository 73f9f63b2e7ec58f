"""Inside one step: the compiled memory of ``value_and_grad`` beside the hand-written scan's.

For a GPT-2-small-shaped bfloat16 tree (148 leaves, ``models.gpt2_tree`` at GPT-2
small's sizes) and a loss whose gradient takes no memory of its own (a weighted sum
of the parameters in float32, each leaf its own weight, times the microbatch's
mean), each program is compiled, not run, and its memory beyond its arguments
(``temp + output - alias``, XLA's ``memory_analysis``) is set beside the
hand-written scan's (``_common.hand_written_scan``): ``accum_jax.value_and_grad(
loss, N)`` with its defaults, with ``on_nonfinite="unchecked"`` (no check, as the
hand-written scan makes none) and with ``return_info=True`` (the loop of
``_loop``, which the defaults leave for the plain scan). Also counted: each
compiled program's fusions.

Run from the repository root::

  python bench/bench_step_memory.py                   # ~1 minute on 2 CPU cores
  python bench/bench_step_memory.py --name NAME       # writes bench/results/NAME.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import environment, hand_written_scan, memory_analysis_dict, write_json
from models import gpt2_tree

import accum_jax
from accum_jax import testing

GPT2_SMALL_TREE = {"layers": 12, "width": 768, "vocab": 50304, "context": 1024}
N, BATCH, FEATURES = 4, 16, 8


def _loss(params: Any, batch: jax.Array) -> jax.Array:
  leaves = jax.tree.leaves(params)
  weighted = sum(jnp.sum(x.astype(jnp.float32)) * (i + 1) for i, x in enumerate(leaves))
  return weighted * jnp.mean(batch) * 1e-6


def _programs() -> dict[str, Any]:
  hand = hand_written_scan(_loss, N)
  return {
      "hand-written lax.scan": hand,
      "value_and_grad": accum_jax.value_and_grad(_loss, N),
      'value_and_grad, on_nonfinite="unchecked"': accum_jax.value_and_grad(
          _loss, N, on_nonfinite="unchecked"),
      "value_and_grad, return_info=True": accum_jax.value_and_grad(_loss, N, return_info=True),
  }


def measure(sizes: dict[str, int] = GPT2_SMALL_TREE) -> dict[str, Any]:
  params = jax.eval_shape(lambda: gpt2_tree(**sizes))
  batch = jax.ShapeDtypeStruct((BATCH, FEATURES), jnp.float32)
  rows = {}
  for name, fun in _programs().items():
    compiled = jax.jit(fun).lower(params, batch).compile()
    xla = memory_analysis_dict(compiled)
    beyond = xla["temp_bytes"] + xla["output_bytes"] - xla["alias_bytes"]
    rows[name] = {"beyond_arguments_bytes": beyond, "xla": xla,
                  "kernels": testing.kernel_counts(compiled)._asdict()}
    print(f"  {name}: {beyond / 2**20:.1f} MiB, {rows[name]['kernels']}", flush=True)
  floor = rows["hand-written lax.scan"]["beyond_arguments_bytes"]
  for entry in rows.values():
    entry["vs_hand_written"] = entry["beyond_arguments_bytes"] / floor
  leaves = jax.tree.leaves(params)
  return {"tree": {**sizes, "leaves": len(leaves),
                   "parameter_bytes": int(sum(np.prod(x.shape) * 2 for x in leaves))},
          "num_microbatches": N, "rows": rows}


def table(result: dict[str, Any]) -> str:
  lines = ["| program | MiB beyond its arguments | vs hand-written | top-level fusions | copies |",
           "| --- | ---: | ---: | ---: | ---: |"]
  for name, entry in result["rows"].items():
    lines.append(f"| {name} | {entry['beyond_arguments_bytes'] / 2**20:.1f} |"
                 f" {entry['vs_hand_written']:.3f} | {entry['kernels']['fusions']} |"
                 f" {entry['kernels']['copies']} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--name", default="step-memory", help="bench/results/NAME.json")
  args = parser.parse_args(argv)
  report = {"environment": environment(), "memory": measure()}
  print(table(report["memory"]))
  print(f"wrote {write_json(args.name, report)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
