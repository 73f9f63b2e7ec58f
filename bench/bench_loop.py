"""The training loop users run: many calls, data from NumPy, no blocking until the end.

A step timed alone, blocked on after each call, hides every wait of the host; in a
loop, JAX dispatches asynchronously and the host prepares the next call while the
device computes, so a loop runs at the pace of its slower side. Each loop here is
written as users write it: each call handed a fresh slice of a host NumPy array, its
loss kept, nothing read back until the end. Across calls (every_k = 8, a microbatch a
call): the two-jit modulo loop (the floor); ``accumulate(adamw)`` with
``apply=HostSchedule.next()`` (by default, ``on_nonfinite="unchecked"``,
``pack_inner_state=True``, around ``optax.flatten``, the update in a jit of its own);
the device schedule; ``optax.MultiSteps``; the full batch; and a control, the floor
with AdamW's state handed through its micro-step. Inside a step (8 microbatches a
call): the hand-written ``lax.scan`` (floor) and ``accum_jax.value_and_grad``, each
with AdamW. The loops take turns in rounds; per loop: samples per second against its
door's floor, the host's and the CPU's time per call, the calls in flight at the last
dispatch, what a call that only accumulates hands over and launches, and each
program's compile time. The model: GPT-2 small on a GPU, ``models.gpt2_tree`` elsewhere.

Run from the repository root::

  python bench/bench_loop.py            # 60 rounds of 2 windows: bench/results/loop.json
  python bench/bench_loop.py --quick    # 1 layer, 3 rounds: a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
    add_float32,
    environment,
    git_commit,
    hand_written_scan,
    markdown_table,
    quartiles,
    report_failure,
    rotations,
    write_json,
    zeros_float32,
)

import accum_jax
from accum_jax.testing import kernel_counts

EVERY_K = 8
ACROSS, INSIDE = "across calls", "inside a step"

FLOOR = "modulo loop, two jits (floor)"
HOST = "accumulate(adamw), HostSchedule"
HOST_NO_SKIP = "accumulate(adamw, on_nonfinite='unchecked'), HostSchedule"
FLATTEN = "accumulate(optax.flatten(adamw)), HostSchedule"
PACKED = "accumulate(adamw, pack_inner_state=True), HostSchedule"
PACKED_NO_SKIP = (
    "accumulate(adamw, pack_inner_state=True, on_nonfinite='unchecked'), HostSchedule")
DEVICE = "accumulate(adamw), device schedule"
MULTISTEPS = "optax.MultiSteps(adamw)"
FULL = "full batch of 8, AdamW"
OWN_JIT = "accumulate(adamw), HostSchedule, update in its own jit"
FLOOR_WITH_STATE = "modulo loop, AdamW state through the micro-step"
SCAN = "hand-written lax.scan + AdamW (floor)"
VALUE_AND_GRAD = "accum_jax.value_and_grad + AdamW"

# Each door's reference: ratios of samples per second are to its row.
REFERENCE = {ACROSS: FLOOR, INSIDE: SCAN}
# The tables a loop is shown in: across calls, but for these.
DOORS = {SCAN: (INSIDE,), VALUE_AND_GRAD: (INSIDE,), FULL: (ACROSS, INSIDE)}


def doors(name: str) -> tuple[str, ...]:
  return DOORS.get(name, (ACROSS,))


@dataclasses.dataclass
class Loop:
  """One training loop, built: its compiled programs and one iteration of it.

  ``step(call, carry, tokens) -> (carry, loss)`` is the body of the user's loop:
  the host's decision (a modulo, ``HostSchedule.next()``) and the jitted calls.
  ``programs``: ``{label: (jitted, args, kwargs)}``, each compiled ahead with
  ``jitted.lower(*args, **kwargs)``, the form the loop calls it in; ``micro_step``:
  the labels of those a call that only accumulates dispatches (every call's, for a
  loop of one program).
  """

  sequences: int  # sequences a call takes
  calls: int  # calls a window of 8 microbatches takes
  step: Callable[[int, tuple, Any], tuple[tuple, Any]]
  carry: tuple
  programs: dict[str, tuple[Any, tuple, dict[str, Any]]]
  micro_step: tuple[str, ...]
  next_call: int = 0

  @property
  def jitted(self) -> list[Any]:
    """The loop's jitted functions, each once."""
    return list({id(j): j for j, _, _ in self.programs.values()}.values())


