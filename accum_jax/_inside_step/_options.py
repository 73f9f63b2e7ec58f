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
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeVar

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from accum_jax import _arguments, _core
from accum_jax._inside_step import _batching

# How sharded parameters are gathered (DataParallel(gather=...)); see _sharding.
Gather = Literal["per_microbatch", "once"]
GATHERS: tuple[str, ...] = ("per_microbatch", "once")

AuxReduction = Literal["mean", "sum", "max", "last", "stack", "concat"]
AUX_REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "last", "stack", "concat")

F = TypeVar("F", bound=Callable[..., Any])


class Options(NamedTuple):
  """The checked options of one microbatched function; see ``value_and_grad``."""

  num_microbatches: int
  argnums: tuple[int, ...]
  single_argnum: bool  # argnums was an int: grads is one pytree, not a tuple
  batch_argnums: tuple[int, ...]  # the arguments split; never guessed from shapes
  rng_argnums: tuple[int, ...]
  state_argnums: tuple[int, ...]  # at most one
  has_aux: bool
  weight_fn: Callable[..., Any] | None
  aux_reduction: Any  # None, a string, or a pytree prefix of the aux; see `aux_reductions`
  reduction: Any  # None, a string, a pytree prefix or a callable; see `grad_reductions`
  split: _batching.Split
  accumulator_dtype: Any
  on_nonfinite: str  # one of ON_NONFINITE (see _arguments.NONFINITE)
  mesh: Any
  data_axis: Any  # str, tuple of str, or None
  param_sharding: Any
  gather: str
  gather_dtype: Any
  reduce_dtype: Any
  return_info: bool
  gradient_noise: bool
  gradient_dtype: Any  # None: each gradient leaf in its parameter's dtype
  # Read from on_nonfinite and the mesh once, here, so that no reader asks again.
  checks_finite: bool  # NaN or Inf is looked for at all (anything but "unchecked")
  propagates: bool  # on_nonfinite="propagate": one check after the loop, the gradient NaN
  data_parallel: bool  # a mesh or a data axis is given
  plain: bool  # nothing beyond the argument numbers and a wide accumulator: `_plain` runs it

  def roles(self) -> dict[str, tuple[int, ...]]:
    """The argument numbers of each role, by option name."""
    return {"argnums": self.argnums, "batch_argnums": self.batch_argnums,
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
  gather: Gather | None = None
  gather_dtype: Any = None
  reduce_dtype: Any = None
  split: _batching.Split = "contiguous"


# value_and_grad's options and their defaults: every function that takes them
# takes them under these names, checked by `make`.
DEFAULTS: dict[str, Any] = {
    "argnums": 0,
    "batch_argnums": 1,
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

def _data_parallel_fields(value: Any) -> dict[str, Any]:
  """A :class:`DataParallel`, checked, as the fields of :class:`Options` it sets."""
  if not isinstance(value, DataParallel):
    raise ValueError(
        f"data_parallel={value!r} is not an accum_jax.DataParallel: pass e.g."
        " data_parallel=accum_jax.DataParallel(mesh, data_axis='data')."
    )
  fields = {
      "mesh": value.mesh, "data_axis": value.data_axis, "param_sharding": value.param_sharding,
      "gather": "per_microbatch" if value.gather is None else value.gather,
      "gather_dtype": _transport_dtype(value.gather_dtype, "gather_dtype"),
      "reduce_dtype": _transport_dtype(value.reduce_dtype, "reduce_dtype"),
      "split": value.split,
      "data_parallel": value.mesh is not None or value.data_axis is not None,
  }
  _check_sharding_options(fields)
  return fields


def make(
    num_microbatches: Any,
    *,
    caller: str = "value_and_grad",
    refused: Mapping[str, str] | None = None,
    **given: Any,
) -> Options:
  """Checks the options of ``value_and_grad`` (or of ``caller``, which refuses
  ``refused``: name -> why, with the fix), when the function is built; raises a
  ValueError naming the bad one.

  Options left at their defaults are valid by construction and are not looked
  at again: a call that gives none enters no validator, and each given option
  enters its own (:data:`_RESOLVE`), then the checks that relate it to others.
  """
  accepted = DEFAULTS.keys() - (refused or {}).keys()
  if not given.keys() <= accepted:
    _arguments.check_keywords(caller, given, accepted, refused)
  if (n := _core.positive_int(num_microbatches)) is None:
    raise ValueError(
        f"num_microbatches={num_microbatches!r} must be an int >= 1 that divides the"
        " batch size; use 1 for the whole batch at once."
    )
  changed = {}
  for name, value in given.items():
    default = DEFAULTS[name]
    if value is not default and not (type(value) is type(default) and value == default):
      changed[name] = value
  if not changed:
    return PLAIN._replace(num_microbatches=n)
  return _resolved(n, changed, caller)


def _resolved(n: int, changed: dict[str, Any], caller: str) -> Options:
  """The options with ``changed`` (those not at their defaults) resolved and checked."""
  fields = PLAIN._asdict()
  fields["num_microbatches"] = n
  for name, value in changed.items():
    fields.update(_RESOLVE[name](value, caller))
  options = Options(**fields)
  options = options._replace(plain=_plain(options))
  if changed.keys() & {"argnums", "batch_argnums", "rng_argnums", "state_argnums"}:
    _check_roles(options.roles())
  if changed.keys() & {"aux_reduction", "data_parallel"}:
    _check_aux_reduction(options)
  if options.gradient_noise and not options.return_info:
    raise ValueError(
        "gradient_noise=True needs return_info=True: the estimate comes back as"
        " info.gradient_noise."
    )
  if options.state_argnums and not options.has_aux:
    raise ValueError(
        "state_argnums needs has_aux=True: fun must return (value, (new_state, aux))."
    )
  return options


def _diff_argnums(value: Any) -> dict[str, Any]:
  diff = argnums_tuple(value, "argnums")
  if not diff:
    raise ValueError("argnums=() differentiates nothing: name at least one argument.")
  return {"argnums": diff, "single_argnum": isinstance(value, numbers.Integral)}


def _state_argnums(value: Any) -> dict[str, Any]:
  state = argnums_tuple(value, "state_argnums")
  if len(state) > 1:
    raise ValueError(
        f"state_argnums={value!r}: one argument can be threaded; gather the states into"
        " one pytree."
    )
  return {"state_argnums": state}


def _on_nonfinite(value: Any, caller: str) -> dict[str, Any]:
  value = _arguments.check_on_nonfinite(value, ON_NONFINITE, caller)
  return {"on_nonfinite": value, "checks_finite": value != "unchecked",
          "propagates": value == "propagate"}


def _reduction(value: Any) -> dict[str, Any]:
  _arguments.check_grad_reduction(value)
  return {"reduction": value}


# How each option given (not at its default) is checked, into the fields it sets.
_RESOLVE: dict[str, Callable[[Any, str], dict[str, Any]]] = {
    "argnums": lambda v, caller: _diff_argnums(v),
    "batch_argnums": lambda v, caller: {"batch_argnums": _batch_argnums(v)},
    "has_aux": lambda v, caller: {"has_aux": v},
    "weight_fn": lambda v, caller: {"weight_fn": v},
    "rng_argnums": lambda v, caller: {"rng_argnums": argnums_tuple(v, "rng_argnums")},
    "state_argnums": lambda v, caller: _state_argnums(v),
    "aux_reduction": lambda v, caller: {"aux_reduction": v},  # checked with the mesh
    "reduction": lambda v, caller: _reduction(v),
    "accumulator_dtype": lambda v, caller: {
        "accumulator_dtype": _core.canonicalize_accumulator_dtype(v)},
    "gradient_dtype": lambda v, caller: {"gradient_dtype": _gradient_dtype(v)},
    "on_nonfinite": _on_nonfinite,
    "data_parallel": lambda v, caller: _data_parallel_fields(v),
    "return_info": lambda v, caller: {"return_info": v},
    "gradient_noise": lambda v, caller: {"gradient_noise": bool(v)},
}

# The options of a call that gives none: what `make` resolves the defaults to.
PLAIN = Options(
    num_microbatches=1, argnums=(0,), single_argnum=True, batch_argnums=(1,),
    rng_argnums=(), state_argnums=(), has_aux=False, weight_fn=None, aux_reduction=None,
    reduction=None, split="contiguous", accumulator_dtype=jnp.dtype(jnp.float32),
    on_nonfinite="propagate", mesh=None, data_axis=None, param_sharding=None,
    gather="per_microbatch", gather_dtype=None, reduce_dtype=None, return_info=False,
    gradient_noise=False, gradient_dtype=None, checks_finite=True, propagates=True,
    data_parallel=False, plain=True,
)


def _plain(options: Options) -> bool:
  """Whether ``options`` ask for nothing that the plain scan (:mod:`._plain`) leaves
  out: no aux, weights, keys, state, per-leaf reduction, mesh, info or noise, the
  gradient in the parameters' dtypes, and an accumulator at least float32 wide."""
  accumulator = options.accumulator_dtype
  return (
      not (options.has_aux or options.rng_argnums or options.state_argnums)
      and options.weight_fn is None and options.reduction is None
      and accumulator is not None and not _core.is_narrow(accumulator)
      and options.gradient_dtype is None and options.on_nonfinite != "skip_microbatch"
      and not (options.data_parallel or options.return_info or options.gradient_noise)
  )


def _batch_argnums(value: Any) -> tuple[int, ...]:
  """``batch_argnums`` as a tuple. Never None: which arguments are the batch is said,
  as ``optax.microbatching``'s ``batch_argnums=1`` says it, never guessed from their
  shapes (a per-class weight vector of the batch's length is no batch)."""
  if value is None:
    raise ValueError(
        "batch_argnums=None does not say which arguments are the batch, and they are not"
        " guessed from shapes: name them, e.g. batch_argnums=1 (the default) for"
        " loss(params, batch), or batch_argnums=(1, 2) for loss(params, x, y)."
    )
  batch = argnums_tuple(value, "batch_argnums")
  if not batch:
    raise ValueError(
        "batch_argnums=() names no batch: name the argument(s) to split, e.g."
        " batch_argnums=1 (the default) or batch_argnums=(1, 2)."
    )
  return batch


# The on_nonfinite values the inside-step functions take (see _arguments.NONFINITE).
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


def _check_sharding_options(fields: dict[str, Any]) -> None:
  if fields["gather"] not in GATHERS:
    raise ValueError(
        f"DataParallel(gather={fields['gather']!r}) is not one of {GATHERS}:"
        " 'per_microbatch' reduce-scatters each microbatch's gradient (FSDP), 'once'"
        " gathers the parameters before the loop and reduce-scatters after it."
    )
  if fields["split"] not in _batching.SPLITS:
    raise ValueError(
        f"DataParallel(split={fields['split']!r}) is not one of {_batching.SPLITS}:"
        " 'contiguous' makes microbatch i of consecutive rows, 'strided' of rows i, i + N, ..."
    )
  given = [
      f"{name}={fields[name]!r}" for name, default in (
          ("param_sharding", None), ("gather", "per_microbatch"), ("gather_dtype", None),
          ("reduce_dtype", None),
      ) if fields[name] != default
  ]
  if given and not fields["data_parallel"]:
    raise ValueError(
        f"DataParallel({given[0]}) says how gradients cross devices, but names no mesh:"
        " give it mesh and data_axis (or data_axis under jax.set_mesh)."
    )


def _check_aux_reduction(options: Options) -> None:
  for where, value in _arguments.spec_strings(options.aux_reduction):
    if value not in AUX_REDUCTIONS:
      raise ValueError(
          f"{_arguments.named('aux_reduction', where, value)} is not one of"
          f" {AUX_REDUCTIONS}: 'mean'"
          " and 'sum' reduce over the microbatches (weighted as the loss), 'max' and"
          " 'last' keep the largest or the last kept microbatch's value, 'concat'"
          " returns per-example outputs as (batch, ...), 'stack' per-microbatch outputs"
          " as (num_microbatches, ...). A pytree prefix of the aux gives one per leaf."
      )
    if value == "stack" and options.data_parallel:
      raise ValueError(
          f"{_arguments.named('aux_reduction', where, value)} is not available with a mesh:"
          " per-microbatch aux differs between devices. Use 'concat' for per-example"
          " outputs, or 'mean', 'sum', 'max' or 'last'."
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
  """Every leaf an array with a leading (batch) axis, none a key: the framework doors'
  ``batch_argnums=None`` test (``value_and_grad`` itself never guesses)."""
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


