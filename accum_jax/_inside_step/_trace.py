"""One microbatch of ``fun``: its arguments placed, its outputs checked, traced once.

:func:`checked` wraps ``fun`` as the loop differentiates it (its loss scaled by
the microbatch's share of the batch, what it returns checked against
``has_aux`` and ``state_argnums``); :func:`microbatch_args` places one
microbatch's rows, keys, state and parameters among the call's arguments;
:func:`trace` traces one microbatch abstractly, checks what it computes, and
returns its :class:`Shapes` with the jitted function that computed them. The
loop calls that function, whose trace JAX keeps: ``fun`` is traced once per
trace of the step, as in a hand-written scan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from accum_jax import _arguments, _core
from accum_jax._inside_step import _options


class Checked(NamedTuple):
  """``fun`` as the loop calls it (:func:`checked`)."""

  value_and_grad: Callable[..., Any]  # (share, *args) -> (scaled, (value, (state, aux))), grads
  forward: Callable[..., Any]  # (*args) -> (value, (state, aux)), no gradient


class Fun(NamedTuple):
  """What every microbatch's call of ``fun`` needs besides its data."""

  grad_fun: Checked  # :func:`checked`
  options: _options.Options
  batch_argnums: tuple[int, ...]
  kwargs: dict[str, Any]


class Shapes(NamedTuple):
  """One microbatch's outputs, abstractly, and how each leaf is combined."""

  value: jax.ShapeDtypeStruct
  grads: Any
  aux: Any
  reductions: tuple[str, ...]  # one per leaf of aux
  grad_kinds: tuple[str, ...] | None  # one per leaf of grads; None: all "mean"
  kinds: tuple[str, ...] | None  # per leaf of the accumulator's (value, grads), for _core


def accumulator_kinds(grad_kinds: tuple[str, ...]) -> tuple[str, ...]:
  """Per leaf of the accumulator's ``(value, grads)``, as ``_core`` takes them: the
  value "sum" when every gradient leaf sums (a summed loss, ``reduction="sum"``),
  as the batch's sum is, else "mean"."""
  sums = [k for k in grad_kinds if not _core.is_statistic(k)]
  value_kind = "sum" if sums and all(k == "sum" for k in sums) else "mean"
  return (value_kind, *grad_kinds)


def describe(x: Any) -> str:
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of {len(x)}"
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
  return f"a {type(x).__name__}"


def _check_state(new: Any, old: Any, argnum: int) -> None:
  """``new`` must be a state of the same tree, shapes and dtypes as ``old``."""
  fix = (
      f" fun must return (value, (new_state, aux)) with new_state shaped like its"
      f" argument {argnum} (state_argnums), e.g. Linen's"
      " `(loss, (updates['batch_stats'], aux))`."
  )
  new_structure: Any = jax.tree.structure(new)
  if new_structure != jax.tree.structure(old):
    raise ValueError(
        f"The new state has structure {jax.tree.structure(new)}, but the state passed in"
        f" has structure {jax.tree.structure(old)}.{fix}"
    )
  for (path, a), b in zip(jax.tree.leaves_with_path(new), jax.tree.leaves(old)):
    if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
      raise ValueError(
          f"The new state's leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(a)} and"
          f" dtype {jnp.result_type(a)}, but the state passed in has shape {jnp.shape(b)}"
          f" and dtype {jnp.result_type(b)}.{fix}"
      )


def _arrays(aux: Any) -> Any:
  """``aux`` with its Python numbers as JAX arrays of their weak dtype (a metric
  such as ``steps=1`` or ``moe_lb_loss=0.0``, which ``jax.value_and_grad``
  takes), so that every reduction sees an array."""
  return jax.tree.map(
      lambda x: jnp.asarray(x) if isinstance(x, (bool, int, float, complex)) else x, aux
  )


def value_and_aux(
    out: Any, has_aux: bool, name: str = "fun", scalar: str = "a scalar loss"
) -> tuple[Any, Any]:
  """What ``name`` returned, as ``(value, aux)``, checked against ``has_aux``;
  ``scalar`` says what its value must be."""
  if has_aux:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
      raise ValueError(
          f"has_aux=True, so {name} must return a pair (value, aux), but it returned"
          f" {describe(out)}. Return (loss, aux) (gather several outputs into one aux"
          " pytree), or pass has_aux=False."
      )
    value, aux = out
  elif isinstance(out, (tuple, list)):
    raise ValueError(
        f"{name} returned {describe(out)}, not a scalar loss. If it returns (loss, aux),"
        " pass has_aux=True."
    )
  else:
    value, aux = out, ()
  if not hasattr(value, "shape") or jnp.ndim(value) != 0:
    raise ValueError(
        f"{name} must return {scalar}, got {describe(value)}: reduce it (e.g. with"
        " jnp.mean), and return other outputs as aux with has_aux=True."
    )
  return value, aux