# ---------------------------------------------------------------------------
# The loops. Each builder takes the loss of a batch of sequences, the parameters
# (its own copy: they are donated), an example batch of a microbatch's shape (a
# NumPy array) and the inner optimizer.


def on_device(tree: Any) -> Any:
  """``tree`` committed to the device, as the steps' outputs are: a program compiled
  ahead for arrays placed otherwise (a jitted init whose zeros read no input leaves
  them uncommitted) is not the one the loop's calls find."""
  return jax.device_put(tree, jax.devices()[0])


def _init(init: Callable, params: Any) -> Any:
  return on_device(jax.jit(init)(params))


def modulo_floor(loss: Callable, params: Any, tokens: np.ndarray,
                 inner: optax.GradientTransformation, *, state_through: bool = False) -> Loop:
  """A careful user's loop: a micro-step that knows nothing of the optimizer, and an
  applying step, chosen on the host by the call's number. ``state_through``: the
  optimizer's state handed to the micro-step too, and back untouched, as an Optax
  transformation's update is handed its whole state (a control: the same program,
  more buffers a call)."""

  def gradient_and_add(params, acc, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    return add_float32(acc, grads), value

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def micro_step(params, acc, tokens):
    return params, *gradient_and_add(params, acc, tokens)

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def micro_step_with_state(params, acc, opt_state, tokens):
    acc, value = gradient_and_add(params, acc, tokens)
    return params, acc, opt_state, value

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def apply_step(params, acc, opt_state, tokens):
    acc, value = gradient_and_add(params, acc, tokens)
    mean = jax.tree.map(lambda a, p: (a / EVERY_K).astype(p.dtype), acc, params)
    updates, opt_state = inner.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), zeros_float32(params), opt_state, value

  def step(call, carry, tokens):
    params, acc, opt_state = carry
    if (call + 1) % EVERY_K == 0:
      params, acc, opt_state, value = apply_step(params, acc, opt_state, tokens)
    elif state_through:
      params, acc, opt_state, value = micro_step_with_state(params, acc, opt_state, tokens)
    else:
      params, acc, value = micro_step(params, acc, tokens)
    return (params, acc, opt_state), value

  acc, opt_state = _init(zeros_float32, params), _init(inner.init, params)
  micro = ((micro_step_with_state, (params, acc, opt_state, tokens), {}) if state_through
           else (micro_step, (params, acc, tokens), {}))
  programs = {"micro-step": micro,
              "applying step": (apply_step, (params, acc, opt_state, tokens), {})}
  return Loop(len(tokens), EVERY_K, step, (params, acc, opt_state), programs,
              ("micro-step",))


def _train_step(tx: optax.GradientTransformation, loss: Callable) -> Callable:
  """The step of the README: the gradient, ``tx.update``, ``apply_updates``."""

  def train_step(params, state, tokens, apply=None):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    extra = {} if apply is None else {"apply": apply}
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state, value

  return train_step


def host_schedule(tx: optax.GradientTransformation, loss: Callable, params: Any,
                  tokens: np.ndarray) -> Loop:
  """``accumulate``'s step with ``apply=schedule.next()``: two programs."""
  train_step = jax.jit(_train_step(tx, loss), static_argnames="apply", donate_argnums=(0, 1))
  state = _init(tx.init, params)
  schedule = accum_jax.HostSchedule(state)

  def step(call, carry, tokens):
    params, state, value = train_step(*carry, tokens, apply=schedule.next())
    return (params, state), value

  programs = {f"apply={a}": (train_step, (params, state, tokens), {"apply": a})
              for a in (False, True)}
  return Loop(len(tokens), EVERY_K, step, (params, state), programs, ("apply=False",))


def one_program(tx: optax.GradientTransformation, loss: Callable, params: Any,
                tokens: np.ndarray) -> Loop:
  """A transformation that decides on the device (``apply`` left out, MultiSteps)."""
  train_step = jax.jit(_train_step(tx, loss), donate_argnums=(0, 1))
  state = _init(tx.init, params)

  def step(call, carry, tokens):
    params, state, value = train_step(*carry, tokens)
    return (params, state), value

  programs = {"step": (train_step, (params, state, tokens), {})}
  return Loop(len(tokens), EVERY_K, step, (params, state), programs, ("step",))


