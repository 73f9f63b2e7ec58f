"""A GPT-2-small Transformer on one GPU: microbatching inside a step and across calls.

The model is a decoder-only Transformer written with Flax NNX, GPT-2 small's
size: 12 layers, width 768, 12 heads, MLP 3072, vocabulary 50304 (GPT-2's 50257
rounded up to a multiple of 64), context 1024, learned position embeddings,
pre-LayerNorm, GELU, and the output head tied to the token embedding (GPT-2's
choice; 124M parameters). Parameters and compute are bfloat16; the loss, the
mean next-token cross-entropy, is computed in float32. Causal attention is
``jax.nn.dot_product_attention(..., is_causal=True)``, asking for cuDNN's fused
kernel on a GPU where it compiles (``--attention``). The data are random tokens
drawn with NumPy. The loss is a pure function of the ``nnx.split`` state, as in
the NNX functional API: ``graphdef, params = nnx.split(model, nnx.Param)``, and
``loss_fn(params, tokens)`` merges and applies.

Inside one step, for each number of microbatches N (``--ns``) and microbatch
size in sequences (``--micro``), three ways of taking the gradient of a batch of
B = N x micro sequences, each ``jax.jit``-ted, returning (loss, grads), with no
optimizer update (the ratios are about the loop):

- ``accum_jax``: ``accum_jax.value_and_grad(loss_fn, N)``, defaults (float32
  accumulator);
- ``lax.scan``: the hand-written loop MaxText and Levanter write: the batch
  reshaped to (N, micro, T + 1), ``jax.value_and_grad`` in a ``lax.scan`` body,
  float32 sums carried, divided by N after;
- ``full batch``: ``jax.value_and_grad(loss_fn)`` of all B sequences at once.

Measured for each (N, micro): the step time, the three methods taking turns in
rounds in this process (``_common.time_interleaved``), median; the peak memory
of one step, each (method, N, micro) in a fresh process
(``_common.fresh_process_peak``: the GPU allocator's peak over what was in use
before the step; on CPU the resident-set growth), with XLA's static
``memory_analysis()`` temp bytes beside it; and accum_jax's loss and gradient
against the hand-written scan's (both are float32 sums of the same bfloat16
microbatch gradients; they must agree to within bfloat16 rounding: the script
exits 1 if they do not). A configuration that runs out of memory is recorded as
OOM and the run goes on.

Across calls: ``accum_jax.accumulate(optax.adamw(1e-4), every_k=N)`` against
``optax.MultiSteps(optax.adamw(1e-4), every_k_schedule=N)`` on the model's
bfloat16 parameters: one jitted ``tx.update`` + ``optax.apply_updates`` with
params and state donated, timed per call (a micro-step only accumulates; the
window's last call applies AdamW) and per window of N calls.

The largest batch that fits (on a GPU, or with ``--fit``): the largest full
batch, doubling from the largest that ran above up to ``--fit-cap`` sequences,
whose step runs without running out of memory; then a batch ``--fit-factor``
times as large through ``accum_jax.value_and_grad`` with microbatches of that
size (halved while they run out of memory), its loss and gradient set against
the hand-written scan of the same batch (a full-batch reference does not fit,
by construction).

``--quick``, the GPU check in one call (under 4 minutes on one GPU): one table for
both doors, no memory workers and no compilation cache. Inside a step, at N x micro
of 8x1, 8x4 and 16x1: the default ``value_and_grad``,
``skip_nonfinite="microbatch"``, ``skip_nonfinite=False``, the hand-written scan and
the full batch, with step time, compile time (after a warm-up compile of one
microbatch's gradient, once per microbatch size) and static memory (temp + output).
Across calls, every_k=8: the floors (one float32 vector add, the per-leaf add, a
hand-written ``lax.cond(emit, adamw, skip)`` accumulator, a plain AdamW step),
``accumulate`` with sgd, adamw and muon in both layouts, and ``optax.MultiSteps``,
each alone and with the gradient of one sequence in the same jit. ``--compare PATH``
puts the figures of an earlier run's JSON beside the rows it has, naming its card and
commit.

Run from the repository root::

  PYTHONPATH=. python bench/bench_gpu.py          # GPT-2 small on a GPU, bench/results/gpu.json
  PYTHONPATH=. python bench/bench_gpu.py --ns 1 8 --micro 8 32 --no-memory   # a part of it
  python bench/bench_gpu.py --tiny                # 2 layers of width 64 on a CPU, about a minute
  PYTHONPATH=. python bench/bench_gpu.py --quick --compare ../shared/gpu/h200-bench_gpu-d1c9549.json

``--budget`` (seconds, default 540) stops starting new configurations once spent,
so the run ends, with its JSON written, inside a 10-minute job.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

# This process and the fresh processes it starts share the device: each takes
# memory as it needs it instead of 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    fresh_process_peak,
    git_commit,
    markdown_table,
    memory_analysis_dict,
    quartiles,
    time_interleaved,
    tree_nbytes,
    write_json,
)
from flax import nnx  # noqa: E402

import accum_jax  # noqa: E402

FULL = "full batch"
SCAN = "lax.scan"
ACCUM = "accum_jax"
METHOD_NAMES = (ACCUM, SCAN, FULL)
MULTISTEPS = "optax.MultiSteps"

# --quick: the inside-step rows, and the (N, micro) pairs they run at.
DEFAULT = "default"
MICROBATCH = 'skip_nonfinite="microbatch"'
NO_SKIP = "skip_nonfinite=False"
QUICK_PAIRS = ((8, 1), (8, 4), (16, 1))

# accum_jax against the hand-written scan: both sum the same bfloat16 microbatch
# gradients in float32 and cast the mean to bfloat16, so they differ by the
# rounding of that cast and the order of the sums: a few bfloat16 ulps (2**-8
# relative) of a leaf's largest entry at most.
GRAD_RTOL = 2e-2
LOSS_RTOL = 1e-4  # the loss is float32 on both sides

_MIB = 2**20
_LIST = getattr(nnx, "List", list)


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int
  width: int
  heads: int
  mlp: int
  vocab: int
  context: int


GPT2_SMALL = Config(layers=12, width=768, heads=12, mlp=3072, vocab=50304, context=1024)
TINY = Config(layers=2, width=64, heads=2, mlp=256, vocab=256, context=32)


# The model.


def _has_fused_attention() -> bool:
  attention = getattr(jax.nn, "dot_product_attention", None)
  return attention is not None and "is_causal" in inspect.signature(attention).parameters


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str) -> jax.Array:
  """Causal self-attention of (batch, time, heads, head_dim) arrays.

  ``implementation``: ``"cudnn"`` or ``"xla"`` for ``jax.nn.dot_product_attention``
  (cuDNN's fused kernel, or XLA's composition of it), ``"manual"`` for the
  softmax written out (float32 logits), where that function is missing.
  """
  if implementation in ("cudnn", "xla"):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
  t = q.shape[1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  logits = logits * q.shape[-1] ** -0.5
  mask = jnp.tril(jnp.ones((t, t), bool))
  weights = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class Block(nnx.Module):
  """Pre-LayerNorm: x + attention(LN(x)), then x + MLP(LN(x))."""

  def __init__(self, config: Config, attention: str, *, rngs: nnx.Rngs):
    kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16, "rngs": rngs}
    self.heads = config.heads
    self.attention = attention
    self.ln1 = nnx.LayerNorm(config.width, **kw)
    self.qkv = nnx.Linear(config.width, 3 * config.width, **kw)
    self.proj = nnx.Linear(config.width, config.width, **kw)
    self.ln2 = nnx.LayerNorm(config.width, **kw)
    self.fc = nnx.Linear(config.width, config.mlp, **kw)
    self.out = nnx.Linear(config.mlp, config.width, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    x = x + self.proj(causal_attention(q, k, v, self.attention).reshape(b, t, d))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
  """Token and learned position embeddings, blocks, final LayerNorm, tied head."""

  def __init__(self, config: Config, attention: str, *, rngs: nnx.Rngs):
    kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16, "rngs": rngs}
    self.wte = nnx.Embed(config.vocab, config.width, **kw)
    self.wpe = nnx.Embed(config.context, config.width, **kw)
    self.blocks = _LIST([Block(config, attention, rngs=rngs) for _ in range(config.layers)])
    self.ln_f = nnx.LayerNorm(config.width, **kw)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
    for block in self.blocks:
      x = block(x)
    return self.wte.attend(self.ln_f(x))  # the tied head: bfloat16 logits


def _path_names(path: tuple[Any, ...]) -> list[str]:
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  return [n for n in names if n != "value"]


def make_model(config: Config, attention: str, seed: int = 0):
  """``(graphdef, params)``: the split model, its parameters on the device.

  The model is built abstractly (``nnx.eval_shape``) and its bfloat16
  parameters filled with NumPy: GPT-2's initialisation (normal, std 0.02, the
  residual projections' scaled by ``1 / sqrt(2 layers)``; LayerNorm scales 1,
  biases 0), with no eager jax op leaving temporaries on the device.
  """
  abstract = nnx.eval_shape(lambda: GPT(config, attention, rngs=nnx.Rngs(0)))
  graphdef, shapes = nnx.split(abstract, nnx.Param)
  rng = np.random.default_rng(seed)

  def fill(path, x):
    names = _path_names(path)
    if names[-1] == "scale":
      value = np.ones(x.shape, np.float32)
    elif names[-1] == "bias":
      value = np.zeros(x.shape, np.float32)
    else:
      std = 0.02 * ((2 * config.layers) ** -0.5 if names[-2] in ("proj", "out") else 1.0)
      value = std * rng.standard_normal(x.shape, np.float32)
    return value.astype(x.dtype)

  return graphdef, jax.device_put(jax.tree.map_with_path(fill, shapes))


def make_loss(graphdef: Any) -> Callable[[Any, jax.Array], jax.Array]:
  def loss_fn(params, tokens):
    """Mean next-token cross-entropy of (batch, T + 1) tokens, in float32."""
    model = nnx.merge(graphdef, params)
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return loss_fn


def make_tokens(batch: int, config: Config, seed: int = 0) -> jax.Array:
  rng = np.random.default_rng(seed)
  return jax.device_put(rng.integers(0, config.vocab, (batch, config.context + 1), np.int32))


def resolve_attention(requested: str, config: Config) -> str:
  """``auto``: cuDNN's fused kernel on a GPU where its gradient compiles, else XLA's."""
  if requested != "auto":
    return requested
  if not _has_fused_attention():
    return "manual"
  if jax.default_backend() != "gpu":
    return "xla"
  q = jnp.zeros((1, config.context, config.heads, config.width // config.heads), jnp.bfloat16)

  def f(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return out.astype(jnp.float32).sum()

  try:
    jax.block_until_ready(jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, q, q))
  except Exception as e:  # no cuDNN, or none with this attention
    print(f"cuDNN attention unavailable ({type(e).__name__}: {str(e)[:200]}); using XLA's")
    return "xla"
  return "cudnn"


# The three ways of taking one batch's gradient.


def full_batch(loss: Callable, num_microbatches: int) -> Callable:
  del num_microbatches
  return jax.value_and_grad(loss)


def hand_written_scan(loss: Callable, num_microbatches: int) -> Callable:
  """The loop users write: reshape to (N, micro, ...), scan, float32 sums, divide by N."""

  def value_and_grad(params, tokens):
    microbatches = tokens.reshape(num_microbatches, -1, *tokens.shape[1:])

    def body(total, microbatch):
      out = jax.value_and_grad(loss)(params, microbatch)
      return jax.tree.map(lambda s, x: s + x.astype(jnp.float32), total, out), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (jnp.zeros(()), params))
    (value, grads), _ = jax.lax.scan(body, zeros, microbatches)
    return value / num_microbatches, jax.tree.map(
        lambda g, p: (g / num_microbatches).astype(p.dtype), grads, params
    )

  return value_and_grad


def accum_jax_value_and_grad(loss: Callable, num_microbatches: int) -> Callable:
  return accum_jax.value_and_grad(loss, num_microbatches)


METHODS: dict[str, Callable[[Callable, int], Callable]] = {
    ACCUM: accum_jax_value_and_grad,
    SCAN: hand_written_scan,
    FULL: full_batch,
}

# --quick: the scan first (the reference), then the door's three ways of judging
# non-finite data, then the full batch.
QUICK_METHODS: dict[str, Callable[[Callable, int], Callable]] = {
    SCAN: hand_written_scan,
    DEFAULT: accum_jax_value_and_grad,
    MICROBATCH: lambda loss, n: accum_jax.value_and_grad(loss, n, skip_nonfinite="microbatch"),
    NO_SKIP: lambda loss, n: accum_jax.value_and_grad(loss, n, skip_nonfinite=False),
    FULL: full_batch,
}


def build_step(
    method: str, num_microbatches: int, micro: int, tiny: bool, attention: str
) -> tuple[Any, tuple[Any, Any]]:
  """The jitted step of one (method, N, micro) and its arguments: the peak worker's builder."""
  config = TINY if tiny else GPT2_SMALL
  graphdef, params = make_model(config, attention)
  step = jax.jit(METHODS[method](make_loss(graphdef), num_microbatches))
  return step, (params, make_tokens(num_microbatches * micro, config))


