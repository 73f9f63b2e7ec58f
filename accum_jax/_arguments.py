"""What both doors' arguments mean, and how a wrong one is answered.

- ``on_nonfinite``: one vocabulary for what a NaN or Inf does (:data:`NONFINITE`),
  checked by :func:`check_on_nonfinite`;
- per-leaf reductions: ``reduction=`` (``accumulate``'s and ``value_and_grad``'s)
  and ``aux_reduction=`` given as a string, a pytree prefix or a callable
  (:func:`grad_reductions`, :func:`per_leaf_spec`);
- keywords: :func:`takes_options` decorates each public function, so that its
  signature lists what it takes and a keyword it does not take (a retired one, a
  misspelling, one it refuses) gets one answer, from :func:`check_keywords`,
  that names the fix.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp

from accum_jax import _core

F = TypeVar("F", bound=Callable[..., Any])

# Flax Linen's FP8 layers (flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT) keep their
# amax histories and scales in this collection; their "gradient" is the new
# value, which TrainState.apply_gradients writes over the old. Over microbatches
# the whole batch's is the maximum of the microbatches' (see grad_reductions).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"

# What both doors do with a NaN or Inf, one word per meaning (``on_nonfinite=``).
# Inside a step, a microbatch is one slice of the batch; across calls, each call
# adds one microbatch's gradient: skipping either drops that one and keeps the rest.
NONFINITE: dict[str, str] = {
    "propagate": "the step's gradient is NaN in every leaf, as the full batch's would be,"
                 " for a gate such as optax.apply_if_finite to skip the step; info says"
                 " which microbatches' losses failed (value_and_grad's default)",
    "skip_microbatch": "a microbatch (a call, across calls) holding NaN or Inf is left"
                       " out and counted; the others are kept",
    "skip_window": "a window whose sum holds NaN or Inf is skipped whole when it is"
                   " applied, its calls counted (accumulate's default)",
    "unchecked": "nothing is checked: NaN or Inf flows where the arithmetic takes it",
}
# The values these replaced, and what each now is.
_RETIRED_NONFINITE = {
    "step": "propagate", "microbatch": "skip_microbatch", "call": "skip_microbatch",
    "window": "skip_window", False: "unchecked",
}


def renamed_nonfinite(value: Any) -> str | None:
  """The ``on_nonfinite`` value that replaced ``skip_nonfinite=value``, if one did."""
  if isinstance(value, bool) and value:
    return None
  try:
    return _RETIRED_NONFINITE.get(value)
  except TypeError:  # unhashable
    return None


def check_on_nonfinite(value: Any, accepted: Sequence[str], caller: str) -> str:
  """``value`` checked against the ``on_nonfinite`` values ``caller`` takes."""
  if isinstance(value, str) and value in accepted:
    return value
  choices = "; ".join(f"{v!r}: {NONFINITE[v]}" for v in accepted)
  if isinstance(value, str) and value in NONFINITE:
    raise ValueError(f"{caller} does not take on_nonfinite={value!r}. It takes {choices}.")
  new = renamed_nonfinite(value)
  hint = f" on_nonfinite={new!r} is what {value!r} meant." if new in accepted else ""
  raise ValueError(f"on_nonfinite={value!r} is not one of {tuple(accepted)}.{hint} {caller}"
                   f" takes {choices}.")


# The options that were renamed, grouped or dropped, and what replaces each.
_RENAMED = {"grad_reduction": "reduction", "skip_nonfinite": "on_nonfinite"}
_DATA_PARALLEL_FIELDS = (
    "mesh", "data_axis", "param_sharding", "gather", "gather_dtype", "reduce_dtype", "split")
_PAD_BATCH_FIX = (
    "pad the batch to a multiple of num_microbatches yourself (np.pad), with rows that"
    " weight_fn weighs zero, e.g. a mask in the batch and"
    " weight_fn=lambda batch: batch['mask'].sum()"
)
RETIRED: tuple[str, ...] = (*_RENAMED, "pad_batch", *_DATA_PARALLEL_FIELDS)


def _shown(value: Any) -> str:
  """``value`` as a message shows it: its repr where that is short, else ``...``."""
  text = repr(value)
  return text if len(text) <= 32 and not text.startswith("<") else "..."


def _retired(caller: str, name: str, given: Mapping[str, Any], refused: Mapping[str, str]) -> str:
  """The message for a retired option: what replaces it, with the value given."""
  value = _shown(given[name])
  if name == "skip_nonfinite":
    now = renamed_nonfinite(given[name])
    return (f"{caller} takes no skip_nonfinite=: pass on_nonfinite={now!r} instead (one"
            " word per meaning in both doors: 'propagate', 'skip_microbatch', 'skip_window',"
            " 'unchecked')." if now else
            f"{caller} takes no skip_nonfinite=: pass on_nonfinite= ('propagate',"
            " 'skip_microbatch', 'skip_window' or 'unchecked', as the function takes them).")
  if name in _RENAMED:
    new = _RENAMED[name]
    if new in refused:
      return f"{caller} takes no {name}= (now {new}=), nor {new}=: {refused[new]}"
    return f"{caller} takes no {name}=: pass {new}={value} instead (renamed, as in accumulate)."
  if name == "pad_batch":
    return f"{caller} takes no pad_batch=: {_PAD_BATCH_FIX}."
  grouped = [n for n in _DATA_PARALLEL_FIELDS if n in given]
  fields = ", ".join(f"{n}={_shown(given[n])}" for n in grouped)
  if "data_parallel" in given:  # add them to the one given
    fields = f"..., {fields}"
  what = (
      ": the order of rows in the microbatches, with or without a mesh" if grouped == ["split"]
      else ""
  )
  names = " or ".join(f"{n}=" for n in grouped)
  return f"{caller} takes no {names}: pass data_parallel=accum_jax.DataParallel({fields}){what}."


def check_keywords(
    caller: str, given: Mapping[str, Any], accepted: Collection[str],
    refused: Mapping[str, str] | None = None, listed: Sequence[str] | None = None,
    retired: Collection[str] = RETIRED,
) -> None:
  """ValueError naming the fix for a keyword in ``given`` that ``caller`` does not
  take (it takes ``accepted``; ``listed`` are the options a message lists):
  why a ``refused`` one means nothing there, what replaced a retired one, or
  which option a misspelt one is close to."""
  refused = refused or {}
  unknown = [name for name in given if name not in accepted]
  if not unknown:
    return
  name = unknown[0]
  value = _shown(given[name])
  if name in refused:
    raise ValueError(f"{caller} does not take {name}={value}: {refused[name]}")
  if name in retired:
    raise ValueError(_retired(caller, name, given, refused))
  options = sorted(listed if listed is not None else accepted)
  close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.8)
  if close:
    raise ValueError(
        f"{caller} got an unknown option {name}={value}: did you mean {close[0]}={value}?"
        f" Its options are {options}."
    )
  raise ValueError(f"{caller} got an unknown option {name}={value}; its options are {options}.")


_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _signature(
    fun: Callable[..., Any], options_of: Callable[..., Any] | None, refused: Mapping[str, str]
) -> inspect.Signature:
  """``fun``'s signature, its ``**options`` (if ``options_of`` is given) replaced by
  the keyword-only options of ``options_of`` that ``fun`` neither names nor refuses."""
  signature = inspect.signature(fun)
  if options_of is None:
    return signature
  own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
  taken = {p.name for p in own} | set(refused)
  added = [
      p for p in inspect.signature(options_of).parameters.values()
      if p.kind is p.KEYWORD_ONLY and p.name not in taken
  ]
  return signature.replace(parameters=[*own, *added])


def takes_options(
    caller: str, *, options_of: Callable[..., Any] | None = None,
    refused: Mapping[str, str] | None = None, shown: bool = True,
    retired: Collection[str] = RETIRED,
) -> Callable[[F], F]:
  """Decorates a public function that takes ``value_and_grad``'s options.

  A keyword it does not take is refused by :func:`check_keywords`, with the fix,
  before Python binds the arguments (so that a misspelt ``num_microbatches`` is
  named as such). With ``options_of``, the function's ``**options`` stand for
  the keyword-only options of ``options_of`` that it neither names nor refuses:
  no other keyword gets through, and (unless ``shown`` is False) they are written
  into its ``__signature__``, which ``help()``, ``inspect`` and the API reference
  read.
  """

  def decorate(fun: F) -> F:
    refusing = refused or {}
    signature = _signature(fun, options_of, refusing)
    params = signature.parameters.values()
    accepted = {p.name for p in params if p.kind in _KEYWORD}
    listed = [p.name for p in params if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(fun)
    def checked(*args: Any, **kwargs: Any) -> Any:
      if not kwargs.keys() <= accepted:  # a keyword it does not take: say which, and why
        check_keywords(caller, kwargs, accepted, refusing, listed, retired)
      return fun(*args, **kwargs)

    if shown:
      checked.__signature__ = signature  # type: ignore[attr-defined]
    return cast(F, checked)

  return decorate


def _is_spec_leaf(x: Any) -> bool:
  return x is None or isinstance(x, str)


def spec_strings(spec: Any) -> list[tuple[str, Any]]:
  """``(where, value)`` of each leaf of a spec that is not None (the root: '')."""
  return [
      (jax.tree_util.keystr(path), x)
      for path, x in jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_spec_leaf)[0]
      if x is not None
  ]


def named(option: str, where: str, value: Any) -> str:
  """How a message names ``value`` found at ``where`` in ``option`` (the root: '')."""
  return f"{option} has {value!r} at {where}, which" if where else f"{option}={value!r}"


def _bad_grad_reduction(where: str, value: Any, option: str) -> ValueError:
  return ValueError(
      f"{named(option, where, value)} is not one of {_core.REDUCTIONS}: 'mean' (the"
      " default) and 'sum' weigh the gradients, 'max' and 'last' keep one value of an"
      " FP8 statistic. Pass one of them, a pytree prefix of the gradient with them (or"
      " None) at its leaves, or a callable (path, leaf) returning one or None."
  )


def check_grad_reduction(spec: Any, option: str = "reduction") -> None:
  """What can be checked of a per-leaf reduction spec before the gradient's tree is known."""
  if callable(spec):
    return
  for where, value in spec_strings(spec):
    if value not in _core.REDUCTIONS:
      raise _bad_grad_reduction(where, value, option)


