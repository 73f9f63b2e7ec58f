"""The options of :func:`accum_jax.value_and_grad`, validated once.

:func:`make` checks every option when the microbatched function is built and
returns an :class:`Options`, with the helpers that name the arguments' roles
(``argnums``, ``batch_argnums``, ...). ``_call.bind`` resolves one call's
arguments against them. The planner, the parity checker and the framework front
ends use the same options, so an option means one thing everywhere.

:func:`takes_options` decorates each public function that takes them: its
signature lists every option it takes, and a keyword it does not take (a
retired one, a misspelling, one it refuses) gets one answer, from
:func:`check_keywords`, that names the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import numbers
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeVar, cast

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from accum_jax import _batching, _core, _sharding

AuxReduction = Literal["mean", "sum", "max", "last", "stack", "concat"]
AUX_REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "last", "stack", "concat")

# Flax Linen's FP8 layers (flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT) keep their
# amax histories and scales in this collection; their "gradient" is the new
# value, which TrainState.apply_gradients writes over the old. Over microbatches
# the whole batch's is the maximum of the microbatches' (see grad_reductions).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"

F = TypeVar("F", bound=Callable[..., Any])


class Options(NamedTuple):
  """The checked options of one microbatched function; see ``value_and_grad``."""

  num_microbatches: int
  argnums: tuple[int, ...]
  single_argnum: bool  # argnums was an int: grads is one pytree, not a tuple
  batch_argnums: tuple[int, ...] | None  # None: found per call, see `bind`
  rng_argnums: tuple[int, ...]
  state_argnums: tuple[int, ...]  # at most one
  has_aux: bool
  weight_fn: Callable[..., Any] | None
  aux_reduction: Any  # None, a string, or a pytree prefix of the aux; see `aux_reductions`
  reduction: Any  # None, a string, a pytree prefix or a callable; see `grad_reductions`
  split: _batching.Split
  accumulator_dtype: Any
  on_nonfinite: str  # one of ON_NONFINITE (see _core.NONFINITE)
  mesh: Any
  data_axis: Any  # str, tuple of str, or None
  param_sharding: Any
  gather: str
  gather_dtype: Any
  reduce_dtype: Any
  return_info: bool
  gradient_noise: bool
  gradient_dtype: Any = None  # None: each gradient leaf in its parameter's dtype

  @property
  def checks_finite(self) -> bool:
    """Whether NaN or Inf is looked for at all (anything but "unchecked")."""
    return self.on_nonfinite != "unchecked"

  @property
  def propagates(self) -> bool:
    """on_nonfinite="propagate": one check after the loop, the step's gradient NaN."""
    return self.on_nonfinite == "propagate"

  @property
  def data_parallel(self) -> bool:
    return self.mesh is not None or self.data_axis is not None

  def roles(self, batch_argnums: tuple[int, ...] | None = None) -> dict[str, tuple[int, ...]]:
    """The argument numbers of each role, by option name."""
    batch = self.batch_argnums if batch_argnums is None else batch_argnums
    return {"argnums": self.argnums, "batch_argnums": batch or (),
            "rng_argnums": self.rng_argnums, "state_argnums": self.state_argnums}


def argnums_tuple(argnums: Any, name: str) -> tuple[int, ...]:
  """``argnums`` (None, an int or a sequence of ints) as a tuple; ValueError if not."""
  if argnums is None:
    return ()
  if isinstance(argnums, numbers.Integral):
    nums: tuple[Any, ...] = (argnums,)
  elif isinstance(argnums, Sequence) and not isinstance(argnums, str):
    nums = tuple(argnums)
  else:
    nums = (argnums,)
  for n in nums:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
      raise ValueError(
          f"{name}={argnums!r} must be a non-negative int or a tuple of them, e.g."
          f" {name}=1 or {name}=(1, 2)."
      )
  return tuple(int(n) for n in nums)


def check_roles(roles: dict[str, tuple[int, ...]], fix: str = "") -> None:
  """ValueError if two roles (keyed by how to name them, e.g. "argnums=(0,)") overlap."""
  names = list(roles)
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      if both := set(roles[a]) & set(roles[b]):
        raise ValueError(
            f"{a} and {b} both name argument(s) {sorted(both)}: each argument has one"
            f" role.{fix}"
        )


def _check_roles(roles: dict[str, tuple[int, ...]]) -> None:
  check_roles({f"{name}={nums}": nums for name, nums in roles.items()})