# Errors: running out of memory is a result, not a failure.


def is_oom(error: BaseException) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def error_status(error: BaseException) -> str:
  if is_oom(error):
    return "OOM"
  return f"error: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def worker_status(error: BaseException) -> str:
  """A fresh-process measurement that failed: OOM, timeout or error."""
  if isinstance(error, subprocess.TimeoutExpired):
    return "timeout"
  return error_status(error)


# Comparisons.


def rel_diff(a: Any, b: Any) -> float:
  """The largest |a - b| of any leaf, relative to the largest |b| of that leaf, in float32."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)
    scale = float(np.max(np.abs(y))) or 1.0
    worst = max(worst, float(np.max(np.abs(x - y))) / scale)
  return worst


def compare(
    out: tuple[Any, Any], reference: tuple[Any, Any], *, check: bool = True
) -> dict[str, Any]:
  """Loss and gradient against a reference; ``check``: with the verdict (``match``)."""
  loss_diff = rel_diff(out[0], reference[0])
  grad_diff = rel_diff(out[1], reference[1])
  result = {
      "loss": float(out[0]),
      "reference_loss": float(reference[0]),
      "loss_rel_diff": loss_diff,
      "grad_max_rel_diff": grad_diff,
  }
  if check:
    result["match"] = loss_diff <= LOSS_RTOL and grad_diff <= GRAD_RTOL
  return result


# Time budget.


class Budget:
  """Deadlines: each phase may start new work until its share of ``seconds`` is spent."""

  # Cumulative shares of the budget at which the phases stop starting new work.
  SHARES = {"memory": 0.4, "step": 0.75, "across_calls": 0.85, "fit": 1.0}
  # --quick: the inside-step pairs, then across calls, both doors in one table.
  QUICK_SHARES = {"step": 0.5, "across_calls": 0.93}

  def __init__(self, seconds: float, shares: dict[str, float] | None = None):
    self.start = time.perf_counter()
    self.seconds = seconds
    self.shares = shares or self.SHARES

  def left(self, phase: str) -> bool:
    if not self.seconds:
      return True
    return time.perf_counter() - self.start < self.seconds * self.shares[phase]


# Inside one step: peak memory (fresh processes), then time and exactness (here).


def step_configurations(ns: list[int], micros: list[int], max_batch: int):
  """The (N, micro) pairs with N x micro <= max_batch, smallest batch first; and the rest."""
  pairs = [(n, m) for n in ns for m in micros]
  kept = sorted((p for p in pairs if p[0] * p[1] <= max_batch), key=lambda p: (p[0] * p[1], p))
  return kept, [p for p in pairs if p[0] * p[1] > max_batch]


def memory_jobs(pairs: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
  """(method, N, micro) to measure; the full batch once per batch size."""
  jobs, batches = [], set()
  for n, micro in pairs:
    jobs += [(ACCUM, n, micro), (SCAN, n, micro)]
    if n * micro not in batches:
      batches.add(n * micro)
      jobs.append((FULL, 1, n * micro))
  return jobs


def measure_memory(
    jobs: list[tuple[str, int, int]], *, tiny: bool, attention: str, workers: int,
    budget: Budget, timeout: float,
) -> dict[tuple[str, int, int], dict[str, Any]]:
  import concurrent.futures

  def one(job):
    method, n, micro = job
    if not budget.left("memory"):
      return {"status": "skipped (budget)"}
    config = {"method": method, "num_microbatches": n, "micro": micro, "tiny": tiny,
              "attention": attention}
    try:
      result = fresh_process_peak("bench_gpu:build_step", config, timeout=timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
      status = worker_status(e)
      print(f"  peak {method} N={n} micro={micro}: {status}", flush=True)
      return {"status": status}
    print(f"  peak {method} N={n} micro={micro}: {result['step_peak_bytes'] / _MIB:.1f} MiB"
          f"{' (masked)' if result.get('masked') else ''}", flush=True)
    return {"status": "ok", **result}

  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    return dict(zip(jobs, pool.map(one, jobs)))


def _report_failure(method: str, error: BaseException) -> str:
  status = error_status(error)
  if status != "OOM":
    traceback.print_exc()
  print(f"    {method}: {status}", flush=True)
  return status


def _compile(fn: Callable, *args: Any) -> tuple[Any, float]:
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - start


def measure_steps(
    pairs: list[tuple[int, int]], loss: Callable, params: Any, config: Config, *,
    rounds: int, budget: Budget, on_group: Callable[[], None],
    methods: dict[str, Callable[[Callable, int], Callable]] | None = None,
    warmup_compile: bool = False,
) -> dict[tuple[int, int], dict[str, Any]]:
  """Per (N, micro): each method compiled once, run once (compared), then timed in turns.

  ``methods`` (default :data:`METHODS`): each one other than the scan and the full
  batch is checked against the scan; the first of them is ``exact``, all are in
  ``checks``. ``warmup_compile``: before the methods of the first pair of each
  microbatch size, the gradient of one microbatch is compiled and thrown away, so
  that no method's compile time holds the process's one-time initialisation or
  the first tuning of that shape's kernels (the first method, the scan, paid it).
  """
  methods = METHODS if methods is None else methods
  checked = [m for m in methods if m not in (SCAN, FULL)]
  full_steps: dict[int, dict[str, Any]] = {}  # by batch size: compiled once, or its failure
  warmed: set[int] = set()  # the microbatch sizes whose gradient was compiled to warm up
  rows: dict[tuple[int, int], dict[str, Any]] = {}
  for n, micro in pairs:
    batch = n * micro
    row: dict[str, Any] = {"num_microbatches": n, "micro": micro, "batch": batch, "methods": {}}
    rows[n, micro] = row
    if not budget.left("step"):
      row["status"] = "skipped (budget)"
      continue
    print(f"  N={n} micro={micro} (batch {batch})", flush=True)
    tokens = make_tokens(batch, config, seed=batch)
    if warmup_compile and micro not in warmed:  # once per microbatch shape
      _compile(jax.value_and_grad(loss), params, tokens[:micro])
      warmed.add(micro)
    compiled, outputs = {}, {}
    for method in methods:
      cached = full_steps.get(batch) if method == FULL else None
      if cached is not None:  # the full batch of this size, compiled for an earlier row
        step, entry = cached["step"], dict(cached["entry"])
      else:
        step, entry = None, {}
        try:
          step, seconds = _compile(methods[method](loss, n), params, tokens)
          entry.update(compile_s=seconds, xla=memory_analysis_dict(step))
        except Exception as e:
          entry["status"] = _report_failure(method, e)
        if step is not None:
          try:
            outputs[method] = jax.block_until_ready(step(params, tokens))
            entry["status"] = "ok"
          except Exception as e:
            step, entry["status"] = None, _report_failure(method, e)
        if method == FULL:
          full_steps[batch] = {"step": step, "entry": dict(entry)}
      if step is not None and method not in outputs:  # the cached full batch
        try:
          outputs[method] = jax.block_until_ready(step(params, tokens))
        except Exception as e:
          step, entry["status"] = None, _report_failure(method, e)
      if step is not None:
        compiled[method] = step
      row["methods"][method] = entry

    if SCAN in outputs:
      checks = {m: compare(outputs[m], outputs[SCAN]) for m in checked if m in outputs}
      if checked[0] in checks:
        row["exact"] = checks[checked[0]]
      if len(checked) > 1:
        row["checks"] = checks
    if checked[0] in outputs and FULL in outputs:
      # Not a check: the full batch sums its bfloat16 gradient (the embedding's
      # scatter-add, the weights' products) over all B sequences in bfloat16.
      row["vs_full"] = compare(outputs[checked[0]], outputs[FULL], check=False)
    del outputs
    if compiled:
      calls = {m: (lambda s=s, t=tokens: s(params, t)) for m, s in compiled.items()}
      try:
        samples = time_interleaved(calls, rounds=rounds, warmup=1)
      except Exception as e:
        row["status"] = f"timing failed: {error_status(e)}"
        traceback.print_exc()
      else:
        for method, times in samples.items():
          row["methods"][method].update(
              step_ms=1e3 * statistics.median(times),
              step_ms_p25_p75=[1e3 * q for q in quartiles(times)],
              step_ms_samples=[1e3 * t for t in times],
          )
    row.setdefault("status", "ok")
    del compiled, tokens
    on_group()
  return rows


# Across calls: accumulate against optax.MultiSteps.


def _update_step(tx: optax.GradientTransformation) -> Callable:
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def measure_across_calls(
    ns: list[int], params: Any, *, rounds: int, budget: Budget
) -> list[dict[str, Any]]:
  """Per N: each call of a window timed, both optimizers taking turns window by window."""
  keys = jax.random.split(jax.random.key(1), 2)
  grads = [
      jax.tree.map(lambda p, k=k: 1e-3 * jax.random.normal(k, p.shape, p.dtype), params)
      for k in keys
  ]
  results = []
  for n in ns:
    if n < 2:
      continue
    if not budget.left("across_calls"):
      results.append({"every_k": n, "status": "skipped (budget)"})
      continue
    print(f"  every_k={n}", flush=True)
    txs = {
        ACCUM: accum_jax.accumulate(optax.adamw(1e-4), every_k=n),
        MULTISTEPS: optax.MultiSteps(optax.adamw(1e-4), every_k_schedule=n)
        .gradient_transformation(),
    }
    entry: dict[str, Any] = {"every_k": n}
    try:
      carries, steps = {}, {}
      for name, tx in txs.items():
        own = jax.tree.map(jnp.copy, params)  # donated: each its own copy
        carries[name] = (own, tx.init(own))
        steps[name] = _update_step(tx)
        entry[name] = {"state_bytes": tree_nbytes(carries[name][1])}
      per_call: dict[str, list[list[float]]] = {name: [] for name in txs}

      def window(name):
        times = []
        p, s = carries[name]
        for i in range(n):
          start = time.perf_counter()
          p, s = jax.block_until_ready(steps[name](p, s, grads[i % 2]))
          times.append(time.perf_counter() - start)
        carries[name] = (p, s)
        return times

      for name in txs:  # compile and warm up: one window each
        window(name)
      names = list(txs)
      for r in range(rounds):
        for name in names[r % 2:] + names[: r % 2]:
          per_call[name].append(window(name))
      for name, windows in per_call.items():
        micro = [t for w in windows for t in w[:-1]]
        entry[name].update(
            micro_step_ms=1e3 * statistics.median(micro),
            apply_step_ms=1e3 * statistics.median(w[-1] for w in windows),
            window_ms=1e3 * statistics.median(sum(w) for w in windows),
            call_ms_samples=[[1e3 * t for t in w] for w in windows],
        )
      for key in ("micro_step_ms", "apply_step_ms", "window_ms"):
        entry[key.replace("_ms", "_ratio")] = entry[ACCUM][key] / entry[MULTISTEPS][key]
      entry["status"] = "ok"
    except Exception as e:
      entry["status"] = error_status(e)
      if entry["status"] != "OOM":
        traceback.print_exc()
    results.append(entry)
    carries = steps = {}
  return results


# --quick, across calls: floors, accumulate in both layouts, MultiSteps; alone and
# in the step that takes the gradient.

VECTOR = "floor: one f32 vector acc += g"
PER_LEAF = "floor: per-leaf acc += g (jax.tree.map)"
HAND_COND = "floor: hand-written lax.cond(emit, adamw, skip)"
PLAIN = "floor: plain adamw step"
MULTISTEPS_ADAMW = "optax.MultiSteps(adamw)"
LAYOUTS = ("tree", "flat")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One way of handling a call's gradient: its state and its update, both of plain arrays.

  ``update(params, state, grads) -> (params, state)`` is jitted with the
  parameters and the state donated. ``vector_grads``: standing alone, it is
  handed the gradient as one vector (the floor of memory traffic).
  """

  init: Callable[[Any], Any]
  update: Callable[[Any, Any, Any], tuple[Any, Any]]
  vector_grads: bool = False


