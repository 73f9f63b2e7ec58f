"""Equinox helpers: ``eqx.filter_value_and_grad`` and ``eqx.filter_grad`` over microbatches.

This is the only module of accum_jax that imports equinox; ``import accum_jax`` does not.

An ``eqx.Module`` is a pytree whose leaves are not all arrays: activation
functions, ``eqx.nn.Lambda``, Python floats and bools. :func:`accum_jax.value_and_grad`
differentiates and splits arrays only, so a model handed to it directly fails
inside JAX. :func:`filter_value_and_grad` does what ``eqx.filter_value_and_grad``
does (differentiate the first argument with respect to its floating-point
arrays, pass everything else through) and translates the call for the core:
every positional argument is cut with ``eqx.partition`` into its arrays, which
go to :func:`accum_jax.value_and_grad` by position, and the rest, which the
function closes over. Under a ``DataParallel`` mesh, ``jax.shard_map`` therefore
sees arrays only. What Equinox code passes besides the model is recognised as it
is written:

* batches: positional arguments whose leaves are all arrays with a leading axis
  (``x``, ``y``, a dict of them) are split into microbatches;
* ``eqx.nn.State`` (BatchNorm statistics, from ``eqx.nn.make_with_state``): threaded
  through the microbatches in order, as ``num_microbatches`` sequential calls
  would; ``fun(model, state, x, y)`` returns ``(loss, state)`` with ``has_aux=True``,
  as in Equinox's stateful example;
* PRNG keys, positional (``loss(model, x, y, key)``) or by keyword (``key=key``):
  microbatch ``i`` receives ``jax.random.fold_in(key, i)``, so dropout differs
  between microbatches.

Across calls, the standard Equinox loop needs nothing from here:
``accum_jax.accumulate(optax.adam(...), every_k=4)`` is an Optax transformation, so
``opt.init(eqx.filter(model, eqx.is_array))``, ``opt.update(grads, opt_state,
eqx.filter(model, eqx.is_array))`` and ``eqx.apply_updates`` work as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from accum_jax import _arguments
from accum_jax._inside_step import _microbatch, _options

__all__ = ("filter_grad", "filter_value_and_grad")

# Options of accum_jax.value_and_grad that the Equinox front end sets itself.
_FIXED_OPTIONS = {
    "argnums": "it differentiates the floating-point arrays of the first argument, as"
    " eqx.filter_value_and_grad does; gather what to differentiate into one pytree"
    " and pass it first.",
    "state_argnums": "an eqx.nn.State argument is found and threaded by itself; pass"
    " the State positionally and return it in aux.",
}


class _StateSlot(eqx.Module):
  """Where the ``eqx.nn.State`` sat in ``fun``'s aux (a pytree with no leaves)."""


def _is_state(x: Any) -> bool:
  """Whether ``x`` is an ``eqx.nn.State``."""
  return isinstance(x, eqx.nn.State)