def _state_and_aux(aux: Any, argnum: int, args: Sequence[Any]) -> tuple[Any, Any]:
  """With ``state_argnums=argnum``: ``aux`` as ``(new_state, aux)``, the new state
  checked against the one passed in."""
  if not isinstance(aux, (tuple, list)) or len(aux) != 2:
    raise ValueError(
        f"With state_argnums={(argnum,)}, fun must return (value, (new_state, aux)), but"
        f" its aux is {describe(aux)}. Return (loss, (new_state, aux)), with aux=() if"
        " there is nothing else."
    )
  new_state, aux = aux
  _check_state(new_state, args[argnum], argnum)
  return new_state, aux


def checked(fun: Callable[..., Any], options: _options.Options) -> Checked:
  """``fun`` returning ``(value, (new_state, aux))``, with what it returned checked:
  its value and gradient with the loss scaled by a share, and its forward pass."""

  def checked(*args, **kwargs):
    value, aux = value_and_aux(fun(*args, **kwargs), options.has_aux)
    new_state = None
    if options.state_argnums:
      new_state, aux = _state_and_aux(aux, options.state_argnums[0], args)
    return value, (new_state, _arrays(aux) if options.has_aux else aux)

  def scaled(share, *args, **kwargs):
    # The microbatch's share of the batch's weight scales the loss before
    # differentiation: its gradient (and every cotangent inside, which FP8
    # scaling reads) is then at the whole batch's scale, and sums of shares,
    # also across devices, are the batch's weighted mean.
    value, aux = checked(*args, **kwargs)
    # The unscaled value rides along, for its dtype and the finiteness check.
    return value.astype(jnp.promote_types(value.dtype, jnp.float32)) * share, (value, aux)

  # fun's arguments come after the share.
  diff = options.argnums[0] + 1 if options.single_argnum else tuple(
      n + 1 for n in options.argnums)
  grad_fun = jax.value_and_grad(scaled, argnums=diff, has_aux=True)
  return Checked(grad_fun, checked)


def fold_in(key: jax.Array, index: jax.Array, shard_index: jax.Array | None) -> jax.Array:
  """The key of microbatch ``index`` (on device ``shard_index`` under a mesh)."""
  raw = not jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  if raw:  # uint32[2] (threefry) or uint32[4] (rbg), whatever the default implementation
    key = jax.random.wrap_key_data(key, impl="threefry2x32" if key.shape == (2,) else "rbg")
  key = jax.random.fold_in(key, index)
  if shard_index is not None:
    key = jax.random.fold_in(key, shard_index)
  return jax.random.key_data(key) if raw else key


class Out(NamedTuple):
  """What one microbatch gives."""

  value: jax.Array  # the loss times the microbatch's share of the batch, float32 at least
  raw_value: jax.Array  # the loss as fun returned it
  grads: Any  # of the scaled loss, w.r.t. the parameters as fun saw them
  state: Any  # the new state, None without state_argnums
  aux: Any


def microbatch_args(
    options: _options.Options, batch_argnums: Sequence[int], args: Sequence[Any], index: jax.Array,
    mb: dict[int, Any], state: Any, params: Any, shard_index: jax.Array | None,
) -> list[Any]:
  """``args`` as ``fun`` takes them for microbatch ``index``: its rows ``mb`` (by
  batch argnum), its keys folded in, the threaded ``state`` and ``params`` (as
  ``fun`` sees them) in their places."""
  call_args = list(args)
  for n in batch_argnums:
    call_args[n] = mb[n]
  for n in options.rng_argnums:
    call_args[n] = jax.tree.map(lambda key: fold_in(key, index, shard_index), args[n])
  if options.state_argnums:
    call_args[options.state_argnums[0]] = state
  flat = [params] if options.single_argnum else params
  for n, p in zip(options.argnums, flat):
    call_args[n] = p
  return call_args


