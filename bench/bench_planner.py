"""accum_jax.diagnostics.plan_microbatches: its memory estimates against measured peaks.

The planner estimates the memory of ``jax.jit(accum_jax.value_and_grad(fun,
N))`` from XLA's compiled memory analysis, ``argument + output + temp - alias``
bytes, without running it. Here, for several N on the activation-dominated MLP
of ``bench_microbatch.py``, each estimate (``accum_jax._inside_step._planner._estimate_bytes``,
the function ``plan_microbatches`` bisects with) is set against the step's
measured peak, each N in a fresh process (``_common.fresh_process_peak``):

  measured = argument bytes + the step's peak growth

(on CPU the growth of the resident set during one step, on GPU the allocator's
``peak_bytes_in_use`` over ``bytes_in_use`` before it). The arguments are
counted exactly in both, so the second error column, the step's own part
(``output + temp - alias`` against the growth), is the sharper test.

Then ``plan_microbatches`` is run once with a budget (by default halfway
between the estimates of the two middle candidates, so that the choice is not
trivially the first or the last), and the measured peak of the N it chose is
checked against that budget.

Run from the repository root::

  python bench/bench_planner.py            # full run, under a minute on 2 CPU cores
  python bench/bench_planner.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from typing import Any

import jax
from _common import environment, fresh_process_peak, markdown_table, write_json
from bench_microbatch import ACCUM, input_shapes, loss_fn

import accum_jax
from accum_jax._inside_step import _planner

_MIB = 2**20


def estimate(n: int, args: tuple[Any, ...]) -> int:
  """The planner's estimate for ``num_microbatches=n`` (what it bisects with)."""
  return _planner._estimate_bytes(loss_fn, n, args, {})


def measure(n: int, model: dict[str, int]) -> dict[str, Any]:
  return fresh_process_peak(
      "bench_microbatch:build_step", {"method": ACCUM, "num_microbatches": n, **model}
  )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch-size", type=int, default=8192, help="rows per step")
  parser.add_argument("--width", type=int, default=512, help="hidden width")
  parser.add_argument("--num-layers", type=int, default=4, help="hidden layers")
  parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                      help="numbers of microbatches")
  parser.add_argument("--budget-bytes", type=int, default=None,
                      help="plan_microbatches' budget (default: halfway between the"
                      " estimates of the two middle candidates)")
  parser.add_argument("--jobs", type=int, default=2, help="memory workers at once")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: batch 512, width 64, 2 layers, N in 1 and 8")
  parser.add_argument("--name", default=None, help="results bench/results/<name>.json"
                      " (default: planner, or planner_quick with --quick)")
  args = parser.parse_args(argv)
  if args.quick:
    args.batch_size, args.width, args.num_layers, args.ns = 512, 64, 2, [1, 8]
  model = {"batch_size": args.batch_size, "width": args.width, "num_layers": args.num_layers}
  name = args.name or ("planner_quick" if args.quick else "planner")

  start = time.perf_counter()
  # The planner compiles abstract arguments: nothing is allocated here.
  shapes = input_shapes(**model)
  with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
    measured = dict(zip(args.ns, pool.map(lambda n: measure(n, model), args.ns)))
    estimates = {n: estimate(n, shapes) for n in args.ns}

  rows, table = [], []
  for n in args.ns:
    m = measured[n]
    xla = m["xla"]
    total = m["argument_bytes"] + m["step_peak_bytes"]
    step_estimate = xla["output_bytes"] + xla["temp_bytes"] - xla.get("alias_bytes", 0)
    row = {
        "num_microbatches": n,
        "estimate_bytes": estimates[n],
        "measured_bytes": total,
        "error": estimates[n] / total - 1,
        "argument_bytes": m["argument_bytes"],
        "step_estimate_bytes": step_estimate,
        "step_measured_bytes": m["step_peak_bytes"],
        "step_error": step_estimate / m["step_peak_bytes"] - 1,
        "masked": m["masked"],
        "memory": m,
    }
    rows.append(row)
    table.append([
        n,
        f"{estimates[n] / _MIB:.1f}",
        f"{total / _MIB:.1f}" + (" (masked)" if m["masked"] else ""),
        f"{100 * row['error']:+.1f}%",
        f"{step_estimate / _MIB:.1f}",
        f"{m['step_peak_bytes'] / _MIB:.1f}",
        f"{100 * row['step_error']:+.1f}%",
    ])

  ordered = sorted(args.ns)
  middle = len(ordered) // 2
  budget = args.budget_bytes or (
      estimates[ordered[max(middle - 1, 0)]] + estimates[ordered[middle]]
  ) // 2
  try:
    plan = accum_jax.diagnostics.plan_microbatches(loss_fn, *shapes, memory_budget_bytes=budget,
                                       candidates=args.ns)
  except accum_jax.diagnostics.MemoryBudgetError as e:
    choice = {"memory_budget_bytes": budget, "num_microbatches": None, "error": str(e)}
  else:
    chosen = plan.num_microbatches
    chosen_measured = next(
        r["measured_bytes"] for r in rows if r["num_microbatches"] == chosen
    )
    choice = {
        "memory_budget_bytes": budget,
        "num_microbatches": chosen,
        "plan_estimates": dict(plan.estimates),
        "chosen_measured_bytes": chosen_measured,
        "chosen_fits": chosen_measured <= budget,
    }

  env = environment()
  config = {
      **model,
      "ns": args.ns,
      "platform": jax.devices()[0].platform,
      "quick": args.quick,
      "command": " ".join(sys.argv),
      "environment": env,
      "total_seconds": time.perf_counter() - start,
  }
  print(
      f"MLP: {args.num_layers} x ReLU({args.width}x{args.width}) + head, batch"
      f" {args.batch_size}; accum_jax.value_and_grad; {env['backend']} ({env['devices'][0]});"
      f" measured: fresh process per N, {rows[0]['memory']['method']}"
  )
  print("estimate = argument + output + temp - alias (XLA memory analysis);"
        " measured = argument bytes + step growth; error = estimate / measured - 1")
  print()
  print(markdown_table(
      ["N", "estimate MiB", "measured MiB", "error", "step estimate MiB",
       "step measured MiB", "step error"],
      table,
  ))
  print()
  call = f"plan_microbatches(memory_budget_bytes={budget} ({budget / _MIB:.1f} MiB),"
  call += f" candidates={args.ns})"
  if choice["num_microbatches"] is None:
    print(f"{call} raised MemoryBudgetError: {choice['error']}")
  else:
    n = choice["num_microbatches"]
    print(
        f"{call} -> num_microbatches={n}; compiled {sorted(choice['plan_estimates'])};"
        f" measured peak of N={n}: {choice['chosen_measured_bytes'] / _MIB:.1f} MiB,"
        f" {'within' if choice['chosen_fits'] else 'OVER'} the budget"
    )
  path = write_json(name, {"config": config, "results": rows, "plan": choice})
  print(f"\nwrote {path} in {config['total_seconds']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
