"""The training loop users run: many calls, data from NumPy, no blocking until the end.

A step timed alone, blocked on after each call, hides every wait of the host; in a
loop, JAX dispatches asynchronously and the host prepares the next call while the
device computes, so a loop runs at the pace of its slower side, and a call pays the
host for every buffer it passes in and out. Each loop here is written as users write
it: each call handed a fresh slice of a host NumPy array, its loss kept, nothing read
back until the end; every_k = 8, one microbatch a call, AdamW.

The parameters come in two containers, measured apart, each against its own floor:
plain arrays (``models.gpt2_tree``) and an ``nnx.State`` of ``nnx.Param``
(``models.GPT``, the same 148 leaves). Two configurations: host-bound (width 8 on a
CPU) and compute-bound (width 64 on a CPU; GPT-2 small on a GPU). The loops, across
calls: the hand-written two-jit loop (the floor: a micro-step that adds the float32
gradient into a donated accumulator, an applying step that adds, takes the mean, runs
AdamW and applies it, chosen by a modulo); the same with a micro-step that returns no
parameters; ``accumulate(adamw)`` by default and with the tree layout, each with
``apply=HostSchedule.next()`` in one jitted step; the default in two jitted steps, the
one that only adds returning no parameters; ``optax.MultiSteps``; and, over
``nnx.State``, ``nnx.Optimizer`` holding ``optax.MultiSteps`` or ``accumulate`` under
``nnx.jit``, and the README's NNX loop as written, with ``nnx.cached_partial``, with
``nnx.split``/``nnx.merge`` around ``jax.jit``, and with ``nnx.jit_partial(graph=False)``.
Inside a step (plain arrays, 8 microbatches a call): the hand-written ``lax.scan`` (its
floor) and ``accum_jax.value_and_grad``. The loops take turns in rounds; per loop:
samples per second against its floor (the median of the rounds' ratios), the host's
and the CPU's time per call, the calls in flight at the last dispatch, and the buffers
in and out of a call that only adds and of an applying call.

The memory section compiles (and does not run) both programs of the hand-written loop,
``accumulate`` default and tree, and the one program of ``accumulate``'s device
schedule and of ``optax.MultiSteps`` for a GPT-2-small-shaped
bfloat16 tree and a loss whose gradient costs nothing: the memory each needs beyond
its donated arguments (``temp + output - alias``), against the hand-written loop's.

Run from the repository root::

  python bench/bench_loop.py            # bench/results/loop.json and a markdown log
  python bench/bench_loop.py --quick    # 2 layers, 3 rounds of 1 window: a smoke run
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
import models
import numpy as np
import optax
from _common import (
    add_float32,
    environment,
    git_commit,
    hand_written_scan,
    markdown_table,
    memory_analysis_dict,
    quartiles,
    report_failure,
    rotations,
    write_json,
    zeros_float32,
)
from flax import nnx

import accum_jax

EVERY_K = 8
LEARNING_RATE = 1e-4
ACROSS, INSIDE = "across calls", "inside a step"
ARRAYS, STATE = "plain arrays", "nnx.State"

FLOOR = "modulo loop, two jits (floor)"
LEAN = "modulo loop, two jits, no parameters out of the micro-step"
HOST = "accumulate(adamw), HostSchedule"
HOST_LEAN = "accumulate(adamw), HostSchedule, no parameters out of a call that only adds"
TREE = "accumulate(adamw, layout='tree'), HostSchedule"
MULTISTEPS = "optax.MultiSteps(adamw)"
NNX_MULTISTEPS = "nnx.Optimizer(optax.MultiSteps(adamw)), nnx.jit"
NNX_ACCUMULATE = "nnx.Optimizer(accumulate(adamw)), nnx.jit"
README = "README's NNX loop: nnx.jit, static apply"
README_CACHED = "README's NNX loop, nnx.cached_partial"
README_SPLIT = "README's NNX loop, nnx.split/merge around jax.jit"
README_TREE_MODE = "README's NNX loop, nnx.jit_partial(graph=False)"
SCAN = "hand-written lax.scan + AdamW (floor)"
VALUE_AND_GRAD = "accum_jax.value_and_grad + AdamW"
DEVICE = "accumulate(adamw), device schedule"  # in the memory section only
# Rows of earlier runs that gpu_report.py's goals still name; not measured here.
HOST_NO_SKIP = "accumulate(adamw, on_nonfinite='unchecked'), HostSchedule"
PACKED = "accumulate(adamw, pack_inner_state=True), HostSchedule"
FLATTEN = "accumulate(optax.flatten(adamw)), HostSchedule"
FLOOR_WITH_STATE = "modulo loop, AdamW state through the micro-step"

# Each door's reference: ratios of samples per second are to its row.
REFERENCE = {ACROSS: FLOOR, INSIDE: SCAN}


def doors(name: str) -> tuple[str, ...]:
  return (INSIDE,) if name in (SCAN, VALUE_AND_GRAD) else (ACROSS,)


# The layout of accumulate's state: a few buffers by default, or one per leaf.



def accumulate_default(inner: optax.GradientTransformation, k: int):
  """``accumulate`` as its default state gives it: a few buffers on one device."""
  return accum_jax.accumulate(inner, k)


def accumulate_tree(inner: optax.GradientTransformation, k: int):
  """``accumulate`` with a buffer per leaf of the accumulator and of the inner state."""
  return accum_jax.accumulate(inner, k, layout="tree")


@dataclasses.dataclass
class Problem:
  """A model's loss and parameters in one container; for ``nnx.State``, the model's
  ``graphdef`` and its loss as the NNX loops take it."""

  container: str
  loss: Callable[[Any, Any], jax.Array]  # (params, tokens) -> loss
  params: Any
  graphdef: Any = None
  model_loss: Callable[[nnx.Module, Any], jax.Array] | None = None

  def fresh_params(self) -> Any:  # the loops donate theirs
    return on_device(jax.tree.map(jnp.copy, self.params))

  def fresh_model(self) -> nnx.Module:
    return nnx.merge(self.graphdef, self.fresh_params())


def problems(config: models.Config) -> dict[str, Problem]:
  """``config``'s GPT in both containers: ``gpt2_tree``'s arrays, ``GPT``'s state."""
  tree = models.gpt2_tree(config.layers, config.width, config.vocab, config.context,
                          jnp.dtype(config.dtype))
  per_sequence = functools.partial(models.loss_fn, heads=config.heads)

  def loss(params, tokens):
    return jax.vmap(per_sequence, (None, 0))(params, tokens).mean()

  graphdef, state = models.make_model(config, models.resolve_attention("auto", config))
  return {ARRAYS: Problem(ARRAYS, loss, tree),
          STATE: Problem(STATE, models.make_loss(graphdef), state, graphdef, models.model_loss)}


