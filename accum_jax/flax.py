"""Flax helpers: a Linen ``TrainState`` and an NNX model, microbatched or accumulated.

This is the only module of accum_jax that imports flax; ``import accum_jax`` does not.
Most of Flax needs nothing from here:

* ``nnx.Optimizer(model, accum_jax.accumulate(inner, every_k=4), wrt=nnx.Param)``
  works as it is, and ``optimizer.update(model, grads, weight=..., apply=...)``
  forwards the keyword arguments to :func:`accum_jax.accumulate`. ``apply``, static
  in ``nnx.jit(..., static_argnames="apply")``, is ``schedule.next(last=...)`` of
  ``schedule = accum_jax.HostSchedule(optimizer)``, made before the loop: a call
  that only adds compiles to the gradient and one add.
* A Linen ``TrainState`` holds an ``accumulate`` state like any Optax state, and
  :func:`accum_jax.value_and_grad` takes Linen's ``batch_stats`` through
  ``state_argnums`` and a dropout key through ``rng_argnums``.

What is here fills two gaps: ``TrainState.apply_gradients`` does not forward
keyword arguments to ``tx.update`` (:func:`apply_gradients` does), and an NNX
model is a mutable object, not the pure pytree :func:`accum_jax.value_and_grad`
threads through a ``lax.scan`` (:func:`nnx_value_and_grad` splits and merges it).

Step counters: ``TrainState.step`` and ``nnx.Optimizer.step`` count calls;
:func:`accum_jax.optimizer_step` counts the updates actually applied.

Linen's FP8 layers need nothing from here either: the leaves of their
``_overwrite_with_gradient`` collection (amax histories and scales, whose
"gradient" is the new value) combine by max over the microbatches by default in
:func:`accum_jax.value_and_grad` itself, found by the collection's name, so that
the default holds with or without this module (see ``reduction``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import jax
import optax
from flax import nnx
from flax.core import spmd as flax_spmd
from flax.training import train_state
from jax.experimental.layout import Format
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accum_jax import _arguments
from accum_jax._inside_step import _microbatch, _options

TrainStateT = TypeVar("TrainStateT", bound=train_state.TrainState)

__all__ = ("apply_gradients", "nnx_grad", "nnx_value_and_grad")


def apply_gradients(state: TrainStateT, *, grads: Any, **update_kwargs: Any) -> TrainStateT:
  """``state.apply_gradients(grads=grads)``, passing ``update_kwargs`` to ``tx.update``.

  Flax's ``TrainState.apply_gradients`` reads its keyword arguments as fields
  to replace, so ``weight`` and ``apply`` cannot reach
  :func:`accum_jax.accumulate` through it. This runs the same method (a
  subclass's override included) with ``state.tx.update`` given
  ``update_kwargs``. ``state.step`` still counts calls; the updates applied are
  :func:`accum_jax.optimizer_step`.

  Args:
    state: a ``flax.training.train_state.TrainState``, or a subclass.
    grads: the gradients, as for ``TrainState.apply_gradients``.
    **update_kwargs: keyword arguments for ``state.tx.update``, such as
      ``weight`` and ``apply``.

  Returns:
    The new state, of the same class and with the same ``tx``.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax, accum_jax.flax
    >>> from flax.training.train_state import TrainState
    >>> state = TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)},
    ...                           tx=accum_jax.accumulate(optax.sgd(1.0), every_k=4))
    >>> schedule = accum_jax.HostSchedule(state)
    >>> for g, tokens in ((1.0, 3), (5.0, 1)):
    ...   state = accum_jax.flax.apply_gradients(
    ...       state, grads={"w": jnp.full(2, g)}, weight=tokens,
    ...       apply=schedule.next(last=g == 5.0))
    >>> state.params["w"], int(state.step), int(accum_jax.optimizer_step(state))
    (Array([-2., -2.], dtype=float32), 2, 1)
  """
  tx = state.tx
  # Swapping tx, rather than repeating apply_gradients, keeps what Flax's method
  # (or a subclass's) does besides calling tx.update.
  bound = optax.GradientTransformation(tx.init, functools.partial(tx.update, **update_kwargs))
  return state.replace(tx=bound).apply_gradients(grads=grads).replace(tx=tx)


class _Parsed(NamedTuple):
  """The options of :func:`nnx_value_and_grad`, checked once when it is built."""

  num_microbatches: int
  diff_nums: tuple[int, ...]  # argnums as a tuple
  single: bool  # argnums is an int: one gradient, not a tuple of them
  batch_nums: tuple[int, ...] | None  # None: found per call
  rng_nums: tuple[int, ...]
  roles: dict[str, tuple[int, ...]]  # per option, the argument numbers it names
  wrt: Callable[[Any, Any], bool]  # the wrt filter, of (path, variable)
  has_aux: bool
  core: dict[str, Any]  # the other options, for the core door


class _Call(NamedTuple):
  """One call's arguments, each in its role."""

  args: tuple[Any, ...]
  kwargs: dict[str, Any]
  node_nums: tuple[int, ...]  # the arguments holding graph nodes
  batch_nums: tuple[int, ...]