@dataclasses.dataclass(frozen=True)
class DataParallel:
  """How the batch is spread over devices, and how gradients cross them.

  Every function that takes ``value_and_grad``'s options takes this one object
  as ``data_parallel=``. See the guide: :doc:`/multi_device`.

  Attributes:
    mesh: the ``jax.sharding.Mesh`` to run on: each device loops over its rows
      of the batch, and each gradient leaf is reduced as its parameter's
      sharding says (replicated: once per call; sharded over a data axis: into
      a shard of the accumulator). None: the ``jax.set_mesh`` mesh when
      ``data_axis`` is given, else no mesh.
    data_axis: the mesh axis (or a tuple of axes, e.g. ``("replica", "fsdp")``
      for HSDP) the batch is sharded over.
    param_sharding: the differentiated arguments' shardings (a
      ``NamedSharding`` or ``PartitionSpec``, or a pytree prefix of them).
      None: read from each parameter; under ``jax.jit`` with automatic axes a
      parameter with none counts as replicated, and an
      :class:`UnknownShardingWarning` says so.
    gather: for parameters sharded over a data axis: ``"per_microbatch"``
      (FSDP: each microbatch's gradient reduce-scattered into a sharded
      accumulator) or ``"once"`` (gathered before the loop: a full-size local
      sum, one reduce-scatter after it). None: ``"per_microbatch"``
      (``plan_microbatches`` compares both).
    gather_dtype: the dtype sharded parameters are gathered in; None keeps theirs.
    reduce_dtype: the dtype gradients cross devices in; None keeps theirs.
    split: ``"contiguous"`` (default) takes consecutive rows per microbatch;
      ``"strided"`` rows ``i, i + N, ...``, so that a batch sharded by
      ``jax.jit`` alone (no mesh) puts rows of every device in each microbatch.

  Examples:
    >>> import jax, accum_jax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> accum_jax.DataParallel(mesh, "data").data_axis
    'data'
  """

  mesh: jax.sharding.Mesh | None = None
  data_axis: str | tuple[str, ...] | None = None
  param_sharding: Any = None
  gather: _sharding.Gather | None = None
  gather_dtype: Any = None
  reduce_dtype: Any = None
  split: _batching.Split = "contiguous"


# value_and_grad's options and their defaults: every function that takes them
# takes them under these names, checked by `make`.
DEFAULTS: dict[str, Any] = {
    "argnums": 0,
    "batch_argnums": None,
    "has_aux": False,
    "weight_fn": None,
    "rng_argnums": None,
    "state_argnums": None,
    "aux_reduction": None,
    "reduction": None,
    "accumulator_dtype": jnp.float32,
    "gradient_dtype": None,
    "on_nonfinite": "propagate",
    "data_parallel": None,
    "return_info": False,
    "gradient_noise": False,
}

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
    now = _core.renamed_nonfinite(given[name])
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
      check_keywords(caller, kwargs, accepted, refusing, listed, retired)
      return fun(*args, **kwargs)

    if shown:
      checked.__signature__ = signature  # type: ignore[attr-defined]
    return cast(F, checked)

  return decorate


def _data_parallel(value: Any) -> DataParallel:
  if value is None:
    return DataParallel()
  if not isinstance(value, DataParallel):
    raise ValueError(
        f"data_parallel={value!r} is not an accum_jax.DataParallel: pass e.g."
        " data_parallel=accum_jax.DataParallel(mesh, data_axis='data')."
    )
  return value