@dataclasses.dataclass
class Loop:
  """One training loop, built.

  ``step(call, carry, tokens) -> (carry, loss)`` is the body of the user's loop: the
  host's decision (a modulo, ``HostSchedule.next()``) and the jitted calls; an NNX
  loop's carry is its model and optimizer, changed in place. ``programs``: ``{label:
  (jitted, args, kwargs)}``, a call's that only adds (``adding``) and an applying
  call's, lowered to count their buffers. ``parameters(carry)``: the parameters, to
  compare the loops' training.
  """

  sequences: int  # sequences a call takes
  calls: int  # calls a window of 8 microbatches takes
  step: Callable[[int, Any, Any], tuple[Any, Any]]
  carry: Any
  programs: dict[str, tuple[Any, tuple, dict[str, Any]]]
  parameters: Callable[[Any], Any] = lambda carry: carry[0]
  next_call: int = 0


def on_device(tree: Any) -> Any:
  """``tree`` committed to the device, as the steps' outputs are, so that the first
  call's program is the one the later calls find."""
  return jax.device_put(tree, jax.devices()[0])


def _init(init: Callable, params: Any) -> Any:
  return on_device(jax.jit(init)(params))


# ---------------------------------------------------------------------------
# The jitted steps, shared by the loops and the memory section.


def floor_steps(loss: Callable, inner: optax.GradientTransformation, *, lean: bool = False
                ) -> tuple[Callable, Callable]:
  """The hand-written loop's micro-step and applying step. ``lean``: the micro-step
  takes the parameters without donating them and returns only the sum and the loss."""

  def gradient_and_add(params, acc, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    return add_float32(acc, grads), value

  if lean:
    micro_step = jax.jit(gradient_and_add, donate_argnums=1)
  else:
    micro_step = jax.jit(lambda params, acc, tokens: (params, *gradient_and_add(
        params, acc, tokens)), donate_argnums=(0, 1))

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def apply_step(params, acc, opt_state, tokens):
    acc, value = gradient_and_add(params, acc, tokens)
    mean = jax.tree.map(lambda a, p: (a / EVERY_K).astype(p.dtype), acc, params)
    updates, opt_state = inner.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), zeros_float32(params), opt_state, value

  return micro_step, apply_step


