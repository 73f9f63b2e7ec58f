"""accum_jax.accumulate against optax.MultiSteps: time, FLOPs, state size.

Both wrap the same inner optimizer (Adam, Muon) with a window of k calls. One
call of the jitted ``update`` is what a training step runs; a window is k such
calls, of which the last applies the inner optimizer. Each is timed twice, side
by side in the same interleaved rounds: with its state donated
(``jax.jit(step, donate_argnums=...)``, as a tuned training loop does) and
undonated (a plain ``jax.jit(train_step)``, as most Flax loops are written).
Undonated, every output is a new buffer: accumulate copies the inner state it
passes through on calls that only accumulate, where optax.MultiSteps rewrites it.

``optax.MultiSteps`` computes the inner update on every call and keeps it only
on the last (a select); ``accum_jax.accumulate`` puts the inner update in a
``lax.cond`` so the other k - 1 calls only add to the accumulator. The gap is
large for an optimizer with a costly update (Muon's Newton-Schulz iterations)
and small for an elementwise one (Adam).

The micro-step (a call that only accumulates; with Adam, the window never
closing) is timed against its floor: a jitted ``acc + g`` returning zero
updates, jitted and donated the same way, in each of the forms a user writes
(see ``MICRO_FORMS``), each call blocked on. Beside it a second floor, the same
add carrying the inner optimizer's state through unchanged: in a form that
moves that state (``jax.jit(tx.update, donate_argnums=1)``, or nothing
donated) it says which part of the cost is the form's. A call and its floors
run back to back, in rotating order; a ratio reported is the median of these
rounds' ratios, which machine drift between rounds does not move. Beside the
times, the number of full-size ``copy`` instructions in each compiled update
(``_common.full_size_copies``): passes over memory nobody asked for.

Run from the repository root::

  python bench/bench_transform.py            # full run, bench/results/transform.json
  python bench/bench_transform.py --quick    # smoke run, a few seconds
  python bench/bench_transform.py --inner adam --dim 1024   # the issue's size
  python bench/bench_transform.py --micro-only --inner adam --dim 1024 --micro-rounds 150
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _common import (
    compiled_flops,
    cost_analysis,
    environment,
    full_size_copies,
    markdown_table,
    time_samples,
    tree_nbytes,
    write_json,
)

import accum_jax

INNER_OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1e-3),
    # Newton-Schulz on the 2-D weights, Adam on the biases (optax's default).
    "muon": lambda: optax.contrib.muon(1e-3),
}

# Issue targets: the largest accepted ratio accum_jax window / MultiSteps window,
# by inner optimizer and donation ("aligned": donated, "none": undonated).
TARGET_RATIO = {
    ("adam", "aligned"): 0.9,
    ("adam", "none"): 1.0,
    ("adam", "misaligned"): 1.0,
    ("muon", "aligned"): 1 / 3,
    ("muon", "none"): 1 / 3,
    ("muon", "misaligned"): 1 / 3,
}
DONATION_LABEL = {"aligned": "donated", "none": "undonated", "misaligned": "donated, misaligned"}

REFERENCE = "optax.MultiSteps"


def _accum_jax(inner: optax.GradientTransformation, k: int) -> optax.GradientTransformation:
  return accum_jax.accumulate(inner, every_k=k)


def _optax_multisteps(
    inner: optax.GradientTransformation, k: int
) -> optax.GradientTransformation:
  return optax.MultiSteps(inner, every_k_schedule=k).gradient_transformation()


# name -> (factory, calls per window that run the inner update).
IMPLEMENTATIONS: dict[str, tuple[Callable[..., optax.GradientTransformation], Callable]] = {
    "accum_jax": (_accum_jax, lambda k: 1),
    REFERENCE: (_optax_multisteps, lambda k: k),
}


def make_params(num_layers: int, dim: int, key: jax.Array) -> dict[str, Any]:
  keys = jax.random.split(key, num_layers)
  return {
      f"layer{i}": {
          "w": jax.random.normal(keys[i], (dim, dim), jnp.float32) * dim**-0.5,
          "b": jnp.zeros((dim,), jnp.float32),
      }
      for i in range(num_layers)
  }


def make_grads(params: Any, k: int, key: jax.Array) -> list[Any]:
  """k different gradient pytrees, one per call of a window."""
  leaves, treedef = jax.tree.flatten(params)
  grads = []
  for call_key in jax.random.split(key, k):
    leaf_keys = jax.random.split(call_key, len(leaves))
    noise = [1e-2 * jax.random.normal(lk, x.shape, x.dtype) for lk, x in zip(leaf_keys, leaves)]
    grads.append(jax.block_until_ready(jax.tree.unflatten(treedef, noise)))
  return grads


def _is_nonzero(tree: Any) -> bool:
  return any(bool(jnp.any(x != 0)) for x in jax.tree.leaves(tree))


def jit_update(
    opt: optax.GradientTransformation, donation: str
) -> tuple[Callable[..., tuple[Any, Any]], Any]:
  """``step(state, grads, params) -> (state, updates)``, and what to lower.

  JAX pairs each donated input buffer with the first not yet paired output of
  the same shape and dtype, in output order. Returning the state first
  ("aligned") pairs every state leaf with its own buffer, so state that a call
  passes through unchanged (the inner optimizer's, on calls that only
  accumulate) needs no copy. ``jax.jit(opt.update, donate_argnums=1)`` returns
  the updates first ("misaligned"): the updates take the accumulator's
  buffers, the accumulator the inner state's, and so on, and XLA copies the
  pass-through state on every call. "none" donates nothing: every output is a
  new buffer.
  """
  if donation == "misaligned":
    jitted = jax.jit(opt.update, donate_argnums=1)

    def step(state, grads, params):
      updates, state = jitted(grads, state, params)
      return state, updates

    return step, lambda state, grads, params: jitted.lower(grads, state, params)

  def update(state, grads, params):
    updates, state = opt.update(grads, state, params)
    return state, updates

  jitted = jax.jit(update, donate_argnums=0 if donation == "aligned" else ())
  return jitted, jitted.lower


class Runner:
  """One optimizer, its jitted update and the state threaded through calls."""

  def __init__(
      self, opt: optax.GradientTransformation, params: Any, grads: list[Any], donation: str
  ):
    self.params = params
    self.grads = grads
    self.state = opt.init(params)
    self.state_bytes = tree_nbytes(self.state)
    self.step, lower = jit_update(opt, donation)
    compiled = lower(self.state, grads[0], params).compile()
    costs = cost_analysis(compiled)
    self.xla_flops = costs.get("flops", float("nan"))
    self.xla_bytes = costs.get("bytes accessed", float("nan"))
    self.copies = full_size_copies(compiled, params)

  def call(self, i: int) -> Any:
    self.state, updates = self.step(self.state, self.grads[i], self.params)
    return updates, self.state

  def window(self) -> Any:
    for i in range(len(self.grads)):
      out = self.call(i)
    return out

  def emitting_calls(self) -> tuple[list[int], Any]:
    """Indices (within one window) of calls that return a non-zero update."""
    emitted, emitted_update = [], None
    for i in range(len(self.grads)):
      updates, _ = self.call(i)
      if _is_nonzero(updates):
        emitted.append(i)
        emitted_update = updates
    return emitted, emitted_update


def bench_inner(
    inner_name: str,
    params: Any,
    grads: list[Any],
    *,
    windows: int,
    min_seconds: float,
    warmup: int,
    donations: list[str],
) -> list[dict[str, Any]]:
  """Times every implementation under every donation mode, interleaved; one entry per mode."""
  k = len(grads)
  make_inner = INNER_OPTIMIZERS[inner_name]
  runners = {
      (name, donation): Runner(make(make_inner(), k), params, grads, donation)
      for donation in donations
      for name, (make, _) in IMPLEMENTATIONS.items()
  }

  # Untimed first window from the initial state: compiles, checks that exactly
  # the last call of a window emits, and that both emit the same update.
  emitted, first_update = {}, {}
  for key, runner in runners.items():
    emitted[key], first_update[key] = runner.emitting_calls()
    if emitted[key] != [k - 1]:
      raise RuntimeError(
          f"{key} with {inner_name} emitted on calls {emitted[key]} of a window of"
          f" {k}; expected only call {k - 1}. The windows are misaligned."
      )

  for runner in runners.values():
    for _ in range(warmup):
      jax.block_until_ready(runner.window())

  # Windows of the implementations and donation modes alternate, so that drift
  # in the machine's speed (other processes, clocks) falls on all alike. At
  # least `windows` rounds, more while under `min_seconds`: cheap inner
  # optimizers get enough samples for their median to settle.
  window_s = {key: [] for key in runners}
  rounds, start = 0, time.perf_counter()
  while rounds < windows or time.perf_counter() - start < min_seconds:
    for key, runner in runners.items():
      window_s[key] += time_samples(runner.window, repeats=1, warmup=0)
    rounds += 1

  # Each call timed on its own (blocking after each one, which a training loop
  # would not do): shows where a window's time goes.
  call_s = {key: [[] for _ in range(k)] for key in runners}
  for _ in range(rounds):
    for key, runner in runners.items():
      for i in range(k):
        call_s[key][i] += time_samples(runner.call, i, repeats=1, warmup=0)

  inner = make_inner()
  inner_step = jax.jit(inner.update)
  inner_state = inner.init(params)
  inner_flops = compiled_flops(inner_step, grads[0], inner_state, params)
  inner_s = time_samples(inner_step, grads[0], inner_state, params, repeats=rounds, warmup=1)

  entries = []
  for donation in donations:
    max_abs_diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(first_update["accum_jax", donation]),
            jax.tree.leaves(first_update[REFERENCE, donation]),
        )
    )
    results = {}
    for name in IMPLEMENTATIONS:
      key, runner = (name, donation), runners[name, donation]
      inner_calls = IMPLEMENTATIONS[name][1](k)
      accumulate_calls = [t for i in range(k - 1) for t in call_s[key][i]]
      results[name] = {
          "window_ms": 1e3 * statistics.median(window_s[key]),
          "window_ms_p25_p75": [1e3 * q for q in _quartiles(window_s[key])],
          "window_ms_samples": [1e3 * t for t in window_s[key]],
          "accumulate_call_ms": 1e3 * statistics.median(accumulate_calls),
          "emitting_call_ms": 1e3 * statistics.median(call_s[key][k - 1]),
          "xla_flops_per_call": runner.xla_flops,
          "inner_calls_per_window": inner_calls,
          # XLA counts a conditional's costliest branch, so the figure above is
          # the emitting call's. Calls that skip the inner update save its cost:
          "executed_flops_per_call_est": runner.xla_flops
          - (k - inner_calls) / k * inner_flops,
          "xla_bytes_accessed_per_call": runner.xla_bytes,
          "full_size_copies": runner.copies,
          "state_bytes": runner.state_bytes,
          "emitting_call_index": emitted[key],
      }
    ratio = results["accum_jax"]["window_ms"] / results[REFERENCE]["window_ms"]
    target = TARGET_RATIO[inner_name, donation]
    entries.append({
        "inner": inner_name,
        "donation": donation,
        "rounds": rounds,
        "inner_update_ms": 1e3 * statistics.median(inner_s),
        "inner_update_flops": inner_flops,
        "first_update_max_abs_diff": max_abs_diff,
        "window_ratio": ratio,
        "target_ratio": target,
        "target_met": ratio <= target,
        "implementations": results,
    })
  return entries


# How a user jits one call, by name: which arguments are donated, and in which
# order the state comes back. JAX gives each output, in order, the first donated
# input buffer of its shape and dtype not yet taken.
MICRO_FORMS = {
    # step(state, grads, params) -> (state, updates), donate_argnums=0, as a
    # TrainState step returns its state: each state leaf keeps its own buffer.
    "state first": "state donated, returned first",
    # jax.jit(tx.update, donate_argnums=1): the updates come first and take the
    # first state leaves' buffers (the accumulator's); each parameter-shaped state
    # leaf takes the next one's, and the last ones new buffers, whatever the
    # update computes: XLA copies Adam's moments on every call (so does the floor
    # carrying the inner state).
    "tx.update": "jax.jit(tx.update, donate_argnums=1)",
    # jax.jit(tx.update, donate_argnums=(0, 1)): the updates take the gradients'
    # buffers, each state leaf keeps its own.
    "tx.update, grads donated": "jax.jit(tx.update, donate_argnums=(0, 1))",
    # jax.jit(tx.update): every output is a new buffer, so what the call passes
    # through (the inner optimizer's state) is copied.
    "undonated": "jax.jit(tx.update), nothing donated",
}
# The arguments of tx.update (grads, state, params) each form donates; the state
# first form jits its own function.
MICRO_DONATE = {"tx.update": 1, "tx.update, grads donated": (0, 1), "undonated": ()}
MICRO_TARGET = 1.30  # the largest accepted ratio micro-step / floor, in every form
# The rows of the micro-step table: a form, and accumulate's options. The last
# shows what the gradient's finiteness check (a read of it that the floor does
# not make) costs: the state-first form without it.
MICRO_ROWS = [
    ("state first", {}),
    ("tx.update", {}),
    ("tx.update, grads donated", {}),
    ("undonated", {}),
    ("state first", {"on_nonfinite": "unchecked"}),
]
# The micro-step and its two floors, timed back to back in each round.
MICRO_RUNNERS = ("accum_jax", "floor", "floor carrying")


def _floor_update(grads: Any, acc: Any, params: Any) -> tuple[Any, Any]:
  """The floor of a call that only accumulates: ``acc + g``, and zero updates."""
  del params
  return jax.tree.map(jnp.zeros_like, grads), jax.tree.map(jnp.add, acc, grads)


def _carrying_floor_update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
  """The floor with the inner optimizer's state carried through unchanged.

  ``state`` is ``(acc, inner_state)``. What moving the inner state costs in a
  form: with the updates first, JAX gives every parameter-shaped leaf of the
  state the buffer of the leaf after it (the last ones new buffers), so each of
  Adam's moments moves on every call, whatever the update does. Beside the bare
  add, this floor says which part of a form's cost is the form's.
  """
  acc, inner_state = state
  updates, acc = _floor_update(grads, acc, params)
  return updates, (acc, inner_state)


class MicroStep:
  """One jitted update, in one of ``MICRO_FORMS``, with its state threaded through."""

  def __init__(self, update: Callable, state: Any, params: Any, grads: Any, form: str):
    self.state, self.params, self.grads = state, params, grads
    self.donates_grads = form == "tx.update, grads donated"
    if form == "state first":
      jitted = jax.jit(lambda s, g, p: update(g, s, p)[::-1], donate_argnums=0)
      self._run = lambda s, g: jitted(s, g, params)[0]
      lowered = jitted.lower(state, grads, params)
    else:
      jitted = jax.jit(update, donate_argnums=MICRO_DONATE[form])
      self._run = lambda s, g: jitted(g, s, params)[1]
      lowered = jitted.lower(grads, state, params)
    self.copies = full_size_copies(lowered.compile(), params)

  def sample(self) -> float:
    """Seconds of one call, blocked on; a donated gradient is made fresh first, untimed."""
    grads = jax.tree.map(jnp.copy, self.grads) if self.donates_grads else self.grads
    jax.block_until_ready(grads)
    start = time.perf_counter()
    self.state = jax.block_until_ready(self._run(self.state, grads))
    return time.perf_counter() - start


def bench_micro_step(
    inner_name: str, params: Any, grads: Any, *, rounds: int, min_seconds: float
) -> list[dict[str, Any]]:
  """accumulate's micro-step against its floors, in every row of MICRO_ROWS, interleaved.

  Each row times three jitted calls in its form: accumulate's, the bare add
  (:func:`_floor_update`, whose ratio is held to ``MICRO_TARGET``) and the add
  carrying the inner optimizer's state (:func:`_carrying_floor_update`).
  """
  make_inner = INNER_OPTIMIZERS[inner_name]
  runners = {}
  for i, (form, options) in enumerate(MICRO_ROWS):
    # A window that never closes: every call only accumulates.
    opt = accum_jax.accumulate(make_inner(), every_k=2**30, **options)
    runners["accum_jax", i] = MicroStep(opt.update, opt.init(params), params, grads, form)
    acc = jax.tree.map(jnp.zeros_like, params)
    runners["floor", i] = MicroStep(_floor_update, acc, params, grads, form)
    carried = (jax.tree.map(jnp.zeros_like, params), make_inner().init(params))
    runners["floor carrying", i] = MicroStep(
        _carrying_floor_update, carried, params, grads, form
    )
  for runner in runners.values():
    runner.sample()  # compiled above; the first call still pays one-time costs
  samples: dict[Any, list[float]] = {key: [] for key in runners}
  ratios: dict[Any, list[float]] = {key: [] for key in runners if key[0] != "accum_jax"}
  rows = list(range(len(MICRO_ROWS)))
  done, start = 0, time.perf_counter()
  while done < rounds or time.perf_counter() - start < min_seconds:
    # Each round starts one row further, and a row's three calls run back to
    # back, each round starting with the next: their ratios see the machine in
    # one state.
    for i in rows[done % len(rows):] + rows[:done % len(rows)]:
      k = done % len(MICRO_RUNNERS)
      times = {name: runners[name, i].sample() for name in MICRO_RUNNERS[k:] + MICRO_RUNNERS[:k]}
      for name, t in times.items():
        samples[name, i].append(t)
      for name in MICRO_RUNNERS[1:]:
        ratios[name, i].append(times["accum_jax"] / times[name])
    done += 1
  entries = []
  for i, (form, options) in enumerate(MICRO_ROWS):
    ms = {name: 1e3 * statistics.median(samples[name, i]) for name in MICRO_RUNNERS}
    entries.append({
        "inner": inner_name,
        "form": form,
        "form_description": MICRO_FORMS[form],
        "options": options,
        "rounds": done,
        "accum_jax_ms": ms["accum_jax"],
        "floor_ms": ms["floor"],
        # The median of the back-to-back ratios; the ratio of the medians beside it.
        "ratio": statistics.median(ratios["floor", i]),
        "ratio_of_medians": ms["accum_jax"] / ms["floor"],
        "target_ratio": MICRO_TARGET,
        "accum_jax_full_size_copies": runners["accum_jax", i].copies,
        "floor_full_size_copies": runners["floor", i].copies,
        "carrying_floor_ms": ms["floor carrying"],
        "ratio_to_carrying_floor": statistics.median(ratios["floor carrying", i]),
        "carrying_floor_full_size_copies": runners["floor carrying", i].copies,
        "accum_jax_ms_samples": [1e3 * t for t in samples["accum_jax", i]],
        "floor_ms_samples": [1e3 * t for t in samples["floor", i]],
        "carrying_floor_ms_samples": [1e3 * t for t in samples["floor carrying", i]],
    })
  return entries


def _print_micro_report(entries: list[dict[str, Any]]) -> None:
  rows = [
      [
          e["inner"],
          e["form_description"]
          + "".join(f", {k}={v}" for k, v in e["options"].items()),
          f"{e['accum_jax_ms']:.3f}",
          f"{e['floor_ms']:.3f}",
          f"{e['ratio']:.2f}",
          f"{e['ratio_of_medians']:.2f}",
          f"<= {e['target_ratio']:.2f}",
          "yes" if e["ratio"] <= e["target_ratio"] else "NO",
          e["accum_jax_full_size_copies"],
          e["floor_full_size_copies"],
          f"{e['ratio_to_carrying_floor']:.2f}",
          e["carrying_floor_full_size_copies"],
      ]
      for e in entries
  ]
  print(
      markdown_table(
          [
              "inner",
              "a call that only accumulates, jitted as",
              "accum_jax ms",
              "floor ms",
              "ratio (paired)",
              "ratio of medians",
              "target",
              "met",
              "full-size copies",
              "floor's",
              "ratio to the floor carrying the inner state",
              "its copies",
          ],
          rows,
      )
  )


def _quartiles(samples: list[float]) -> tuple[float, float]:
  if len(samples) < 2:
    return samples[0], samples[0]
  q = statistics.quantiles(samples, n=4)
  return q[0], q[2]


def _print_report(config: dict[str, Any], per_inner: list[dict[str, Any]]) -> None:
  k = config["k"]
  headers = [
      "inner",
      "donation",
      "implementation",
      f"window ms (k={k})",
      f"vs {REFERENCE}",
      "accumulate call ms",
      "emitting call ms",
      "XLA GFLOP/call",
      "executed GFLOP/call (est.)",
      "full-size copies",
      "state MiB",
  ]
  rows = []
  for entry in per_inner:
    for name, r in entry["implementations"].items():
      ratio = r["window_ms"] / entry["implementations"][REFERENCE]["window_ms"]
      rows.append([
          entry["inner"],
          DONATION_LABEL[entry["donation"]],
          name,
          f"{r['window_ms']:.2f}",
          f"{ratio:.3f}",
          f"{r['accumulate_call_ms']:.3f}",
          f"{r['emitting_call_ms']:.3f}",
          f"{r['xla_flops_per_call'] / 1e9:.4g}",
          f"{r['executed_flops_per_call_est'] / 1e9:.4g}",
          r["full_size_copies"],
          f"{r['state_bytes'] / 2**20:.2f}",
      ])
  rounds = ", ".join(sorted({f"{e['inner']} {e['rounds']}" for e in per_inner})) or "none"
  print(
      f"params: {config['num_layers']} x ({config['dim']}x{config['dim']} weight + bias),"
      f" {config['num_params']:,} floats; k={k};"
      f" timed windows: {rounds};"
      f" {config['environment']['backend']}, {config['environment']['cpu_count']} CPUs"
  )
  if not per_inner:  # --micro-only
    return
  print()
  print(markdown_table(headers, rows))
  print()
  target_rows = [
      [
          e["inner"],
          DONATION_LABEL[e["donation"]],
          f"<= {e['target_ratio']:.3f}",
          f"{e['window_ratio']:.3f}",
          "yes" if e["target_met"] else "NO",
          f"{e['inner_update_ms']:.3f}",
          f"{e['inner_update_flops'] / 1e9:.4g}",
          f"{e['first_update_max_abs_diff']:.1e}",
      ]
      for e in per_inner
  ]
  print(
      markdown_table(
          [
              "inner",
              "donation",
              "target window ratio",
              "measured",
              "met",
              "inner update alone ms",
              "inner GFLOP",
              "max abs update diff",
          ],
          target_rows,
      )
  )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--k", type=int, default=8, help="calls per window (every_k)")
  parser.add_argument("--num-layers", type=int, default=4, help="weight matrices")
  parser.add_argument("--dim", type=int, default=512, help="each weight is dim x dim")
  parser.add_argument("--windows", type=int, default=7, help="least timed windows (median)")
  parser.add_argument(
      "--min-seconds",
      type=float,
      default=3.0,
      help="keep timing windows, per inner optimizer, for at least this long",
  )
  parser.add_argument(
      "--donation",
      nargs="+",
      choices=("aligned", "misaligned", "none"),
      default=["aligned", "none"],
      help="how the jitted update donates the state, each timed side by side in the same"
      " rounds (default: donated and undonated); see jit_update",
  )
  parser.add_argument("--warmup", type=int, default=1, help="untimed windows first")
  parser.add_argument(
      "--micro-rounds", type=int, default=40,
      help="least interleaved rounds of the micro-step against its floors (0: skip them)",
  )
  parser.add_argument(
      "--micro-only", action="store_true",
      help="time only the micro-step against its floors, not the windows against MultiSteps",
  )
  parser.add_argument(
      "--inner", nargs="+", choices=sorted(INNER_OPTIMIZERS), default=list(INNER_OPTIMIZERS)
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
      "--quick", action="store_true", help="smoke run: 2 layers of 128, 3 windows, 0.2 s"
  )
  parser.add_argument(
      "--name", default=None, help="results file bench/results/<name>.json"
      " (default: transform, or transform_quick with --quick)"
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.num_layers, args.dim, args.windows, args.min_seconds = 2, 128, 3, 0.2
    args.micro_rounds = min(args.micro_rounds, 5)
  if args.k < 2:
    parser.error(f"--k={args.k} must be >= 2: with k=1 nothing is accumulated.")
  name = args.name or ("transform_quick" if args.quick else "transform")

  start = time.perf_counter()
  params_key, grads_key = jax.random.split(jax.random.key(args.seed))
  params = make_params(args.num_layers, args.dim, params_key)
  grads = make_grads(params, args.k, grads_key)
  config = {
      "k": args.k,
      "num_layers": args.num_layers,
      "dim": args.dim,
      "num_params": sum(x.size for x in jax.tree.leaves(params)),
      "windows": args.windows,
      "min_seconds": args.min_seconds,
      "warmup": args.warmup,
      "donation": args.donation,
      "seed": args.seed,
      "quick": args.quick,
      "micro_only": args.micro_only,
      "command": " ".join(sys.argv),
      "environment": environment(),
  }
  per_inner = [
      entry
      for inner in args.inner
      if not args.micro_only
      for entry in bench_inner(
          inner,
          params,
          grads,
          windows=args.windows,
          min_seconds=args.min_seconds,
          warmup=args.warmup,
          donations=args.donation,
      )
  ]
  micro = [
      entry
      for inner in args.inner
      if args.micro_rounds > 0
      for entry in bench_micro_step(
          inner, params, grads[0], rounds=args.micro_rounds, min_seconds=args.min_seconds
      )
  ]
  config["total_seconds"] = time.perf_counter() - start
  config["load_average_end"] = environment()["load_average"]
  _print_report(config, per_inner)
  if micro:
    print()
    _print_micro_report(micro)
  path = write_json(name, {"config": config, "results": per_inner, "micro_step": micro})
  print(f"\nwrote {path} in {config['total_seconds']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