class _Nodes(NamedTuple):
  """The graph-node arguments, split together into what is differentiated and the rest."""

  nodes: tuple[Any, ...]
  graphdef: Any
  diff: Any  # nnx.State of the wrt variables of the differentiated nodes
  state: Any  # nnx.State of everything else
  positions: frozenset[int]  # which of ``nodes`` are differentiated
  differentiated: Callable[[Any, Any], bool]  # the filter that split them


def _holds_graph_node(arg: Any) -> bool:
  """Whether ``arg`` is, or is a pytree holding, an NNX graph node or Variable."""
  is_node = nnx.graph.is_graph_node
  return any(is_node(leaf) for leaf in jax.tree.leaves(arg, is_leaf=is_node))


def _positional(fun: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
  """Moves keyword arguments that ``fun`` could take by position into ``args``.

  ``nnx.value_and_grad`` does the same, so ``vg(model=model, batch=batch)`` works
  and argnums count such arguments.
  """
  if not kwargs:
    return args, kwargs
  try:
    bound = inspect.signature(fun).bind(*args, **kwargs)
  except (TypeError, ValueError):  # no signature, or a call fun itself rejects
    return args, kwargs
  return bound.args, bound.kwargs


def _kind(arg: Any) -> str:
  """How an error message names a graph-node argument."""
  return f"{type(arg).__name__} (an NNX graph node)"


def _wrt_predicate(wrt: Any) -> Callable[[Any, Any], bool]:
  """``wrt`` as a predicate of ``(path, variable)``; ValueError if it is no NNX filter."""
  try:
    return nnx.filterlib.to_predicate(wrt)
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"wrt={wrt!r} is not an NNX filter: pass a Variable type such as nnx.Param, a"
        " tag string, nnx.All/nnx.Any/nnx.Not of filters, or a callable (path, variable)."
    ) from e


_REFUSED = {
    "state_argnums": (
        "the state of every NNX graph-node argument (a model, nnx.Rngs, metrics) is"
        " threaded through the microbatches already; hold it in an nnx.Variable."
    ),
}


def _parse(
    fun: Callable[..., Any], num_microbatches: int, argnums: Any, wrt: Any, has_aux: bool,
    batch_argnums: Any, rng_argnums: Any, options: dict[str, Any],
) -> _Parsed:
  """Checks the options once, when the function is built."""
  diff_nums = _options.argnums_tuple(argnums, "argnums")
  batch_nums = (
      None if batch_argnums is None else _options.argnums_tuple(batch_argnums, "batch_argnums")
  )
  rng_nums = _options.argnums_tuple(rng_argnums, "rng_argnums")
  if not diff_nums:
    raise ValueError("argnums=() differentiates nothing: name at least one argument.")
  if batch_nums == ():
    raise ValueError(
        "batch_argnums=() names no batch: name the argument(s) to split, or leave"
        " batch_argnums=None to take every array argument with a leading axis."
    )
  roles = {"argnums": diff_nums, "batch_argnums": batch_nums or (), "rng_argnums": rng_nums}
  _options.check_roles({f"{role}={nums}": nums for role, nums in roles.items()})
  wrt_predicate = _wrt_predicate(wrt)
  _options.make(num_microbatches, caller="nnx_value_and_grad", refused=_REFUSED, **options)
  return _Parsed(
      num_microbatches, diff_nums, isinstance(argnums, numbers.Integral), batch_nums,
      rng_nums, roles, wrt_predicate, has_aux, dict(options),
  )