def _is_single_key(x: Any) -> bool:
  """A typed key of shape (), or a raw ``uint32[2]`` key (``jax.random.PRNGKey``)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return jnp.ndim(x) == 0
  return dtype == jnp.uint32 and jnp.shape(x) == (2,)


def _holds_keys(arrays: Any, static: Any) -> bool:
  """Whether an argument (cut by ``eqx.partition``) is a key, or a pytree of keys only."""
  leaves = jax.tree.leaves(arrays)
  return bool(leaves) and not jax.tree.leaves(static) and all(map(_is_single_key, leaves))


def _is_batch(arg: Any, arrays: Any, static: Any) -> bool:
  """Arrays only, each with a leading axis, and not a Module (a second model is no batch)."""
  leaves = jax.tree.leaves(arrays)
  return (
      bool(leaves)
      and not jax.tree.leaves(static)
      and not isinstance(arg, eqx.Module)
      and all(jnp.ndim(x) >= 1 for x in leaves)
  )


def _argnums(value: Any, name: str, find: Any = None) -> tuple[int, ...] | None:
  """``value`` as a tuple of argument numbers; None where it is ``find``: found per call."""
  if value is find:
    return None
  nums = _options.argnums_tuple(value, name)
  if 0 in nums:
    raise ValueError(
        f"{name}={value!r} names argument 0, the model, which is differentiated. Name"
        " the arguments after it (the batch is usually argument 1)."
    )
  return nums


def _check_in_range(nums: tuple[int, ...] | None, name: str, num_args: int) -> None:
  """ValueError if ``name`` names an argument past the ``num_args`` given."""
  for n in nums or ():
    if n >= num_args:
      raise ValueError(
          f"{name}={nums} names argument {n}, but the function was called with {num_args}"
          f" positional argument(s). Pass it positionally, or fix {name}."
      )


def _roles(
    parts: list[tuple[Any, Any]],
    args: tuple[Any, ...],
    batch_nums: tuple[int, ...] | None,
    rng_nums: tuple[int, ...] | None,
) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
  """The batch, key and State arguments among ``args[1:]``, in the user's numbering."""
  state_nums = tuple(i for i in range(1, len(args)) if _is_state(args[i]))
  if len(state_nums) > 1:
    raise ValueError(
        f"Arguments {list(state_nums)} are all eqx.nn.State objects; one State can be"
        " threaded through the microbatches. Pass the whole model's State, as"
        " eqx.nn.make_with_state returns it."
    )
  taken = set(state_nums) | set(batch_nums or ())
  if rng_nums is None:
    rng_nums = tuple(
        i for i in range(1, len(args)) if i not in taken and _holds_keys(*parts[i])
    )
  if batch_nums is None:
    skip = set(state_nums) | set(rng_nums)
    batch_nums = tuple(
        i for i in range(1, len(args)) if i not in skip and _is_batch(args[i], *parts[i])
    )
    _options.check_unambiguous(batch_nums, args)
    if not batch_nums:
      raise ValueError(
          f"None of the {len(args) - 1} argument(s) after the model is a batch: a batch"
          " argument's leaves are all arrays with a leading batch axis (a Module, a"
          " State, a PRNG key or an argument holding non-arrays is none). Name the"
          " batch with batch_argnums=..."
      )
  roles = {
      f"batch_argnums={batch_nums}": batch_nums,
      f"rng_argnums={rng_nums}": rng_nums,
      "the eqx.nn.State argument": state_nums,
  }
  _options.check_roles(roles, fix=" Fix batch_argnums or rng_argnums.")
  # A raw key, uint32[2], looks like a batch of two; say so rather than guess.
  sizes = {jnp.shape(leaf)[0] for i in batch_nums for leaf in jax.tree.leaves(parts[i][0])}
  for i in rng_nums:
    raw = any(
        not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        for leaf in jax.tree.leaves(parts[i][0])
    )
    if raw and 2 in sizes:
      raise ValueError(
          f"Argument {i} is a uint32 array of shape (2,), a raw PRNG key or a batch of 2"
          " (the batch size). Say which: rng_argnums=... or batch_argnums=..., or pass"
          " typed keys (jax.random.key)."
      )
  return batch_nums, rng_nums, (state_nums[0] if state_nums else None)


def _split_state(aux: Any, state_num: int) -> tuple[Any, Any]:
  """``aux`` with its one ``eqx.nn.State`` taken out: ``(state, aux with a _StateSlot)``."""
  leaves, treedef = jax.tree.flatten(aux, is_leaf=_is_state)
  found = [n for n, leaf in enumerate(leaves) if _is_state(leaf)]
  if len(found) != 1:
    raise ValueError(
        f"Argument {state_num} is an eqx.nn.State, so fun must return the updated State"
        f" in its aux, (loss, state) or (loss, (state, ...)); its aux holds {len(found)}"
        " State objects. Return the State from the model's call."
    )
  state = leaves[found[0]]
  leaves[found[0]] = _StateSlot()
  return state, jax.tree.unflatten(treedef, leaves)


def _put_state(aux: Any, state: Any) -> Any:
  """``aux`` with ``state`` back where :func:`_split_state` left a ``_StateSlot``."""
  is_slot = lambda x: isinstance(x, _StateSlot)  # noqa: E731
  return jax.tree.map(lambda x: state if is_slot(x) else x, aux, is_leaf=is_slot)


