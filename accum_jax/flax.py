"""Flax helpers: a Linen ``TrainState`` and an NNX model, microbatched or accumulated.

This is the only module of accum_jax that imports flax; ``import accum_jax`` does not.

Most of Flax needs nothing from here:

* ``nnx.Optimizer(model, accum_jax.accumulate(inner, every_k=4), wrt=nnx.Param)``
  works as it is, and ``optimizer.update(model, grads, weight=..., flush=...)``
  forwards the keyword arguments to :func:`accum_jax.accumulate`.
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
the default holds with or without this module (see ``grad_reduction``).
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import jax
import optax
from flax import nnx
from flax.training import train_state

from accum_jax import _microbatch, _options

TrainStateT = TypeVar("TrainStateT", bound=train_state.TrainState)

__all__ = ("apply_gradients", "nnx_grad", "nnx_value_and_grad")


def apply_gradients(state: TrainStateT, *, grads: Any, **update_kwargs: Any) -> TrainStateT:
  """``state.apply_gradients(grads=grads)``, passing ``update_kwargs`` to ``tx.update``.

  Flax's ``TrainState.apply_gradients`` reads its keyword arguments as fields
  to replace, so ``weight`` and ``flush`` cannot reach
  :func:`accum_jax.accumulate` through it. This runs the same method (a
  subclass's override included) with ``state.tx.update`` given
  ``update_kwargs``. ``state.step`` still counts calls; the updates applied are
  :func:`accum_jax.optimizer_step`.

  Args:
    state: a ``flax.training.train_state.TrainState``, or a subclass.
    grads: the gradients, as for ``TrainState.apply_gradients``.
    **update_kwargs: keyword arguments for ``state.tx.update``, such as
      ``weight`` and ``flush``.

  Returns:
    The new state, of the same class and with the same ``tx``.

  Examples:
    >>> import jax.numpy as jnp, optax, accum_jax, accum_jax.flax
    >>> from flax.training.train_state import TrainState
    >>> state = TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)},
    ...                           tx=accum_jax.accumulate(optax.sgd(1.0), every_k=4))
    >>> for g, tokens in ((1.0, 3), (5.0, 1)):
    ...   state = accum_jax.flax.apply_gradients(
    ...       state, grads={"w": jnp.full(2, g)}, weight=tokens, flush=g == 5.0)
    >>> state.params["w"], int(state.step), int(accum_jax.optimizer_step(state))
    (Array([-2., -2.], dtype=float32), 2, 1)
  """
  tx = state.tx
  # Swapping tx, rather than repeating apply_gradients, keeps what Flax's method
  # (or a subclass's) does besides calling tx.update.
  bound = optax.GradientTransformation(tx.init, functools.partial(tx.update, **update_kwargs))
  return state.replace(tx=bound).apply_gradients(grads=grads).replace(tx=tx)


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
  return f"{type(arg).__name__} (an NNX graph node)"


def _is_spec(x: Any) -> bool:
  return isinstance(x, (jax.sharding.PartitionSpec, jax.sharding.NamedSharding))


def _variable_specs(state: Any) -> Any:
  """Per Variable of ``state``, the ``PartitionSpec`` of its sharding metadata
  (``nnx.with_partitioning``, ``sharding_rules`` applied), None where it names no
  mesh axis: such a Variable's sharding is read from its array, as without
  metadata."""
  specs = nnx.get_partition_spec(state)
  return jax.tree.map(
      lambda spec: spec if _is_spec(spec) and any(e is not None for e in spec) else None,
      specs, is_leaf=_is_spec,
  )


def _core_param_sharding(
    given: Any, diff: Any, node_nums: tuple[int, ...], diff_nums: tuple[int, ...],
    single: bool, num_plain: int,
) -> Any:
  """``param_sharding`` as the core door sees the differentiated arguments: the
  graph nodes' variables in one ``nnx.State`` keyed by node, then plain arrays.

  ``given`` is shaped like the gradients returned (a prefix of each argnum's:
  an ``nnx.State`` or dict for a graph node); None derives the graph nodes'
  from their Variables' sharding metadata.
  """
  if _is_spec(given):
    return given
  if given is None:
    node_specs = _variable_specs(diff)
    plain: tuple[Any, ...] = (None,) * num_plain
  else:
    per_argnum = dict(zip(diff_nums, (given,) if single else tuple(given)))

    def pure(spec: Any) -> Any:
      return nnx.to_pure_dict(spec) if isinstance(spec, nnx.State) else spec

    node_specs = nnx.State({j: pure(per_argnum[node_nums[j]]) for j in diff})
    plain = tuple(per_argnum[i] for i in diff_nums if i not in node_nums)
  if single:
    return node_specs if diff else plain[0]
  return ((node_specs,) if diff else ()) + plain


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
    **options: other options of :func:`accum_jax.value_and_grad`, such as
      ``weight_fn``, ``aux_reduction``, ``accumulator_dtype``, ``return_info``,
      ``mesh``. Under a mesh, ``param_sharding`` defaults to the Variables'
      sharding metadata (``nnx.with_partitioning``, as ``nnx.get_partition_spec``
      reads it), so annotated parameters sharded over the data axis take the
      FSDP path; given, it is shaped like the gradients returned (a
      ``PartitionSpec``, or an ``nnx.State`` or dict of them per graph node).

  Returns:
    A function of ``fun``'s arguments returning ``loss, grads`` (or ``(loss,
    aux), grads``) as ``nnx.value_and_grad`` does, a graph node's gradient an
    ``nnx.State``; a :class:`accum_jax.MicrobatchInfo` third with
    ``return_info=True``.

  Raises:
    ValueError: for ``state_argnums`` in ``options``, bad argnums or ``wrt``;
      when called, for no batch found or a graph node passed by keyword;
      otherwise as :func:`accum_jax.value_and_grad`.

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
  if "state_argnums" in options:
    raise ValueError(
        f"nnx_value_and_grad got state_argnums={options['state_argnums']!r}: the state"
        " of every NNX graph-node argument (a model, nnx.Rngs, metrics) is threaded"
        " through the microbatches already. Drop state_argnums, and hold the state"
        " in an nnx.Module or nnx.Variable passed as an argument."
    )
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
  try:
    wrt_predicate = nnx.filterlib.to_predicate(wrt)
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"wrt={wrt!r} is not an NNX filter: pass a Variable type such as nnx.Param, a"
        " tag string, nnx.All/nnx.Any/nnx.Not of filters, or a callable (path, variable)."
    ) from e
  # num_microbatches and the options of the core door, checked by the core door
  # itself, now rather than at the first call.
  _microbatch.value_and_grad(
      fun, num_microbatches, argnums=0, batch_argnums=1, state_argnums=2, has_aux=True,
      **options,
  )
  single = isinstance(argnums, numbers.Integral)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    args, kwargs = _positional(fun, args, kwargs)
    for role, nums in roles.items():
      for n in nums:
        if n >= len(args):
          raise ValueError(
              f"{role}={roles[role]} names argument {n}, but the function was called with"
              f" {len(args)} positional argument(s). Pass it positionally, or fix {role}."
          )
    for key, value in kwargs.items():
      if _holds_graph_node(value):
        raise ValueError(
            f"Keyword argument {key}= holds an NNX graph node ({type(value).__name__}),"
            " which nnx_value_and_grad threads only as a positional argument. Pass it"
            " positionally."
        )
    node_nums = tuple(i for i, arg in enumerate(args) if _holds_graph_node(arg))
    if bad := [n for n in batch_nums or () if n in node_nums]:
      raise ValueError(
          f"batch_argnums={batch_nums} names argument {bad[0]}, a {_kind(args[bad[0]])}:"
          " its state is threaded through the microbatches in order, not split. Name"
          " only the arguments holding the batch's arrays, or leave batch_argnums=None."
      )
    if bad := [n for n in rng_nums if n in node_nums]:
      raise ValueError(
          f"rng_argnums={rng_nums} names argument {bad[0]}, a {_kind(args[bad[0]])}:"
          " an nnx.Rngs argument is threaded through the microbatches, its count"
          " advancing as in sequential calls; rng_argnums is for raw jax.random keys."
          " Drop it from rng_argnums."
      )
    if batch_nums is None:
      skip = {*diff_nums, *rng_nums, *node_nums}
      batches = tuple(
          i for i, arg in enumerate(args) if i not in skip and _options.looks_like_batch(arg)
      )
      if not batches:
        raise ValueError(
            f"No argument of the {len(args)} given is a batch: batch_argnums=None takes"
            " the arguments outside argnums and rng_argnums, holding no graph node, whose"
            " leaves are all arrays with a leading batch axis. Pass batch_argnums."
        )
    else:
      batches = batch_nums

    # One split of all graph-node arguments together keeps objects they share
    # (an nnx.Rngs in the model and in an argument) one object.
    nodes = tuple(args[i] for i in node_nums)
    diff_positions = frozenset(node_nums.index(i) for i in diff_nums if i in node_nums)

    def differentiated(path, variable):
      return path[0] in diff_positions and wrt_predicate(path[1:], variable)

    graphdef, diff, state = cast(tuple[Any, Any, Any], nnx.split(nodes, differentiated, ...))

    # fun's arguments keep their numbers; the graph nodes' places hold None, and
    # their differentiated variables and state come last, at n and n + 1.
    n = len(args)
    plain_diff = tuple(i for i in diff_nums if i not in node_nums)
    core_argnums: int | tuple[int, ...]
    if single:
      core_argnums = n if diff_positions else diff_nums[0]
    else:
      core_argnums = ((n,) if diff_positions else ()) + plain_diff

    def pure(*core_args, **kwargs):
      *call_args, diff, state = core_args
      merged = nnx.merge(graphdef, diff, state)
      for i, node in zip(node_nums, merged, strict=True):
        call_args[i] = node
      out = fun(*call_args, **kwargs)
      loss, aux = out if has_aux else (out, None)
      _, _, new_state = cast(tuple[Any, Any, Any], nnx.split(merged, differentiated, ...))
      return loss, (nnx.as_pure(new_state), aux)

    core_args = [None if i in node_nums else arg for i, arg in enumerate(args)]
    # Plain arrays, not Variables, are the scan carry: a Variable may only be
    # changed at the trace level that made it.
    core_args += [diff, nnx.as_pure(state)]
    core_options = dict(options)
    if options.get("mesh") is not None or options.get("data_axis") is not None:
      # Under nnx.jit the traced arrays cannot say how they are sharded; the
      # Variables' metadata can.
      core_options["param_sharding"] = _core_param_sharding(
          options.get("param_sharding"), diff, node_nums, diff_nums, single, len(plain_diff)
      )
    vg = _microbatch.value_and_grad(
        pure,
        num_microbatches,
        argnums=core_argnums,
        batch_argnums=batches,
        rng_argnums=rng_nums or None,
        state_argnums=n + 1,
        has_aux=True,
        **core_options,
    )
    (loss, (new_state, aux)), core_grads, *info = vg(*core_args, **kwargs)
    nnx.update(nodes, new_state)

    if single:
      core_grads = (core_grads,)
    by_argnum = dict(zip(plain_diff, core_grads[1:] if diff_positions else core_grads))
    if diff_positions:
      diff_grads = core_grads[0]
      for i in diff_nums:
        if i in node_nums:
          j = node_nums.index(i)
          by_argnum[i] = diff_grads[j] if j in diff_grads else nnx.State({})
    grads = by_argnum[diff_nums[0]] if single else tuple(by_argnum[i] for i in diff_nums)
    return ((loss, aux) if has_aux else loss), grads, *info

  return wrapped


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
