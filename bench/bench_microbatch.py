"""Microbatching inside one step: peak memory, step time, compile time.

On an MLP whose full-batch step is dominated by its activations, four ways of
taking the gradient of one batch, side by side, for several numbers of
microbatches N:

- ``full batch``: ``jax.value_and_grad`` of the whole batch (one row, no N);
- ``lax.scan``: the hand-written loop (``_common.hand_written_scan``);
- ``optax.microbatching``: ``optax.microbatching.microbatch(jax.value_and_grad(
  loss), argnums=1, microbatch_size=B/N, accumulator=MEAN)`` (a ``fori_loop``);
- ``accum_jax``: ``accum_jax.value_and_grad(loss, num_microbatches=N)``, and at N = 8
  also with ``on_nonfinite="unchecked"``.

Measured: the peak memory of one step, each (method, N) in a fresh process
(``_common.fresh_process_peak``: on a CPU the resident set's growth, on a GPU the
allocator's peak), with XLA's ``memory_analysis()`` beside it, and on a CPU of several
cores the scan and the door at N = 8 once more under each of ``CPU_CONDITIONS``; the
step time, all (method, N) taking turns in this process; and the compile time.

Run from the repository root::

  python bench/bench_microbatch.py            # full run, 1 to 3 minutes on 2 CPU cores
  python bench/bench_microbatch.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
    environment,
    fresh_process_peak,
    hand_written_scan,
    markdown_table,
    memory_analysis_dict,
    quartiles,
    time_interleaved,
    write_json,
)

import accum_jax

FULL = "full batch"
SCAN = "lax.scan"
OPTAX = "optax.microbatching"
ACCUM = "accum_jax"
MICROBATCHED = (SCAN, OPTAX, ACCUM)
# At TARGET_N only: accum_jax without its finiteness check, which the hand-written scan
# does not make either; and the scan and the door under each of CPU_CONDITIONS.
ACCUM_NO_CHECK = "accum_jax on_nonfinite='unchecked'"
TARGET_N = 8
_MIB = 2**20


# The model: num_layers ReLU layers of width x width, a linear head, MSE.


def make_inputs(batch_size: int, width: int, num_layers: int, seed: int = 0):
  """Parameters and batch on the device, made with NumPy (no eager jax op, no temporary)."""
  rng = np.random.default_rng(seed)

  def normal(*shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)

  def dense(n_in, n_out):
    return {"w": normal(n_in, n_out, scale=n_in**-0.5), "b": np.zeros(n_out, np.float32)}

  params = [dense(width, width) for _ in range(num_layers)] + [dense(width, 1)]
  batch = {"x": normal(batch_size, width), "y": normal(batch_size, 1)}
  return jax.device_put(params), jax.device_put(batch)


def loss_fn(params: list[dict[str, jax.Array]], batch: dict[str, jax.Array]) -> jax.Array:
  h = batch["x"]
  for layer in params[:-1]:
    h = jax.nn.relu(h @ layer["w"] + layer["b"])
  prediction = h @ params[-1]["w"] + params[-1]["b"]
  return jnp.mean((prediction - batch["y"]) ** 2)


# The ways. Each takes (loss, N, batch size) and returns value_and_grad(params, batch).


def optax_microbatching(loss: Callable, num_microbatches: int, batch_size: int) -> Callable:
  return optax.microbatching.microbatch(
      jax.value_and_grad(loss), argnums=1, microbatch_size=batch_size // num_microbatches,
      accumulator=optax.microbatching.AccumulationType.MEAN)


METHODS: dict[str, Callable[[Callable, int, int], Callable]] = {
    FULL: lambda loss, n, batch_size: jax.value_and_grad(loss),
    SCAN: lambda loss, n, batch_size: hand_written_scan(loss, n),
    OPTAX: optax_microbatching,
    ACCUM: lambda loss, n, batch_size: accum_jax.value_and_grad(loss, n),
    ACCUM_NO_CHECK: lambda loss, n, batch_size: accum_jax.value_and_grad(
        loss, n, on_nonfinite="unchecked"),
}


def build_step(
    method: str, num_microbatches: int, batch_size: int, width: int, num_layers: int
) -> tuple[Any, tuple[Any, Any]]:
  """The jitted step of one (method, N) and its arguments; the peak worker's builder."""
  params, batch = make_inputs(batch_size, width, num_layers)
  step = jax.jit(METHODS[method](loss_fn, num_microbatches, batch_size))
  return step, (params, batch)


def configurations(ns: list[int]) -> list[tuple[str, int]]:
  configs = [(FULL, 1)] + [(m, n) for n in ns for m in MICROBATCHED]
  if TARGET_N in ns:
    configs.append((ACCUM_NO_CHECK, TARGET_N))
  return configs