def abstract(x: Any, dtype: Any = None) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x) if dtype is None else dtype)


def run(fun: Fun, args: Sequence[Any], shard_index, index, mb, state, share, params) -> Out:
  """Value, gradient, new state and aux of microbatch ``index`` (its rows ``mb``),
  its loss scaled by ``share``; ``args`` as this device holds them."""
  call_args = microbatch_args(fun.options, fun.batch_argnums, args, index, mb, state, params,
                              shard_index)
  (value, (raw_value, (new_state, aux))), grads = fun.grad_fun.value_and_grad(
      share, *call_args, **fun.kwargs)
  return Out(value, raw_value, grads, new_state, aux)


def trace(
    fun: Fun, args: Sequence[Any], rows: int, seen: Any, grads: Any,
    grad_kinds: tuple[str, ...], batch_size: int,
) -> tuple[Shapes, Callable[..., Out]]:
  """One microbatch of ``rows`` rows, traced abstractly (no compile) and checked.

  ``seen`` are the parameters as ``fun`` sees them (full-size, in the dtype they
  are gathered in), ``grads`` as the gradient comes back (the parameters' own
  shapes and dtypes). Returns the :class:`Shapes` and the jitted microbatch
  function ``(index, mb, state, share, params) -> Out``: called again with
  arguments of the same types (one device's loop), it reuses this trace.
  ``batch_size`` is the whole batch's (every device's), which the aux's
  default reduction is checked against (:func:`_aux_reductions`).
  """
  options = fun.options
  state = args[options.state_argnums[0]] if options.state_argnums else None
  one = jax.jit(functools.partial(run, fun, args, None))  # (index, mb, state, share, params)
  scalar = jax.ShapeDtypeStruct
  traced = one.trace(scalar((), jnp.int32), _rows(fun, args, rows), state,
                     scalar((), jnp.float32), seen)
  out = traced.out_info
  whole = (functools.partial(_whole_batch_aux, fun, args, batch_size, state, seen)
           if batch_size != rows else lambda: None)  # one microbatch is the whole batch
  reductions = (_aux_reductions(out.aux, options.aux_reduction, rows, whole)
                if options.has_aux else ())
  # All "mean": the default path, as if per-leaf kinds did not exist.
  kinds = None if grad_kinds.count("mean") == len(grad_kinds) else grad_kinds
  shapes = Shapes(out.raw_value, jax.tree.map(abstract, grads), out.aux, reductions, kinds,
                  None if kinds is None else accumulator_kinds(kinds))
  return shapes, one


def _rows(fun: Fun, args: Sequence[Any], rows: int) -> dict[int, Any]:
  """The batch arguments, abstractly, cut to ``rows`` rows (by argnum)."""
  # JAX's own dtypes: a float64 numpy batch is float32 once traced (unless x64
  # is on), and asking for float64 here would warn on every trace.
  canonical = jax.dtypes.canonicalize_dtype
  cut = {}
  for n in fun.batch_argnums:
    cut[n] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), canonical(x.dtype)), args[n])
  return cut


def _whole_batch_aux(fun: Fun, args, batch_size: int, state, seen) -> Any:
  """The aux ``fun`` returns on the whole batch, abstractly (its forward pass traced,
  no gradient, no compile); None where ``fun`` cannot be traced on it (a model
  written for one microbatch size): then no shape can be compared."""

  def forward(i, mb, state, params):
    call_args = microbatch_args(fun.options, fun.batch_argnums, args, i, mb, state, params, None)
    return fun.grad_fun.forward(*call_args, **fun.kwargs)[1][1]

  index = jax.ShapeDtypeStruct((), jnp.int32)
  try:
    return jax.eval_shape(forward, index, _rows(fun, args, batch_size), state, seen)
  except (TypeError, ValueError):  # JAX's shape errors; fun's own checks are made on one microbatch
    return None


