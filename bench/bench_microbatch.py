"""Microbatching inside one step: peak memory, step time, compiles, collectives.

On an MLP whose full-batch step is dominated by its activations, four ways of
taking the gradient of one batch, side by side, for several numbers of
microbatches N:

- ``full batch``: ``jax.value_and_grad`` of the whole batch (one row, no N);
- ``lax.scan``: the hand-written loop a user would write: the batch reshaped to
  ``(N, B/N, ...)``, ``jax.value_and_grad`` inside a ``lax.scan`` body, the
  results summed and divided by N;
- ``optax.microbatching``: ``optax.microbatching.microbatch(jax.value_and_grad(
  loss), argnums=1, microbatch_size=B/N, accumulator=MEAN)`` (a ``fori_loop``);
- ``accum_jax``: ``accum_jax.value_and_grad(loss, num_microbatches=N)``.

Measured:

- peak step memory, each (method, N) in a fresh process (``_common.
  fresh_process_peak``): on CPU the growth of the resident set during one step,
  on GPU the allocator's ``peak_bytes_in_use`` over ``bytes_in_use`` before
  it; with XLA's compiled ``memory_analysis()`` temp bytes beside it; on a
  CPU of several cores, ``lax.scan`` and ``accum_jax`` at N = 8 once more
  under each of ``CPU_CONDITIONS`` (the worker on one core; XLA:CPU's
  memory-first schedule);
- step time: the median of calls blocked on, all (method, N) taking turns in
  this process on one device;
- compile time (``lower`` + ``compile``) against N;
- collectives per step with the batch sharded over 8 (fake CPU) devices, in
  a subprocess started with ``--xla_force_host_platform_device_count=8``:
  inside the loop (run N times) and outside it.

Run from the repository root::

  python bench/bench_microbatch.py            # full run, 1 to 3 minutes on 2 CPU cores
  python bench/bench_microbatch.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
    RESULTS_DIR,
    cost_analysis,
    environment,
    fresh_process_peak,
    markdown_table,
    memory_analysis_dict,
    print_worker_result,
    quartiles,
    run_json_worker,
    time_interleaved,
    tree_nbytes,
    write_json,
)

import accum_jax
from accum_jax.testing import collective_counts, opcode_counts

FULL = "full batch"
SCAN = "lax.scan"
OPTAX = "optax.microbatching"
ACCUM = "accum_jax"
MICROBATCHED = (SCAN, OPTAX, ACCUM)
STRIDED_SCAN = "lax.scan, strided split"  # only in the collectives table
# Only at TARGET_N: accum_jax without its finiteness check, which the
# hand-written scan does not make either.
ACCUM_NO_CHECK = "accum_jax on_nonfinite='unchecked'"

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

# The targets, at TARGET_N microbatches.
TARGET_N = 8
TARGET_MEMORY_VS_FULL = 0.25  # accum_jax peak <= 25% of the full batch's
TARGET_MEMORY_VS_SCAN = 1.00  # and no more than the hand-written scan's
TARGET_TIME_VS_SCAN = 1.10  # step time within 10% of the hand-written scan's
TARGET_TIME_VS_OPTAX = 1.0  # and no slower than optax.microbatching

DOCS_PLOT = Path(__file__).resolve().parent.parent / "docs" / "microbatch.png"
_MIB = 2**20


# The model: num_layers ReLU layers of width x width, a linear head, MSE.


def _shapes(batch_size: int, width: int, num_layers: int) -> tuple[Any, Any]:
  layers = [{"w": (width, width), "b": (width,)} for _ in range(num_layers)]
  params = [*layers, {"w": (width, 1), "b": (1,)}]
  return params, {"x": (batch_size, width), "y": (batch_size, 1)}


def _is_shape(x: Any) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_inputs(batch_size: int, width: int, num_layers: int, seed: int = 0):
  """Parameters and batch on the device, made with NumPy (no eager jax op, no temporary)."""
  rng = np.random.default_rng(seed)

  def fill(path, shape):
    if jax.tree_util.keystr(path).endswith("['b']"):
      return np.zeros(shape, np.float32)
    scale = shape[0] ** -0.5 if jax.tree_util.keystr(path).endswith("['w']") else 1.0
    return (scale * rng.standard_normal(shape)).astype(np.float32)

  params, batch = jax.tree.map_with_path(
      fill, _shapes(batch_size, width, num_layers), is_leaf=_is_shape
  )
  return jax.device_put(params), jax.device_put(batch)


def input_shapes(batch_size: int, width: int, num_layers: int, sharding=(None, None)):
  """``jax.ShapeDtypeStruct``s of ``make_inputs``' parameters and batch, to compile with.

  ``sharding``: the parameters' and the batch's shardings (None: unspecified).
  """
  return tuple(
      jax.tree.map(lambda shape, s=s: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s),
                   tree, is_leaf=_is_shape)
      for tree, s in zip(_shapes(batch_size, width, num_layers), sharding)
  )


def loss_fn(params: list[dict[str, jax.Array]], batch: dict[str, jax.Array]) -> jax.Array:
  h = batch["x"]
  for layer in params[:-1]:
    h = jax.nn.relu(h @ layer["w"] + layer["b"])
  prediction = h @ params[-1]["w"] + params[-1]["b"]
  return jnp.mean((prediction - batch["y"]) ** 2)


# The four ways. Each returns value_and_grad(params, batch) -> (loss, grads).


def full_batch(loss: Callable, num_microbatches: int, batch_size: int) -> Callable:
  del num_microbatches, batch_size
  return jax.value_and_grad(loss)


def hand_written_scan(
    loss: Callable, num_microbatches: int, batch_size: int, *, strided: bool = False
) -> Callable:
  """The obvious user code: scan over reshaped microbatches, sum, divide.

  ``strided=True`` takes rows ``i, i + N, i + 2N, ...`` as microbatch ``i``
  (as ``optax.microbatching`` does) instead of consecutive rows: with a sharded
  batch, every microbatch is then spread over all the devices.
  """
  del batch_size

  def split(x):
    if strided:
      return x.reshape(-1, num_microbatches, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(num_microbatches, -1, *x.shape[1:])

  def value_and_grad(params, batch):
    microbatches = jax.tree.map(split, batch)

    def body(total, microbatch):
      out = jax.value_and_grad(loss)(params, microbatch)
      return jax.tree.map(jnp.add, total, out), None

    zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), params))
    total, _ = jax.lax.scan(body, zeros, microbatches)
    return jax.tree.map(lambda x: x / num_microbatches, total)

  return value_and_grad


def optax_microbatching(loss: Callable, num_microbatches: int, batch_size: int) -> Callable:
  return optax.microbatching.microbatch(
      jax.value_and_grad(loss),
      argnums=1,
      microbatch_size=batch_size // num_microbatches,
      accumulator=optax.microbatching.AccumulationType.MEAN,
  )


def accum_jax_value_and_grad(
    loss: Callable, num_microbatches: int, batch_size: int, **options: Any
) -> Callable:
  del batch_size
  return accum_jax.value_and_grad(loss, num_microbatches, **options)


def accum_jax_without_check(loss: Callable, num_microbatches: int, batch_size: int) -> Callable:
  return accum_jax_value_and_grad(loss, num_microbatches, batch_size, on_nonfinite="unchecked")


METHODS: dict[str, Callable[..., Callable]] = {
    FULL: full_batch,
    SCAN: hand_written_scan,
    OPTAX: optax_microbatching,
    ACCUM: accum_jax_value_and_grad,
    ACCUM_NO_CHECK: accum_jax_without_check,
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


# On a CPU of several cores, XLA:CPU's default schedule favours running a step's
# independent kernels at once, and each large dot takes scratch memory of its
# own, outside the compiled buffers (on the 2-core development CPU, 5.9 MiB per
# 1024 x 1024 weight gradient). Whether two of them overlap follows from where
# that schedule's buffer assignment puts their outputs: two dots writing one
# buffer run one after the other. So the two methods are measured once more,
# one worker at a time, under two conditions that take the runtime's
# concurrency out of the comparison:
# - "one core": the worker pinned to one CPU runs the kernels one at a time;
# - "memory-first schedule": XLA:CPU schedules for memory instead of
#   concurrency (all cores), and both programs compile to the same buffers.
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


# Collectives: a subprocess with 8 fake CPU devices.


def collectives_worker(num_microbatches: int, batch_size: int, width: int, num_layers: int):
  """Compiles (never runs) each method with the batch sharded over 8 devices."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  num_devices = len(jax.devices())
  mesh = jax.make_mesh((num_devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  params, batch = input_shapes(
      batch_size, width, num_layers, (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))
  )
  result = {"num_devices": num_devices, "num_microbatches": num_microbatches, "methods": {}}
  variants = [(m, make, {}) for m, make in METHODS.items() if m != ACCUM_NO_CHECK]
  variants.insert(2, (STRIDED_SCAN, hand_written_scan, {"strided": True}))
  for method, make, options in variants:
    if method == ACCUM:
      options = {"data_parallel": accum_jax.DataParallel(
          mesh=mesh, data_axis="data", param_sharding=P())}
    fn = make(loss_fn, num_microbatches, batch_size, **options)
    compiled = jax.jit(fn).lower(params, batch).compile()
    hlo = compiled.as_text()
    counts = collective_counts(hlo)
    loops = 0 if method == FULL else num_microbatches
    ops = opcode_counts(hlo, "all")
    kinds = {op: ops[op] + ops[f"{op}-start"] for op in _COLLECTIVES}
    result["methods"][method] = {
        "in_loop": counts.in_loop,
        "outside_loop": counts.outside_loop,
        "per_step": counts.in_loop * loops + counts.outside_loop,
        "kinds": {op: k for op, k in kinds.items() if k},
        # XLA's count for one device's program: 1/num_devices of the full
        # batch's work when the step is data-parallel.
        "flops_per_device": cost_analysis(compiled).get("flops", float("nan")),
        "how": ("DataParallel(mesh, data_axis, P())" if method == ACCUM
                else "jit, batch sharded P('data')"),
    }
  # XLA counts a while loop's body once: a data-parallel loop body does 1/N of
  # the full batch's work per device, a body that replicates work more.
  full_flops = result["methods"][FULL]["flops_per_device"]
  for method, c in result["methods"].items():
    ideal = full_flops / (1 if method == FULL else num_microbatches)
    c["work_vs_data_parallel"] = c["flops_per_device"] / ideal
  print_worker_result(result)


def measure_collectives(model: dict[str, int], num_microbatches: int) -> dict[str, Any]:
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  command = [
      sys.executable, __file__, "--collectives-worker",
      "--batch-size", str(model["batch_size"]), "--width", str(model["width"]),
      "--num-layers", str(model["num_layers"]), "--ns", str(num_microbatches),
  ]
  return run_json_worker(command, env={"XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"})


# Time and compile, in this process.


def measure_time(
    configs: list[tuple[str, int]],
    model: dict[str, int],
    *,
    rounds: int,
    warmup: int,
    compile_repeats: int,
) -> dict[tuple[str, int], dict[str, Any]]:
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


def _targets(rows: dict[tuple[str, int], dict[str, Any]], n: int) -> list[dict[str, Any]]:
  if (ACCUM, n) not in rows:
    return []
  accum, scan, optax_, full = rows[ACCUM, n], rows[SCAN, n], rows[OPTAX, n], rows[FULL, 1]

  def check(name, measured, limit):
    return {"target": name, "limit": limit, "measured": measured, "met": measured <= limit}

  return [
      check(f"peak memory N={n} / full batch", accum["peak_bytes"] / full["peak_bytes"],
            TARGET_MEMORY_VS_FULL),
      check(f"peak memory N={n} / lax.scan", accum["peak_bytes"] / scan["peak_bytes"],
            TARGET_MEMORY_VS_SCAN),
      *[check(f"peak memory N={n} / lax.scan, {name}",
              accum["peak_bytes_under"][name] / scan["peak_bytes_under"][name],
              TARGET_MEMORY_VS_SCAN) for name in accum.get("peak_bytes_under", {})],
      check(f"step time N={n} / lax.scan", accum["step_ms"] / scan["step_ms"],
            TARGET_TIME_VS_SCAN),
      check(f"step time N={n} / optax.microbatching", accum["step_ms"] / optax_["step_ms"],
            TARGET_TIME_VS_OPTAX),
  ]


def report(config: dict[str, Any], rows: dict[tuple[str, int], dict[str, Any]],
           collectives: dict[str, Any], targets: list[dict[str, Any]]) -> None:
  on_gpu = config["platform"] == "gpu"
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
  print(
      f"MLP: {config['num_layers']} x ReLU({config['width']}x{config['width']}) + head,"
      f" batch {config['batch_size']}; {env['backend']} ({env['devices'][0]}),"
      f" {env['cpu_count']} CPUs, load average at start {env['load_average']};"
      f" {config['rounds']} timed rounds (median), interleaved"
  )
  how = rows[FULL, 1]["memory"]["method"]
  print(f"peak step memory: fresh process per row, {how}")
  if not on_gpu:
    print("on CPU, compare ratios: absolute times depend on the load from other processes")
  print()
  print(markdown_table(headers, table))
  under = [(m, r) for (m, n), r in rows.items() if "peak_bytes_under" in r]
  for name in CPU_CONDITIONS if under else ():
    print(f"peak step MiB, {name} (XLA temp MiB):", ", ".join(
        f"{m} N={r['num_microbatches']} {r['peak_bytes_under'][name] / _MIB:.1f}"
        f" ({r['memory_under'][name]['xla'].get('temp_bytes', float('nan')) / _MIB:.1f})"
        for m, r in under))

  print()
  accum_ns = [n for n in config["ns"] if (ACCUM, n) in rows]
  base = rows[ACCUM, accum_ns[0]]["compile_s_median"]
  print(markdown_table(
      ["accum_jax N", "compile s (median)", f"vs N={accum_ns[0]}"],
      [[n, f"{rows[ACCUM, n]['compile_s_median']:.3f}",
        f"{rows[ACCUM, n]['compile_s_median'] / base:.2f}"] for n in accum_ns],
  ))

  print()
  print(f"collectives with the batch sharded over {collectives['num_devices']} CPU devices,"
        f" N={collectives['num_microbatches']} (static count in the compiled HLO; per step ="
        " in loop x N + outside; XLA counts a loop body's FLOPs once, so 'vs data-parallel'"
        " compares the body with 1/N of the full batch's per-device work):")
  print(markdown_table(
      ["method", "how", "in loop", "outside loop", "per step", "kinds (in the HLO)",
       "GFLOP/device (loop body once)", "vs data-parallel"],
      [[m, c["how"], c["in_loop"], c["outside_loop"], c["per_step"],
        ", ".join(f"{op} {k}" for op, k in c["kinds"].items()) or "none",
        f"{c['flops_per_device'] / 1e9:.4g}", f"{c['work_vs_data_parallel']:.2f}"]
       for m, c in collectives["methods"].items()],
  ))

  if targets:
    print()
    print(markdown_table(
        ["target (accum_jax)", "limit", "measured", "met"],
        [[t["target"], f"<= {t['limit']:.2f}", f"{t['measured']:.3f}",
          "yes" if t["met"] else "NO"] for t in targets],
    ))


def plot(config: dict[str, Any], rows: dict[tuple[str, int], dict[str, Any]],
         path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ns = config["ns"]
  fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
  full = rows[FULL, 1]
  styles = {SCAN: ("tab:blue", "o", "-"), OPTAX: ("tab:orange", "s", "-"),
            ACCUM: ("tab:green", "^", "--")}
  for ax, key, scale, ylabel in (
      (mem_ax, "peak_bytes", 1 / _MIB, "peak step memory (MiB)"),
      (time_ax, "step_ms", 1.0, "step time (ms, median)"),
  ):
    ax.axhline(full[key] * scale, color="gray", linestyle=":", label=f"{FULL} (no N)")
    for method, (color, marker, line) in styles.items():
      values = [rows[method, n][key] * scale for n in ns]
      ax.plot(ns, values, color=color, marker=marker, linestyle=line, label=method)
      if key == "step_ms":  # the spread of the timed calls: first to third quartile
        low, high = zip(*(rows[method, n]["step_ms_p25_p75"] for n in ns))
        ax.fill_between(ns, low, high, color=color, alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("number of microbatches N")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
  how = "device peak_bytes_in_use" if config["platform"] == "gpu" else "resident-set growth"
  mem_ax.set_title(f"peak memory of one step ({how}, fresh process)", fontsize=10)
  time_ax.set_title("time of one step (median and quartiles, interleaved)", fontsize=10)
  mem_ax.legend(fontsize=8)
  env = config["environment"]
  fig.suptitle(
      f"{config['num_layers']} x {config['width']}-wide ReLU MLP, batch {config['batch_size']},"
      f" {env['backend']} ({env['cpu_count']} CPUs)" if env["backend"] == "cpu" else
      f"{config['num_layers']} x {config['width']}-wide ReLU MLP, batch {config['batch_size']},"
      f" {env['devices'][0]}",
      fontsize=10,
  )
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)


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
  parser.add_argument("--name", default=None, help="results bench/results/<name>.json/.png"
                      " (default: microbatch, or microbatch_quick with --quick)")
  parser.add_argument("--collectives-worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.quick:
    args.batch_size, args.width, args.num_layers = 512, 64, 2
    args.ns, args.rounds, args.compile_repeats = [1, TARGET_N], 3, 1
  model = {"batch_size": args.batch_size, "width": args.width, "num_layers": args.num_layers}
  if args.collectives_worker:
    collectives_worker(args.ns[0], **model)
    return 0
  if bad := [n for n in args.ns if args.batch_size % (8 * n)]:
    parser.error(f"--batch-size={args.batch_size} must divide into 8 devices x N for N in {bad}.")
  name = args.name or ("microbatch_quick" if args.quick else "microbatch")

  start = time.perf_counter()
  configs = configurations(args.ns)
  collective_n = TARGET_N if TARGET_N in args.ns else args.ns[-1]
  # The workers first, while this process has not yet touched the device. The
  # collectives worker only compiles, so it runs beside the memory workers.
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    collectives_future = pool.submit(measure_collectives, model, collective_n)
    memory = measure_memory(configs, model, args.jobs)
    under = {}
    if memory[FULL, 1]["platform"] == "cpu" and TARGET_N in args.ns and len(
        os.sched_getaffinity(0)) > 1:
      under = measure_conditions(model)
    collectives = collectives_future.result()
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
  targets = _targets(rows, TARGET_N)
  params, _ = input_shapes(**model)
  config = {
      **model,
      "ns": args.ns,
      "rounds": args.rounds,
      "warmup": args.warmup,
      "compile_repeats": args.compile_repeats,
      "param_bytes": tree_nbytes(params),
      "batch_bytes": args.batch_size * (args.width + 1) * 4,
      "platform": jax.devices()[0].platform,
      "quick": args.quick,
      "command": " ".join(sys.argv),
      "environment": environment(),
      "memory_seconds": memory_seconds,
  }
  config["total_seconds"] = time.perf_counter() - start
  config["load_average_end"] = environment()["load_average"]
  report(config, rows, collectives, targets)

  path = write_json(name, {
      "config": config,
      "results": [{"label": label(*c), **r} for c, r in rows.items()],
      "collectives": collectives,
      "targets": targets,
  })
  png = RESULTS_DIR / f"{name}.png"
  plot(config, rows, png)
  written = [path, png]
  if not args.quick and args.name is None:
    DOCS_PLOT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(png, DOCS_PLOT)
    written.append(DOCS_PLOT)
  print(f"\nwrote {', '.join(str(p) for p in written)} in {config['total_seconds']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