def make(
    num_microbatches: Any,
    *,
    caller: str = "value_and_grad",
    refused: Mapping[str, str] | None = None,
    **given: Any,
) -> Options:
  """Checks the options of ``value_and_grad`` (or of ``caller``, which refuses
  ``refused``: name -> why, with the fix), when the function is built; raises a
  ValueError naming the bad one."""
  refused = refused or {}
  check_keywords(caller, given, set(DEFAULTS) - set(refused), refused)
  o = {**DEFAULTS, **given}
  if (n := _core.positive_int(num_microbatches)) is None:
    raise ValueError(
        f"num_microbatches={num_microbatches!r} must be an int >= 1 that divides the"
        " batch size; use 1 for the whole batch at once."
    )
  diff = argnums_tuple(o["argnums"], "argnums")
  if not diff:
    raise ValueError("argnums=() differentiates nothing: name at least one argument.")
  batch = (
      None if o["batch_argnums"] is None else argnums_tuple(o["batch_argnums"], "batch_argnums")
  )
  if batch == ():
    raise ValueError(
        "batch_argnums=() names no batch: name the argument(s) to split, or leave it"
        " None to split every positional array argument that is not differentiated."
    )
  state = argnums_tuple(o["state_argnums"], "state_argnums")
  if len(state) > 1:
    raise ValueError(
        f"state_argnums={o['state_argnums']!r}: one argument can be threaded; gather the"
        " states into one pytree."
    )
  dp = _data_parallel(o["data_parallel"])
  options = Options(
      num_microbatches=n, argnums=diff, single_argnum=isinstance(o["argnums"], numbers.Integral),
      batch_argnums=batch, rng_argnums=argnums_tuple(o["rng_argnums"], "rng_argnums"),
      state_argnums=state, has_aux=o["has_aux"], weight_fn=o["weight_fn"],
      aux_reduction=o["aux_reduction"], reduction=o["reduction"], split=dp.split,
      accumulator_dtype=_core.canonicalize_accumulator_dtype(o["accumulator_dtype"]),
      on_nonfinite=_core.check_on_nonfinite(o["on_nonfinite"], ON_NONFINITE, caller),
      mesh=dp.mesh,
      data_axis=dp.data_axis, param_sharding=dp.param_sharding,
      gather="per_microbatch" if dp.gather is None else dp.gather,
      gather_dtype=_transport_dtype(dp.gather_dtype, "gather_dtype"),
      reduce_dtype=_transport_dtype(dp.reduce_dtype, "reduce_dtype"),
      return_info=o["return_info"], gradient_noise=bool(o["gradient_noise"]),
      gradient_dtype=_gradient_dtype(o["gradient_dtype"]),
  )
  _check_roles(options.roles())
  _check_choices(options)
  return options


# The on_nonfinite values the inside-step functions take (see _core.NONFINITE).
ON_NONFINITE: tuple[str, ...] = ("propagate", "skip_microbatch", "unchecked")


def _floating_dtype(dtype: Any, name: str, fix: str) -> Any:
  """``dtype`` checked as None or a real floating dtype; ValueError naming ``name``."""
  if dtype is None:
    return None
  try:
    checked = jnp.dtype(dtype)
  except TypeError:
    checked = None
  if checked is None or not jnp.issubdtype(checked, jnp.floating):
    raise ValueError(f"{name}={dtype!r} is not a floating dtype. {fix}")
  return checked


def _transport_dtype(dtype: Any, name: str) -> Any:
  """``gather_dtype`` / ``reduce_dtype``: None or a floating dtype."""
  return _floating_dtype(
      dtype, name,
      "Pass e.g. jnp.bfloat16 to halve the bytes that cross devices, or None to keep the"
      " parameters' own.",
  )


def _gradient_dtype(dtype: Any) -> Any:
  """``gradient_dtype``: None or a real floating dtype."""
  return _floating_dtype(
      dtype, "gradient_dtype",
      "Pass e.g. jnp.float32 to return the gradient of bfloat16 parameters unrounded, or"
      " None (the default) to return each gradient leaf in its parameter's dtype.",
  )


def _check_sharding_options(options: Options) -> None:
  if options.gather not in _sharding.GATHERS:
    raise ValueError(
        f"DataParallel(gather={options.gather!r}) is not one of {_sharding.GATHERS}:"
        " 'per_microbatch' reduce-scatters each microbatch's gradient (FSDP), 'once'"
        " gathers the parameters before the loop and reduce-scatters after it."
    )
  given = [
      f"{name}={value!r}" for name, value, default in (
          ("param_sharding", options.param_sharding, None),
          ("gather", options.gather, "per_microbatch"),
          ("gather_dtype", options.gather_dtype, None),
          ("reduce_dtype", options.reduce_dtype, None),
      ) if value != default
  ]
  if given and not options.data_parallel:
    raise ValueError(
        f"DataParallel({given[0]}) says how gradients cross devices, but names no mesh:"
        " give it mesh and data_axis (or data_axis under jax.set_mesh)."
    )


def _is_spec_leaf(x: Any) -> bool:
  return x is None or isinstance(x, str)


def _spec_strings(spec: Any) -> list[tuple[str, Any]]:
  """``(where, value)`` of each leaf of a spec that is not None (the root: '')."""
  return [
      (jax.tree_util.keystr(path), x)
      for path, x in jax.tree_util.tree_flatten_with_path(spec, is_leaf=_is_spec_leaf)[0]
      if x is not None
  ]


def _named(option: str, where: str, value: Any) -> str:
  """How a message names ``value`` found at ``where`` in ``option`` (the root: '')."""
  return f"{option} has {value!r} at {where}, which" if where else f"{option}={value!r}"