def update_in_own_jit(tx: optax.GradientTransformation, loss: Callable, params: Any,
                      tokens: np.ndarray) -> Loop:
  """The gradient in one jit, compiled once; ``tx.update`` and ``apply_updates`` in
  another, with ``apply`` static: three small programs, two dispatches a call."""
  gradient = jax.jit(jax.value_and_grad(loss))

  @functools.partial(jax.jit, static_argnames="apply", donate_argnums=(0, 1))
  def update(params, state, grads, apply):
    updates, state = tx.update(grads, state, params, apply=apply)
    return optax.apply_updates(params, updates), state

  state = _init(tx.init, params)
  schedule = accum_jax.HostSchedule(state)

  def step(call, carry, tokens):
    params, state = carry
    value, grads = gradient(params, tokens)
    return update(params, state, grads, apply=schedule.next()), value

  grads = jax.eval_shape(gradient, params, tokens)[1]
  programs = {"gradient": (gradient, (params, tokens), {}),
              **{f"update, apply={a}": (update, (params, state, grads), {"apply": a})
                 for a in (False, True)}}
  return Loop(len(tokens), EVERY_K, step, (params, state), programs,
              ("gradient", "update, apply=False"))


def whole_batch(value_and_grad: Callable, params: Any, tokens: np.ndarray,
                inner: optax.GradientTransformation) -> Loop:
  """One call a batch of 8 microbatches: ``value_and_grad`` of it, then the optimizer."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, tokens):
    value, grads = value_and_grad(params, tokens)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  def step(call, carry, tokens):
    params, opt_state, value = train_step(*carry, tokens)
    return (params, opt_state), value

  opt_state = _init(inner.init, params)
  programs = {"step": (train_step, (params, opt_state, tokens), {})}
  return Loop(len(tokens), 1, step, (params, opt_state), programs, ("step",))


def loop_builders(loss: Callable) -> dict[str, Callable[[Any, np.ndarray], Loop]]:
  """Each loop's builder, from the parameters and a microbatch of tokens, in the order
  they are built: the floors and the rows of the headline figures first, so that a
  budget's cut falls on the others."""
  adamw = optax.adamw(1e-4)

  def accumulate(inner=adamw, **kwargs):
    return accum_jax.accumulate(inner, every_k=EVERY_K, **kwargs)

  def batch(tokens):  # 8 microbatches
    return np.concatenate([tokens] * EVERY_K)

  return {
      FLOOR: lambda p, t: modulo_floor(loss, p, t, adamw),
      HOST: lambda p, t: host_schedule(accumulate(), loss, p, t),
      PACKED: lambda p, t: host_schedule(accumulate(pack_inner_state=True), loss, p, t),
      PACKED_NO_SKIP: lambda p, t: host_schedule(
          accumulate(pack_inner_state=True, on_nonfinite="unchecked"), loss, p, t),
      HOST_NO_SKIP: lambda p, t: host_schedule(accumulate(on_nonfinite="unchecked"), loss, p, t),
      FLATTEN: lambda p, t: host_schedule(accumulate(optax.flatten(adamw)), loss, p, t),
      DEVICE: lambda p, t: one_program(accumulate(), loss, p, t),
      MULTISTEPS: lambda p, t: one_program(
          optax.MultiSteps(adamw, EVERY_K).gradient_transformation(), loss, p, t),
      SCAN: lambda p, t: whole_batch(hand_written_scan(loss, EVERY_K), p, batch(t), adamw),
      VALUE_AND_GRAD: lambda p, t: whole_batch(
          accum_jax.value_and_grad(loss, num_microbatches=EVERY_K), p, batch(t), adamw),
      FULL: lambda p, t: whole_batch(jax.value_and_grad(loss), p, batch(t), adamw),
      OWN_JIT: lambda p, t: update_in_own_jit(accumulate(), loss, p, t),
      FLOOR_WITH_STATE: lambda p, t: modulo_floor(loss, p, t, adamw, state_through=True),
  }


# ---------------------------------------------------------------------------
# Building, running, measuring.


def compile_programs(loop: Loop) -> tuple[dict[str, float], dict[str, Any]]:
  """Each of the loop's programs lowered and compiled: the seconds it took, and the
  compiled program."""
  seconds, compiled = {}, {}
  for label, (jitted, args, kwargs) in loop.programs.items():
    start = time.perf_counter()
    compiled[label] = jitted.lower(*args, **kwargs).compile()
    seconds[label] = time.perf_counter() - start
  return seconds, compiled