def _step(tx: optax.GradientTransformation, loss: Callable) -> Callable:
  """The README's step over plain parameters, not jitted: the gradient, ``tx.update``
  (with ``apply`` where it is given), ``apply_updates``."""

  def step(params, state, tokens, apply=None):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    extra = {} if apply is None else {"apply": apply}
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state, value

  return step


def train_step(tx: optax.GradientTransformation, loss: Callable, *, host: bool) -> Callable:
  """The README's step, jitted with parameters and state donated; ``host``: ``apply``
  static, two programs."""
  return jax.jit(_step(tx, loss), donate_argnums=(0, 1),
                 static_argnames="apply" if host else None)


def lean_steps(tx: optax.GradientTransformation, loss: Callable) -> tuple[Callable, Callable]:
  """The README's step as two jitted programs: one that only adds, taking the
  parameters without donating them and returning only the state and the loss, and
  one that applies, donating both."""
  step = _step(tx, loss)
  add_step = jax.jit(lambda params, state, tokens: step(params, state, tokens, False)[1:],
                     donate_argnums=1)
  apply_step = jax.jit(functools.partial(step, apply=True), donate_argnums=(0, 1))
  return add_step, apply_step


# ---------------------------------------------------------------------------
# The loops over parameters. Each builder takes the problem, an example microbatch
# (a NumPy array) and the inner optimizer.


def modulo_floor(problem: Problem, tokens: np.ndarray, inner: optax.GradientTransformation,
                 *, lean: bool = False) -> Loop:
  """A careful user's loop: a micro-step that knows nothing of the optimizer, and an
  applying step, chosen on the host by the call's number."""
  micro_step, apply_step = floor_steps(problem.loss, inner, lean=lean)

  def step(call, carry, tokens):
    params, acc, opt_state = carry
    if (call + 1) % EVERY_K == 0:
      params, acc, opt_state, value = apply_step(params, acc, opt_state, tokens)
    elif lean:
      acc, value = micro_step(params, acc, tokens)
    else:
      params, acc, value = micro_step(params, acc, tokens)
    return (params, acc, opt_state), value

  params = problem.fresh_params()
  acc, opt_state = _init(zeros_float32, params), _init(inner.init, params)
  programs = {"adding": (micro_step, (params, acc, tokens), {}),
              "applying": (apply_step, (params, acc, opt_state, tokens), {})}
  return Loop(len(tokens), EVERY_K, step, (params, acc, opt_state), programs)


def transform_loop(problem: Problem, tokens: np.ndarray, tx: optax.GradientTransformation,
                   *, host: bool) -> Loop:
  """``tx`` in the README's step: with ``apply=HostSchedule.next()`` (``host``), or
  deciding on the device (``optax.MultiSteps``)."""
  jitted = train_step(tx, problem.loss, host=host)
  params = problem.fresh_params()
  state = _init(tx.init, params)
  schedule = accum_jax.HostSchedule(state) if host else None

  def step(call, carry, tokens):
    extra = {"apply": schedule.next()} if schedule else {}
    params, state, value = jitted(*carry, tokens, **extra)
    return (params, state), value

  args = (params, state, tokens)
  programs = ({"adding": (jitted, args, {"apply": False}),
               "applying": (jitted, args, {"apply": True})} if host
              else {"adding": (jitted, args, {}), "applying": (jitted, args, {})})
  return Loop(len(tokens), EVERY_K, step, (params, state), programs)


def lean_transform_loop(problem: Problem, tokens: np.ndarray,
                        tx: optax.GradientTransformation) -> Loop:
  """``tx`` in two jitted steps chosen by ``HostSchedule.next()``: a call that only
  adds takes the parameters without donating them and returns only the state and the
  loss; an applying call donates both and returns the new parameters."""
  add_step, apply_step = lean_steps(tx, problem.loss)
  params = problem.fresh_params()
  state = _init(tx.init, params)
  schedule = accum_jax.HostSchedule(state)

  def step(call, carry, tokens):
    params, state = carry
    if schedule.next():
      params, state, value = apply_step(params, state, tokens)
    else:
      state, value = add_step(params, state, tokens)
    return (params, state), value

  args = (params, state, tokens)
  programs = {"adding": (add_step, args, {}), "applying": (apply_step, args, {})}
  return Loop(len(tokens), EVERY_K, step, (params, state), programs)