class _Parsed(NamedTuple):
  """The options of :func:`filter_value_and_grad`, checked once when it is built."""

  num_microbatches: int
  has_aux: bool
  batch_nums: tuple[int, ...] | None  # None: found per call
  rng_nums: tuple[int, ...] | None  # None: found per call
  weight_fn: Callable[..., jax.typing.ArrayLike] | None
  core: dict[str, Any]  # the other options, for the core door


class _Call(NamedTuple):
  """One call's arguments, cut into arrays and the rest, each in its role."""

  num_args: int
  diff: Any  # the model's floating-point arrays
  model_arrays: Any  # the model's other arrays
  model_static: Any  # the model's non-arrays
  user_arrays: list[Any]  # the arrays of each argument after the model
  statics: list[Any]  # the non-arrays of each positional argument
  batch_nums: tuple[int, ...]
  rng_nums: tuple[int, ...]
  state_num: int | None  # the eqx.nn.State argument
  kw_keys: dict[str, Any]  # keyword arguments that are PRNG keys
  kw_arrays: dict[str, Any]  # the arrays of the other keyword arguments
  kw_static: dict[str, Any]  # the non-arrays of the keyword arguments


def _parse(
    num_microbatches: int | None, has_aux: bool, batch_argnums: Any, rng_argnums: Any,
    weight_fn: Callable[..., jax.typing.ArrayLike] | None, options: dict[str, Any],
) -> _Parsed:
  """Checks the options once, when the function is built."""
  if num_microbatches is None:
    raise ValueError(
        "num_microbatches is missing: pass the number of microbatches, an int >= 1 that"
        " divides the batch, e.g. filter_value_and_grad(loss_fn, num_microbatches=4)."
    )
  _options.make(
      num_microbatches, caller="filter_value_and_grad", refused=_FIXED_OPTIONS, **options
  )
  if isinstance(rng_argnums, str) and rng_argnums != "auto":
    raise ValueError(
        f"rng_argnums={rng_argnums!r} is not 'auto' (find the PRNG keys), None (fold"
        " none) or argument numbers."
    )
  return _Parsed(
      num_microbatches, has_aux, _argnums(batch_argnums, "batch_argnums"),
      _argnums(rng_argnums, "rng_argnums", find="auto"), weight_fn, dict(options),
  )


