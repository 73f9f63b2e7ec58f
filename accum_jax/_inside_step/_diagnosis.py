"""What :func:`check_parity` compares, and how it explains a failure.

:func:`compare` measures each leaf's deviation against its largest entry
(:class:`LeafDeviation`); :func:`diagnose` names the usual causes of a failed
check (a masked mean without ``weight_fn``, with the one that restores parity;
BatchNorm; dropout keys; non-finite steps; narrow transport dtypes), rerunning
the microbatched step where a candidate fix must be tried.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from accum_jax._inside_step import _call, _options, _planner, _result

# Names of batch leaves that hold per-element validity or weights.
_MASK_NAMES = ("mask", "valid", "padding", "weight")
# At most this many mask candidates are tried as a weight_fn (one compile each).
_MAX_WEIGHT_TRIALS = 2


class LeafDeviation(NamedTuple):
  """How far one leaf of the microbatched result is from the full-batch one.

  Attributes:
    max_abs: ``max |micro - full|`` over the leaf's entries (inf where one side
      is NaN or Inf and the other is not).
    max_rel: ``max_abs / max |full|``: the deviation against the leaf's largest
      entry (inf where ``full`` is all zeros and ``micro`` is not).
    ok: ``max_abs <= atol + rtol * max |full|``.
  """

  max_abs: float
  max_rel: float
  ok: bool


def _default_rtol(dtype: Any) -> float:
  """``max(1e-5, 4 * eps)``: float32 1e-5; float16 3.9e-3; bfloat16 3.1e-2.

  Against the leaf's largest entry, summing in another order leaves float32
  gradients a few ``eps`` (1.2e-7) apart: 1e-5 leaves a wide margin for long
  reductions. Float16 and bfloat16 results are rounded once more on the way
  out; 4 ``eps`` allows a few such roundings.
  """
  return max(1e-5, 4 * float(jnp.finfo(dtype).eps))


def _deviation(micro: Any, full: Any, rtol: float, atol: float) -> LeafDeviation:
  a = np.asarray(micro, np.float64)
  b = np.asarray(full, np.float64)
  same = (a == b) | (np.isnan(a) & np.isnan(b))
  diff = np.where(same, 0.0, np.abs(a - b))
  diff = np.where(np.isnan(diff), np.inf, diff)
  max_abs = float(diff.max()) if diff.size else 0.0
  finite = np.abs(b[np.isfinite(b)])
  scale = float(finite.max()) if finite.size else 0.0
  if scale > 0:
    max_rel = max_abs / scale
  else:
    max_rel = 0.0 if max_abs == 0 else math.inf
  return LeafDeviation(max_abs, max_rel, bool(max_abs <= atol + rtol * scale))


def compare(
    micro: tuple[Any, Any], full: tuple[Any, Any], rtol: float | None, atol: float
) -> tuple[dict[str, LeafDeviation], dict[str, float], dict[str, float]]:
  """Per leaf: the deviation, the rtol used, and the default rtol of its dtype."""
  named = [("loss", micro[0], full[0])]
  for (path, g_micro), g_full in zip(
      jax.tree.leaves_with_path(micro[1]), jax.tree.leaves(full[1])
  ):
    named.append((f"grads{jax.tree_util.keystr(path)}", g_micro, g_full))
  per_leaf, rtols, round_off = {}, {}, {}
  for name, x, y in named:
    dtype = jnp.result_type(y)
    if not jnp.issubdtype(dtype, jnp.inexact):  # e.g. float0, no gradient
      continue
    round_off[name] = _default_rtol(dtype)
    rtols[name] = round_off[name] if rtol is None else rtol
    per_leaf[name] = _deviation(x, y, rtols[name], atol)
  return per_leaf, rtols, round_off


def _weight_fn_code(batch_nums: tuple[int, ...], position: int, path: str) -> str:
  if len(batch_nums) == 1:
    return f"weight_fn=lambda batch: batch{path}.sum()" if path else (
        "weight_fn=lambda mask: mask.sum()")
  return f"weight_fn=lambda *batches: batches[{position}]{path}.sum()"


def _mask_candidates(
    args: tuple[Any, ...],
    batch_nums: tuple[int, ...],
    num_microbatches: int,
    num_shards: int,
    split: str,
) -> list[tuple[int, int, str, list[float]]]:
  """Batch leaves that look like masks and count differently per microbatch.

  Returns ``(position among the batch arguments, leaf index, keystr path,
  per-microbatch sums)``, leaves named like masks first, then boolean ones, then
  arrays of zeros and ones.
  """
  num_parts = num_microbatches * num_shards
  found = []
  for position, n in enumerate(batch_nums):
    for index, (path, leaf) in enumerate(jax.tree.leaves_with_path(args[n])):
      name = jax.tree_util.keystr(path)
      dtype = jnp.result_type(leaf)
      if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] % num_parts:
        continue
      if any(word in name.lower() for word in _MASK_NAMES):
        rank = 0
      elif dtype == jnp.bool_:
        rank = 1
      elif jnp.issubdtype(dtype, jnp.integer):
        rank = 2  # e.g. an attention mask of ints; float data is not fetched
      else:
        continue
      values = np.asarray(leaf)
      if rank == 2 and not np.isin(values, (0, 1)).all():
        continue
      # Each device's rows, split as value_and_grad splits them.
      rows = values.reshape(values.shape[0], -1).astype(np.float64).sum(axis=1)
      per_device = rows.reshape(num_shards, -1)
      if split == "strided":
        parts = per_device.reshape(num_shards, -1, num_microbatches).sum(axis=1)
      else:
        parts = per_device.reshape(num_shards, num_microbatches, -1).sum(axis=2)
      sums = parts.reshape(-1).tolist()
      if len(set(sums)) > 1:
        found.append((rank, position, index, name, sums))
  found.sort(key=lambda c: c[0])  # stable: in the order of the arguments
  return [c[1:] for c in found]


def _format_sums(sums: Sequence[float]) -> str:
  shown = ", ".join(f"{s:g}" for s in sums[:8])
  return shown + (", ..." if len(sums) > 8 else "")


def diagnose(
    *,
    args: tuple[Any, ...],
    options: Mapping[str, Any],
    per_leaf: Mapping[str, LeafDeviation],
    round_off: Mapping[str, float],
    full: tuple[Any, Any],
    full_aux: Any,
    info: _result.MicrobatchInfo,
    num_microbatches: int,
    num_shards: int,
    run_micro: Callable[[Mapping[str, Any]], tuple[Any, Any, Any]],
    rtol: float | None,
    atol: float,
) -> list[str]:
  """The recognised causes of a failed check, in words: by-design causes first."""
  parsed = _options.make(num_microbatches, **options)
  batch_nums = _call.bind(parsed, args).batch_argnums
  # Causes that make parity fail whatever the weights: with one of them, a
  # weight_fn cannot be checked against the reference, so none is tried.
  by_design = [
      *non_finite_reference(full),
      *_state_causes(parsed.state_argnums, full_aux),
      *_key_causes(args, parsed.rng_argnums),
      *_transport_causes(parsed, args),
  ]
  hints = by_design + _skipped_hints(
      parsed, options, info, num_microbatches, num_shards, run_micro
  )
  conclusive = bool(hints)
  if options.get("weight_fn") is not None:
    hints.append(
        "weight_fn is given: check that it returns exactly the count the loss divides"
        " by in each microbatch (e.g. the number of valid tokens, not of rows), and that"
        " fun returns the microbatch's mean over those, not its sum."
    )
  elif not by_design:
    mask_hints, found = _mean_of_means_hints(
        args, options, batch_nums, num_microbatches, num_shards, run_micro, full, rtol, atol
    )
    hints.extend(mask_hints)
    conclusive = conclusive or found
  return hints if conclusive else hints + _unexplained_hints(per_leaf, round_off)


def non_finite_reference(full: tuple[Any, Any]) -> list[str]:
  inexact = [x for x in jax.tree.leaves(full) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if all(np.isfinite(np.asarray(x)).all() for x in inexact):
    return []
  return [
      "The full-batch loss or gradient is itself not finite (NaN or Inf), so there is"
      " no finite reference to match; fix the loss (or the data) on the full batch"
      " first."
  ]


def _skipped_hints(
    parsed: _options.Options,
    options: Mapping[str, Any],
    info: _result.MicrobatchInfo,
    num_microbatches: int,
    num_shards: int,
    run_micro: Callable[[Mapping[str, Any]], tuple[Any, Any, Any]],
) -> list[str]:
  """What was skipped, and why: a whole step (the default) or microbatches."""
  num_skipped = int(info.num_skipped)
  if parsed.propagates and bool(info.step_not_finite):
    return [_skipped_step_hint(options, info, num_microbatches, num_shards, run_micro)]
  if not num_skipped:
    return []
  if parsed.propagates:  # the step was kept: only weights leave microbatches out
    return [
        f"{num_skipped} microbatch(es) were left out for a negative or non-finite weight;"
        " the result averages the others only. Check what weight_fn returns."
    ]
  return [
      f"{num_skipped} microbatch(es) were skipped because their loss or gradient was"
      " not finite (or their weight negative); the result averages the others only."
      " Find the rows that make the loss non-finite, or pass on_nonfinite='unchecked' to"
      " see the NaN."
  ]


def _skipped_step_hint(
    options: Mapping[str, Any],
    info: _result.MicrobatchInfo,
    num_microbatches: int,
    num_shards: int,
    run_micro: Callable[[Mapping[str, Any]], tuple[Any, Any, Any]],
) -> str:
  """The default skipped the step: names the microbatches whose loss is not finite
  (info.loss_finite), or, where every loss is finite, counts those whose gradient
  is not by running them once more with on_nonfinite="skip_microbatch"."""
  skipped = (
      f"so the step was skipped whole (on_nonfinite='propagate', the default): the gradient"
      f" came back NaN in every leaf and info.num_skipped counts all"
      f" {int(info.num_skipped)} microbatches."
  )
  fixes = (
      " Pass on_nonfinite='skip_microbatch' to leave out only the microbatches that are not"
      " finite, or on_nonfinite='unchecked' to see where the gradient is not finite."
  )
  bad = np.flatnonzero(~np.asarray(info.loss_finite)).tolist()
  if bad:
    where = ", ".join(
        f"{i % num_microbatches} on device {i // num_microbatches}" if num_shards > 1
        else str(i) for i in bad
    )
    return (
        f"The loss of microbatch(es) {where} (of {num_microbatches}"
        f"{' per device' if num_shards > 1 else ''}) is not finite, {skipped} Find the"
        f" rows there that make the loss non-finite.{fixes}"
    )
  _, _, by_microbatch = run_micro({**options, "on_nonfinite": "skip_microbatch"})
  if num_bad := int(by_microbatch.num_skipped):
    return (
        f"Every microbatch's loss is finite, but the gradient of {num_bad} microbatch(es)"
        " is not (e.g. sqrt or a norm at 0, whose derivative is infinite there),"
        f" {skipped}{fixes}"
    )
  return (
      "Every microbatch's loss and gradient is finite, but their sum is not (it"
      f" overflows the accumulator's dtype), {skipped}"
  )


def _state_causes(state_nums: tuple[int, ...], full_aux: Any) -> list[str]:
  """BatchNorm: statistics per microbatch differ from the full batch's."""
  if state_nums:
    return [
        f"state_argnums={state_nums[0]} threads a state such as BatchNorm batch_stats:"
        " in training mode each microbatch is normalised with its own batch statistics,"
        " which differ from the full batch's by design (and the running averages are"
        " updated once per microbatch). Check parity in evaluation mode"
        " (use_running_average=True) to test the rest of the step."
    ]
  if any("batch_stats" in jax.tree_util.keystr(path)
         for path, _ in jax.tree.leaves_with_path(full_aux)):
    return [
        "The aux holds batch_stats: with BatchNorm in training mode each microbatch is"
        " normalised with its own statistics, which differ from the full batch's by"
        " design. Thread the statistics with state_argnums, and check parity in"
        " evaluation mode (use_running_average=True)."
    ]
  return []