def whole_batch(problem: Problem, tokens: np.ndarray, inner: optax.GradientTransformation,
                value_and_grad: Callable) -> Loop:
  """One call a batch of 8 microbatches: ``value_and_grad`` of it, then the optimizer."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step_fn(params, opt_state, tokens):
    value, grads = value_and_grad(params, tokens)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  def step(call, carry, tokens):
    params, opt_state, value = step_fn(*carry, tokens)
    return (params, opt_state), value

  params = problem.fresh_params()
  opt_state = _init(inner.init, params)
  programs = {"adding": (step_fn, (params, opt_state, tokens), {})}
  return Loop(len(tokens), 1, step, (params, opt_state), programs)


# ---------------------------------------------------------------------------
# The NNX loops: a model and an ``nnx.Optimizer``, changed in place.


def _nnx_step(model_loss: Callable) -> Callable:
  """The README's ``train_step``, with ``apply`` left out where the optimizer decides."""

  def train_step(model, optimizer, microbatch, apply=None):
    loss, grads = nnx.value_and_grad(model_loss)(model, microbatch)
    if apply is None:
      optimizer.update(model, grads)
    else:
      optimizer.update(model, grads, apply=apply)  # apply reaches accumulate
    return loss

  return train_step


def _nnx_parameters(carry: tuple) -> Any:
  return nnx.state(carry[0], nnx.Param)


def nnx_loop(problem: Problem, tokens: np.ndarray, tx: optax.GradientTransformation,
             form: str) -> Loop:
  """``nnx.Optimizer(model, tx)`` in a loop of one of these forms: ``device`` (``tx``
  decides, ``nnx.jit``); ``readme`` (``nnx.jit`` with ``apply`` static, parameters and
  optimizer donated, ``HostSchedule``); ``cached`` (the same through
  ``nnx.cached_partial``); ``split`` (``nnx.split`` once, ``nnx.merge`` inside a
  ``jax.jit`` that returns the state); ``tree_mode`` (``nnx.jit_partial(graph=False)``)."""
  model = problem.fresh_model()
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  body = _nnx_step(problem.model_loss)
  if form == "device":
    jitted = nnx.jit(body, donate_argnums=(0, 1))
    programs = {"adding": (jitted, (model, optimizer, tokens), {})}
    programs["applying"] = programs["adding"]
    return Loop(len(tokens), EVERY_K, lambda call, carry, tokens: (carry, jitted(
        *carry, tokens)), (model, optimizer), programs, _nnx_parameters)
  schedule = accum_jax.HostSchedule(optimizer)
  readme = nnx.jit(body, static_argnames="apply", donate_argnums=(0, 1))
  programs = {label: (readme, (model, optimizer, tokens), {"apply": apply})
              for label, apply in (("adding", False), ("applying", True))}
  if form == "readme":
    def step(call, carry, tokens):
      return carry, readme(*carry, tokens, schedule.next())
  elif form == "cached":
    cached = nnx.cached_partial(readme, model, optimizer)

    def step(call, carry, tokens):
      return carry, cached(tokens, schedule.next())
  elif form == "tree_mode":
    # The partial arguments go in as one list, the first argument: donated.
    bound = nnx.jit_partial(body, model, optimizer, static_argnames="apply",
                            donate_argnums=0, graph=False)
    programs = {label: (bound, (tokens,), {"apply": apply})
                for label, apply in (("adding", False), ("applying", True))}

    def step(call, carry, tokens):
      return carry, bound(tokens, apply=schedule.next())
  elif form == "split":
    graphdef, state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, static_argnames="apply", donate_argnums=0)
    def merged(state, microbatch, apply):
      model, optimizer = nnx.merge(graphdef, state)
      loss = body(model, optimizer, microbatch, apply)
      return nnx.state((model, optimizer)), loss

    programs = {label: (merged, (state, tokens), {"apply": apply})
                for label, apply in (("adding", False), ("applying", True))}

    def step(call, state, tokens):
      return merged(state, tokens, apply=schedule.next())

    return Loop(len(tokens), EVERY_K, step, state, programs,
                lambda state: nnx.state(nnx.merge(graphdef, state)[0], nnx.Param))
  else:
    raise ValueError(f"{form=} is not one of device, readme, cached, split, tree_mode.")
  return Loop(len(tokens), EVERY_K, step, (model, optimizer), programs, _nnx_parameters)