def _check_call(parsed: _Parsed, args: tuple, kwargs: dict) -> None:
  """ValueError for an argnum past the arguments or a graph node passed by keyword."""
  for role, nums in parsed.roles.items():
    for n in nums:
      if n >= len(args):
        raise ValueError(
            f"{role}={parsed.roles[role]} names argument {n}, but the function was called"
            f" with {len(args)} positional argument(s). Pass it positionally, or fix {role}."
        )
  for key, value in kwargs.items():
    if _holds_graph_node(value):
      raise ValueError(
          f"Keyword argument {key}= holds an NNX graph node ({type(value).__name__}),"
          " which nnx_value_and_grad threads only as a positional argument. Pass it"
          " positionally."
      )


def _check_not_nodes(parsed: _Parsed, args: tuple, node_nums: tuple[int, ...]) -> None:
  """ValueError for a graph node named as a batch or a raw key."""
  if bad := [n for n in parsed.batch_nums or () if n in node_nums]:
    raise ValueError(
        f"batch_argnums={parsed.batch_nums} names argument {bad[0]}, a"
        f" {_kind(args[bad[0]])}: its state is threaded through the microbatches in"
        " order, not split. Name only the arguments holding the batch's arrays, or leave"
        " batch_argnums=None."
    )
  if bad := [n for n in parsed.rng_nums if n in node_nums]:
    raise ValueError(
        f"rng_argnums={parsed.rng_nums} names argument {bad[0]}, a {_kind(args[bad[0]])}:"
        " an nnx.Rngs argument is threaded through the microbatches, its count"
        " advancing as in sequential calls; rng_argnums is for raw jax.random keys."
        " Drop it from rng_argnums."
    )


def _batches(parsed: _Parsed, args: tuple, node_nums: tuple[int, ...]) -> tuple[int, ...]:
  """``batch_argnums``, or when None every plain argument that looks like a batch."""
  if parsed.batch_nums is not None:
    return parsed.batch_nums
  skip = {*parsed.diff_nums, *parsed.rng_nums, *node_nums}
  batches = tuple(
      i for i, arg in enumerate(args) if i not in skip and _options.looks_like_batch(arg)
  )
  _options.check_unambiguous(batches, args)
  if not batches:
    raise ValueError(
        f"No argument of the {len(args)} given is a batch: batch_argnums=None takes"
        " the arguments outside argnums and rng_argnums, holding no graph node, whose"
        " leaves are all arrays with a leading batch axis. Pass batch_argnums."
    )
  return batches


def _bind(parsed: _Parsed, fun: Callable[..., Any], args: tuple, kwargs: dict) -> _Call:
  """Checks one call's arguments and sorts them into graph nodes, batches and the rest."""
  args, kwargs = _positional(fun, args, kwargs)
  _check_call(parsed, args, kwargs)
  node_nums = tuple(i for i, arg in enumerate(args) if _holds_graph_node(arg))
  _check_not_nodes(parsed, args, node_nums)
  return _Call(tuple(args), kwargs, node_nums, _batches(parsed, args, node_nums))


def _split_nodes(parsed: _Parsed, call: _Call) -> _Nodes:
  """The graph-node arguments split into their differentiated variables and state."""
  # One split of all graph-node arguments together keeps objects they share
  # (an nnx.Rngs in the model and in an argument) one object.
  nodes = tuple(call.args[i] for i in call.node_nums)
  positions = frozenset(
      call.node_nums.index(i) for i in parsed.diff_nums if i in call.node_nums
  )

  def differentiated(path, variable):
    return path[0] in positions and parsed.wrt(path[1:], variable)

  graphdef, diff, state = cast(tuple[Any, Any, Any], nnx.split(nodes, differentiated, ...))
  return _Nodes(nodes, graphdef, diff, state, positions, differentiated)


def _plain_diff(parsed: _Parsed, call: _Call) -> tuple[int, ...]:
  """The differentiated arguments that hold no graph node."""
  return tuple(i for i in parsed.diff_nums if i not in call.node_nums)


def _pure(
    fun: Callable[..., Any], parsed: _Parsed, call: _Call, nodes: _Nodes
) -> Callable[..., Any]:
  """``fun`` on :func:`_core_args`, returning ``(loss, (new state, aux))``."""

  def pure(*core_args, **kwargs):
    *call_args, diff, state = core_args
    merged = nnx.merge(nodes.graphdef, diff, state)
    for i, node in zip(call.node_nums, merged, strict=True):
      call_args[i] = node
    out = fun(*call_args, **kwargs)
    loss, aux = out if parsed.has_aux else (out, None)
    _, _, new_state = cast(tuple[Any, Any, Any], nnx.split(merged, nodes.differentiated, ...))
    return loss, (nnx.as_pure(new_state), aux)

  return pure


