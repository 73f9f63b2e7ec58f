"""One call of a microbatched function, bound and then traced: everything its loop reads.

:func:`bind` resolves a call's positional arguments once, into a :class:`Bound`:
which are the batch and its sizes,
the mesh and the reduction plan, and how each gradient leaf combines. Given the
function the loop differentiates, :func:`traced` adds one microbatch traced (its
outputs' shapes, how each aux leaf reduces, and the jitted microbatch the loop
calls), making the :class:`Call` that the loop and the finalisation read; nothing
after it goes back to the options. The inside-step door, the statistics door, the
cached door, the planner and the parity checker bind the same way; only the
doors that run the microbatch loop trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np

from accum_jax import _arguments, _core
from accum_jax._inside_step import _batching, _options, _sharding, _trace


@dataclasses.dataclass(frozen=True)
class Bound:
  """What one call's arguments resolve to, before anything is traced."""

  options: _options.Options
  args: tuple[Any, ...]  # the positional arguments
  kwargs: dict[str, Any]
  batch_argnums: tuple[int, ...]
  batch_size: int
  mesh: Any  # None without data parallelism
  data_axes: tuple[str, ...]  # () without
  num_shards: int
  rows: int  # rows of one microbatch on one device
  grad_kinds: tuple[str, ...]  # how each gradient leaf combines; see `_arguments.grad_reductions`
  plan: Any  # the checked _sharding.Plan under a mesh, else None
  diff: Any  # the differentiated arguments, structured as their gradient is

  def params(self, args: Sequence[Any] | None = None) -> Any:
    """The differentiated arguments (of ``args``, by default the call's),
    structured as their gradient is."""
    return self.diff if args is None else diff_args(self.options, args)


@dataclasses.dataclass(frozen=True)
class Call(Bound):
  """A :class:`Bound` call with one microbatch of its gradient function traced:
  what the loop and the finalisation read. A type of its own, so that nothing
  reads the traced fields of a call that was never traced."""

  fun: _trace.Fun  # what every microbatch's call needs besides its data
  shapes: _trace.Shapes  # one microbatch's outputs, and how each leaf combines
  microbatch: Callable[..., _trace.Out]  # the jitted microbatch, its trace kept (one device)


def diff_args(options: _options.Options, args: Sequence[Any]) -> Any:
  """The differentiated arguments, structured as their gradient is."""
  if options.single_argnum:
    return args[options.argnums[0]]
  return tuple(args[n] for n in options.argnums)


@overload
def bind(
    options: _options.Options, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
    grad_fun: None = None,
) -> Bound: ...


@overload
def bind(
    options: _options.Options, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
    grad_fun: _trace.Checked,
) -> Call: ...


def bind(
    options: _options.Options, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
    grad_fun: _trace.Checked | None = None,
) -> Bound:
  """Resolves one call's positional ``args``: their roles, the batch's sizes, how
  each gradient leaf combines and, under a mesh, the checked reduction plan: a
  :class:`Bound`; with ``grad_fun`` (:func:`_trace.checked`), the :class:`Call`
  with one microbatch of it traced (:func:`traced`).

  ValueError for anything about them that does not fit the options; an
  ``UnknownShardingWarning`` where the plan takes a parameter whose sharding the
  trace cannot see as replicated (once per call, so once per trace under jit).
  """
  kwargs = kwargs or {}
  _check_args(options, args)
  batch = {}
  for n in options.batch_argnums:
    batch[n] = args[n]
  size = _batching.batch_size(batch)
  mesh, num_shards = None, 1
  axes: tuple[str, ...] = ()
  if options.data_parallel:
    mesh, axes = _sharding.resolve_mesh(options.mesh, options.data_axis)
    num_shards = _sharding.num_shards(mesh, axes)
  if size % (num_shards * options.num_microbatches):
    _batching.check_divisible(size, options.num_microbatches, num_shards)
  rows = size // (num_shards * options.num_microbatches)
  params = diff_args(options, args)
  kinds = _arguments.grad_reductions(options.reduction, params)
  plan = None if mesh is None else _plan(options, mesh, axes, params, kinds)
  call = Bound(options, tuple(args), kwargs, options.batch_argnums, size, mesh, axes,
               num_shards, rows, kinds, plan, params)
  return call if grad_fun is None else traced(call, grad_fun)


