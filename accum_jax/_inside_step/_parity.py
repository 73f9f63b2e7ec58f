"""Does microbatching change the result? A full-batch check with diagnoses.

:func:`check_parity` runs ``jax.value_and_grad`` on the whole batch and
:func:`accum_jax.value_and_grad` on the same batch split into microbatches, and
compares the loss and every gradient leaf::

  full = jax.value_and_grad(fun, argnums, has_aux)(*args)
  micro = accum_jax.value_and_grad(fun, num_microbatches, **options)(*args)
  for leaf in [loss, *gradient leaves]:
    max_abs = max |micro - full|
    max_rel = max_abs / max |full|        # against the leaf's largest entry
    ok = max_abs <= atol + rtol * max |full|

The deviation is measured against the leaf's largest entry, not entry by
entry: an entry that cancels to nearly zero would otherwise fail on round-off
alone. Where the check fails, :attr:`ParityReport.hints` names the usual causes
it recognises (:mod:`._diagnosis`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax

from accum_jax._inside_step import _diagnosis, _microbatch, _options, _planner, _sharding
from accum_jax._inside_step._diagnosis import LeafDeviation


@dataclasses.dataclass(frozen=True)
class ParityReport:
  """The result of :func:`check_parity`.

  Attributes:
    ok: every leaf is within tolerance, and the full batch's loss and gradient
      are finite (otherwise there is nothing to match).
    max_abs: the largest ``max_abs`` over the leaves.
    max_rel: the largest ``max_rel`` over the leaves.
    per_leaf: a :class:`LeafDeviation` per leaf: ``"loss"``, then each gradient
      leaf as ``"grads"`` followed by its ``jax.tree_util.keystr`` path.
    hints: the likely causes of a failure, in words (empty when ``ok``).
    num_microbatches: the number of microbatches checked.
    rtol: the relative tolerance used per leaf (it depends on the leaf's dtype
      when not given), by leaf.
    atol: the absolute tolerance.
  """

  ok: bool
  max_abs: float
  max_rel: float
  per_leaf: Mapping[str, LeafDeviation]
  hints: tuple[str, ...]
  num_microbatches: int
  rtol: Mapping[str, float]
  atol: float

  def __repr__(self) -> str:
    width = max(len("leaf"), *(len(k) for k in self.per_leaf))
    lines = [
        f"ParityReport(ok={self.ok}, num_microbatches={self.num_microbatches},"
        f" max_abs={self.max_abs:.3g}, max_rel={self.max_rel:.3g})",
        f"  {'leaf':<{width}}  {'max_abs':>9}  {'max_rel':>9}  {'rtol':>8}",
    ]
    for name, leaf in self.per_leaf.items():
      lines.append(
          f"  {name:<{width}}  {leaf.max_abs:>9.2e}  {leaf.max_rel:>9.2e}"
          f"  {self.rtol[name]:>8.1e}  {'ok' if leaf.ok else 'FAIL'}"
      )
    if self.hints:
      lines.append("hints:")
      lines.extend(f"  - {hint}" for hint in self.hints)
    return "\n".join(lines)


def _check_tolerance(name: str, value: Any) -> float:
  if (
      isinstance(value, bool)
      or not isinstance(value, numbers.Real)
      or not math.isfinite(value)
      or value < 0
  ):
    raise ValueError(
        f"{name}={value!r} must be a finite number >= 0 (the default rtol=None takes"
        " max(1e-5, 4 * eps) of each leaf's dtype)."
    )
  return float(value)


def check_parity(
    fun: Callable[..., Any],
    *args: Any,
    num_microbatches: int,
    rtol: float | None = None,
    atol: float = 0.0,
    **value_and_grad_options: Any,
) -> ParityReport:
  """Compares :func:`accum_jax.value_and_grad` with the full-batch gradient.

  Runs ``jax.value_and_grad`` on the whole batch and ``accum_jax.value_and_grad``
  with the step's options on the same batch (the whole batch must fit: check on
  a batch as large as fits), and compares the loss and each gradient leaf: a
  leaf passes when ``max |micro - full| <= atol + rtol * max |full|``. Where
  parity fails, :attr:`ParityReport.hints` names the causes it recognises (a
  masked mean without ``weight_fn``, with the one that restores parity;
  BatchNorm; dropout keys; non-finite steps; narrow transport dtypes). See the
  guide: :doc:`/planner_parity`.

  Args:
    fun: the loss function, as for :func:`accum_jax.value_and_grad`.
    *args: its positional arguments, concrete arrays.
    num_microbatches: the number of microbatches to check.
    rtol: relative tolerance per leaf against its largest entry; None for
      ``max(1e-5, 4 * eps)`` of each leaf's dtype.
    atol: absolute tolerance.
    **value_and_grad_options: the options of :func:`accum_jax.value_and_grad`,
      as the step uses them.

  Returns:
    A :class:`ParityReport`.

  Examples:
    >>> import jax.numpy as jnp, accum_jax
    >>> def loss(w, batch):  # the mean over valid tokens
    ...   err = (batch["x"] @ w - batch["y"]) ** 2
    ...   return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])
    >>> w = jnp.ones(3)
    >>> batch = {"x": jnp.arange(24.0).reshape(8, 3) / 24, "y": jnp.zeros(8),
    ...          "mask": jnp.array([1.0, 1, 1, 0, 1, 1, 1, 1])}
    >>> report = accum_jax.diagnostics.check_parity(loss, w, batch, num_microbatches=4)
    >>> report.ok
    False
    >>> print(report.hints[0])  # doctest: +ELLIPSIS
    The loss looks like a mean over the valid elements of batch['mask'], ...
    >>> accum_jax.diagnostics.check_parity(loss, w, batch, num_microbatches=4,
    ...                        weight_fn=lambda batch: batch["mask"].sum()).ok
    True
  """
  _options.make(num_microbatches, caller="check_parity", **value_and_grad_options)
  atol = _check_tolerance("atol", atol)
  if rtol is not None:
    rtol = _check_tolerance("rtol", rtol)
  options = _step_options(args, value_and_grad_options)
  argnums = options.get("argnums", 0)
  if not isinstance(argnums, numbers.Integral):
    argnums = _options.argnums_tuple(argnums, "argnums")
  has_aux = options.get("has_aux", False)

  def run_micro(opts: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    out, grads, info = jax.jit(
        _microbatch.value_and_grad(fun, num_microbatches, return_info=True, **opts)
    )(*args)
    return (out[0] if has_aux else out), grads, info

  micro_loss, micro_grads, info = run_micro(options)
  full_out, full_grads = jax.jit(jax.value_and_grad(fun, argnums, has_aux=has_aux))(
      *_on_one_device(args)
  )
  full_loss = full_out[0] if has_aux else full_out
  per_leaf, rtols, round_off = _diagnosis.compare(
      (micro_loss, micro_grads), (full_loss, full_grads), rtol, atol
  )
  # A full batch that is not finite leaves nothing to match, even where the
  # microbatched result is NaN in the same places, as a skipped step's is.
  ok = all(leaf.ok for leaf in per_leaf.values()) and not _diagnosis.non_finite_reference(
      (full_loss, full_grads))

  hints: list[str] = []
  if not ok:
    hints = _diagnosis.diagnose(
        args=args,
        options=options,
        per_leaf=per_leaf,
        round_off=round_off,
        full=(full_loss, full_grads),
        full_aux=full_out[1] if has_aux else None,
        info=info,
        num_microbatches=num_microbatches,
        num_shards=_num_shards(options),
        run_micro=run_micro,
        rtol=rtol,
        atol=atol,
    )
  return ParityReport(
      ok=ok,
      max_abs=max((leaf.max_abs for leaf in per_leaf.values()), default=0.0),
      max_rel=max((leaf.max_rel for leaf in per_leaf.values()), default=0.0),
      per_leaf=per_leaf,
      hints=tuple(hints),
      num_microbatches=num_microbatches,
      rtol=rtols,
      atol=atol,
  )


def _step_options(args: tuple[Any, ...], given: Mapping[str, Any]) -> dict[str, Any]:
  """The step's options, as the microbatched run takes them (its own ``return_info``)."""
  options = dict(given)
  options.pop("return_info", None)
  # Under jax.jit with automatic mesh axes the step cannot see how the
  # parameters are sharded: read it here, so that the mode checked is the
  # step's (FSDP, HSDP), not the replicated one.
  if (param_sharding := _planner.read_param_sharding(args, options)) is not None:
    options = _planner.with_data_parallel(options, param_sharding=param_sharding)
  return options


def _num_shards(options: Mapping[str, Any]) -> int:
  """The devices of the data axes the batch is split over (1 without a mesh)."""
  dp = _planner.data_parallel(options)
  if dp.mesh is None and dp.data_axis is None:
    return 1
  mesh, axes = _sharding.resolve_mesh(dp.mesh, dp.data_axis)
  return _sharding.num_shards(mesh, axes)


def _on_one_device(args: tuple[Any, ...]) -> tuple[Any, ...]:
  """``args`` with every array on one device: the reference is the plain full batch,
  not a sharded computation. Arrays this process cannot hold whole stay as they are."""
  leaves = [x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)]
  if not leaves or not all(x.is_fully_addressable for x in leaves):
    return args
  device = jax.local_devices()[0]
  return jax.tree.map(
      lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, args
  )