def loop_builders(problem: Problem) -> dict[str, Callable[[np.ndarray], Loop]]:
  """Each loop's builder for ``problem``'s container, from a microbatch of tokens, in
  the order they are built: the floors and the headline rows first, so that a budget's
  cut falls on the others."""
  adamw = optax.adamw(LEARNING_RATE)

  def batch(tokens):  # 8 microbatches
    return np.concatenate([tokens] * EVERY_K)

  builders = {
      FLOOR: lambda t: modulo_floor(problem, t, adamw),
      HOST: lambda t: transform_loop(problem, t, accumulate_default(adamw, EVERY_K),
                                     host=True),
  }
  if problem.container == STATE:
    builders |= {
        README: lambda t: nnx_loop(problem, t, accumulate_default(adamw, EVERY_K), "readme"),
        NNX_ACCUMULATE: lambda t: nnx_loop(problem, t, accumulate_default(adamw, EVERY_K),
                                           "device"),
        NNX_MULTISTEPS: lambda t: nnx_loop(problem, t, optax.MultiSteps(adamw, EVERY_K),
                                           "device"),
    }
  builders |= {
      LEAN: lambda t: modulo_floor(problem, t, adamw, lean=True),
      HOST_LEAN: lambda t: lean_transform_loop(problem, t, accumulate_default(adamw, EVERY_K)),
      TREE: lambda t: transform_loop(problem, t, accumulate_tree(adamw, EVERY_K), host=True),
      MULTISTEPS: lambda t: transform_loop(
          problem, t, optax.MultiSteps(adamw, EVERY_K).gradient_transformation(), host=False),
  }
  if problem.container == STATE:
    builders |= {
        README_CACHED: lambda t: nnx_loop(problem, t, accumulate_default(adamw, EVERY_K),
                                          "cached"),
        README_SPLIT: lambda t: nnx_loop(problem, t, accumulate_default(adamw, EVERY_K),
                                         "split"),
        README_TREE_MODE: lambda t: nnx_loop(problem, t, accumulate_default(adamw, EVERY_K),
                                             "tree_mode"),
    }
  else:
    builders |= {
        SCAN: lambda t: whole_batch(problem, batch(t), adamw,
                                    hand_written_scan(problem.loss, EVERY_K)),
        VALUE_AND_GRAD: lambda t: whole_batch(
            problem, batch(t), adamw,
            accum_jax.value_and_grad(problem.loss, num_microbatches=EVERY_K)),
    }
  return builders


# ---------------------------------------------------------------------------
# Building, running, measuring.


def buffer_counts(loop: Loop) -> dict[str, int]:
  """The flattened leaves of each program's arguments and results, as lowered (a call
  that only adds: the sum over the programs it dispatches)."""
  counts = {}
  for label, (jitted, args, kwargs) in loop.programs.items():
    lowered = jitted.lower(*args, **kwargs)
    counts[f"{label}_in"] = lowered.in_tree.num_leaves
    counts[f"{label}_out"] = lowered.out_tree.num_leaves
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
  jax.block_until_ready((jax.tree.leaves(carry), values))
  total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
  loop.carry, loop.next_call = carry, first + calls
  return {"host_s": host, "total_s": total, "cpu_s": cpu, "calls": calls,
          "in_flight": in_flight, "samples_per_s": calls * s / total}


def build(
    groups: dict[str, Problem], data: np.ndarray, *, micro: int,
    names: Collection[str] | None = None, should_start: Callable[[], bool] = lambda: True,
) -> tuple[dict[str, dict[str, Loop]], dict[str, dict[str, dict[str, Any]]]]:
  """Each loop of each container (``names``; None: all) built, its buffers counted,
  and a window run (its calls compile); the loops and their entries in the
  results, by container. Row by row across the containers, so that a budget's cut
  falls alike on both: ``should_start()`` is asked before each loop (a loop not built
  is recorded ``skipped (budget)``). A loop that fails (out of memory) is recorded with
  its status and the others go on.
  """
  example = np.asarray(data[:micro])
  builders = {c: loop_builders(p) for c, p in groups.items()}
  loops: dict[str, dict[str, Loop]] = {c: {} for c in groups}
  results: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in groups}
  # The rows in the order of the container that has most: its headline rows first.
  order = list(dict.fromkeys(name for b in sorted(builders.values(), key=len, reverse=True)
                             for name in b))
  for name in order:
    for container, make in builders.items():
      if name not in make or (names is not None and name not in names):
        continue
      if not should_start():
        results[container][name] = {"status": "skipped (budget)"}
        continue
      print(f"  {container}: {name}", flush=True)
      try:
        loop = make[name](example)
        counts = buffer_counts(loop)
        start = time.perf_counter()
        run(loop, data, 1)
        loops[container][name] = loop
        results[container][name] = {
            "status": "ok", "sequences_per_call": loop.sequences,
            "calls_per_window": loop.calls, "first_window_s": time.perf_counter() - start,
            "buffers": counts}
      except Exception as e:
        results[container][name] = {"status": report_failure(name, e)}
  return loops, results