def _core_args(call: _Call, nodes: _Nodes) -> list[Any]:
  """The arguments of :func:`_pure`."""
  # fun's arguments keep their numbers (so the core's messages name them); the
  # graph nodes' places hold None, and their variables come last, at n and n + 1.
  core_args = [None if i in call.node_nums else arg for i, arg in enumerate(call.args)]
  # Plain arrays, not Variables, are the scan carry: a Variable may only be
  # changed at the trace level that made it.
  return core_args + [nodes.diff, nnx.as_pure(nodes.state)]


def _core_options(parsed: _Parsed, call: _Call, nodes: _Nodes) -> dict[str, Any]:
  """The options of the core door for :func:`_pure` on :func:`_core_args`."""
  n = len(call.args)
  plain_diff = _plain_diff(parsed, call)
  core_argnums: int | tuple[int, ...]
  if parsed.single:
    core_argnums = n if nodes.positions else parsed.diff_nums[0]
  else:
    core_argnums = ((n,) if nodes.positions else ()) + plain_diff
  core = dict(parsed.core)
  dp = core.get("data_parallel")
  if dp is not None and (dp.mesh is not None or dp.data_axis is not None):
    # Under nnx.jit the traced arrays cannot say how they are sharded; the
    # Variables' metadata can.
    core["data_parallel"] = dataclasses.replace(
        dp, param_sharding=_core_param_sharding(parsed, call, nodes)
    )
  return dict(
      core, argnums=core_argnums, batch_argnums=call.batch_nums,
      rng_argnums=parsed.rng_nums or None, state_argnums=n + 1, has_aux=True,
  )


def _grads_by_argnum(parsed: _Parsed, call: _Call, nodes: _Nodes, core_grads: Any) -> Any:
  """The core door's gradients shaped as ``nnx.value_and_grad`` returns them."""
  if parsed.single:
    core_grads = (core_grads,)
  plain = core_grads[1:] if nodes.positions else core_grads
  by_argnum = dict(zip(_plain_diff(parsed, call), plain))
  for i in parsed.diff_nums:
    if i in call.node_nums:
      j = call.node_nums.index(i)
      by_argnum[i] = core_grads[0][j] if j in core_grads[0] else nnx.State({})
  if parsed.single:
    return by_argnum[parsed.diff_nums[0]]
  return tuple(by_argnum[i] for i in parsed.diff_nums)


def _is_spec(x: Any) -> bool:
  """Whether ``x`` is one sharding for all parameters rather than a tree of them."""
  return isinstance(x, (P, NamedSharding))


def _mesh_axes(core: dict[str, Any]) -> tuple[str, ...]:
  """The axis names of the mesh the core door runs on: its ``DataParallel``'s, else the
  ambient one."""
  mesh = core["data_parallel"].mesh
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  return tuple(mesh.axis_names)


def _annotated_spec(sharding: Any, rules: Any) -> P | None:
  """``out_sharding`` metadata as a ``PartitionSpec`` of mesh axes; None if it is no
  form Flax takes.

  Logical names are mapped as Flax maps them when it places the Variable: by the
  Variable's ``sharding_rules`` and those of ``nnx.logical_axis_rules``.
  """
  if isinstance(sharding, list):
    sharding = tuple(sharding)
  resolved = flax_spmd.apply_rules(sharding, rules)
  if isinstance(resolved, Format):
    if resolved.sharding is None:  # a layout alone places nothing
      return P()
    resolved = resolved.sharding
  if isinstance(resolved, NamedSharding):
    return resolved.spec
  return resolved if isinstance(resolved, P) else None


def _axis_names(spec: P) -> list[Any]:
  """The mesh axis names ``spec`` shards over."""
  names: list[Any] = []
  for entry in spec:
    if entry is not None and entry is not P.UNCONSTRAINED:
      names.extend(entry if isinstance(entry, tuple) else (entry,))
  return names


