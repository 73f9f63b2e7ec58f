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

Under a mesh, a parameter sharded over a data axis can be reduced two ways
(``DataParallel(gather=...)``, see :class:`accum_jax.DataParallel`): ``"per_microbatch"`` keeps
a sharded accumulator and reduce-scatters every microbatch's gradient, ``"once"``
keeps a full-size local sum and reduce-scatters it once after the loop. Each is
bisected, the leaner first, and the plan is the fastest that fits::

  fewest microbatches first; at equal num_microbatches, gather="once"

Fewer microbatches run fewer iterations of the loop, each of which reads every
parameter (and gathers the sharded ones, unless XLA hoists the gather) and
launches smaller matrix products; and at equal ``num_microbatches``,
``"once"`` sends each gradient across devices once per step instead of once per
microbatch, with no collective inside the loop (the same arithmetic otherwise).
So the faster mode is bisected only up to the leaner mode's choice. Replicated
parameters have one mode.

The parameters' shardings are read from the arguments (arrays, or
``jax.ShapeDtypeStruct`` with ``sharding=``) and passed on in the ``DataParallel``:
under ``jax.jit`` with automatic mesh axes the traced step cannot see them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from accum_jax._inside_step import _batching, _call, _microbatch, _options, _sharding

_MIB = 2**20
# The gather modes of sharded parameters, the leanest first; at equal
# num_microbatches the later one is the faster (no collective in the loop).
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
      that was compiled with the chosen ``gather``, by ascending
      ``num_microbatches``. The bisection compiles only a few candidates; the
      others are absent.
    memory_budget_bytes: the budget the estimates were held against.
    gather: under a mesh with parameters sharded over a data axis, the reduction
      chosen, ``"per_microbatch"`` or ``"once"``: give it to the step's
      :class:`accum_jax.DataParallel` as ``gather=``. None where no parameter is
      sharded over a data axis (nothing is gathered; leave the option out).
    gather_estimates: with sharded parameters, the estimate of every ``(gather,
      num_microbatches)`` compiled, the modes in the order above; empty otherwise.
  """

  num_microbatches: int
  estimates: Mapping[int, int]
  memory_budget_bytes: int
  gather: str | None = None
  gather_estimates: Mapping[tuple[str, int], int] = dataclasses.field(default_factory=dict)

  def __repr__(self) -> str:
    budget = f"memory_budget_bytes={self.memory_budget_bytes}" + (
        f" ({_format_bytes(self.memory_budget_bytes)}))"
    )
    if self.gather is None:
      lines = [
          f"MicrobatchPlan(num_microbatches={self.num_microbatches}, {budget}",
          "  num_microbatches   estimate (MiB)",
      ]
      rows: list[tuple[tuple[str | None, int], int]] = [
          ((None, n), e) for n, e in self.estimates.items()
      ]
    else:
      lines = [
          f"MicrobatchPlan(num_microbatches={self.num_microbatches},"
          f" gather={self.gather!r}, {budget}",
          f"  {'gather':<14}   num_microbatches   estimate (MiB)",
      ]
      rows = list(self.gather_estimates.items())
    for (gather, n), estimate in rows:
      verdict = "fits" if estimate <= self.memory_budget_bytes else "over budget"
      chosen = (gather, n) == (self.gather, self.num_microbatches)
      mode = "" if gather is None else f"  {gather:<14} "
      lines.append(
          f"{mode}  {n:>16}   {estimate / _MIB:>14.3f}   {verdict}{'  <- chosen' if chosen else ''}"
      )
    return "\n".join(lines)


class MemoryBudgetError(ValueError):
  """No candidate ``num_microbatches`` fits the memory budget.

  Attributes:
    estimates: the estimated bytes of each ``num_microbatches`` compiled (with
      sharded parameters: with the leaner ``gather="per_microbatch"``).
    memory_budget_bytes: the budget.
    gather_estimates: with sharded parameters, the estimate of every ``(gather,
      num_microbatches)`` compiled; empty otherwise.
  """

  def __init__(
      self,
      message: str,
      estimates: Mapping[int, int],
      memory_budget_bytes: int,
      gather_estimates: Mapping[tuple[str, int], int] | None = None,
  ):
    super().__init__(message)
    self.estimates = estimates
    self.memory_budget_bytes = memory_budget_bytes
    self.gather_estimates = dict(gather_estimates or {})


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


def _bind(args: tuple[Any, ...], options: Mapping[str, Any]) -> _call.Bound:
  """The call's roles and sizes for one microbatch: ``rows`` is the batch size each
  device splits into microbatches (padded)."""
  parsed = _options.make(1, **options)
  try:
    return _call.bind(parsed, args)
  except ValueError as e:
    raise ValueError(
        f"{e} (plan_microbatches got {len(args)} argument(s) to plan with: pass the step's"
        " arguments, arrays or jax.ShapeDtypeStruct, after fun.)"
    ) from e


def data_parallel(options: Mapping[str, Any]) -> _options.DataParallel:
  """The ``data_parallel=`` of ``value_and_grad(**options)``."""
  return options.get("data_parallel") or _options.DataParallel()


def with_data_parallel(options: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
  """``options`` with their ``data_parallel=`` changed as ``changes`` say."""
  return {**options, "data_parallel": dataclasses.replace(data_parallel(options), **changes)}


def read_param_sharding(args: tuple[Any, ...], options: Mapping[str, Any]) -> Any:
  """``param_sharding=`` for ``value_and_grad(**options)`` called on ``args``.

  The option itself where given; else, under a mesh, each differentiated leaf's
  ``PartitionSpec`` read from the argument (a ``jax.Array`` or a
  ``jax.ShapeDtypeStruct`` with a ``NamedSharding``), None where it has none.
  Under ``jax.jit`` with automatic axes the traced function cannot read them
  itself. None without a mesh.
  """
  dp = data_parallel(options)
  given = dp.param_sharding
  if given is not None or (dp.mesh is None and dp.data_axis is None):
    return given
  params = _call.diff_args(_options.make(1, **options), args)
  return jax.tree.map(lambda x: _sharding.spec_of(x), params)


def _gathers(
    call: _call.Bound, args: tuple[Any, ...], options: Mapping[str, Any]
) -> tuple[str | None, ...]:
  """The reductions to compare: both gather modes where a parameter is sharded over
  a data axis (unless the DataParallel gives one), else one (None)."""
  if call.mesh is None:
    return (None,)
  params = _call.diff_args(_options.make(1, **options), args)
  dp = data_parallel(options)
  plan = _sharding.plan(call.mesh, call.data_axes, params, param_sharding=dp.param_sharding)
  if not plan.sharded:
    return (None,)
  return _options.GATHERS if dp.gather is None else (dp.gather,)


def _first_fit(estimate: Callable[[int], int], ordered: list[int], budget: int) -> int | None:
  """Bisection: the index of the first candidate whose estimate fits, or None."""
  lo, hi = 0, len(ordered)
  while lo < hi:
    mid = (lo + hi) // 2
    if estimate(ordered[mid]) <= budget:
      hi = mid
    else:
      lo = mid + 1
  return lo if lo < len(ordered) else None


def _search(
    estimate: Callable[[str | None, int], int],
    ordered: list[int],
    budget: int,
    gathers: tuple[str | None, ...],
) -> tuple[str | None, int] | None:
  """The fastest ``(gather, num_microbatches)`` that fits: fewest microbatches first;
  at a tie the later gather mode. Each mode is bisected only up to the choice so far."""
  best: tuple[int, str | None] | None = None
  for gather in gathers:
    stop = len(ordered) if best is None else best[0] + 1
    found = _first_fit(functools.partial(estimate, gather), ordered[:stop], budget)
    if found is not None:
      best = (found, gather)
  return None if best is None else (best[1], ordered[best[0]])


def _check_candidates(candidates: Iterable[Any] | None, local_batch: int) -> list[int]:
  divisors = _batching.divisors(local_batch)
  if candidates is None:
    return divisors
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
  if not_divisors := [c for c in listed if local_batch % c]:
    raise ValueError(
        f"candidates={listed!r}: {not_divisors} do not divide the batch size {local_batch}"
        f" (per device) into equal microbatches. Choose among its divisors {divisors}."
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

  Under a mesh with parameters sharded over a data axis, both reductions
  (``DataParallel(gather=...)``, ``"per_microbatch"`` and ``"once"``) are
  compiled unless one is given, and the plan is the fastest that fits: the
  fewest microbatches, and at equal ``num_microbatches`` ``"once"``. The
  parameters' shardings are read from ``args`` unless ``param_sharding`` is
  given; the step needs them as ``param_sharding`` too.

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
    candidates compiled, the ``memory_budget_bytes`` used and, with sharded
    parameters, the ``gather`` chosen and the ``gather_estimates`` of both.

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
    >>> plan = accum_jax.diagnostics.plan_microbatches
    >>> roomy = plan(loss, params, batch, memory_budget_bytes=2**30)
    >>> roomy.num_microbatches
    1
    >>> tight = accum_jax.diagnostics.plan_microbatches(
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
  _options.make(1, caller="plan_microbatches", **value_and_grad_options)
  if memory_budget_bytes is None:
    budget = _default_budget()
  else:
    budget = _check_budget(memory_budget_bytes)
  call = _bind(args, value_and_grad_options)
  options = dict(value_and_grad_options)
  if (param_sharding := read_param_sharding(args, options)) is not None:
    options = with_data_parallel(options, param_sharding=param_sharding)
  gathers = _gathers(call, args, options)
  ordered = _check_candidates(candidates, call.rows)

  estimates: dict[tuple[str | None, int], int] = {}

  def estimate(gather: str | None, n: int) -> int:
    if (gather, n) not in estimates:
      with_gather = options if gather is None else with_data_parallel(options, gather=gather)
      estimates[gather, n] = _estimate_bytes(fun, n, args, with_gather)
    return estimates[gather, n]

  chosen = _search(estimate, ordered, budget, gathers)
  # Sorted by mode (in the order compared), then by num_microbatches.
  estimates = dict(sorted(estimates.items(), key=lambda kv: (gathers.index(kv[0][0]), kv[0][1])))
  by_mode = {g: {n: e for (g2, n), e in estimates.items() if g2 == g} for g in gathers}
  gather_estimates = {(g, n): e for (g, n), e in estimates.items() if g is not None}
  if chosen is None:
    raise _no_fit(estimates, by_mode[gathers[0]], gather_estimates, ordered, call, budget)
  gather, n = chosen
  return MicrobatchPlan(
      num_microbatches=n, estimates=by_mode[gather], memory_budget_bytes=budget,
      gather=gather, gather_estimates=gather_estimates,
  )


def _no_fit(
    estimates: Mapping[tuple[str | None, int], int],
    leanest: Mapping[int, int],
    gather_estimates: Mapping[tuple[str, int], int],
    ordered: list[int],
    call: _call.Bound,
    budget: int,
) -> MemoryBudgetError:
  """The error when nothing fits: the smallest estimate, every estimate, what to try."""
  smallest = min(estimates, key=estimates.__getitem__)
  gather, smallest_n = smallest

  def name(key: tuple[str | None, int]) -> str:
    return f"{key[1]}" if key[0] is None else f"({key[0]!r}, {key[1]})"

  listed = ", ".join(f"{name(k)}: {_format_bytes(e)}" for k, e in estimates.items())
  more = ""
  if ordered[-1] < call.rows:
    more = (
        f" The candidates stop at {ordered[-1]}; up to {call.rows} microbatches"
        " divide the batch, and more may fit."
    )
  per_device = f" per device ({call.num_shards} devices)" if call.num_shards > 1 else ""
  modes = " with either gather mode" if len({g for g, _ in estimates}) > 1 else ""
  which = "by num_microbatches" if gather is None else "by (gather, num_microbatches)"
  with_gather = "" if gather is None else f", gather={gather!r}"
  return MemoryBudgetError(
      f"No num_microbatches among {ordered} fits memory_budget_bytes={budget}"
      f" ({_format_bytes(budget)}){per_device}{modes}: the smallest estimate is"
      f" {_format_bytes(estimates[smallest])}, for num_microbatches={smallest_n}{with_gather}"
      f" (estimates {which}: {listed}).{more} To fit, try {_FIXES}.",
      dict(leanest),
      budget,
      gather_estimates,
  )