def _ravel(tree: Any) -> jax.Array:
  return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])


def _vector_floor() -> Candidate:
  def update(params, acc, grads):
    g = grads if isinstance(grads, jax.Array) else _ravel(grads)
    return params, acc + g.astype(jnp.float32)

  return Candidate(lambda p: jnp.zeros(sum(x.size for x in jax.tree.leaves(p)), jnp.float32),
                   update, vector_grads=True)


def _per_leaf_floor() -> Candidate:
  def update(params, acc, grads):
    return params, jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)

  return Candidate(lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p), update)


def _hand_written_cond(inner: optax.GradientTransformation, every_k: int) -> Candidate:
  """What a careful user writes: a float32 tree, the inner update under a kept conditional.

  The skip branch only passes its operands through, so XLA:GPU keeps the
  conditional (it turns one whose branches hold only cheap ops into selects of
  both); the zero updates and the reset are ``where``s outside it.
  """

  def init(params):
    acc = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
    return jnp.zeros((), jnp.int32), acc, inner.init(params)

  def update(params, state, grads):
    count, acc, inner_state = state
    count = count + 1
    acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
    emit = count % every_k == 0

    def apply(acc, inner_state, params):
      mean = jax.tree.map(lambda a, p: (a / every_k).astype(p.dtype), acc, params)
      return inner.update(mean, inner_state, params)

    def skip(acc, inner_state, params):
      return params, inner_state  # the parameters stand in for the updates' shapes

    updates, inner_state = jax.lax.cond(emit, apply, skip, acc, inner_state, params)
    updates = jax.tree.map(lambda u: jnp.where(emit, u, jnp.zeros_like(u)), updates)
    acc = jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc)
    return optax.apply_updates(params, updates), (count, acc, inner_state)

  return Candidate(init, update)