def _metadata_spec(where: str, variable: Any, mesh_axes: tuple[str, ...]) -> P | None:
  """The ``PartitionSpec`` a Variable's sharding metadata says, None where it names no
  mesh axis (its sharding is then read from its array, as without metadata);
  ValueError where it cannot be read on the mesh."""
  metadata = variable.get_metadata() if isinstance(variable, nnx.Variable) else {}
  sharding, rules = metadata.get("out_sharding"), metadata.get("sharding_rules")
  if not sharding:
    return None
  try:
    spec = _annotated_spec(sharding, rules)
    cause = "" if spec is not None else (
        "it is none of the forms Flax takes (a tuple of axis names, a PartitionSpec, a"
        " NamedSharding)"
    )
  except (TypeError, ValueError) as e:
    spec, cause = None, f"Flax cannot map it ({e})"
  unknown = [name for name in _axis_names(spec) if name not in mesh_axes] if spec else []
  if unknown and mesh_axes:
    cause = f"it says {spec}, and {unknown} name no axis of the mesh {mesh_axes}"
  if cause or spec is None:
    given = f"out_sharding={sharding!r}" + (f", sharding_rules={rules!r}" if rules else "")
    raise ValueError(
        f"The sharding metadata of {where} ({given}) does not say how it is sharded on"
        f" the mesh: {cause}. Map logical axis names to mesh axes with sharding_rules"
        " (nnx.with_partitioning(init, names, sharding_rules=...), or call inside"
        " nnx.logical_axis_rules(...)), or give nnx_value_and_grad's DataParallel param_sharding=,"
        " shaped like the gradients returned."
    )
  return spec if any(e is not None for e in spec) else None


def _variable_specs(diff: Any, node_nums: tuple[int, ...], mesh_axes: tuple[str, ...]) -> Any:
  """Per Variable of ``diff`` (an ``nnx.State`` keyed by graph node), its metadata's
  ``PartitionSpec`` or None."""

  def spec(path, variable):
    keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
    where = f"the Variable {'.'.join(map(str, keys[1:]))} of argument {node_nums[keys[0]]}"
    return _metadata_spec(where, variable, mesh_axes)

  return jax.tree_util.tree_map_with_path(
      spec, diff, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )


def _core_param_sharding(parsed: _Parsed, call: _Call, nodes: _Nodes) -> Any:
  """``param_sharding`` as the core door sees the differentiated arguments: the
  graph nodes' variables in one ``nnx.State`` keyed by node, then plain arrays.

  The one given is shaped like the gradients returned (a prefix of each argnum's:
  an ``nnx.State`` or dict for a graph node); without one, the graph nodes' come
  from their Variables' sharding metadata.
  """
  given = parsed.core["data_parallel"].param_sharding
  if _is_spec(given):
    return given
  plain_nums = _plain_diff(parsed, call)
  if given is None:
    node_specs = _variable_specs(nodes.diff, call.node_nums, _mesh_axes(parsed.core))
    plain: tuple[Any, ...] = (None,) * len(plain_nums)
  else:
    per_argnum = dict(zip(parsed.diff_nums, (given,) if parsed.single else tuple(given)))

    def pure(spec: Any) -> Any:
      return nnx.to_pure_dict(spec) if isinstance(spec, nnx.State) else spec

    node_specs = nnx.State({j: pure(per_argnum[call.node_nums[j]]) for j in nodes.diff})
    plain = tuple(per_argnum[i] for i in plain_nums)
  if parsed.single:
    return node_specs if nodes.diff else plain[0]
  return ((node_specs,) if nodes.diff else ()) + plain