def _key_causes(args: tuple[Any, ...], rng_nums: tuple[int, ...]) -> list[str]:
  """Random draws per microbatch differ from the full batch's."""
  causes = []
  if rng_nums:
    causes.append(
        f"rng_argnums={rng_nums} gives microbatch i the key fold_in(key, i), so dropout"
        " and other random draws differ from the full-batch draw by design. Check"
        " parity with dropout off (deterministic=True, or a rate of 0)."
    )
  unnamed_keys = [
      n for n, arg in enumerate(args)
      if n not in rng_nums and any(_options.is_key(x) for x in jax.tree.leaves(arg))
  ]
  if unnamed_keys:
    causes.append(
        f"Argument(s) {unnamed_keys} hold a PRNG key not named in rng_argnums: every"
        " microbatch draws with the same key, so random draws repeat across microbatches"
        " and differ from the full-batch draw. Name the key in rng_argnums, and check"
        " parity with dropout off."
    )
  return causes


def _transport_causes(options: _options.Options, args: tuple[Any, ...]) -> list[str]:
  """Sharded parameters gathered, or gradients reduced, in a narrower dtype."""
  if not options.data_parallel:
    return []
  params = _call.diff_args(options, args)
  widest = max((jnp.finfo(jnp.result_type(x)).bits for x in jax.tree.leaves(params)
                if jnp.issubdtype(jnp.result_type(x), jnp.floating)), default=0)
  narrow = [
      f"{name}={jnp.dtype(dtype).name}" for name, dtype in (
          ("gather_dtype", options.gather_dtype), ("reduce_dtype", options.reduce_dtype))
      if dtype is not None and jnp.finfo(dtype).bits < widest
  ]
  if not narrow:
    return []
  return [
      f"{' and '.join(narrow)}: the sharded parameters (gather_dtype) or the gradients"
      " crossing devices (reduce_dtype) are rounded to a narrower dtype than the"
      " full batch computes in, by design. Check parity without them to test the rest"
      " of the step, or pass an rtol of that dtype (e.g. 3.1e-2 for bfloat16)."
  ]