def micro_step_counts(loop: Loop, compiled: dict[str, Any]) -> dict[str, int]:
  """What a call that only accumulates hands over and launches: the buffers in and
  out of the programs it dispatches, their top-level fusions, copies, conditionals."""
  counts = {"dispatches": len(loop.micro_step), "buffers_in": 0, "buffers_out": 0}
  for label in loop.micro_step:
    jitted, args, kwargs = loop.programs[label]
    counts["buffers_in"] += len(jax.tree.leaves(args))
    counts["buffers_out"] += len(jax.tree.leaves(jax.eval_shape(jitted, *args, **kwargs)))
    for key, value in kernel_counts(compiled[label])._asdict().items():
      counts[key] = counts.get(key, 0) + value
  return counts


def run(loop: Loop, data: np.ndarray, windows: int) -> dict[str, Any]:
  """``windows`` windows of the loop, as a user's loop runs them; the times.

  Call ``i`` takes rows ``i * s`` to ``(i + 1) * s`` of ``data`` (cyclically; s
  sequences a call), a fresh slice of the host's array. Nothing is waited on until
  the last call is dispatched: then the host's time is read, the calls whose loss is
  not yet ready are counted, and everything is blocked on.
  """
  rows, s = len(data), loop.sequences
  carry, values = loop.carry, []
  first, calls = loop.next_call, windows * loop.calls
  start, cpu_start = time.perf_counter(), time.process_time()
  for call in range(first, first + calls):
    offset = call * s % rows
    carry, value = loop.step(call, carry, data[offset:offset + s])
    values.append(value)
  host = time.perf_counter() - start
  in_flight = sum(not v.is_ready() for v in values)
  jax.block_until_ready((carry, values))
  total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
  loop.carry, loop.next_call = carry, first + calls
  return {"host_s": host, "total_s": total, "cpu_s": cpu, "calls": calls,
          "in_flight": in_flight, "samples_per_s": calls * s / total}


def compiled_count(loop: Loop) -> int | None:
  """Programs the loop's jitted functions hold (None where jax does not say): as many
  as ``loop.programs`` once the loop has run, if its calls found them compiled."""
  try:
    return sum(j._cache_size() for j in loop.jitted)
  except AttributeError:
    return None


def build(
    loss: Callable, params: Any, data: np.ndarray, *, micro: int,
    names: Collection[str] | None = None, should_start: Callable[[], bool] = lambda: True,
) -> tuple[dict[str, Loop], dict[str, dict[str, Any]]]:
  """Each loop (``names``; None: all) built, its programs compiled, and one window
  run (the first calls allocate); the loops, and their entries in the results.

  ``should_start()`` is asked before each loop is built (a time budget); a loop not
  built is recorded ``skipped (budget)``. A loop that fails to build or run (out of
  memory) is recorded with its status and the others go on.
  """
  example = np.asarray(data[:micro])
  # One-time initialisation and the first kernels' tuning fall on no loop's compile.
  jax.jit(jax.value_and_grad(loss)).lower(params, example).compile()
  results: dict[str, dict[str, Any]] = {}
  loops: dict[str, Loop] = {}
  for name, build_loop in loop_builders(loss).items():
    if names is not None and name not in names:
      continue
    if not should_start():
      results[name] = {"status": "skipped (budget)"}
      continue
    print(f"  {name}", flush=True)
    try:
      loop = build_loop(on_device(jax.tree.map(jnp.copy, params)), example)  # donated
      compile_s, compiled = compile_programs(loop)
      run(loop, data, 1)
      loops[name] = loop
      results[name] = {
          "status": "ok", "sequences_per_call": loop.sequences, "calls_per_window": loop.calls,
          "programs": len(loop.programs), "compile_s": compile_s,
          "compile_total_s": sum(compile_s.values()),
          "micro_step": micro_step_counts(loop, compiled)}
    except Exception as e:
      results[name] = {"status": report_failure(name, e)}
  return loops, results


def time_rounds(loops: dict[str, Loop], results: dict[str, dict[str, Any]], data: np.ndarray,
                *, rounds: int, windows: int) -> None:
  """The loops taking turns, ``windows`` windows each per round, in rotating order;
  their figures added to ``results``."""
  samples: dict[str, list[dict[str, Any]]] = {name: [] for name in loops}
  for order in rotations(loops, rounds):
    for name in order:
      samples[name].append(run(loops[name], data, windows))
  for name, runs in samples.items():
    loop, entry = loops[name], results[name]
    entry.update(summary(runs), runs=runs, compiled_after_runs=compiled_count(loop))
    # Per window of 8 microbatches (a call inside a step): the time at the median rate.
    entry["window_ms"] = 1e3 * loop.calls * loop.sequences / entry["samples_per_s"]
  add_ratios(results)