def _bind(parsed: _Parsed, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
  """Cuts one call's arguments with ``eqx.partition`` and sorts them into their roles."""
  if not args:
    raise ValueError(
        "filter_value_and_grad differentiates the first positional argument (the"
        " model), but the function was called without positional arguments."
    )
  _check_in_range(parsed.batch_nums, "batch_argnums", len(args))
  _check_in_range(parsed.rng_nums, "rng_argnums", len(args))
  # Each argument as (arrays, the rest): only the arrays reach JAX's transformations.
  parts = [eqx.partition(arg, eqx.is_array) for arg in args]
  diff, model_rest = eqx.partition(args[0], eqx.is_inexact_array)
  model_arrays, model_static = eqx.partition(model_rest, eqx.is_array)
  batch_nums, rng_nums, state_num = _roles(parts, args, parsed.batch_nums, parsed.rng_nums)
  if state_num is not None and not parsed.has_aux:
    raise ValueError(
        f"Argument {state_num} is an eqx.nn.State, threaded through the microbatches:"
        " fun must return (loss, state) and be wrapped with has_aux=True."
    )
  kw_arrays, kw_static = eqx.partition(kwargs, eqx.is_array)
  key_names = [k for k in kwargs if _holds_keys(kw_arrays[k], kw_static[k])]
  kw_keys = {k: kw_arrays.pop(k) for k in key_names}
  return _Call(
      len(args), diff, model_arrays, model_static, [arrays for arrays, _ in parts[1:]],
      [static for _, static in parts], batch_nums, rng_nums, state_num, kw_keys, kw_arrays,
      kw_static,
  )


def _core_args(call: _Call) -> tuple[Any, ...]:
  """The arguments of :func:`_pure`: arrays only."""
  return (call.diff, *call.user_arrays, call.model_arrays, call.kw_keys, call.kw_arrays)


def _pure(fun: Callable[..., Any], call: _Call) -> Callable[..., Any]:
  """``fun`` on :func:`_core_args`, its ``eqx.nn.State`` moved to where the core threads it."""

  def pure(diff, *arrays):
    # The core's numbering: 0 the model's floating-point arrays, 1..n-1 the
    # user's arguments (so messages name the user's numbers), then the model's
    # other arrays, the keyword keys and the other keyword arrays.
    user_arrays = arrays[: call.num_args - 1]
    model_arrays, kw_keys, kw_arrays = arrays[call.num_args - 1:]
    model = eqx.combine(diff, model_arrays, call.model_static)
    call_args = [eqx.combine(a, s) for a, s in zip(user_arrays, call.statics[1:])]
    call_kwargs = eqx.combine({**kw_arrays, **kw_keys}, call.kw_static)
    out = fun(model, *call_args, **call_kwargs)
    if call.state_num is None:
      return out
    loss, aux = out
    state, aux = _split_state(aux, call.state_num)
    return loss, (eqx.filter(state, eqx.is_array), aux)

  return pure


def _core_options(parsed: _Parsed, call: _Call) -> dict[str, Any]:
  """The options of the core door for :func:`_pure` on :func:`_core_args`."""
  kw_keys_num = call.num_args + 1
  core_weight_fn = None
  if parsed.weight_fn is not None:
    weight_fn = parsed.weight_fn

    def core_weight_fn(*batches):
      return weight_fn(*(eqx.combine(b, call.statics[n]) for b, n in zip(batches, call.batch_nums)))

  return dict(
      parsed.core, argnums=0, batch_argnums=call.batch_nums,
      rng_argnums=call.rng_nums + ((kw_keys_num,) if call.kw_keys else ()),
      state_argnums=call.state_num, has_aux=parsed.has_aux, weight_fn=core_weight_fn,
  )


def _with_state(out: Any, call: _Call) -> Any:
  """The core door's ``(loss, (state arrays, aux))`` as ``fun`` returned it, State and all."""
  if call.state_num is None:
    return out
  loss, (state, aux) = out
  return (loss, _put_state(aux, eqx.combine(state, call.statics[call.state_num])))


@_arguments.takes_options(
    "filter_value_and_grad", options_of=_microbatch.value_and_grad, refused=_FIXED_OPTIONS
)
def filter_value_and_grad(
    fun: Callable[..., Any] | None = None,
    num_microbatches: int | None = None,
    *,
    has_aux: bool = False,
    batch_argnums: int | Sequence[int] | None = None,
    rng_argnums: int | Sequence[int] | str | None = "auto",
    weight_fn: Callable[..., jax.typing.ArrayLike] | None = None,
    **options: Any,
) -> Callable[..., Any]:
  """``eqx.filter_value_and_grad(fun)`` over a batch split into microbatches.

  As with Equinox, the gradient is taken with respect to the floating-point
  arrays of the first argument (the model). The arguments after it are read by
  what they are: batches are split, an ``eqx.nn.State`` is threaded through the
  microbatches, PRNG keys get the microbatch index folded in, and anything else
  passes unchanged.

  See the guide: :doc:`/guides/equinox`.

  Args:
    fun: ``fun(model, *args, **kwargs)`` returning a scalar loss, or ``(loss,
      aux)`` with ``has_aux``. Without ``fun``, a decorator:
      ``@filter_value_and_grad(num_microbatches=4)``.
    num_microbatches: the number of microbatches, an int >= 1 dividing the batch.
    has_aux: ``fun`` returns ``(loss, aux)``; needed with an ``eqx.nn.State``.
    batch_argnums: which positional arguments are batches, in ``fun``'s
      numbering (never 0, the model); None finds them.
    rng_argnums: which positional arguments hold PRNG keys: ``"auto"`` (the
      default) finds them, None folds none.
    weight_fn: maps one microbatch's batch arguments to its scalar weight, as
      for :func:`accum_jax.value_and_grad`.
    **options: the other options of :func:`accum_jax.value_and_grad` but
      ``argnums`` and ``state_argnums``. A ``DataParallel``'s ``param_sharding``
      is a prefix of ``eqx.filter(model, eqx.is_inexact_array)``.

  Returns:
    A function with ``fun``'s signature returning what
    ``eqx.filter_value_and_grad`` would, ``grads`` shaped like the model; a
    :class:`accum_jax.MicrobatchInfo` third with ``return_info=True``. Call it
    under ``eqx.filter_jit``.

  Raises:
    ValueError: for ``argnums`` or ``state_argnums``, or argnums naming the
      model; when called, for no batch found or a misused ``eqx.nn.State``;
      otherwise as :func:`accum_jax.value_and_grad`.

  Examples:
    >>> import equinox as eqx, jax, jax.numpy as jnp, accum_jax.equinox
    >>> model = eqx.nn.MLP(3, 1, width_size=8, depth=1, activation=jax.nn.relu,
    ...                    key=jax.random.key(0))
    >>> def loss_fn(model, x, y):
    ...   return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)
    >>> x, y = jnp.arange(24.0).reshape(8, 3) / 24, jnp.ones(8)
    >>> vg = accum_jax.equinox.filter_value_and_grad(loss_fn, num_microbatches=4)
    >>> loss, grads = eqx.filter_jit(vg)(model, x, y)
    >>> full_loss, full_grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    >>> bool(jnp.allclose(loss, full_loss)), bool(jnp.allclose(grads.layers[0].weight,
    ...                                                         full_grads.layers[0].weight))
    (True, True)
  """
  if fun is None:
    return functools.partial(
        filter_value_and_grad,
        num_microbatches=num_microbatches,
        has_aux=has_aux,
        batch_argnums=batch_argnums,
        rng_argnums=rng_argnums,
        weight_fn=weight_fn,
        **options,
    )
  parsed = _parse(num_microbatches, has_aux, batch_argnums, rng_argnums, weight_fn, options)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    call = _bind(parsed, args, kwargs)
    vg = _microbatch.value_and_grad(
        _pure(fun, call), parsed.num_microbatches, **_core_options(parsed, call)
    )
    out, grads, *info = vg(*_core_args(call))
    return (_with_state(out, call), grads, *info)

  return wrapped


# Its signature keeps **options for now: it would show rng_argnums="auto", the default
# it forwards, which the API test holds to value_and_grad's None for every function
# but filter_value_and_grad.
@_arguments.takes_options(
    "filter_grad", options_of=filter_value_and_grad, refused=_FIXED_OPTIONS, shown=False
)
def filter_grad(
    fun: Callable[..., Any] | None = None,
    num_microbatches: int | None = None,
    *,
    has_aux: bool = False,
    **options: Any,
) -> Callable[..., Any]:
  """``eqx.filter_grad(fun)`` over microbatches; the options of :func:`filter_value_and_grad`.

  Returns ``grads``, or ``(grads, aux)`` with ``has_aux=True``, as
  ``eqx.filter_grad`` does (and a :class:`accum_jax.MicrobatchInfo` last with
  ``return_info=True``). The stateful pattern of Equinox's BatchNorm example
  works as written: ``grads, state = filter_grad(compute_loss, 4,
  has_aux=True)(model, state, xs, ys)``.

  Examples:
    >>> import equinox as eqx, jax, jax.numpy as jnp, accum_jax.equinox
    >>> model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    >>> loss_fn = lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)
    >>> grads = accum_jax.equinox.filter_grad(loss_fn, num_microbatches=2)(model, jnp.eye(2))
    >>> full = eqx.filter_grad(loss_fn)(model, jnp.eye(2))
    >>> bool(jnp.allclose(grads.weight, full.weight))
    True
  """
  if fun is None:
    return functools.partial(
        filter_grad, num_microbatches=num_microbatches, has_aux=has_aux, **options
    )
  vg = filter_value_and_grad(fun, num_microbatches, has_aux=has_aux, **options)
  return _microbatch.grad_of(vg, fun, has_aux, options.get("return_info", False))