def _optimizer(tx: optax.GradientTransformation) -> Candidate:
  """An Optax transformation's update and ``apply_updates``, every call."""

  def update(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return Candidate(tx.init, update)


def _inner(name: str) -> optax.GradientTransformation:
  if name == "sgd":
    return optax.sgd(1e-3)
  if name == "adamw":
    return optax.adamw(1e-4)
  return optax.contrib.muon(1e-3)


def across_candidates(every_k: int) -> dict[str, Candidate]:
  """The rows of the quick across-calls table, references first."""
  rows: dict[str, Candidate] = {
      VECTOR: _vector_floor(),
      PER_LEAF: _per_leaf_floor(),
      HAND_COND: _hand_written_cond(_inner("adamw"), every_k),
      PLAIN: _optimizer(_inner("adamw")),
      MULTISTEPS_ADAMW: _optimizer(
          optax.MultiSteps(_inner("adamw"), every_k).gradient_transformation()),
  }
  for inner in ("adamw", "sgd", "muon"):
    for layout in LAYOUTS:
      rows[accumulate_row(inner, layout)] = _optimizer(
          accum_jax.accumulate(_inner(inner), every_k=every_k, layout=layout))
  return rows


def accumulate_row(inner: str, layout: str) -> str:
  return f"accumulate({inner}), {layout}"


def _window_times(step: Callable, carry: list[Any], grads: Any, every_k: int) -> list[float]:
  """Seconds of each call of one window; ``carry`` holds ``[params, state]``, updated."""
  times = []
  for _ in range(every_k):
    start = time.perf_counter()
    carry[:] = jax.block_until_ready(step(*carry, grads))
    times.append(time.perf_counter() - start)
  return times


def measure_quick_across(
    params: Any, loss: Callable, tokens: jax.Array, *, every_k: int, rounds: int,
    budget: Budget, combined: bool, names: Collection[str] | None = None,
) -> dict[str, dict[str, Any]]:
  """Each row a window at a time, taking turns: micro-step, last call, window, compile.

  ``combined``: the jitted call takes the gradient of ``tokens`` (one sequence)
  and updates, as users jit a step; else it is handed a fixed gradient.
  ``names``: the rows to measure (None: all of :func:`across_candidates`).
  """
  keys = jax.random.split(jax.random.key(1), 2)
  grads = jax.tree.map(lambda p, k=keys[0]: 1e-3 * jax.random.normal(k, p.shape, p.dtype), params)
  vector = _ravel(grads)
  results: dict[str, dict[str, Any]] = {}
  steps, carries, inputs = {}, {}, {}
  for name, candidate in across_candidates(every_k).items():
    if names is not None and name not in names:
      continue
    if not budget.left("across_calls"):
      results[name] = {"status": "skipped (budget)"}
      continue
    if combined:
      def call(params, state, tokens, update=candidate.update):
        return update(params, state, jax.grad(loss)(params, tokens))
      inputs[name] = tokens
    else:
      call = candidate.update
      inputs[name] = vector if candidate.vector_grads else grads
    print(f"  {name}", flush=True)
    own = jax.tree.map(jnp.copy, params)  # donated: each its own copy
    try:
      state = jax.jit(candidate.init)(own)
      start = time.perf_counter()
      steps[name] = jax.jit(call, donate_argnums=(0, 1)).lower(own, state, inputs[name]).compile()
      results[name] = {"compile_s": time.perf_counter() - start,
                       "xla": memory_analysis_dict(steps[name]), "state_bytes": tree_nbytes(state)}
      carries[name] = [own, state]
      _window_times(steps[name], carries[name], inputs[name], every_k)  # warm-up
    except Exception as e:
      results[name] = {"status": _report_failure(name, e)}
      steps.pop(name, None)
      carries.pop(name, None)
  per_call: dict[str, list[list[float]]] = {name: [] for name in steps}
  names = list(steps)
  for r in range(rounds if names else 0):
    for name in names[r % len(names):] + names[:r % len(names)]:
      per_call[name].append(_window_times(steps[name], carries[name], inputs[name], every_k))
  for name, windows in per_call.items():
    micro = [t for w in windows for t in w[:-1]]
    results[name].update(
        status="ok",
        micro_step_ms=1e3 * statistics.median(micro),
        last_call_ms=1e3 * statistics.median(w[-1] for w in windows),
        window_ms=1e3 * statistics.median(sum(w) for w in windows),
        call_ms_samples=[[1e3 * t for t in w] for w in windows],
    )
  return results


# The largest batch that fits.


def measure_fit(
    loss: Callable, params: Any, config: Config, *, known: int | None, cap: int, factor: int,
    rounds: int, budget: Budget,
) -> dict[str, Any]:
  """Doubles the full batch until OOM (or ``cap``), then runs ``factor`` times it microbatched.

  ``known``: the largest full batch that already ran (the step section's); the
  doubling starts at twice it.
  """
  result: dict[str, Any] = {"cap": cap, "factor": factor, "tried": []}
  largest = None
  if known is not None:
    largest = min(known, cap)
    result["tried"].append({"batch": largest, "status": "ok (step section)"})
  batch = 2 * largest if largest else 1
  while batch <= cap:
    if not budget.left("fit"):
      result["status"] = "skipped (budget)"
      break
    print(f"  full batch {batch}", flush=True)
    tokens = make_tokens(batch, config, seed=batch)
    try:
      step, seconds = _compile(METHODS[FULL](loss, 1), params, tokens)
      jax.block_until_ready(step(params, tokens))
      start_time = time.perf_counter()
      jax.block_until_ready(step(params, tokens))
      result["tried"].append({"batch": batch, "status": "ok", "compile_s": seconds,
                              "step_ms": 1e3 * (time.perf_counter() - start_time),
                              "xla": memory_analysis_dict(step)})
      largest = batch
    except Exception as e:
      status = error_status(e)
      result["tried"].append({"batch": batch, "status": status})
      if status != "OOM":
        traceback.print_exc()
      break
    finally:
      step = tokens = None
    batch *= 2
  result["largest_full_batch"] = largest
  result["cap_reached"] = largest is not None and largest * 2 > cap
  if largest is None or not budget.left("fit"):
    result.setdefault("status", "no full batch ran" if largest is None else "skipped (budget)")
    return result

  big = factor * largest
  tokens = make_tokens(big, config, seed=big)
  result["batch"] = big
  outputs, steps = {}, {}
  for method in (ACCUM, SCAN):
    n, status = factor, "no microbatch size divides the batch"
    while big % n == 0:
      print(f"  {method}: batch {big} as N={n} x {big // n}", flush=True)
      try:
        step, seconds = _compile(METHODS[method](loss, n), params, tokens)
        outputs[method] = jax.block_until_ready(step(params, tokens))
      except Exception as e:
        status = error_status(e)
        result.setdefault("failed", []).append({"method": method, "num_microbatches": n,
                                                "status": status})
        if status != "OOM":
          traceback.print_exc()
          break
        n *= 2  # smaller microbatches
        continue
      steps[method] = step
      result[method] = {"num_microbatches": n, "micro": big // n, "status": "ok",
                        "compile_s": seconds, "xla": memory_analysis_dict(step)}
      break
    if method not in steps:
      result[method] = {"status": status}
  if ACCUM in outputs and SCAN in outputs:
    result["exact"] = compare(outputs[ACCUM], outputs[SCAN])
  del outputs
  if steps:
    calls = {m: (lambda s=s: s(params, tokens)) for m, s in steps.items()}
    try:
      samples = time_interleaved(calls, rounds=rounds, warmup=0)
    except Exception as e:
      result["timing"] = error_status(e)
    else:
      for method, times in samples.items():
        result[method].update(step_ms=1e3 * statistics.median(times),
                              step_ms_samples=[1e3 * t for t in times])
  result["status"] = "ok" if "exact" in result else "incomplete"
  return result


# Report.


def flops_per_token(config: Config, param_count: int) -> float:
  """nanoGPT's estimate: 6 per parameter (less the position embeddings) + attention."""
  return 6 * (param_count - config.context * config.width) + (
      12 * config.layers * config.width * config.context
  )


def _mib(x: Any) -> str:
  return "-" if x is None else f"{x / _MIB:.1f}"


def _ratio(a: Any, b: Any) -> str:
  return "-" if a is None or b is None or not b else f"{a / b:.3f}"


def _time_cell(entry: dict[str, Any]) -> str:
  if entry.get("step_ms") is not None:
    return f"{entry['step_ms']:.2f}"
  return entry.get("status", "-")


def _peak_cell(entry: dict[str, Any]) -> str:
  memory = entry.get("memory") or {}
  if memory.get("status") != "ok":
    return memory.get("status", "-")
  return _mib(memory["step_peak_bytes"]) + (" (masked)" if memory.get("masked") else "")


def step_tables(config: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[str, str]:
  time_rows, memory_rows = [], []
  fpt = config["flops_per_token"]
  for row in rows:
    m = row["methods"]
    accum, scan, full = (m.get(k, {}) for k in METHOD_NAMES)
    head = [row["num_microbatches"], row["micro"], row["batch"]]
    if row["status"].startswith("skipped"):
      time_rows.append(head + [row["status"]] + ["-"] * 8)
      memory_rows.append(head + [row["status"]] + ["-"] * 7)
      continue
    exact, vs_full = row.get("exact"), row.get("vs_full")
    tflops = (f"{fpt * row['batch'] * config['model']['context'] / accum['step_ms'] / 1e9:.3g}"
              if accum.get("step_ms") else "-")
    time_rows.append(head + [
        _time_cell(accum), _time_cell(scan), _time_cell(full),
        _ratio(accum.get("step_ms"), scan.get("step_ms")),
        _ratio(accum.get("step_ms"), full.get("step_ms")),
        tflops,
        f"{exact['loss_rel_diff']:.1e} / {exact['grad_max_rel_diff']:.1e}" if exact else "-",
        ("yes" if exact["match"] else "NO") if exact else "-",
        f"{vs_full['grad_max_rel_diff']:.1e}" if vs_full else "-",
    ])
    peaks = [(e.get("memory") or {}).get("step_peak_bytes")
             if (e.get("memory") or {}).get("status") == "ok" else None
             for e in (accum, scan, full)]
    memory_rows.append(head + [
        _peak_cell(accum), _peak_cell(scan), _peak_cell(full),
        _ratio(peaks[0], peaks[1]), _ratio(peaks[0], peaks[2]),
        *(_mib(e.get("xla", {}).get("temp_bytes")) for e in (accum, scan, full)),
    ])
  time_table = markdown_table(
      ["N", "micro", "batch", "accum_jax ms", "lax.scan ms", "full batch ms", "vs scan",
       "vs full", "accum_jax TFLOP/s", "vs scan: loss / grad rel diff", "match",
       "vs full: grad rel diff"],
      time_rows,
  )
  memory_table = markdown_table(
      ["N", "micro", "batch", "accum_jax peak MiB", "lax.scan peak MiB", "full batch peak MiB",
       "vs scan", "vs full", "accum_jax XLA temp MiB", "lax.scan XLA temp MiB",
       "full batch XLA temp MiB"],
      memory_rows,
  )
  return time_table, memory_table


def across_calls_table(results: list[dict[str, Any]]) -> str:
  rows = []
  for r in results:
    if r["status"] != "ok":
      rows.append([r["every_k"], r["status"]] + ["-"] * 9)
      continue
    a, o = r[ACCUM], r[MULTISTEPS]
    rows.append([
        r["every_k"], f"{a['micro_step_ms']:.3f}", f"{o['micro_step_ms']:.3f}",
        f"{r['micro_step_ratio']:.3f}", f"{a['apply_step_ms']:.3f}", f"{o['apply_step_ms']:.3f}",
        f"{a['window_ms']:.3f}", f"{o['window_ms']:.3f}", f"{r['window_ratio']:.3f}",
        _mib(a["state_bytes"]), _mib(o["state_bytes"]),
    ])
  return markdown_table(
      ["every_k", "accum_jax micro-step ms", "MultiSteps micro-step ms", "ratio",
       "accum_jax last call ms", "MultiSteps last call ms", "accum_jax window ms",
       "MultiSteps window ms", "ratio", "accum_jax state MiB", "MultiSteps state MiB"],
      rows,
  )


def fit_table(fit: dict[str, Any]) -> str:
  rows = [[f"full batch {t['batch']}", t["status"],
           f"{t['step_ms']:.2f}" if "step_ms" in t else "-",
           _mib(t.get("xla", {}).get("temp_bytes")), "-"] for t in fit["tried"]]
  exact = fit.get("exact")
  for method in (ACCUM, SCAN):
    e = fit.get(method)
    if e is None:
      continue
    label = (f"{method} {fit['batch']} = {e['num_microbatches']} x {e['micro']}"
             if e.get("status") == "ok" else f"{method} {fit['batch']}")
    diff = (f"loss {exact['loss_rel_diff']:.1e}, grad {exact['grad_max_rel_diff']:.1e}"
            if exact and method == ACCUM else "-")
    rows.append([label, e["status"], f"{e['step_ms']:.2f}" if "step_ms" in e else "-",
                 _mib(e.get("xla", {}).get("temp_bytes")), diff])
  return markdown_table(["step", "status", "step ms (full batch: one call)", "XLA temp MiB",
                         "vs lax.scan: rel diff"], rows)


# The one table of --quick, and the before column of --compare.

INSIDE, ACROSS = "inside a step", "across calls"
# Per across-calls case: the reference of its ratios.
ACROSS_CASES = {
    "micro-step": ("micro_step_ms", HAND_COND),
    "window of 8": ("window_ms", MULTISTEPS_ADAMW),
}
# Method names of earlier JSON (bench_gpu.py before --quick) in today's rows.
LEGACY_ROWS = {ACCUM: DEFAULT, SCAN: SCAN, FULL: FULL}


def _record(door: str, case: str, row: str, ref: str, entry: dict[str, Any],
            ms_key: str) -> dict[str, Any]:
  xla = entry.get("xla") or {}
  memory = (xla["temp_bytes"] + xla["output_bytes"]
            if "temp_bytes" in xla and "output_bytes" in xla else None)
  return {"door": door, "case": case, "row": row, "ref": ref, "ms": entry.get(ms_key),
          "compile_s": entry.get("compile_s"), "memory_bytes": memory,
          "status": entry.get("status", "-")}


def records_of(output: dict[str, Any]) -> list[dict[str, Any]]:
  """The rows of the one table, from a run's JSON, this script's of any version."""
  records = []
  for row in output.get("results", []):
    case = f"{row['num_microbatches']}x{row['micro']}"
    for method, entry in row.get("methods", {}).items():
      records.append(_record(INSIDE, case, LEGACY_ROWS.get(method, method), SCAN, entry,
                             "step_ms"))
  for form, results in (output.get("quick_across") or {}).items():
    suffix = "" if form == "standalone" else " + gradient"
    for name, entry in results.items():
      for case, (key, ref) in ACROSS_CASES.items():
        records.append(_record(ACROSS, case + suffix, name, ref, entry, key))
  for entry in output.get("across_calls") or []:  # the full run's accumulate / MultiSteps
    if entry.get("status") != "ok" or entry["every_k"] != 8:
      continue
    for name, row in ((ACCUM, accumulate_row("adamw", "tree")), (MULTISTEPS, MULTISTEPS_ADAMW)):
      for case, (key, ref) in ACROSS_CASES.items():
        records.append(_record(ACROSS, case, row, ref, {"status": "ok", **entry[name]}, key))
  return records


def _ratios(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
  """Records by (door, case, row), each with its ratios to its reference's figures."""
  by_key = {(r["door"], r["case"], r["row"]): dict(r) for r in records}
  for (door, case, _), r in by_key.items():
    ref = by_key.get((door, case, r["ref"]), {})
    for field in ("ms", "compile_s", "memory_bytes"):
      a, b = r.get(field), ref.get(field)
      r[f"{field}_ratio"] = a / b if a is not None and b else None
  return by_key


def source_label(output: dict[str, Any], path: str | None = None) -> str:
  """The card, JAX and commit a run was measured with."""
  config = output.get("config", {})
  commit = config.get("commit")
  if not commit and path:
    found = re.search(r"-([0-9a-f]{7,40})\.json$", path)
    commit = found.group(1) if found else None
  jax_version = config.get("environment", {}).get("jax", "?")
  return f"{config.get('device_kind', '?')}, jax {jax_version}, at {commit or 'unknown commit'}"


def _cell(value: Any, scale: float = 1.0, digits: int = 2) -> str:
  return "-" if value is None else f"{value * scale:.{digits}f}"


def one_table(records: list[dict[str, Any]], before: list[dict[str, Any]] | None = None) -> str:
  """Both doors in one table; with ``before``, its time and ratio beside each row it has."""
  now = _ratios(records)
  then = _ratios(before) if before else {}
  rows = []
  for key, r in now.items():
    door, case, row = key
    ok = r["ms"] is not None
    cells = [door, case, row, _cell(r["ms"], digits=3) if ok else r["status"].split(":")[0],
             _cell(r["ms_ratio"], digits=3), _cell(r["compile_s"]),
             _cell(r["compile_s_ratio"]), _cell(r["memory_bytes"], 1 / _MIB, 1),
             _cell(r["memory_bytes_ratio"])]
    if before is not None:
      old = then.get(key, {})
      cells += [_cell(old.get("ms"), digits=3), _cell(old.get("ms_ratio"), digits=3)]
    rows.append(cells)
  headers = ["door", "case", "row", "ms", "x ref", "compile s", "x ref", "temp + output MiB",
             "x ref"]
  if before is not None:
    headers += ["before ms", "before x ref"]
  return markdown_table(headers, rows)


def goals(records: list[dict[str, Any]]) -> list[list[str]]:
  """The figures issues 27 and 28 set goals for: (figure, measured, goal)."""
  by_key = _ratios(records)
  out = []
  for (door, case, row), r in by_key.items():
    if door == INSIDE and row == DEFAULT:
      out.append([f"default / lax.scan step time, {case}", _cell(r["ms_ratio"], digits=3),
                  "<= 1.02"])
      out.append([f"default / lax.scan compile time, {case}", _cell(r["compile_s_ratio"]),
                  "<= 1.3"])
  for suffix in ("", " + gradient"):
    flat = by_key.get((ACROSS, "micro-step" + suffix, accumulate_row("adamw", "flat")), {})
    floor = by_key.get((ACROSS, "micro-step" + suffix, PER_LEAF), {})
    ratio = flat["ms"] / floor["ms"] if flat.get("ms") and floor.get("ms") else None
    out.append([f"accumulate(adamw), flat / per-leaf floor, micro-step{suffix}",
                _cell(ratio, digits=3), "<= 0.5 (GPU)"])
    window = by_key.get((ACROSS, "window of 8" + suffix, accumulate_row("adamw", "flat")), {})
    out.append([f"accumulate(adamw), flat / MultiSteps, window{suffix}",
                _cell(window.get("ms_ratio"), digits=3), "<= 0.5 (GPU)"])
  return out


def print_quick(output: dict[str, Any], before: dict[str, Any] | None,
                before_path: str | None) -> None:
  records = output["records"]
  print("\nboth doors: step time in ms (inside a step: median of interleaved rounds; across calls:"
        " median micro-step and window, rows taking turns a window at a time), compile s (after"
        " a warm-up compile), temp + output = compiled.memory_analysis().\nx ref: to lax.scan at"
        f" the same N x micro; micro-steps to '{HAND_COND}'; windows to '{MULTISTEPS_ADAMW}';"
        " '+ gradient': the gradient of one sequence in the same jit")
  if before is not None:
    print(f"now: {source_label(output)}; before: {source_label(before, before_path)}")
  print(one_table(records, records_of(before) if before is not None else None))
  print()
  print(markdown_table(["figure", "measured", "goal"], output["goals"]))


def header(config: dict[str, Any]) -> str:
  m = config["model"]
  env = config["environment"]
  return (
      f"GPT ({'tiny' if config['tiny'] else 'GPT-2 small'}): {m['layers']} layers, width"
      f" {m['width']}, {m['heads']} heads, MLP {m['mlp']}, vocabulary {m['vocab']}, context"
      f" {m['context']}, tied head, bfloat16, {config['param_count'] / 1e6:.2f}M parameters;"
      f" attention: {config['attention']}\n"
      f"device: {config['device_kind']} ({env['devices'][0]}), jax {env['jax']},"
      f" {env['cpu_count']} CPUs, load average at start {env['load_average']};"
      f" {config['rounds']} timed rounds (median), interleaved"
  )


def _checks(row: dict[str, Any]) -> list[dict[str, Any]]:
  """A row's comparisons with the scan: every checked method's, or the one ``exact``."""
  if "checks" in row:
    return list(row["checks"].values())
  return [row["exact"]] if row.get("exact") else []


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tiny", action="store_true",
                      help="2 layers of width 64, vocabulary 256, context 32: a CPU smoke run")
  parser.add_argument("--tiny-off-gpu", action="store_true",
                      help="GPT-2 small on a GPU, the --tiny configuration elsewhere")
  parser.add_argument("--quick", action="store_true",
                      help="the GPU check, both doors in one table, in under 4 minutes:"
                      " N x micro of 8x1, 8x4 and 16x1, then across calls; no memory workers")
  parser.add_argument("--forms", nargs="+", choices=("standalone", "combined"),
                      default=["standalone", "combined"],
                      help="--quick, across calls: each call alone, or with the gradient of one"
                      " sequence in the same jit (default both)")
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
  parser.add_argument("--sections", nargs="+", choices=("step", "across_calls", "fit"),
                      default=["step", "across_calls", "fit"], help="what to run (default all;"
                      " fit only on a GPU or with --fit)")
  parser.add_argument("--attention", choices=("auto", "cudnn", "xla", "manual"), default="auto",
                      help="auto: cuDNN's fused kernel on a GPU where it compiles, else XLA's")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds after which no new configuration starts (0: no limit;"
                      " default 540, --quick 215)")
  parser.add_argument("--jobs", type=int, default=None,
                      help="memory workers at once (default 2 on CPU, 1 on GPU)")
  parser.add_argument("--worker-timeout", type=float, default=300,
                      help="seconds before a memory worker is stopped (default 300)")
  parser.add_argument("--compile-cache", default=None,
                      help="persistent compilation cache shared with the memory workers"
                      " (default on GPU bench/results/jax_cache, none on CPU; '' for none)")
  parser.add_argument("--name", default=None,
                      help="results bench/results/<name>.json (default gpu, or gpu_quick)")
  args = parser.parse_args(argv)
  platform = jax.default_backend()
  on_gpu = platform == "gpu"
  if args.tiny_off_gpu and not on_gpu:
    print(f"no GPU ({platform}): the --tiny configuration")
    args.tiny = True
  model = TINY if args.tiny else GPT2_SMALL
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
  seconds = args.budget if args.budget is not None else (215 if args.quick else 540)
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
  run_fit = "fit" in args.sections and (on_gpu or args.fit)

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
      "fit": run_fit,
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
  output: dict[str, Any] = {"config": config, "results": [], "across_calls": [], "fit": None}

  def save():
    config["total_seconds"] = time.perf_counter() - budget.start
    return write_json(name, output)

  graphdef, params = make_model(model, attention)
  config["param_count"] = sum(x.size for x in jax.tree.leaves(params))
  config["param_bytes"] = tree_nbytes(params)
  config["flops_per_token"] = flops_per_token(model, config["param_count"])
  print(header(config), flush=True)
  if too_large:
    print(f"skipped, batch above --max-batch {args.max_batch}: "
          + ", ".join(f"N={n} micro={m}" for n, m in too_large))
  loss = make_loss(graphdef)

  if "step" in args.sections:
    memory: dict[tuple[str, int, int], dict[str, Any]] = {}
    if config["memory"]:
      print("\npeak memory of one step, a fresh process each:", flush=True)
      jobs = args.jobs or (1 if on_gpu else 2)
      start = time.perf_counter()
      memory = measure_memory(memory_jobs(pairs), tiny=args.tiny, attention=attention,
                              workers=jobs, budget=budget, timeout=args.worker_timeout)
      config["memory_seconds"] = time.perf_counter() - start
    print("\nstep time, the methods taking turns:", flush=True)
    rows = measure_steps(pairs, loss, params, model, rounds=rounds, budget=budget,
                         on_group=save, methods=QUICK_METHODS if args.quick else None,
                         warmup_compile=args.quick)
    for (n, micro), row in rows.items():
      for method in METHOD_NAMES:
        key = (FULL, 1, n * micro) if method == FULL else (method, n, micro)
        if key in memory:
          row["methods"].setdefault(method, {})["memory"] = memory[key]
    output["results"] = list(rows.values())
    save()
  if "step" in args.sections and not args.quick:
    time_table, memory_table = step_tables(config, output["results"])
    print()
    print("gradient of one batch (N x micro sequences): step time, median ms; vs = accum_jax's"
          " time / the other's; rel diff = largest |difference| / largest |entry| of any leaf,"
          f" float32 (match: loss <= {LOSS_RTOL:g}, grad <= {GRAD_RTOL:g})")
    if not on_gpu:
      print("on CPU, compare ratios: absolute times depend on the load from other processes")
    print(time_table)
    if config["memory"]:
      how = next((m["method"] for m in memory.values() if m.get("status") == "ok"), "-")
      print()
      print(f"peak memory of one step, fresh process per cell: {how}; XLA temp ="
            " compiled.memory_analysis().temp_size_in_bytes")
      print(memory_table)

  if "across_calls" in args.sections and args.quick:
    sequence = make_tokens(1, model, seed=1)
    output["quick_across"] = {}
    for form in args.forms:
      print(f"\nacross calls, every_k=8, {form}:", flush=True)
      # A window is 8 calls: half the step section's rounds give as many samples.
      output["quick_across"][form] = measure_quick_across(
          params, loss, sequence, every_k=8, rounds=max(1, rounds // 2), budget=budget,
          combined=form == "combined")
      save()

  if "across_calls" in args.sections and not args.quick:
    print("\nacross calls, AdamW on the model's bfloat16 parameters, donated:", flush=True)
    output["across_calls"] = measure_across_calls(ns, params, rounds=rounds, budget=budget)
    save()
    if output["across_calls"]:
      print()
      print("accum_jax.accumulate(adamw, every_k) / optax.MultiSteps(adamw, every_k): median ms"
            " of a micro-step (accumulates only), of a window's last call, of a window")
      print(across_calls_table(output["across_calls"]))

  if run_fit:
    print("\nthe largest batch that fits:", flush=True)
    ran = [r["batch"] for r in output["results"]
           if r.get("methods", {}).get(FULL, {}).get("status") == "ok"]
    output["fit"] = fit = measure_fit(loss, params, model, known=max(ran, default=None),
                                      cap=fit_cap, factor=args.fit_factor,
                                      rounds=min(rounds, 5), budget=budget)
    save()
    print()
    largest = fit.get("largest_full_batch")
    print(f"largest full batch: {largest}"
          f"{' (the cap, --fit-cap; no OOM)' if fit.get('cap_reached') else ''}; then"
          f" {fit.get('batch', '-')} sequences microbatched, against the hand-written scan")
    print(fit_table(fit))

  output["records"] = records_of(output)
  output["goals"] = goals(output["records"])
  if args.quick or before is not None:
    print_quick(output, before, args.compare)

  mismatches = [r for r in output["results"] if any(not c["match"] for c in _checks(r))]
  if output["fit"] and output["fit"].get("exact") and not output["fit"]["exact"]["match"]:
    mismatches.append(output["fit"])
  output["all_match"] = not mismatches
  config["load_average_end"] = environment()["load_average"]
  path = save()
  print(f"\nwrote {path} in {config['total_seconds']:.0f} s")
  if mismatches:
    print(f"accum_jax differs from the hand-written scan in {len(mismatches)} configuration(s)")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
