"""A GPT-2-small Transformer on one GPU: microbatching inside a step and across calls.

The model (``gpu_model.py``) is a decoder-only Transformer in Flax NNX, GPT-2
small's size (124M parameters, bfloat16, a float32 loss), on random tokens; causal
attention asks for cuDNN's fused kernel on a GPU where it compiles
(``--attention``). This script reads the arguments, runs the sections, prints
the tables and writes the JSON; each section lives in its own module:

- ``gpu_methods.py``: inside one step, the ways of taking a batch of N x micro
  sequences' gradient (accum_jax's ``value_and_grad``, the hand-written
  ``lax.scan``, the full batch) and the check of the door against the scan (the
  script exits 1 if they differ by more than bfloat16 rounding);
- ``gpu_step.py``: for each (N, micro) (``--ns``, ``--micro``), the step time,
  the methods taking turns in rounds, median; the compile time and XLA's static
  memory; the peak memory of one step in a fresh process;
- ``gpu_across.py``: across calls, ``accum_jax.accumulate(optax.adamw(1e-4),
  every_k=N)`` against ``optax.MultiSteps``, timed per call and per window of N;
  and the rows of ``--quick`` below;
- ``gpu_fit.py``: the largest full batch that fits (on a GPU, or with ``--fit``),
  then a batch ``--fit-factor`` times as large, microbatched;
- ``bench_loop.py``: the training loop users run (``--quick``, or ``--sections
  loop``): many calls, each handed a fresh slice of a host NumPy array, nothing
  blocked on until the end; samples per second against the hand-written loops';
- ``gpu_tables.py``: the full run's tables; ``gpu_records.py``: --quick's one
  table of both doors, and an earlier run's figures beside it (``--compare``);
- ``gpu_budget.py``: ``--budget`` (seconds, default 540) stops starting new
  configurations once spent, so the run ends, with its JSON written, inside a
  10-minute job; ``gpu_failures.py``: a configuration that runs out of memory is
  recorded as OOM and the run goes on.

``--quick``, the GPU check in one call (under 4.5 minutes on one GPU, ``--budget``
245 s): one table for both doors, no memory workers, no compilation cache (compile
times are figures of the check) and no fit. Inside a step, at N x micro of 8x1,
8x4 and 16x1: the default ``value_and_grad``, ``on_nonfinite="skip_microbatch"``,
``on_nonfinite="unchecked"``, the hand-written scan and the full batch, with step time,
compile time (after a warm-up compile of one microbatch's gradient, once per
microbatch size) and static memory (temp + output). Across calls, every_k=8, in
the form users write (the gradient of one sequence and the update in one jit),
each per micro-step and per window of 8: the acc-only floor (the gradient and a
float32 add per leaf), the interface's floor (the same, AdamW's state passed
through untouched), ``accumulate(adamw)`` on the host schedule (``apply=False``
on 7 calls, ``apply=True`` on the 8th: two compiled programs) and on the device
schedule (``apply`` left out), a hand-written ``lax.cond`` accumulator, a plain
AdamW step, ``optax.MultiSteps(adamw)`` and ``accumulate(optax.flatten(adamw))``
on the host schedule. Micro-steps are set against the interface's floor, windows
against MultiSteps'. Then the training loop (``bench_loop.py``), a few rounds of 2
windows of 8 sequences: across calls the hand-written two-jit modulo loop (the
floor), ``accumulate(adamw)`` with ``apply=HostSchedule.next()`` (also with
``on_nonfinite="unchecked"``, and around ``optax.flatten(adamw)``), the device schedule,
``optax.MultiSteps``; inside a step the hand-written scan and ``value_and_grad``,
each + AdamW, a batch of 8 sequences a call; then the full batch and the update in
a jit of its own, as the budget allows. ``--compare PATH`` puts the figures of an
earlier run's JSON beside the rows it has, naming its card and commit.

Run from the repository root::

  PYTHONPATH=. python bench/bench_gpu.py          # GPT-2 small on a GPU, bench/results/gpu.json
  PYTHONPATH=. python bench/bench_gpu.py --ns 1 8 --micro 8 32 --no-memory   # a part of it
  python bench/bench_gpu.py --tiny                # 2 layers of width 64 on a CPU, about a minute
  PYTHONPATH=. python bench/bench_gpu.py --quick --compare ../shared/gpu/h200-bench_gpu-d1c9549.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# This process and the fresh processes it starts share the device: each takes
# memory as it needs it instead of 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
from _common import RESULTS_DIR, environment, git_commit, tree_nbytes, write_json  # noqa: E402
from bench_loop import host_tokens  # noqa: E402
from bench_loop import measure as measure_loops  # noqa: E402
from bench_loop import print_report as print_loop_report  # noqa: E402
from gpu_across import measure_across_calls, measure_quick_across  # noqa: E402
from gpu_budget import Budget  # noqa: E402
from gpu_fit import measure_fit  # noqa: E402
from gpu_methods import FULL, GRAD_RTOL, LOSS_RTOL, METHOD_NAMES, QUICK_METHODS  # noqa: E402
from gpu_model import (  # noqa: E402
    GPT2_SMALL,
    TINY,
    Config,
    flops_per_token,
    make_loss,
    make_model,
    make_tokens,
    resolve_attention,
)
from gpu_records import goals, print_quick, records_of  # noqa: E402
from gpu_step import (  # noqa: E402
    QUICK_PAIRS,
    checks_of,
    measure_memory,
    measure_steps,
    memory_jobs,
    step_configurations,
)
from gpu_tables import across_calls_table, fit_table, header, step_tables  # noqa: E402


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tiny", action="store_true",
                      help="2 layers of width 64, vocabulary 256, context 32: a CPU smoke run")
  parser.add_argument("--tiny-off-gpu", action="store_true",
                      help="GPT-2 small on a GPU, the --tiny configuration elsewhere")
  parser.add_argument("--quick", action="store_true",
                      help="the GPU check, both doors in one table, in under 4.5 minutes:"
                      " N x micro of 8x1, 8x4 and 16x1, across calls, the training loop;"
                      " no memory workers")
  parser.add_argument("--compare", default=None, metavar="PATH",
                      help="a JSON of this script (e.g. an earlier card or commit): its figures"
                      " beside today's where the rows match")
  parser.add_argument("--ns", type=int, nargs="+", default=None,
                      help="numbers of microbatches (default 1 2 4 8 16; --tiny 1 4)")
  parser.add_argument("--micro", type=int, nargs="+", default=None,
                      help="sequences per microbatch (default 1 2 4 8 16 32; --tiny 4)")
  parser.add_argument("--rounds", type=int, default=None,
                      help="timed calls (windows across calls) of each (default 10; --tiny 5)")
  parser.add_argument("--max-batch", type=int, default=512,
                      help="skip (N, micro) with N x micro above this (default 512)")
  parser.add_argument("--no-memory", action="store_true",
                      help="skip the fresh-process peak memory measurements")
  parser.add_argument("--fit", action="store_true",
                      help="search the largest batch that fits also off a GPU")
  parser.add_argument("--fit-cap", type=int, default=None,
                      help="largest full batch tried (default 512; --tiny 64)")
  parser.add_argument("--fit-factor", type=int, default=4,
                      help="the microbatched batch is this many times the largest (default 4)")
  parser.add_argument("--sections", nargs="+", choices=("step", "across_calls", "loop", "fit"),
                      default=None, help="what to run (default step across_calls fit, fit only"
                      " on a GPU or with --fit; --quick: step across_calls loop)")
  parser.add_argument("--attention", choices=("auto", "cudnn", "xla", "manual"), default="auto",
                      help="auto: cuDNN's fused kernel on a GPU where it compiles, else XLA's")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds after which no new configuration starts (0: no limit;"
                      " default 540, --quick 245)")
  parser.add_argument("--jobs", type=int, default=None,
                      help="memory workers at once (default 2 on CPU, 1 on GPU)")
  parser.add_argument("--worker-timeout", type=float, default=300,
                      help="seconds before a memory worker is stopped (default 300)")
  parser.add_argument("--compile-cache", default=None,
                      help="persistent compilation cache shared with the memory workers"
                      " (default on GPU bench/results/jax_cache, none on CPU; '' for none)")
  parser.add_argument("--name", default=None,
                      help="results bench/results/<name>.json (default gpu, or gpu_quick)")
  return parser


@dataclasses.dataclass
class Run:
  """One run: its settings, read once from the arguments, and its output as it grows."""

  args: argparse.Namespace
  model: Config
  on_gpu: bool
  ns: list[int]
  pairs: list[tuple[int, int]]
  rounds: int
  fit_cap: int
  name: str
  budget: Budget
  output: dict[str, Any]
  before: dict[str, Any] | None  # --compare's JSON

  @property
  def config(self) -> dict[str, Any]:
    return self.output["config"]

  def save(self) -> Path:
    self.config["total_seconds"] = time.perf_counter() - self.budget.start
    return write_json(self.name, self.output)


def _start(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Run:
  """The arguments' defaults resolved, the compilation cache set, the JSON's config."""
  platform = jax.default_backend()
  on_gpu = platform == "gpu"
  if args.tiny_off_gpu and not on_gpu:
    print(f"no GPU ({platform}): the --tiny configuration")
    args.tiny = True
  model = TINY if args.tiny else GPT2_SMALL
  if args.sections is None:
    args.sections = ["step", "across_calls", "loop" if args.quick else "fit"]
  if args.quick:
    # Compile times are figures of the check: no cache may answer for a compile.
    args.no_memory = True
    args.sections = [x for x in args.sections if x != "fit"]
    args.compile_cache = "" if args.compile_cache is None else args.compile_cache
  ns = args.ns or ([1, 4] if args.tiny else [1, 2, 4, 8, 16])
  micros = args.micro or ([4] if args.tiny else [1, 2, 4, 8, 16, 32])
  rounds = args.rounds or (5 if args.tiny else 10)
  fit_cap = args.fit_cap or (64 if args.tiny else 512)
  if min(ns + micros) < 1 or rounds < 1:
    parser.error("--ns, --micro and --rounds must be >= 1")
  name = args.name or ("gpu_check" if args.quick else "gpu_quick" if args.tiny else "gpu")
  if args.quick and args.tiny and not args.name:
    name = "gpu_check_tiny"
  seconds = args.budget if args.budget is not None else (245 if args.quick else 540)
  budget = Budget(seconds, Budget.QUICK_SHARES if args.quick else None)
  before = json.loads(Path(args.compare).read_text()) if args.compare else None

  cache = args.compile_cache
  if cache is None:
    cache = str(RESULTS_DIR / "jax_cache") if on_gpu else ""
  if cache:
    os.makedirs(cache, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache  # for the memory workers
    jax.config.update("jax_compilation_cache_dir", cache)
  attention = resolve_attention(args.attention, model)
  pairs, too_large = step_configurations(ns, micros, args.max_batch)
  if args.quick and not (args.ns or args.micro):
    pairs, too_large = list(QUICK_PAIRS), []

  device = jax.devices()[0]
  config: dict[str, Any] = {
      "model": dataclasses.asdict(model),
      "tiny": args.tiny,
      "tied_head": True,
      "dtype": "bfloat16 parameters and compute, float32 loss",
      "attention": attention,
      "quick": args.quick,
      "pairs": [list(p) for p in pairs],
      "ns": ns,
      "micro": micros,
      "rounds": rounds,
      "max_batch": args.max_batch,
      "skipped_too_large": [list(p) for p in too_large],
      "sections": args.sections,
      "fit": "fit" in args.sections and (on_gpu or args.fit),
      "memory": not args.no_memory and "step" in args.sections,
      "budget_s": seconds,
      "commit": git_commit(),
      "compile_cache": cache or None,
      "platform": platform,
      "device_kind": device.device_kind,
      "command": " ".join(sys.argv),
      "environment": environment(),
      "grad_rtol": GRAD_RTOL,
      "loss_rtol": LOSS_RTOL,
  }
  output = {"config": config, "results": [], "across_calls": [], "loop": {}, "fit": None}
  return Run(args=args, model=model, on_gpu=on_gpu, ns=ns, pairs=pairs, rounds=rounds,
             fit_cap=fit_cap, name=name, budget=budget, output=output, before=before)


def _step_section(run: Run, loss: Any, params: Any) -> None:
  """Inside a step: peak memory (fresh processes), then time and exactness; the tables."""
  args, config = run.args, run.config
  memory: dict[tuple[str, int, int], dict[str, Any]] = {}
  if config["memory"]:
    print("\npeak memory of one step, a fresh process each:", flush=True)
    jobs = args.jobs or (1 if run.on_gpu else 2)
    start = time.perf_counter()
    memory = measure_memory(memory_jobs(run.pairs), tiny=args.tiny,
                            attention=config["attention"], workers=jobs, budget=run.budget,
                            timeout=args.worker_timeout)
    config["memory_seconds"] = time.perf_counter() - start
  print("\nstep time, the methods taking turns:", flush=True)
  rows = measure_steps(run.pairs, loss, params, run.model, rounds=run.rounds, budget=run.budget,
                       on_group=run.save, methods=QUICK_METHODS if args.quick else None,
                       warmup_compile=args.quick)
  for (n, micro), row in rows.items():
    for method in METHOD_NAMES:
      key = (FULL, 1, n * micro) if method == FULL else (method, n, micro)
      if key in memory:
        row["methods"].setdefault(method, {})["memory"] = memory[key]
  run.output["results"] = list(rows.values())
  run.save()
  if not args.quick:
    _print_step_tables(run, memory)


def _print_step_tables(run: Run, memory: dict[tuple[str, int, int], dict[str, Any]]) -> None:
  time_table, memory_table = step_tables(run.config, run.output["results"])
  print()
  print("gradient of one batch (N x micro sequences): step time, median ms; vs = accum_jax's"
        " time / the other's; rel diff = largest |difference| / largest |entry| of any leaf,"
        f" float32 (match: loss <= {LOSS_RTOL:g}, grad <= {GRAD_RTOL:g})")
  if not run.on_gpu:
    print("on CPU, compare ratios: absolute times depend on the load from other processes")
  print(time_table)
  if run.config["memory"]:
    how = next((m["method"] for m in memory.values() if m.get("status") == "ok"), "-")
    print()
    print(f"peak memory of one step, fresh process per cell: {how}; XLA temp ="
          " compiled.memory_analysis().temp_size_in_bytes")
    print(memory_table)


def _quick_across_section(run: Run, loss: Any, params: Any) -> None:
  print("\nacross calls, every_k=8, the gradient of one sequence and the update in one jit:",
        flush=True)
  # The form users write: the standalone form (a fixed gradient handed to each
  # call) told nothing these rows do not, at the cost of compiling every row twice.
  run.output["quick_across"] = {"combined": measure_quick_across(
      params, loss, make_tokens(1, run.model, seed=1), every_k=8, rounds=run.rounds,
      budget=run.budget)}
  run.save()


# The loop section: rounds of LOOP_WINDOWS windows of 8 calls (one sequence each) per loop.
LOOP_ROUNDS = 5
LOOP_WINDOWS = 2


def _loop_section(run: Run, loss: Any, params: Any) -> None:
  rounds = min(run.rounds, LOOP_ROUNDS)
  print(f"\nthe training loop, every_k=8, one sequence a call from a host NumPy array,"
        f" {rounds} rounds of {LOOP_WINDOWS} windows:", flush=True)
  run.config["loop"] = {"rounds": rounds, "windows": LOOP_WINDOWS, "micro": 1}
  data = host_tokens(16 * 8, run.model.context, run.model.vocab, seed=2)
  run.output["loop"] = measure_loops(loss, params, data, micro=1, rounds=rounds,
                                     windows=LOOP_WINDOWS,
                                     should_start=lambda: run.budget.left("loop"))
  run.save()
  if not run.args.quick:  # --quick prints them beside its one table
    print_loop_report(run.output["loop"])


def _across_section(run: Run, params: Any) -> None:
  print("\nacross calls, AdamW on the model's bfloat16 parameters, donated:", flush=True)
  run.output["across_calls"] = measure_across_calls(run.ns, params, rounds=run.rounds,
                                                    budget=run.budget)
  run.save()
  if run.output["across_calls"]:
    print()
    print("accum_jax.accumulate(adamw, every_k) / optax.MultiSteps(adamw, every_k): median ms"
          " of a micro-step (accumulates only), of a window's last call, of a window")
    print(across_calls_table(run.output["across_calls"]))


def _fit_section(run: Run, loss: Any, params: Any) -> None:
  print("\nthe largest batch that fits:", flush=True)
  ran = [r["batch"] for r in run.output["results"]
         if r.get("methods", {}).get(FULL, {}).get("status") == "ok"]
  run.output["fit"] = fit = measure_fit(
      loss, params, run.model, known=max(ran, default=None), cap=run.fit_cap,
      factor=run.args.fit_factor, rounds=min(run.rounds, 5), budget=run.budget)
  run.save()
  print()
  largest = fit.get("largest_full_batch")
  print(f"largest full batch: {largest}"
        f"{' (the cap, --fit-cap; no OOM)' if fit.get('cap_reached') else ''}; then"
        f" {fit.get('batch', '-')} sequences microbatched, against the hand-written scan")
  print(fit_table(fit))


def _finish(run: Run) -> int:
  """The one table (--quick or --compare), the verdict, the JSON; 1 if a check failed."""
  output = run.output
  output["records"] = records_of(output)
  output["goals"] = goals(output["records"])
  if run.args.quick or run.before is not None:
    print_quick(output, run.before, run.args.compare)
  mismatches = [r for r in output["results"] if any(not c["match"] for c in checks_of(r))]
  if output["fit"] and output["fit"].get("exact") and not output["fit"]["exact"]["match"]:
    mismatches.append(output["fit"])
  output["all_match"] = not mismatches
  run.config["load_average_end"] = environment()["load_average"]
  path = run.save()
  print(f"\nwrote {path} in {run.config['total_seconds']:.0f} s")
  if mismatches:
    print(f"accum_jax differs from the hand-written scan in {len(mismatches)} configuration(s)")
    return 1
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = _parser()
  run = _start(parser.parse_args(argv), parser)
  config, sections = run.config, run.args.sections
  graphdef, params = make_model(run.model, config["attention"])
  config["param_count"] = sum(x.size for x in jax.tree.leaves(params))
  config["param_bytes"] = tree_nbytes(params)
  config["flops_per_token"] = flops_per_token(run.model, config["param_count"])
  print(header(config), flush=True)
  if config["skipped_too_large"]:
    print(f"skipped, batch above --max-batch {run.args.max_batch}: "
          + ", ".join(f"N={n} micro={m}" for n, m in config["skipped_too_large"]))
  loss = make_loss(graphdef)
  if "step" in sections:
    _step_section(run, loss, params)
  if "across_calls" in sections and run.args.quick:
    _quick_across_section(run, loss, params)
  if "across_calls" in sections and not run.args.quick:
    _across_section(run, params)
  if "loop" in sections:
    _loop_section(run, loss, params)
  if config["fit"]:
    _fit_section(run, loss, params)
  return _finish(run)


if __name__ == "__main__":
  sys.exit(main())