def _unexplained_hints(
    per_leaf: Mapping[str, LeafDeviation], round_off: Mapping[str, float]
) -> list[str]:
  """No cause recognised: round-off, or a loss that couples the examples."""
  # The worst failing leaf's deviation, in units of its dtype's default rtol.
  excess = max(leaf.max_rel / round_off[name] for name, leaf in per_leaf.items()
               if not leaf.ok)
  if excess <= 1:
    return [
        f"The deviation is within round-off (max_rel at most {excess:.3g} times the"
        " default rtol of the leaf's dtype): the tolerance given is tighter than the"
        " order of summation allows. Use the default, rtol=None."
    ]
  hints = []
  if excess < 100:
    hints.append(
        f"The deviation is small ({excess:.3g} times the default rtol of the leaf's"
        " dtype): this can be round-off of long reductions, or of low-precision arithmetic"
        " (e.g. bfloat16 activations) summed in another order. If so, pass a looser"
        " rtol."
    )
  hints.append(
      "Microbatching reproduces the full batch when the loss is a mean of independent"
      " per-example terms (or, with weight_fn, a mean over the units weight_fn"
      " counts). Losses that couple the examples of a batch (batch statistics,"
      " in-batch negatives of contrastive losses, normalising by a batch-dependent"
      " quantity) change with the microbatch size by design."
  )
  return hints


