"""Choosing ``num_microbatches`` from XLA's compile-time memory analysis.

:func:`plan_microbatches` compiles, and never runs, the step
``jax.jit(accum_jax.value_and_grad(fun, n, **options))`` for a few candidate
``n`` and reads XLA's buffer sizes. More microbatches keep fewer activations
alive, so the estimate falls as ``n`` grows; a bisection over the sorted
candidates finds the smallest ``n`` that fits in O(log #candidates) compiles::

  candidates = sorted divisors of the (per-device) batch size
  lo, hi = 0, len(candidates)
  while lo < hi:                     # first candidate whose estimate fits
    mid = (lo + hi) // 2
    if estimate(candidates[mid]) <= budget: hi = mid
    else: lo = mid + 1
  return candidates[lo]              # MemoryBudgetError if lo == len(candidates)

The estimate of one compiled step is::

  argument + output + temp - alias          # bytes, per device

from ``compiled.memory_analysis()``: every buffer XLA assigns counted as if
all were alive at once (temporaries are already packed by liveness inside
``temp``), less the outputs that reuse an input buffer. XLA also reports
``peak_memory_in_bytes``, but on CPU it leaves out the temporaries, so it is not
used. The generated code is not counted.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from accum_jax import _batching, _microbatch, _options

_MIB = 2**20
_FIXES = (
    "a smaller model; rematerialisation (wrap the model's blocks in jax.checkpoint, so"
    " activations are recomputed in the backward pass instead of stored); sharding the"
    " parameters and optimizer state over several devices; or a smaller batch"
)


def _format_bytes(num_bytes: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if num_bytes >= size:
      return f"{num_bytes / size:.2f} {unit}"
  return f"{num_bytes} bytes"


@dataclasses.dataclass(frozen=True)
class MicrobatchPlan:
  """The result of :func:`plan_microbatches`.

  Attributes:
    num_microbatches: the smallest candidate whose estimate fits the budget.
    estimates: the estimated peak bytes (per device) of each ``num_microbatches``
      that was compiled, by ascending ``num_microbatches``. The bisection
      compiles only a few candidates; the others are absent.
    memory_budget_bytes: the budget the estimates were held against.
  """

  num_microbatches: int
  estimates: Mapping[int, int]
  memory_budget_bytes: int

  def __repr__(self) -> str:
    lines = [
        f"MicrobatchPlan(num_microbatches={self.num_microbatches},"
        f" memory_budget_bytes={self.memory_budget_bytes}"
        f" ({_format_bytes(self.memory_budget_bytes)}))",
        "  num_microbatches   estimate (MiB)",
    ]
    for n, estimate in self.estimates.items():
      verdict = "fits" if estimate <= self.memory_budget_bytes else "over budget"
      chosen = "  <- chosen" if n == self.num_microbatches else ""
      lines.append(f"  {n:>16}   {estimate / _MIB:>14.3f}   {verdict}{chosen}")
    return "\n".join(lines)


class MemoryBudgetError(ValueError):
  """No candidate ``num_microbatches`` fits the memory budget.

  Attributes:
    estimates: the estimated bytes of each ``num_microbatches`` compiled.
    memory_budget_bytes: the budget.
  """

  def __init__(self, message: str, estimates: Mapping[int, int], memory_budget_bytes: int):
    super().__init__(message)
    self.estimates = estimates
    self.memory_budget_bytes = memory_budget_bytes


def _estimate_bytes(
    fun: Callable[..., Any],
    num_microbatches: int,
    args: tuple[Any, ...],
    options: Mapping[str, Any],
) -> int:
  """Compiles the microbatched step for ``num_microbatches``; its bytes per device."""
  step = jax.jit(_microbatch.value_and_grad(fun, num_microbatches, **options))
  stats = step.lower(*args).compile().memory_analysis()
  if stats is None:
    raise ValueError(
        f"The {jax.default_backend()} backend gives no memory analysis of compiled"
        " programs, so plan_microbatches cannot estimate their memory. Choose"
        " num_microbatches by hand."
    )
  return int(
      stats.argument_size_in_bytes
      + stats.output_size_in_bytes
      + stats.temp_size_in_bytes
      - stats.alias_size_in_bytes
  )


def _default_budget() -> int:
  device = jax.devices()[0]
  stats = device.memory_stats()
  example = "memory_budget_bytes=8 * 2**30 for 8 GiB"
  if not stats or "bytes_limit" not in stats:
    raise ValueError(
        f"memory_budget_bytes=None, but device {device} ({device.platform}) reports no"
        " memory limit (its memory_stats() is"
        f" {'None' if stats is None else 'without bytes_limit'}), so there is no free"
        f" memory to default to. Pass the budget in bytes, e.g. {example}."
    )
  free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  if free <= 0:
    raise ValueError(
        f"memory_budget_bytes=None, and device {device} has no free memory"
        f" (bytes_limit={stats['bytes_limit']}, bytes_in_use={stats.get('bytes_in_use')})."
        f" Free some arrays, or pass the budget in bytes, e.g. {example}."
    )
  return free


def _check_budget(memory_budget_bytes: Any) -> int:
  if (
      isinstance(memory_budget_bytes, bool)
      or not isinstance(memory_budget_bytes, numbers.Real)
      or not math.isfinite(memory_budget_bytes)
      or memory_budget_bytes < 1
  ):
    raise ValueError(
        f"memory_budget_bytes={memory_budget_bytes!r} must be a positive number of bytes,"
        " e.g. 8 * 2**30 for 8 GiB; or None for the device's free memory (where the"
        " backend reports it)."
    )
  return int(float(memory_budget_bytes))


def _local_batch_size(args: tuple[Any, ...], options: Mapping[str, Any]) -> tuple[int, int]:
  """The batch size each device splits into microbatches (padded), and the number of devices."""
  parsed = _options.make(1, **options)
  try:
    call = _options.bind(parsed, args)
  except ValueError as e:
    raise ValueError(
        f"{e} (plan_microbatches got {len(args)} argument(s) to plan with: pass the step's"
        " arguments, arrays or jax.ShapeDtypeStruct, after fun.)"
    ) from e
  return call.rows, call.num_shards


def _check_candidates(
    candidates: Iterable[Any] | None, local_batch: int, pad_batch: bool
) -> list[int]:
  divisors = _batching.divisors(local_batch)
  if candidates is None:
    # With pad_batch any number of microbatches up to the batch size works.
    return list(range(1, local_batch + 1)) if pad_batch else divisors
  try:
    listed = list(candidates)
  except TypeError as e:
    raise ValueError(
        f"candidates={candidates!r} must be an iterable of ints, e.g. {divisors}."
    ) from e
  if not listed:
    raise ValueError(f"candidates=[] leaves nothing to choose from; pass some of {divisors}.")
  not_ints = [
      c for c in listed if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1
  ]
  if not_ints:
    raise ValueError(
        f"candidates={listed!r}: {not_ints} are not ints >= 1. Choose among the divisors"
        f" of the batch size {local_batch} (per device): {divisors}."
    )
  if not_divisors := [c for c in listed if local_batch % c and not pad_batch]:
    raise ValueError(
        f"candidates={listed!r}: {not_divisors} do not divide the batch size {local_batch}"
        f" (per device) into equal microbatches. Choose among its divisors {divisors}, or"
        " pass pad_batch=True (with a weight_fn) to pad the batch to a multiple."
    )
  return sorted({int(c) for c in listed})


def plan_microbatches(
    fun: Callable[..., Any],
    *args: Any,
    memory_budget_bytes: int | None = None,
    candidates: Iterable[int] | None = None,
    **value_and_grad_options: Any,
) -> MicrobatchPlan:
  """The smallest ``num_microbatches`` whose step fits a memory budget.

  Compiles, never runs, ``jax.jit(accum_jax.value_and_grad(fun, n, **options))``
  for a few candidate ``n`` and estimates each one's peak from XLA's memory
  analysis. The estimate covers the gradient step only: leave room in the
  budget for the optimizer update.

  See the guide: :doc:`/planner_parity`.

  Args:
    fun: the loss function, as for :func:`accum_jax.value_and_grad`.
    *args: the step's positional arguments: arrays, or ``jax.ShapeDtypeStruct``
      to plan without data.
    memory_budget_bytes: the bytes the step may use on each device. None
      (default): the free memory of ``jax.devices()[0]``; required on CPU.
    candidates: the ``num_microbatches`` to choose from, each dividing the
      (per-device) batch size. None (default): all its divisors.
    **value_and_grad_options: the options of :func:`accum_jax.value_and_grad`
      as the step will use them.

  Returns:
    A :class:`MicrobatchPlan`: ``num_microbatches``, the ``estimates`` of the
    candidates compiled, and the ``memory_budget_bytes`` used.

  Raises:
    MemoryBudgetError: (a ``ValueError``) when no candidate fits.
    ValueError: for a bad budget or candidates, or ``num_microbatches`` among
      the options.

  Examples:
    >>> import jax, jax.numpy as jnp, accum_jax
    >>> def loss(params, batch):
    ...   hidden = jnp.tanh(batch["x"] @ params["w1"])
    ...   return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)
    >>> params = {"w1": jnp.ones((4, 256)), "w2": jnp.ones((256, 1))}
    >>> batch = {"x": jnp.ones((512, 4)), "y": jnp.ones((512, 1))}
    >>> roomy = accum_jax.plan_microbatches(loss, params, batch, memory_budget_bytes=2**30)
    >>> roomy.num_microbatches
    1
    >>> tight = accum_jax.plan_microbatches(
    ...     loss, params, batch, memory_budget_bytes=roomy.estimates[1] // 2)
    >>> tight.num_microbatches > 1
    True
    >>> all(tight.estimates[n] > tight.memory_budget_bytes
    ...     for n in tight.estimates if n < tight.num_microbatches)
    True
  """
  if "num_microbatches" in value_and_grad_options:
    raise ValueError(
        "num_microbatches is what plan_microbatches chooses: drop it from the options"
        " (limit the choice with candidates=[...] instead)."
    )
  _options.make(1, **value_and_grad_options)  # checks the options once, before any compile
  if memory_budget_bytes is None:
    budget = _default_budget()
  else:
    budget = _check_budget(memory_budget_bytes)
  local_batch, num_shards = _local_batch_size(args, value_and_grad_options)
  ordered = _check_candidates(
      candidates, local_batch, bool(value_and_grad_options.get("pad_batch", False))
  )

  estimates: dict[int, int] = {}
  lo, hi = 0, len(ordered)
  while lo < hi:
    mid = (lo + hi) // 2
    n = ordered[mid]
    estimates[n] = _estimate_bytes(fun, n, args, value_and_grad_options)
    if estimates[n] <= budget:
      hi = mid
    else:
      lo = mid + 1
  estimates = dict(sorted(estimates.items()))

  if lo == len(ordered):
    smallest_n = min(estimates, key=estimates.__getitem__)
    listed = ", ".join(f"{n}: {_format_bytes(e)}" for n, e in estimates.items())
    more = ""
    if ordered[-1] < local_batch:
      more = (
          f" The candidates stop at {ordered[-1]}; up to {local_batch} microbatches"
          " divide the batch, and more may fit."
      )
    per_device = f" per device ({num_shards} devices)" if num_shards > 1 else ""
    raise MemoryBudgetError(
        f"No num_microbatches among {ordered} fits memory_budget_bytes={budget}"
        f" ({_format_bytes(budget)}){per_device}: the smallest estimate is"
        f" {_format_bytes(estimates[smallest_n])}, for num_microbatches={smallest_n} (estimates"
        f" by num_microbatches: {listed}).{more} To fit, try {_FIXES}.",
        estimates,
        budget,
    )
  return MicrobatchPlan(
      num_microbatches=ordered[lo], estimates=estimates, memory_budget_bytes=budget
  )