def traced(call: Bound, grad_fun: _trace.Checked) -> Call:
  """``call`` with one microbatch of ``grad_fun`` traced (:func:`_trace.trace`)."""
  fun = _trace.Fun(grad_fun, call.options, call.batch_argnums, call.kwargs)
  params, plan = call.diff, call.plan
  # The parameters as fun sees them: full-size, in the dtype they are gathered in.
  seen = params if plan is None else jax.tree.map(
      lambda x, leaf: _trace.abstract(x, plan.gather_dtype if leaf.gathers else None),
      params, jax.tree.unflatten(jax.tree.structure(params), plan.leaves),
  )
  shapes, one = _trace.trace(fun, call.args, call.rows, seen, params, call.grad_kinds,
                            call.batch_size)
  return Call(**vars(call), fun=fun, shapes=shapes, microbatch=one)


def _check_args(options: _options.Options, args: tuple[Any, ...]) -> None:
  """ValueError for an argument number past ``args``, a differentiated argument
  that holds no array, or a key argument that holds no key."""
  last = max((*options.argnums, *options.batch_argnums, *options.rng_argnums,
              *options.state_argnums))
  if last >= len(args):  # which role names it, only when one does
    for role, nums in options.roles().items():
      if last in nums:
        raise ValueError(
            f"{role}={nums} names argument {last}, but the function was called with"
            f" {len(args)} positional argument(s). Pass it positionally, or fix {role}."
        )
  for n in options.argnums:
    for path, leaf in jax.tree.leaves_with_path(args[n]):
      if not isinstance(leaf, _ARRAYS):
        raise ValueError(
            f"argnums={options.argnums} differentiates argument {n}, which holds"
            f" {type(leaf).__name__} at {jax.tree_util.keystr(path) or 'its root'}, not an"
            " array. For an Equinox module use accum_jax.equinox.filter_value_and_grad"
            " (or eqx.partition the arrays out of it); for Flax NNX use"
            " accum_jax.flax.nnx_value_and_grad."
        )
  for n in options.rng_argnums:
    _check_keys(args[n], n)


# What a differentiated argument's leaves may be: arrays, or Python numbers.
_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, int, float, complex)


def _plan(options: _options.Options, mesh, axes, params, kinds) -> _sharding.Plan:
  """The reduction plan of ``params`` over the data ``axes``, checked."""
  plan = _sharding.plan(
      mesh, axes, params, param_sharding=options.param_sharding, gather=options.gather,
      gather_dtype=options.gather_dtype, reduce_dtype=options.reduce_dtype,
  )
  _check_plan(options, plan, params, kinds)
  _sharding.warn_hidden(
      plan, params, options.argnums, options.single_argnum, options.accumulator_dtype
  )
  return plan


def _check_keys(keys: Any, argnum: int) -> None:
  leaves = jax.tree.leaves(keys)
  if not leaves or not all(_options.is_key(leaf) for leaf in leaves):
    bad = next((leaf for leaf in leaves if not _options.is_key(leaf)), keys)
    raise ValueError(
        f"rng_argnums names argument {argnum}, which is not a PRNG key or a pytree of"
        f" them (got {getattr(bad, 'dtype', type(bad).__name__)} of shape"
        f" {jnp.shape(bad) if _options.is_array(bad) else '?'}). Pass single keys such as"
        " jax.random.key(0), or drop it from rng_argnums."
    )


def _check_plan(options: _options.Options, plan: Any, params: Any, kinds: Sequence[str]) -> None:
  """What a call's reduction plan cannot do with these options (``kinds``: the
  gradient leaves' :func:`grad_reductions`)."""
  for (path, _), leaf, kind in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                   plan.leaves, kinds):
    if leaf.gathers and _core.is_statistic(kind):
      raise ValueError(
          f"The gradient leaf {jax.tree_util.keystr(path)} combines by {kind!r} (its"
          " reduction, or the default for Flax's FP8 statistics), but its parameter is"
          f" sharded over the data axes {tuple(a for _, axes in leaf.gathers for a in axes)}"
          f" (its spec over them is {leaf.spec}): a 'max' or 'last' leaf is combined"
          " whole on each device after the loop. Replicate it over the data axes (such"
          " statistics are a few numbers), or give it 'mean' or 'sum'."
      )
  narrow = any(
      leaf.gathers
      and _core.is_narrow(_core.accumulator_dtype_for(x.dtype, options.accumulator_dtype))
      for x, leaf in zip(jax.tree.leaves(params), plan.leaves)
  )
  if narrow and plan.gather == "per_microbatch":
    raise ValueError(
        f"accumulator_dtype={options.accumulator_dtype} with parameters sharded over the"
        f" data axes {plan.axes} and gather='per_microbatch': a narrow accumulator keeps"
        " a running mean, which a reduce-scatter per microbatch cannot update. Keep the"
        " float32 default (the accumulator is sharded: 4 bytes x parameters / devices),"
        " or pass gather='once'."
    )