def label(method: str, n: int) -> str:
  return method if method == FULL else f"{method} N={n}"


# Peak memory: one fresh process per (method, N).


def measure_memory(
    configs: list[tuple[str, int]], model: dict[str, int], jobs: int, cpus: int | None = None,
    xla_flags: str | None = None,
) -> dict[tuple[str, int], dict[str, Any]]:
  def one(config):
    method, n = config
    return fresh_process_peak(
        "bench_microbatch:build_step", {"method": method, "num_microbatches": n, **model},
        cpus=cpus, xla_flags=xla_flags,
    )

  # Memory is per process, so workers may overlap; only their wall time is shared.
  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    return dict(zip(configs, pool.map(one, configs)))


# On a CPU of several cores, XLA:CPU's default schedule runs independent kernels at
# once, and each large dot takes scratch memory of its own outside the compiled
# buffers (5.9 MiB per 1024 x 1024 weight gradient on the 2-core development CPU):
# whether two overlap follows from where the buffer assignment puts their outputs. So
# the scan and the door are measured once more under two conditions that take the
# runtime's concurrency out: the worker on one core (kernels one at a time), and
# XLA:CPU's memory-first schedule (both compile to the same buffers).
CPU_CONDITIONS: dict[str, dict[str, Any]] = {
    "one core": {"cpus": 1},
    "memory-first schedule": {
        "xla_flags": "--xla_cpu_enable_concurrency_optimized_scheduler=false"},
}
CONDITION_METHODS = (SCAN, ACCUM)


def measure_conditions(model: dict[str, int]) -> dict[tuple[str, int], dict[str, Any]]:
  """Per (method, TARGET_N) of CONDITION_METHODS: {condition: the worker's result}."""
  configs = [(m, TARGET_N) for m in CONDITION_METHODS]
  by_condition = {name: measure_memory(configs, model, jobs=1, **how)
                  for name, how in CPU_CONDITIONS.items()}
  return {c: {name: results[c] for name, results in by_condition.items()} for c in configs}


# Time and compile, in this process.


def measure_time(configs: list[tuple[str, int]], model: dict[str, int], *, rounds: int,
                 warmup: int, compile_repeats: int) -> dict[tuple[str, int], dict[str, Any]]:
  params, batch = make_inputs(model["batch_size"], model["width"], model["num_layers"])
  results: dict[tuple[str, int], dict[str, Any]] = {c: {"compile_s": []} for c in configs}
  compiled = {}
  # Compiles take turns too; each is a new jit of a new function, so none is cached.
  for _ in range(compile_repeats):
    for method, n in configs:
      fn = jax.jit(METHODS[method](loss_fn, n, model["batch_size"]))
      start = time.perf_counter()
      compiled[method, n] = fn.lower(params, batch).compile()
      results[method, n]["compile_s"].append(time.perf_counter() - start)

  reference_loss, reference_grads = compiled[FULL, 1](params, batch)
  for config, step in compiled.items():
    value, grads = step(params, batch)
    results[config]["xla"] = memory_analysis_dict(step)
    results[config]["max_abs_grad_diff"] = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference_grads))
    )
    results[config]["loss_diff"] = abs(float(value - reference_loss))

  calls = {config: (lambda s=step: s(params, batch)) for config, step in compiled.items()}
  samples = time_interleaved(calls, rounds=rounds, warmup=warmup)
  for config, times in samples.items():
    results[config].update(
        step_ms=1e3 * statistics.median(times),
        step_ms_p25_p75=[1e3 * q for q in quartiles(times)],
        step_ms_samples=[1e3 * t for t in times],
        compile_s_median=statistics.median(results[config]["compile_s"]),
    )
  return results


# Report.