def measure(
    loss: Callable, params: Any, data: np.ndarray, *, micro: int, rounds: int, windows: int,
    names: Collection[str] | None = None, should_start: Callable[[], bool] = lambda: True,
) -> dict[str, dict[str, Any]]:
  """:func:`build`, then :func:`time_rounds`: each loop's figures, by name."""
  loops, results = build(loss, params, data, micro=micro, names=names,
                         should_start=should_start)
  time_rounds(loops, results, data, rounds=rounds, windows=windows)
  return results


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
  """A loop's rounds: medians, quartiles of samples per second, whether it ran ahead."""
  rate = [r["samples_per_s"] for r in runs]
  calls = runs[0]["calls"]
  return {
      "samples_per_s": statistics.median(rate),
      "samples_per_s_quartiles": quartiles(rate),
      "host_ms_per_call": 1e3 * statistics.median(r["host_s"] / r["calls"] for r in runs),
      # The process's CPU time (the host's thread and the runtime's): on a CPU shared
      # with other work, the work a call took, which the wall clock's waits do not blur.
      "cpu_ms_per_call": 1e3 * statistics.median(r["cpu_s"] / r["calls"] for r in runs),
      "total_ms": 1e3 * statistics.median(r["total_s"] for r in runs),
      "in_flight": statistics.median(r["in_flight"] for r in runs),
      "calls_per_round": calls,
      # More than the call just dispatched still running: the host was ahead.
      "ran_ahead": sum(r["in_flight"] > 1 and r["host_s"] < r["total_s"] for r in runs)
      > len(runs) / 2,
  }


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
  """Each loop's samples per second against its door's floor: the median of the
  rounds' ratios (``ratio``) and the ratio of the medians (``ratio_of_medians``)."""
  for door, reference in REFERENCE.items():
    ref = results.get(reference, {})
    for name, entry in results.items():
      if door not in doors(name) or "runs" not in entry or "runs" not in ref:
        continue
      pairs = zip(entry["runs"], ref["runs"])
      entry.setdefault("ratio", {})[door] = statistics.median(
          a["samples_per_s"] / b["samples_per_s"] for a, b in pairs)
      entry.setdefault("ratio_of_medians", {})[door] = (
          entry["samples_per_s"] / ref["samples_per_s"])


def tables(results: dict[str, dict[str, Any]]) -> dict[str, str]:
  """A markdown table per door."""
  out = {}
  for door, reference in REFERENCE.items():
    rows = []
    for name, entry in results.items():
      if door not in doors(name):
        continue
      if "samples_per_s" not in entry:
        rows.append([name, entry["status"].split(":")[0]] + ["-"] * 9)
        continue
      counts = entry["micro_step"]
      rows.append([
          name, f"{entry['samples_per_s']:.1f}", f"{entry['ratio'][door]:.3f}",
          f"{entry['host_ms_per_call']:.3f}", f"{entry['cpu_ms_per_call']:.3f}",
          f"{entry['total_ms']:.1f}",
          f"{entry['in_flight']:g} of {entry['calls_per_round']}",
          "yes" if entry["ran_ahead"] else "no",
          f"{counts['buffers_in']} / {counts['buffers_out']}", counts["fusions"],
          f"{entry['compile_total_s']:.2f} ({len(entry['compile_s'])})"])
    if not rows:
      continue
    out[door] = markdown_table(
        ["loop", "samples/s", f"/ {reference}", "host ms / call", "CPU ms / call", "round ms",
         "in flight at last dispatch", "ran ahead", "buffers in / out", "fusions",
         "compile s (programs)"], rows)
  return out


def compile_note(results: dict[str, dict[str, Any]]) -> str:
  """The second program's cost: the host schedule's compiles against the device's one."""
  host, device, own = (results.get(n, {}).get("compile_s") for n in (HOST, DEVICE, OWN_JIT))
  if not host or not device:
    return ""
  line = (f"compile: HostSchedule's two programs {sum(host.values()):.2f} s"
          f" (apply=False {host['apply=False']:.2f}, apply=True {host['apply=True']:.2f})"
          f" against the device schedule's one {sum(device.values()):.2f} s")
  if own:
    line += (f"; the update in its own jit {sum(own.values()):.2f} s (the gradient"
             f" {own['gradient']:.2f}, the updates {own['update, apply=False']:.2f} and"
             f" {own['update, apply=True']:.2f})")
  return line