def _mean_of_means_hints(
    args: tuple[Any, ...],
    options: Mapping[str, Any],
    batch_nums: tuple[int, ...],
    num_microbatches: int,
    num_shards: int,
    run_micro: Callable[[Mapping[str, Any]], tuple[Any, Any, Any]],
    full: tuple[Any, Any],
    rtol: float | None,
    atol: float,
) -> tuple[list[str], bool]:
  """Tries mask-like batch leaves as weight_fn; says which one restores parity.

  Returns the hints, and whether a ``weight_fn`` was found that restores parity.
  """
  hints = []
  num_parts = num_microbatches * num_shards
  where = f" ({num_microbatches} on each of {num_shards} devices)" if num_shards > 1 else ""
  split = _planner.data_parallel(options).split
  candidates = _mask_candidates(args, batch_nums, num_microbatches, num_shards, split)
  for position, index, path, sums in candidates[:_MAX_WEIGHT_TRIALS]:

    def mask_weight(*batches, position=position, index=index):
      return jnp.sum(jax.tree.leaves(batches[position])[index].astype(jnp.float32))

    micro_loss, micro_grads, _ = run_micro({**options, "weight_fn": mask_weight})
    weighted, _, _ = compare((micro_loss, micro_grads), full, rtol, atol)
    if len(batch_nums) == 1:
      leaf_name = f"batch{path}" if path else "the batch"
    else:
      leaf_name = f"argument {batch_nums[position]}{path}"
    code = _weight_fn_code(batch_nums, position, path)
    counts = f"it sums to {_format_sums(sums)} in the {num_parts} microbatches{where}"
    if all(leaf.ok for leaf in weighted.values()):
      return [
          f"The loss looks like a mean over the valid elements of {leaf_name}, but"
          f" {counts}: the plain mean of the microbatch means weights them equally, not"
          f" by their counts. Pass {code} (checked: it restores parity), so that each"
          " microbatch counts by its number of valid elements."
      ], True
    if any(word in path.lower() for word in _MASK_NAMES):
      hints.append(
          f"{leaf_name} looks like a mask and {counts}; weighting the microbatches by"
          f" it ({code}) did not restore parity on its own. If the loss divides by"
          " another count, return that count from weight_fn."
      )
  return hints, False