@_arguments.takes_options(
    "nnx_value_and_grad", options_of=_microbatch.value_and_grad, refused=_REFUSED
)
def nnx_value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
    batch_argnums: int | Sequence[int] | None = None,
    rng_argnums: int | Sequence[int] | None = None,
    **options: Any,
) -> Callable[..., Any]:
  """``nnx.value_and_grad(fun)`` over microbatches.

  Graph-node arguments (the model, an ``nnx.Rngs``, metrics) are handled as
  ``nnx.value_and_grad`` handles them: the ``wrt`` variables of ``argnums`` are
  differentiated, and the state of all graph nodes is threaded through the
  microbatches in order and written back afterwards. Argument numbers are
  ``fun``'s own.

  See the guide: :doc:`/guides/flax_nnx`.

  Args:
    fun: ``fun(*args)`` returning a scalar loss, or ``(loss, aux)`` with
      ``has_aux``. It may update its graph nodes' state, not add variables.
    num_microbatches: the number of microbatches, an int >= 1 dividing the batch.
    argnums: which argument(s) to differentiate: graph nodes (their ``wrt``
      variables) or arrays. An int gives one gradient, a tuple a tuple.
    wrt: the filter of the variables to differentiate; ``nnx.Param`` by default.
    has_aux: ``fun`` returns ``(loss, aux)``.
    batch_argnums: which arguments are batches, split along axis 0. None
      (default): every other argument, holding no graph node, whose leaves are
      arrays with a leading axis.
    rng_argnums: arguments holding a raw PRNG key to fold the microbatch index
      into. An ``nnx.Rngs`` needs none.
    **options: the other options of :func:`accum_jax.value_and_grad` but
      ``state_argnums`` (the signature lists them), such as ``weight_fn``,
      ``aux_reduction``, ``return_info``, ``data_parallel``. Under a mesh, the
      ``DataParallel``'s ``param_sharding`` defaults to the Variables'
      sharding metadata (``nnx.with_partitioning``: a tuple of axis names, a
      ``PartitionSpec``, a ``NamedSharding``, or logical names mapped by
      ``sharding_rules`` or ``nnx.logical_axis_rules``), so annotated parameters
      sharded over the data axis take the FSDP path; given, it is shaped like
      the gradients returned (a ``PartitionSpec``, or an ``nnx.State`` or dict
      of them per graph node).

  Returns:
    A function of ``fun``'s arguments returning ``loss, grads`` (or ``(loss,
    aux), grads``) as ``nnx.value_and_grad`` does, a graph node's gradient an
    ``nnx.State``; a :class:`accum_jax.MicrobatchInfo` third with
    ``return_info=True``.

  Raises:
    ValueError: for ``state_argnums`` in ``options``, bad argnums or ``wrt``;
      when called, for no batch found, a graph node passed by keyword, or
      sharding metadata naming no axis of the mesh; otherwise as
      :func:`accum_jax.value_and_grad`.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> def loss_fn(model, x, y):
    ...   return jnp.mean((model(x)[:, 0] - y) ** 2)
    >>> x, y = jnp.arange(24.0).reshape(8, 3) / 24, jnp.ones(8)
    >>> vg = accum_jax.flax.nnx_value_and_grad(loss_fn, num_microbatches=4)
    >>> loss, grads = nnx.jit(vg)(model, x, y)
    >>> full_loss, full_grads = nnx.value_and_grad(loss_fn)(model, x, y)
    >>> bool(jnp.allclose(loss, full_loss)), bool(jnp.allclose(grads["kernel"][...],
    ...                                                         full_grads["kernel"][...]))
    (True, True)
  """
  parsed = _parse(
      fun, num_microbatches, argnums, wrt, has_aux, batch_argnums, rng_argnums, options
  )

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    call = _bind(parsed, fun, args, kwargs)
    nodes = _split_nodes(parsed, call)
    vg = _microbatch.value_and_grad(
        _pure(fun, parsed, call, nodes), num_microbatches, **_core_options(parsed, call, nodes)
    )
    (loss, (new_state, aux)), core_grads, *info = vg(*_core_args(call, nodes), **call.kwargs)
    nnx.update(nodes.nodes, new_state)
    grads = _grads_by_argnum(parsed, call, nodes, core_grads)
    return ((loss, aux) if has_aux else loss), grads, *info

  return wrapped


@_arguments.takes_options("nnx_grad", options_of=nnx_value_and_grad, refused=_REFUSED)
def nnx_grad(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
    batch_argnums: int | Sequence[int] | None = None,
    rng_argnums: int | Sequence[int] | None = None,
    **options: Any,
) -> Callable[..., Any]:
  """``nnx.grad(fun)`` over microbatches; the options of :func:`nnx_value_and_grad`.

  Returns ``grads``, or ``(grads, aux)`` with ``has_aux=True``, as ``nnx.grad``
  does (and a :class:`accum_jax.MicrobatchInfo` last with ``return_info=True``);
  the graph-node arguments' state is threaded and written back as in
  :func:`nnx_value_and_grad`.

  Examples:
    >>> import jax.numpy as jnp, accum_jax.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
    >>> def loss_fn(model, x):
    ...   return jnp.mean(model(x) ** 2)
    >>> grads = accum_jax.flax.nnx_grad(loss_fn, num_microbatches=2)(model, jnp.eye(2))
    >>> full = nnx.grad(loss_fn)(model, jnp.eye(2))
    >>> bool(jnp.allclose(grads["kernel"][...], full["kernel"][...]))
    True
  """
  vg = nnx_value_and_grad(
      fun,
      num_microbatches,
      argnums=argnums,
      wrt=wrt,
      has_aux=has_aux,
      batch_argnums=batch_argnums,
      rng_argnums=rng_argnums,
      **options,
  )
  return _microbatch.grad_of(vg, fun, has_aux, options.get("return_info", False))