# ---------------------------------------------------------------------------
# The models.


def cpu_problem(layers: int, micro: int, rows: int) -> tuple[Callable, Any, np.ndarray]:
  """``models.gpt2_tree`` and its loss, over a batch of sequences."""
  from models import gpt2_tree, host_tokens, loss_fn

  context, vocab = 16, 128

  def loss(params, tokens):
    return jax.vmap(loss_fn, (None, 0))(params, tokens).mean()

  data = host_tokens(rows * micro, context, vocab)
  return loss, gpt2_tree(layers=layers, vocab=vocab, context=context), data


def gpu_problem(micro: int, rows: int, config: Any = None,
                ) -> tuple[Callable, Any, np.ndarray, dict[str, Any]]:
  """GPT-2 small (or ``config``), and random tokens in a host array."""
  from models import GPT2_SMALL, host_tokens, make_loss, make_model, resolve_attention

  config = config or GPT2_SMALL
  attention = resolve_attention("auto", config)
  graphdef, params = make_model(config, attention)
  data = host_tokens(rows * micro, config.context, config.vocab)
  return make_loss(graphdef), params, data, {**dataclasses.asdict(config),
                                             "attention": attention}


def print_report(results: dict[str, dict[str, Any]]) -> None:
  for door, table in tables(results).items():
    print(f"\n{door}: samples (sequences) per second, median of the rounds; / floor: the"
          " median of the rounds' ratios; host ms / call: the host's time from the loop's"
          " start to its last dispatch, per call; CPU ms / call: the process's CPU time (all"
          " its threads) from the start until all is ready, per call; in flight: calls whose"
          " loss was not ready"
          " at the last dispatch; buffers and fusions: of the programs a call that only"
          " accumulates dispatches (a call's, inside a step)")
    print(table)
  note = compile_note(results)
  if note:
    print(f"\n{note}")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="a smoke run: on a CPU 1 layer, 3 rounds of 2 windows")
  parser.add_argument("--rounds", type=int, default=None, help="rounds (default 60; --quick 3)")
  parser.add_argument("--windows", type=int, default=None,
                      help="windows of 8 microbatches per loop and round (default 2)")
  parser.add_argument("--micro", type=int, default=1, help="sequences a microbatch (default 1)")
  parser.add_argument("--name", default=None,
                      help="results bench/results/<name>.json (default loop, or loop_quick)")
  parser.add_argument("--loops", nargs="+", default=None, metavar="NAME",
                      help="measure only the loops whose names contain one of these (and"
                      " the floors)")
  args = parser.parse_args(argv)
  rounds = args.rounds or (3 if args.quick else 60)
  windows = args.windows or 2
  if min(rounds, windows, args.micro) < 1:
    parser.error("--rounds, --windows and --micro must be >= 1")
  rows = 16 * EVERY_K  # sequences of the host array, per sequence of a microbatch
  if jax.default_backend() == "gpu":
    loss, params, data, model = gpu_problem(args.micro, rows)
  else:
    layers = 1 if args.quick else 12
    loss, params, data = cpu_problem(layers, args.micro, rows)
    model = {"tree": "models.gpt2_tree", "layers": layers, "width": 64,
             "vocab": 128, "context": 16}
  leaves = len(jax.tree.leaves(params))
  print(f"the training loop, every_k={EVERY_K}, {args.micro} sequence(s) a microbatch,"
        f" {leaves} parameter leaves ({model}); {rounds} rounds of {windows} window(s) per"
        " loop, interleaved; data sliced from a host NumPy array each call", flush=True)
  start = environment()
  names = None
  if args.loops:  # with the floor of each door they are in: the ratios are to it
    names = {n for n in loop_builders(loss) if any(part in n for part in args.loops)}
    names |= {REFERENCE[door] for name in names for door in doors(name)}
  results = measure(loss, params, data, micro=args.micro, rounds=rounds, windows=windows,
                    names=names)
  report = {"environment": start, "commit": git_commit(), "rounds": rounds,
            "windows": windows, "every_k": EVERY_K, "micro": args.micro, "leaves": leaves,
            "model": model, "loops": results}
  print_report(results)
  report["load_average_end"] = environment()["load_average"]
  name = args.name or ("loop_quick" if args.quick else "loop")
  print(f"\nwrote {write_json(name, report)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