def per_leaf_spec(spec: Any, tree: Any, option: str, what: str) -> list[tuple[Any, Any]]:
  """Per leaf of ``tree``: the entry of ``spec`` (None, a string, or a pytree prefix
  of ``tree`` with those at its leaves) that covers it, and that entry's key path."""
  num_leaves = len(jax.tree.leaves(tree))
  if _is_spec_leaf(spec):
    return [(spec, ())] * num_leaves
  try:
    nested = jax.tree_util.tree_map_with_path(
        lambda path, x, sub: _Group([(x, path)] * len(jax.tree.leaves(sub))), spec, tree,
        is_leaf=_is_spec_leaf,
    )
  except ValueError as e:
    raise ValueError(
        f"{option} is neither a string nor a pytree prefix of {what} (with a string or"
        f" None at each of its leaves): {e} Match the structure of {what}, or put one"
        " string at the top for all of it."
    ) from e
  groups = jax.tree.leaves(nested)  # a _Group is not a pytree: one leaf each
  return [entry for group in groups for entry in group.entries]


class _Group:
  """The entries of a spec for the leaves under one of its leaves (not a pytree,
  unlike a list, which a spec may itself be)."""

  def __init__(self, entries: list[tuple[Any, Any]]):
    self.entries = entries


def _overwritten(path: Any) -> bool:
  """Whether ``path`` goes through Flax's ``_overwrite_with_gradient`` collection."""
  for key in path:
    if getattr(key, "key", getattr(key, "name", None)) == OVERWRITE_WITH_GRADIENT:
      return True
  return False