def report(config: dict[str, Any], rows: dict[tuple[str, int], dict[str, Any]]) -> None:
  full, scan_by_n = rows[FULL, 1], {n: rows[SCAN, n] for n in config["ns"]}
  headers = ["method", "N", "peak step MiB", "vs full", "vs lax.scan", "XLA temp MiB",
             "step ms", "vs lax.scan", "compile s", "max |grad diff|"]
  table = []
  for (method, n), r in rows.items():
    scan = scan_by_n.get(n, full) if method != FULL else full
    masked = " (masked)" if r["memory"].get("masked") else ""
    table.append([
        method, "-" if method == FULL else n,
        f"{r['peak_bytes'] / _MIB:.1f}{masked}",
        f"{r['peak_bytes'] / full['peak_bytes']:.3f}",
        "-" if method == FULL else f"{r['peak_bytes'] / scan['peak_bytes']:.3f}",
        f"{r['xla'].get('temp_bytes', float('nan')) / _MIB:.1f}",
        f"{r['step_ms']:.1f}",
        "-" if method == FULL else f"{r['step_ms'] / scan['step_ms']:.3f}",
        f"{r['compile_s_median']:.2f}",
        f"{r['max_abs_grad_diff']:.1e}",
    ])
  env = config["environment"]
  print(f"MLP: {config['num_layers']} x ReLU({config['width']}x{config['width']}) + head,"
        f" batch {config['batch_size']}; {env['backend']} ({env['devices'][0]}),"
        f" {env['cpu_count']} CPUs, load average at start {env['load_average']};"
        f" {config['rounds']} timed rounds (median), interleaved\npeak step memory: fresh"
        f" process per row, {rows[FULL, 1]['memory']['method']}")
  if config["platform"] != "gpu":
    print("on CPU, compare ratios: absolute times depend on the load from other processes")
  print()
  print(markdown_table(headers, table))
  under = [(m, r) for (m, n), r in rows.items() if "peak_bytes_under" in r]
  for name in CPU_CONDITIONS if under else ():
    print(f"peak step MiB, {name} (XLA temp MiB):", ", ".join(
        f"{m} N={r['num_microbatches']} {r['peak_bytes_under'][name] / _MIB:.1f}"
        f" ({r['memory_under'][name]['xla'].get('temp_bytes', float('nan')) / _MIB:.1f})"
        for m, r in under))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch-size", type=int, default=8192,
                      help="rows per step (default 8192; the issue's 16384 x 1024 takes"
                      " about 4 s a step on 2 CPU cores)")
  parser.add_argument("--width", type=int, default=512, help="hidden width (default 512)")
  parser.add_argument("--num-layers", type=int, default=4, help="hidden layers (default 4)")
  parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                      help="numbers of microbatches")
  parser.add_argument("--rounds", type=int, default=7, help="timed calls of each (median)")
  parser.add_argument("--warmup", type=int, default=1, help="untimed calls of each first")
  parser.add_argument("--compile-repeats", type=int, default=2,
                      help="compiles of each (median)")
  parser.add_argument("--jobs", type=int, default=2,
                      help="memory workers at once (memory is per process; default 2)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: batch 512, width 64, 2 layers, N in 1 and 8")
  parser.add_argument("--name", default=None, help="results bench/results/<name>.json"
                      " (default: microbatch, or microbatch_quick with --quick)")
  args = parser.parse_args(argv)
  if args.quick:
    args.batch_size, args.width, args.num_layers = 512, 64, 2
    args.ns, args.rounds, args.compile_repeats = [1, TARGET_N], 3, 1
  model = {"batch_size": args.batch_size, "width": args.width, "num_layers": args.num_layers}
  if bad := [n for n in args.ns if args.batch_size % n]:
    parser.error(f"--batch-size={args.batch_size} must divide into N microbatches for N in {bad}.")
  name = args.name or ("microbatch_quick" if args.quick else "microbatch")

  start = time.perf_counter()
  configs = configurations(args.ns)
  # The workers first, while this process has not yet touched the device.
  memory = measure_memory(configs, model, args.jobs)
  under = {}
  if memory[FULL, 1]["platform"] == "cpu" and TARGET_N in args.ns and len(
      os.sched_getaffinity(0)) > 1:
    under = measure_conditions(model)
  memory_seconds = time.perf_counter() - start
  timing = measure_time(configs, model, rounds=args.rounds, warmup=args.warmup,
                        compile_repeats=args.compile_repeats)

  rows = {}
  for c in configs:
    rows[c] = {"method": c[0], "num_microbatches": c[1], **timing[c],
               "peak_bytes": memory[c]["step_peak_bytes"], "memory": memory[c]}
    if c in under:
      rows[c].update(
          peak_bytes_under={name: r["step_peak_bytes"] for name, r in under[c].items()},
          memory_under=under[c])
  config = {
      **model, "ns": args.ns, "rounds": args.rounds, "warmup": args.warmup,
      "compile_repeats": args.compile_repeats,
      "param_bytes": 4 * (args.num_layers * (args.width + 1) * args.width + args.width + 1),
      "batch_bytes": args.batch_size * (args.width + 1) * 4,
      "platform": jax.devices()[0].platform, "quick": args.quick, "command": " ".join(sys.argv),
      "environment": environment(), "memory_seconds": memory_seconds,
  }
  config["total_seconds"] = time.perf_counter() - start
  config["load_average_end"] = environment()["load_average"]
  report(config, rows)

  path = write_json(name, {"config": config,
                           "results": [{"label": label(*c), **r} for c, r in rows.items()]})
  print(f"\nwrote {path} in {config['total_seconds']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