def time_rounds(loops: dict[str, Loop], results: dict[str, dict[str, Any]], data: np.ndarray,
                *, rounds: int, windows: int) -> None:
  """One container's loops taking turns, ``windows`` windows each per round, in
  rotating order; their figures added to ``results``."""
  samples: dict[str, list[dict[str, Any]]] = {name: [] for name in loops}
  for order in rotations(loops, rounds):
    for name in order:
      samples[name].append(run(loops[name], data, windows))
  for name, runs in samples.items():
    loop, entry = loops[name], results[name]
    entry.update(summary(runs), runs=runs)
    # Per window of 8 microbatches (a call inside a step): the time at the median rate.
    entry["window_ms"] = 1e3 * loop.calls * loop.sequences / entry["samples_per_s"]
  add_ratios(results)


def measure(
    groups: dict[str, Problem], data: np.ndarray, *, micro: int, rounds: int, windows: int,
    names: Collection[str] | None = None, should_start: Callable[[], bool] = lambda: True,
) -> dict[str, dict[str, dict[str, Any]]]:
  """:func:`build`, then :func:`time_rounds` per container: each loop's figures, by
  container and name."""
  loops, results = build(groups, data, micro=micro, names=names, should_start=should_start)
  for container in groups:
    time_rounds(loops[container], results[container], data, rounds=rounds, windows=windows)
  return results


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
  """A loop's rounds: medians, quartiles of samples per second."""
  rate = [r["samples_per_s"] for r in runs]
  return {
      "samples_per_s": statistics.median(rate),
      "samples_per_s_quartiles": quartiles(rate),
      "host_ms_per_call": 1e3 * statistics.median(r["host_s"] / r["calls"] for r in runs),
      # The process's CPU time (the host's thread and the runtime's): on a CPU shared
      # with other work, the work a call took, which the wall clock's waits do not blur.
      "cpu_ms_per_call": 1e3 * statistics.median(r["cpu_s"] / r["calls"] for r in runs),
      "total_ms": 1e3 * statistics.median(r["total_s"] for r in runs),
      "in_flight": statistics.median(r["in_flight"] for r in runs),
      "calls_per_round": runs[0]["calls"],
  }


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
  """Each loop's samples per second against its door's floor in the same container:
  the median of the rounds' ratios (``ratio``) and the ratio of the medians."""
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
  """One container's loops: a markdown table per door."""
  out = {}
  for door, reference in REFERENCE.items():
    rows = []
    for name, entry in results.items():
      if door not in doors(name):
        continue
      if "samples_per_s" not in entry:
        rows.append([name, entry["status"].split(":")[0]] + ["-"] * 6)
        continue
      b = entry["buffers"]
      rows.append([
          name, f"{entry['samples_per_s']:.1f}", f"{entry['ratio'][door]:.3f}",
          f"{entry['host_ms_per_call']:.3f}", f"{entry['cpu_ms_per_call']:.3f}",
          f"{entry['in_flight']:g} of {entry['calls_per_round']}",
          f"{b['adding_in']} / {b['adding_out']}",
          f"{b['applying_in']} / {b['applying_out']}" if "applying_in" in b else "-"])
    if rows:
      out[door] = markdown_table(
          ["loop", "samples/s", "/ floor", "host ms / call", "CPU ms / call",
           "in flight at last dispatch", "buffers in / out, adding", "applying"], rows)
  return out


def print_report(results: dict[str, dict[str, Any]], title: str = "") -> None:
  for door, table in tables(results).items():
    print(f"\n{title}{door}: samples (sequences) per second, median of the rounds; / floor:"
          " the median of the rounds' ratios to the floor of this container; host ms / call:"
          " the host's time from the loop's start to its last dispatch, per call; CPU ms /"
          " call: the process's CPU time from the start until all is ready, per call; in"
          " flight: calls whose loss was not ready at the last dispatch; buffers: the"
          " flattened arguments / results of a call that only adds, and of an applying call")
    print(table)