def grad_reductions(spec: Any, grads: Any, option: str = "reduction") -> tuple[str, ...]:
  """How each gradient leaf combines (``reduction=``, ``accumulate``'s ``reduction=``).

  ``spec`` is None, a string, a pytree prefix of ``grads`` with strings or None
  at its leaves, or a callable ``(path, leaf)`` returning a string or None.
  None means the default: "mean", but "max" for the leaves of Flax Linen's FP8
  collection (any key named ``_overwrite_with_gradient`` on the path), whose
  "gradient" is the new amax history or scale. That default yields only to an
  entry placed at or below the collection (or a callable, which sees every
  leaf's path): ``reduction="sum"`` sums the gradients and keeps the FP8
  statistics exact.
  """
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  if spec is None:  # the default: no spec to read, only where Flax's FP8 collection is
    given = [(None, ())] * len(flat)
  elif callable(spec):
    given = []
    for path, leaf in flat:
      kind = spec(path, leaf)
      if kind is not None and kind not in _core.REDUCTIONS:
        raise _bad_grad_reduction(f"{jax.tree_util.keystr(path)} (returned by the callable)",
                                  kind, option)
      given.append((kind, path))
  else:
    given = per_leaf_spec(spec, grads, option, "the gradient (the parameters' structure)")
  kinds = []
  for (path, leaf), (kind, named_at) in zip(flat, given):
    statistic = _overwritten(path)
    if kind is None or (statistic and not _overwritten(named_at)):
      kind = "max" if statistic else "mean"
    if kind == "max" and not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise ValueError(
          f"{option} gives the leaf {jax.tree_util.keystr(path)} of dtype"
          f" {jnp.result_type(leaf)} 'max', which needs real floating values. Give it"
          " 'mean', 'sum' or 'last'."
      )
    kinds.append(kind)
  return tuple(kinds)
