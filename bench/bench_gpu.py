"""GPT-2 small on one GPU: both doors, the training loop, the largest batch that fits.

The sections, on ``models.GPT2_SMALL``: ``step`` (``gpu_step.py``, inside one step: the
hand-written scan, the door's three ways of judging non-finite data and the full batch,
timed, compiled, and the door checked against the scan: exit 1 beyond bfloat16
rounding); ``across_calls`` (``bench_micro_step.py``'s rows); ``loop`` (``bench_loop.py``'s
loops over plain arrays and ``nnx.State``, then its memory section);
``fit`` (``gpu_step.py``: the largest full batch that fits, then ``--fit-factor`` times
it microbatched; on a GPU, or with ``--fit``). ``gpu_report.py`` prints both doors in
one table (``--compare``: an earlier run's figures beside it) and the headline figures.
``--budget`` stops starting new work once a section's share is spent, so that a run
ends, its JSON written, inside a 10-minute job; a step out of memory is recorded OOM.
``--quick`` is the GPU check: step (8x1, 8x4, 16x1), across_calls and loop, 245 s.

Run from the repository root::

  PYTHONPATH=. python bench/bench_gpu.py --quick    # the GPU check: bench/results/gpu_check.json
  PYTHONPATH=. python bench/bench_gpu.py --quick --compare bench/figures/h200-quick-e76c363.json
  PYTHONPATH=. python bench/bench_gpu.py --sections fit     # the largest batch that fits
  python bench/bench_gpu.py --tiny --quick          # the same code on a CPU, a 2-layer model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import bench_loop
import jax
import models
from _common import Budget, environment, git_commit, tree_nbytes, write_json
from bench_micro_step import measure_rows
from gpu_report import fit_table, goals, header, print_report, records_of
from gpu_step import (
    FULL,
    GRAD_RTOL,
    LOSS_RTOL,
    QUICK_PAIRS,
    checks_of,
    measure_fit,
    measure_steps,
)
from models import Config, host_tokens, make_tokens

SECTIONS = ("step", "across_calls", "loop", "fit")
# The loop section: rounds of LOOP_WINDOWS windows of 8 calls (one sequence each) per loop.
LOOP_ROUNDS = 5
LOOP_WINDOWS = 2


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tiny", action="store_true",
                      help="2 layers of width 64, vocabulary 256, context 32: a CPU smoke run")
  parser.add_argument("--quick", action="store_true",
                      help="the GPU check in under 4.5 minutes: N x micro of 8x1, 8x4 and 16x1,"
                      " across calls, the training loop")
  parser.add_argument("--compare", default=None, metavar="PATH",
                      help="a JSON of this script (an earlier card or commit): its figures"
                      " beside today's where the rows match")
  parser.add_argument("--ns", type=int, nargs="+", default=None,
                      help="numbers of microbatches (default 1 2 4 8 16; --tiny 1 4)")
  parser.add_argument("--micro", type=int, nargs="+", default=None,
                      help="sequences per microbatch (default 1 2 4 8 16 32; --tiny 4)")
  parser.add_argument("--rounds", type=int, default=None,
                      help="timed calls (windows across calls) of each (default 10; --tiny 5)")
  parser.add_argument("--fit", action="store_true",
                      help="search the largest batch that fits also off a GPU")
  parser.add_argument("--fit-cap", type=int, default=None,
                      help="largest full batch tried (default 512; --tiny 64)")
  parser.add_argument("--fit-factor", type=int, default=4,
                      help="the microbatched batch is this many times the largest (default 4)")
  parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=None,
                      help="what to run (default step across_calls fit, fit only on a GPU or"
                      " with --fit; --quick: step across_calls loop)")
  parser.add_argument("--attention", choices=("auto", "cudnn", "xla"), default="auto",
                      help="auto: cuDNN's fused kernel on a GPU where it compiles, else XLA's")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds after which no new configuration starts (0: no limit;"
                      " default 540, --quick 245)")
  parser.add_argument("--name", default=None, help="results bench/results/<name>.json"
                      " (default gpu, gpu_check with --quick; _tiny with --tiny)")
  return parser


@dataclasses.dataclass
class Run:
  """One run: its settings, read once from the arguments, and its output as it grows."""

  args: argparse.Namespace
  model: Config
  pairs: list[tuple[int, int]]
  rounds: int
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
  """The arguments' defaults resolved, and the JSON's config."""
  on_gpu = jax.default_backend() == "gpu"
  model = models.TINY if args.tiny else models.GPT2_SMALL
  sections = args.sections or ["step", "across_calls", "loop" if args.quick else "fit"]
  ns = args.ns or ([1, 4] if args.tiny else [1, 2, 4, 8, 16])
  micros = args.micro or ([4] if args.tiny else [1, 2, 4, 8, 16, 32])
  rounds = args.rounds or (5 if args.tiny else 10)
  if min(ns + micros) < 1 or rounds < 1:
    parser.error("--ns, --micro and --rounds must be >= 1")
  pairs = sorted(((n, m) for n in ns for m in micros), key=lambda p: (p[0] * p[1], p))
  if args.quick and not (args.ns or args.micro):
    pairs = list(QUICK_PAIRS)
  name = args.name or ("gpu_check" if args.quick else "gpu") + ("_tiny" if args.tiny else "")
  seconds = args.budget if args.budget is not None else (245 if args.quick else 540)
  device = jax.devices()[0]
  config: dict[str, Any] = {
      "model": dataclasses.asdict(model), "tiny": args.tiny, "tied_head": True,
      "dtype": "bfloat16 parameters and compute, float32 loss",
      "attention": models.resolve_attention(args.attention, model), "quick": args.quick,
      "pairs": [list(p) for p in pairs], "rounds": rounds, "sections": sections,
      "fit": "fit" in sections and (on_gpu or args.fit), "budget_s": seconds,
      "fit_cap": args.fit_cap or (64 if args.tiny else 512), "commit": git_commit(),
      "platform": jax.default_backend(), "device_kind": device.device_kind,
      "command": " ".join(sys.argv), "environment": environment(),
      "grad_rtol": GRAD_RTOL, "loss_rtol": LOSS_RTOL,
  }
  output = {"config": config, "results": [], "loop": {}, "fit": None}
  return Run(args=args, model=model, pairs=pairs, rounds=rounds, name=name,
             budget=Budget(seconds, Budget.QUICK_SHARES if args.quick else None),
             output=output,
             before=json.loads(Path(args.compare).read_text()) if args.compare else None)


def _step_section(run: Run, loss: Any, params: Any) -> None:
  print("\ninside a step, the methods taking turns:", flush=True)
  rows = measure_steps(run.pairs, loss, params, run.model, rounds=run.rounds,
                       budget=run.budget, on_group=run.save)
  run.output["results"] = list(rows.values())
  run.save()


def _across_section(run: Run, loss: Any, params: Any) -> None:
  print("\nacross calls, every_k=8, the gradient of one sequence and the update in one jit:",
        flush=True)
  run.output["quick_across"] = {"combined": measure_rows(
      params, loss, make_tokens(1, run.model, seed=1), every_k=8, rounds=run.rounds,
      budget=run.budget)}
  run.save()


def _loop_section(run: Run, loss: Any, params: Any) -> None:
  """bench_loop.py's loops on the model in both containers (built there: plain arrays
  and ``nnx.State``), then its memory section if the budget allows."""
  rounds = min(run.rounds, LOOP_ROUNDS)
  print(f"\nthe training loop, every_k=8, one sequence a call from a host NumPy array,"
        f" {rounds} rounds of {LOOP_WINDOWS} windows:", flush=True)
  run.config["loop"] = {"rounds": rounds, "windows": LOOP_WINDOWS, "micro": 1}
  data = host_tokens(16 * 8, run.model.context, run.model.vocab, seed=2)
  results = bench_loop.measure(bench_loop.problems(run.model), data, micro=1, rounds=rounds,
                               windows=LOOP_WINDOWS, should_start=lambda: run.budget.left("loop"))
  # gpu_report.py reads the plain arrays' rows as the loop's.
  run.output["loop"] = results[bench_loop.ARRAYS]
  run.output["loop_nnx_state"] = results[bench_loop.STATE]
  bench_loop.print_report(results[bench_loop.STATE], f"{bench_loop.STATE}, ")
  run.save()
  if run.budget.left("loop"):
    print("\nmemory beyond the arguments (temp + output - alias), compiled only:", flush=True)
    run.output["loop_memory"] = bench_loop.memory_section()
    print(bench_loop.memory_table(run.output["loop_memory"]))
    run.save()


def _fit_section(run: Run, loss: Any, params: Any) -> None:
  print("\nthe largest batch that fits:", flush=True)
  ran = [r["batch"] for r in run.output["results"]
         if r.get("methods", {}).get(FULL, {}).get("status") == "ok"]
  run.output["fit"] = fit = measure_fit(
      loss, params, run.model, known=max(ran, default=None), cap=run.config["fit_cap"],
      factor=run.args.fit_factor, rounds=min(run.rounds, 5), budget=run.budget)
  run.save()
  print(f"\nlargest full batch: {fit.get('largest_full_batch')}"
        f"{' (the cap, --fit-cap; no OOM)' if fit.get('cap_reached') else ''}; then"
        f" {fit.get('batch', '-')} sequences microbatched, against the hand-written scan")
  print(fit_table(fit))


def _finish(run: Run) -> int:
  """The one table, the verdict, the JSON; 1 if a check failed."""
  output = run.output
  output["records"] = records_of(output)
  output["goals"] = goals(output["records"])
  print_report(output, run.before, run.args.compare)
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
  config = run.config
  graphdef, params = models.make_model(run.model, config["attention"])
  config["param_count"] = sum(x.size for x in jax.tree.leaves(params))
  config["param_bytes"] = tree_nbytes(params)
  print(header(config), flush=True)
  loss = models.make_loss(graphdef)
  sections = {"step": _step_section, "across_calls": _across_section, "loop": _loop_section}
  for name, section in sections.items():
    if name in config["sections"]:
      section(run, loss, params)
  if config["fit"]:
    _fit_section(run, loss, params)
  return _finish(run)


if __name__ == "__main__":
  sys.exit(main())