# ---------------------------------------------------------------------------
# Memory beyond the arguments, compiled only.


# GPT-2 small's shapes: 148 leaves, 124M parameters, GPT-2's own vocabulary.
GPT2_SMALL_TREE = {"layers": 12, "width": 768, "vocab": 50257, "context": 1024}


def memory_section(sizes: dict[str, int] = GPT2_SMALL_TREE) -> dict[str, Any]:
  """Both programs of the hand-written loop, ``accumulate`` default and tree, the
  default's two lean programs (:func:`lean_steps`), and
  ``accumulate``'s device schedule and ``optax.MultiSteps`` (one program for both
  calls), compiled for ``gpt2_tree``'s
  shapes at ``sizes`` in bfloat16 and a loss whose gradient takes no memory (a
  weighted sum of the parameters in float32, each leaf its own weight: a sum of
  squares keeps a float32 copy of them for its gradient, and with one weight for all
  XLA computes equal buckets of ones once and keeps them): ``temp + output - alias``
  bytes, each to the hand-written program's, and the buffers in and out."""

  def loss(params, tokens):
    return sum(jnp.sum(p, dtype=jnp.float32) * (i + 1)
               for i, p in enumerate(jax.tree.leaves(params)))

  params = jax.eval_shape(lambda: models.gpt2_tree(**sizes))
  tokens = jax.ShapeDtypeStruct((1, sizes["context"] + 1), jnp.int32)
  adamw = optax.adamw(LEARNING_RATE)
  micro_step, apply_step = floor_steps(loss, adamw)
  acc, opt_state = jax.eval_shape(zeros_float32, params), jax.eval_shape(adamw.init, params)
  programs = {FLOOR: {"adding": (micro_step, (params, acc, tokens), {}),
                      "applying": (apply_step, (params, acc, opt_state, tokens), {})}}
  for name, tx, host in (
      (HOST, accumulate_default(adamw, EVERY_K), True),
      (TREE, accumulate_tree(adamw, EVERY_K), True),
      (DEVICE, accumulate_default(adamw, EVERY_K), False),
      (MULTISTEPS, optax.MultiSteps(adamw, EVERY_K).gradient_transformation(), False)):
    jitted, args = train_step(tx, loss, host=host), (params, jax.eval_shape(tx.init, params),
                                                     tokens)
    programs[name] = ({label: (jitted, args, {"apply": apply})
                       for label, apply in (("adding", False), ("applying", True))} if host
                      else dict.fromkeys(("adding", "applying"), (jitted, args, {})))
  tx = accumulate_default(adamw, EVERY_K)
  args = (params, jax.eval_shape(tx.init, params), tokens)
  programs[HOST_LEAN] = {label: (jitted, args, {})
                         for label, jitted in zip(("adding", "applying"), lean_steps(tx, loss))}
  out: dict[str, Any] = {"tree": sizes, "rows": {}}
  for name, calls in programs.items():
    entry = out["rows"][name] = {}
    for label, (jitted, args, kwargs) in calls.items():
      if kwargs == {} and "adding" in entry and calls["adding"] is calls[label]:
        entry[label] = dict(entry["adding"])  # one program for both calls
        continue
      print(f"  memory: {name}, {label}", flush=True)
      try:
        lowered = jitted.lower(*args, **kwargs)
        xla = memory_analysis_dict(lowered.compile())
        beyond = xla["temp_bytes"] + xla["output_bytes"] - xla["alias_bytes"]
        entry[label] = {"beyond_arguments_bytes": beyond, "xla": xla,
                        "buffers_in": lowered.in_tree.num_leaves,
                        "buffers_out": lowered.out_tree.num_leaves}
      except Exception as e:
        entry[label] = {"status": report_failure(f"{name}, {label}", e)}
  for name, entry in out["rows"].items():
    for label, figures in entry.items():
      floor = out["rows"][FLOOR].get(label, {}).get("beyond_arguments_bytes")
      if "beyond_arguments_bytes" in figures and floor:
        figures["to_floor"] = figures["beyond_arguments_bytes"] / floor
        figures["over_floor_bytes"] = figures["beyond_arguments_bytes"] - floor
  return out