def _aux_reductions(
    aux: Any, spec: Any, rows: int, whole: Callable[[], Any] = lambda: None,
) -> tuple[str, ...]:
  """How each aux leaf is reduced (``spec``: ``aux_reduction``, maybe per leaf).

  A leaf that ``spec`` leaves at None is averaged ("mean") where that gives the
  whole batch's shape. The rule, from abstract shapes only: ``whole()`` traces
  ``fun``'s forward pass on the whole batch, and a leaf whose shape there differs
  from its shape on one microbatch (a per-example output, or anything sized by
  the rows) depends on how the batch is split, so no reduction can be chosen for
  it without changing what the step returns with ``num_microbatches``: a
  ValueError names the leaf, both shapes and the fix (``"concat"``, or a
  reduction of its own).

  ``whole`` is called only when a leaf left at None has an axis, or the
  microbatch has one row. A scalar of a microbatch of several rows is taken to be
  a scalar of the whole batch too, so that the usual aux (a dict of scalar
  metrics) costs no second trace: its rank would have to change with the number
  of rows, which a squeeze of a one-row axis does (hence one-row microbatches are
  always compared) and otherwise only code that branches on the batch's size.
  Per-example outputs come back in batch order where ``"concat"`` asks for them."""
  reductions = []
  given = _arguments.per_leaf_spec(_completed(spec, aux), aux, "aux_reduction", "the aux")
  leaves = jax.tree.leaves_with_path(aux)
  for (path, leaf), (requested, _) in zip(leaves, given):
    if requested == "concat" and not (len(leaf.shape) >= 1 and leaf.shape[0] == rows):
      raise ValueError(
          f"aux_reduction='concat' returns per-example outputs in batch order, but aux"
          f" leaf {jax.tree_util.keystr(path) or '(the aux)'} has shape {leaf.shape}, with"
          f" no leading axis of the microbatch's {rows} rows. Return one row per example,"
          " or reduce it with aux_reduction='mean' or 'sum'."
      )
    reductions.append(requested or "mean")
  defaults = [i for i, (requested, _) in enumerate(given) if requested is None]
  # Scalars on microbatches of several rows are the whole batch's scalars (see above):
  # then fun is traced once, as in a hand-written scan.
  compared = rows == 1 or any(leaves[i][1].shape for i in defaults)
  if compared and (full := whole()) is not None:
    _check_default_shapes([leaves[i] for i in defaults],
                          [jax.tree.leaves(full)[i] for i in defaults], rows)
  return tuple(reductions)


def _check_default_shapes(leaves, full, rows: int) -> None:
  """ValueError for the first aux leaf at the default reduction whose shape on one
  microbatch (``leaves``: (path, leaf)) is not its shape on the whole batch (``full``)."""
  for (path, leaf), whole in zip(leaves, full):
    if tuple(leaf.shape) == tuple(whole.shape):
      continue
    name = jax.tree_util.keystr(path) or "(the aux)"
    per_example = len(leaf.shape) >= 1 and leaf.shape[0] == rows
    fix = ("aux_reduction='concat' returns it in batch order, as the whole batch's"
           if per_example else "aux_reduction='stack' returns it per microbatch")
    raise ValueError(
        f"The aux leaf {name} has shape {tuple(leaf.shape)} on a microbatch of {rows} rows"
        f" but {tuple(whole.shape)} on the whole batch: its shape depends on the"
        f" microbatches, so the default reduction ('mean') would make what the step returns"
        f" change with num_microbatches. Say how it combines: {fix} (for this leaf alone,"
        f" a pytree prefix of the aux with it at {name}), or give it 'mean', 'sum', 'max'"
        " or 'last' explicitly."
    )


def _completed(spec: Any, tree: Any, where: str = "") -> Any:
  """``spec`` with None (the default) for each key of a dict in ``tree`` that the
  dict at the same place in ``spec`` leaves out: a mapping may name some keys of
  a large aux (MaxText's has ten) and leave the rest at the default. A key that
  ``tree`` does not have is refused, so that a misspelt one is not ignored."""
  if isinstance(spec, dict) and isinstance(tree, dict):
    if unknown := sorted(set(spec) - set(tree), key=str):
      raise ValueError(
          f"aux_reduction names {unknown[0]!r}{f' at {where}' if where else ''}, which the"
          f" aux does not have (its keys there: {sorted(tree, key=str)}). Name keys of the"
          " aux; those left out take the default."
      )
    return {k: _completed(spec.get(k), v, f"{where}[{k!r}]") for k, v in tree.items()}
  if isinstance(spec, (tuple, list)) and type(spec) is type(tree) and len(spec) == len(tree):
    return type(spec)(_completed(s, t, f"{where}[{i}]")
                      for i, (s, t) in enumerate(zip(spec, tree)))
  return spec