def _check_aux_reduction(options: Options) -> None:
  for where, value in _spec_strings(options.aux_reduction):
    if value not in AUX_REDUCTIONS:
      raise ValueError(
          f"{_named('aux_reduction', where, value)} is not one of {AUX_REDUCTIONS}: 'mean'"
          " and 'sum' reduce over the microbatches (weighted as the loss), 'max' and"
          " 'last' keep the largest or the last kept microbatch's value, 'concat'"
          " returns per-example outputs as (batch, ...), 'stack' per-microbatch outputs"
          " as (num_microbatches, ...). A pytree prefix of the aux gives one per leaf."
      )
    if value == "stack" and options.data_parallel:
      raise ValueError(
          f"{_named('aux_reduction', where, value)} is not available with a mesh:"
          " per-microbatch aux differs between devices. Use 'concat' for per-example"
          " outputs, or 'mean', 'sum', 'max' or 'last'."
      )


def _bad_grad_reduction(where: str, value: Any, option: str) -> ValueError:
  return ValueError(
      f"{_named(option, where, value)} is not one of {_core.REDUCTIONS}: 'mean' (the"
      " default) and 'sum' weigh the gradients, 'max' and 'last' keep one value of an"
      " FP8 statistic. Pass one of them, a pytree prefix of the gradient with them (or"
      " None) at its leaves, or a callable (path, leaf) returning one or None."
  )


def check_grad_reduction(spec: Any, option: str = "reduction") -> None:
  """What can be checked of a per-leaf reduction spec before the gradient's tree is known."""
  if callable(spec):
    return
  for where, value in _spec_strings(spec):
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
  return any(
      getattr(key, "key", getattr(key, "name", None)) == OVERWRITE_WITH_GRADIENT for key in path
  )


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
  if callable(spec):
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


def _check_choices(options: Options) -> None:
  _check_sharding_options(options)
  _check_aux_reduction(options)
  check_grad_reduction(options.reduction)
  if options.split not in _batching.SPLITS:
    raise ValueError(
        f"DataParallel(split={options.split!r}) is not one of {_batching.SPLITS}:"
        " 'contiguous' makes microbatch i of consecutive rows, 'strided' of rows i, i + N, ..."
    )
  if options.gradient_noise and not options.return_info:
    raise ValueError(
        "gradient_noise=True needs return_info=True: the estimate comes back as"
        " info.gradient_noise."
    )
  if options.state_argnums and not options.has_aux:
    raise ValueError(
        "state_argnums needs has_aux=True: fun must return (value, (new_state, aux))."
    )


def is_key(x: Any) -> bool:
  """A typed PRNG key, or a raw one (uint32[2] threefry, uint32[4] rbg)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return jnp.ndim(x) == 0
  return dtype == jnp.uint32 and jnp.shape(x) in ((2,), (4,))


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def looks_like_batch(arg: Any) -> bool:
  """Every leaf an array with a leading (batch) axis, none a key: the batch_argnums=None test."""
  leaves = jax.tree.leaves(arg)
  return bool(leaves) and all(
      is_array(x) and jnp.ndim(x) >= 1 and not is_key(x) for x in leaves
  )


def check_unambiguous(found: tuple[int, ...], args: Sequence[Any], fix: str = "") -> None:
  """ValueError where ``batch_argnums=None`` cannot tell which arguments are the batch.

  The rule: bare arrays with a leading axis (``loss(params, x, y)``) are all
  batch data and split; an argument that holds the batch as a pytree of arrays
  (``loss(params, batch)``) says where the batch is, so any other argument that
  looks like a batch beside it (per-class weights of the batch's length) is
  refused rather than split or kept by a guess.
  """
  containers = [n for n in found if not is_array(args[n])]
  if len(found) < 2 or not containers:
    return
  others = [n for n in found if n != containers[0]]
  sizes = sorted({jnp.shape(x)[0] for n in found for x in jax.tree.leaves(args[n])})
  raise ValueError(
      f"batch_argnums=None finds arguments {list(found)} that could each be the batch:"
      f" argument {containers[0]} holds a pytree of arrays and argument(s) {others} too"
      f" have leading axes (of sizes {sizes}), and which of them are batch data cannot be"
      f" told from their shapes. Name the batch: batch_argnums={containers[0]} to split"
      f" it alone (e.g. when argument {others[0]} holds per-class weights), or"
      f" batch_argnums={tuple(found)} to split them all.{fix}"
  )