def memory_table(memory: dict[str, Any]) -> str:
  def cells(figures: dict[str, Any]) -> list[str]:
    if "beyond_arguments_bytes" not in figures:
      return [figures.get("status", "-"), "-", "-"]
    ratio = figures.get("to_floor")
    return [f"{figures['beyond_arguments_bytes'] / 2**20:.1f}",
            "-" if ratio is None else f"{ratio:.3f}",
            f"{figures['buffers_in']} / {figures['buffers_out']}"]

  rows = [[name, *cells(entry.get("adding", {})), *cells(entry.get("applying", {}))]
          for name, entry in memory["rows"].items()]
  return markdown_table(
      ["program", "adding: MiB", "x floor", "buffers in / out", "applying: MiB", "x floor",
       "buffers in / out"], rows)


# ---------------------------------------------------------------------------


def configurations(quick: bool) -> dict[str, models.Config]:
  """The CPU's: 148 leaves (12 layers; 2 layers, 28 leaves, in a smoke run) of width 8,
  host-bound, and of width 64; a GPU's: GPT-2 small."""
  if jax.default_backend() == "gpu":
    return {"compute-bound": models.GPT2_SMALL}
  layers = 2 if quick else 12
  return {f"{bound}-bound": models.Config(layers=layers, width=w, heads=4, mlp=4 * w,
                                          vocab=128, context=16)
          for bound, w in (("host", 8), ("compute", 64))}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="a smoke run: on a CPU 2 layers, 3 rounds of 1 window")
  parser.add_argument("--rounds", type=int, default=None, help="rounds (default 30; --quick 3)")
  parser.add_argument("--windows", type=int, default=None,
                      help="windows of 8 microbatches per loop and round (default 2; --quick 1)")
  parser.add_argument("--micro", type=int, default=1, help="sequences a microbatch (default 1)")
  parser.add_argument("--name", default=None,
                      help="results bench/results/<name>.json (default loop, or loop_quick)")
  parser.add_argument("--loops", nargs="+", default=None, metavar="NAME",
                      help="measure only the loops whose names contain one of these (and"
                      " the floors)")
  parser.add_argument("--configurations", nargs="+", default=None, metavar="NAME",
                      help="host-bound, compute-bound (default both on a CPU)")
  parser.add_argument("--no-memory", action="store_true", help="leave out the memory section")
  args = parser.parse_args(argv)
  rounds = args.rounds or (3 if args.quick else 30)
  windows = args.windows or (1 if args.quick else 2)
  if min(rounds, windows, args.micro) < 1:
    parser.error("--rounds, --windows and --micro must be >= 1")
  start = environment()
  report: dict[str, Any] = {
      "environment": start, "commit": git_commit(), "rounds": rounds, "windows": windows,
      "every_k": EVERY_K, "micro": args.micro,
      "configurations": {}}
  print(f"the training loop, every_k={EVERY_K}, {args.micro} sequence(s) a microbatch;"
        f" {rounds} rounds of {windows} window(s) per loop, interleaved; data sliced from a"
        " host NumPy array each call", flush=True)
  for bound, config in configurations(args.quick).items():
    if args.configurations and bound not in args.configurations:
      continue
    groups = problems(config)
    leaves = len(jax.tree.leaves(groups[ARRAYS].params))
    print(f"\n{bound}: {leaves} parameter leaves, {config}", flush=True)
    names = None
    if args.loops:  # with the floor of each door they are in: the ratios are to it
      every = {n for p in groups.values() for n in loop_builders(p)}
      names = {n for n in every if any(part in n for part in args.loops)}
      names |= {REFERENCE[door] for name in names for door in doors(name)}
    data = models.host_tokens(16 * EVERY_K * args.micro, config.context, config.vocab)
    results = measure(groups, data, micro=args.micro, rounds=rounds, windows=windows,
                      names=names)
    report["configurations"][bound] = {"model": dataclasses.asdict(config),
                                       "leaves": leaves, "containers": results}
    for container, rows in results.items():
      print_report(rows, f"{bound}, {container}, ")
  if not args.no_memory:
    print("\nmemory beyond the arguments (temp + output - alias), compiled only:", flush=True)
    report["memory"] = memory_section()
    print("\nGPT-2-small-shaped bfloat16 tree, the sum of the parameters as the loss; MiB,"
          f" x the hand-written program's:\n{memory_table(report['memory'])}")
  report["load_average_end"] = environment()["load_average"]
  name = args.name or ("loop_quick" if args.quick else "loop")
  print(f"\nwrote {write_json(name, report)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
