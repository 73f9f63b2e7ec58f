"""Losses that couple the batch: ``cached_value_and_grad`` (gradient caching).

A contrastive loss (CLIP, SigLIP, InfoNCE, any in-batch negatives) compares every
example with all the others, so it is no mean over microbatches and
:func:`accum_jax.value_and_grad` cannot split it. Gradient caching (Gao et al.
2021) splits the towers instead: the loss is taken once, on the whole batch's
embeddings, and only the embedding is done chunk by chunk::

  options = _options.make(...)                  # once, when it is built
  call = _call.bind(options, args)              # per call: batch, sizes, mesh
  embeddings = _embed(...)                      # pass 1: lax.scan, forward only
  loss, aux, direct, cotangents = _loss(...)    # d loss / d embeddings, whole batch
  acc = _pull_back(...)                         # pass 2: lax.scan of jax.vjp, summed
  return _finalise(...)                         # + direct gradient, cast, finite check

Under a mesh the same steps run per device inside ``jax.shard_map``
(:func:`_data_parallel`): each device embeds its rows, the embeddings are
all-gathered for the loss, each device pulls back its own rows' cotangents, and
the gradient sums are all-reduced once, after both loops. Parameters sharded
over the data axis follow the reduction plan of the other door
(``_sharding.plan``): gathered for both passes, each chunk's gradient
reduce-scattered into a sharded accumulator (or, with ``gather="once"``, a
full-size sum reduce-scattered once); the loss's direct gradient, the same on
every device, is added to this device's shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from accum_jax import _arguments, _core
from accum_jax._inside_step import (
    _across_devices,
    _batching,
    _call,
    _microbatch,
    _options,
    _sharding,
    _trace,
)
from accum_jax._inside_step._result import MicrobatchInfo

# Options of value_and_grad that have no meaning here, and what to do instead.
_REFUSED = {
    "weight_fn": (
        "the loss is computed once, on the whole batch, so there are no microbatch"
        " means to weigh. Weigh the examples inside loss_fn (e.g. with a mask in the"
        " batch), which then is exact as it stands."
    ),
    "state_argnums": (
        "a threaded state such as BatchNorm statistics would make each chunk's"
        " embeddings depend on the chunk, and no split of the batch could equal the"
        " full batch. Use a per-example normalisation (LayerNorm, GroupNorm), or"
        " BatchNorm with frozen statistics (use_running_average=True)."
    ),
    "aux_reduction": (
        "loss_fn's aux is computed once, on the whole batch, and comes back as it"
        " returned it: there is nothing to reduce."
    ),
    "gradient_noise": (
        "the gradient of a batch-coupled loss is not a mean of independent"
        " per-chunk gradients, so their spread estimates no gradient noise."
    ),
    "reduction": "each gradient leaf is the whole batch's, and none is a statistic to reduce.",
    "gradient_dtype": "the gradient comes back in the parameters' dtype; cast it after.",
}


class _Devices(NamedTuple):
  """What differs between one device and a data axis of several."""

  axis: tuple[str, ...] | None  # None: one device, no collectives
  shard: jax.Array | None  # this device's index along the axis
  num: int
  plan: _sharding.Plan | None = None  # where each parameter is gathered and reduced

  def gather(self, tree: Any) -> Any:
    """The whole batch's rows, in batch order (device order), on every device."""
    if self.axis is None:
      return tree
    return jax.tree.map(lambda x: jax.lax.all_gather(x, self.axis, tiled=True), tree)

  def agreed(self, flag: jax.Array) -> jax.Array:
    """``flag`` true on every device or on none: where parameters are sharded,
    each device judges its own shards of the gradient (one all-reduce of a
    flag); else every device holds the same gradient and agrees already."""
    if self.plan is None or not self.plan.sharded:
      return flag
    return jax.lax.pmin(flag.astype(jnp.int32), self.axis) > 0

  def own_rows(self, tree: Any) -> Any:
    """This device's rows of a whole-batch ``tree``."""
    if self.axis is None:
      return tree
    return jax.tree.map(
        lambda x: jax.lax.dynamic_slice_in_dim(x, self.shard * (x.shape[0] // self.num),
                                               x.shape[0] // self.num),
        tree,
    )

  def reduce(self, acc: _core.Accumulator) -> _core.Accumulator:
    """The devices' gradient sums added: the one reduction of the step (sharded
    leaves reduce-scattered, per chunk or here, as the plan says)."""
    if self.axis is None:
      return acc
    if any(_core.holds_mean(x) for x in jax.tree.leaves(acc.total)):
      # Running means, weighed by the devices' weights (full-size: gather="once").
      merged = _core.merge(acc, self.axis)
      return merged._replace(total=_across_devices.own_shards(self.plan, merged.total))
    # Every device adds the same number of chunks, so only the sums travel.
    if self.plan is not None and self.plan.sharded:
      total = _across_devices.reduce_grads(self.plan, acc.total)
    else:
      total = jax.lax.psum(acc.total, self.axis)
    return acc._replace(total=total, weight=acc.weight * self.num, count=acc.count * self.num)


_ONE_DEVICE = _Devices(None, None, 1)


def _chunk_args(options, call, args, index, chunk, devices) -> list[Any]:
  """``args`` with the batch replaced by chunk ``index`` and its keys folded."""
  chunk_args = list(args)
  for n in call.batch_argnums:
    chunk_args[n] = chunk[n]
  for n in options.rng_argnums:
    chunk_args[n] = jax.tree.map(lambda key: _trace.fold_in(key, index, devices.shard), args[n])
  return chunk_args


def _split(options, tree: Any) -> Any:
  """Each leaf of ``tree`` as ``(num_microbatches, rows, ...)``, for a scan over chunks."""
  return jax.tree.map(
      lambda x: _batching.split(x, options.num_microbatches, options.split), tree
  )


def _check_embeddings(embeddings: Any, rows: int) -> None:
  for path, leaf in jax.tree.leaves_with_path(embeddings):
    where = jax.tree_util.keystr(path) or "(the embeddings)"
    shape = jnp.shape(leaf)
    if not shape or shape[0] != rows:
      raise ValueError(
          f"embed_fn returned a leaf {where} of shape {shape}, without the chunk's {rows}"
          " rows as its leading axis. embed_fn must return per-example embeddings (a"
          " pytree of (rows, ...) arrays). If this is a batch statistic (BatchNorm's"
          " updated batch_stats), no chunked embedding can equal the full batch's: use a"
          " per-example normalisation, or BatchNorm with frozen statistics."
      )
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      raise ValueError(
          f"embed_fn returned a leaf {where} of dtype {jnp.result_type(leaf)}: embeddings"
          " must be floating point, since the loss's gradient flows back through them."
      )


def _embed(embed_fn, options, call, args, kwargs, devices) -> Any:
  """Pass 1: every chunk embedded, forward only; this device's rows in batch order."""

  def body(carry, xs):
    index, chunk = xs
    embeddings = embed_fn(*_chunk_args(options, call, args, index, chunk, devices), **kwargs)
    _check_embeddings(embeddings, call.rows)
    return carry, embeddings

  batch = {n: _split(options, args[n]) for n in call.batch_argnums}
  xs = (jnp.arange(options.num_microbatches, dtype=jnp.int32), batch)
  _, stacked = jax.lax.scan(jax.named_call(body, name="accum_jax_embed"), (), xs)
  return jax.tree.map(lambda x: _batching.unsplit(x, options.split), stacked)


class _Loss(NamedTuple):
  value: jax.Array
  aux: Any
  direct: tuple[Any, ...]  # d loss / d argnums, through loss_fn's own use of them
  cotangents: Any  # d loss / d embeddings, this device's rows


def _loss(loss_fn, options, call, args, kwargs, embeddings, devices) -> _Loss:
  """The loss of the whole batch, and its gradient w.r.t. the embeddings and argnums."""
  whole = [devices.gather(arg) if n in call.batch_argnums else arg for n, arg in enumerate(args)]
  # The embeddings go in before the first batch argument: loss_fn(params, embeddings, batch).
  at = min(call.batch_argnums)
  loss_args = [*whole[:at], devices.gather(embeddings), *whole[at:]]
  diff_at = tuple(n + (n > at) for n in options.argnums) + (at,)

  def loss_of(*diff_values):
    full = list(loss_args)
    for n, value in zip(diff_at, diff_values):
      full[n] = value
    return _trace.value_and_aux(loss_fn(*full, **kwargs), options.has_aux, "loss_fn",
                               "the scalar loss of the whole batch")

  (value, aux), grads = jax.value_and_grad(
      loss_of, argnums=tuple(range(len(diff_at))), has_aux=True
  )(*(loss_args[n] for n in diff_at))
  return _Loss(value, aux, grads[:-1], devices.own_rows(grads[-1]))


def _pull_back(
    embed_fn, options, call, args, kwargs, cotangents, devices, shards
) -> _core.Accumulator:
  """Pass 2: each chunk embedded again under ``jax.vjp``, its cotangents pulled back.

  Under a plan that reduce-scatters per chunk, each chunk's gradient is
  reduce-scattered into an accumulator of this device's ``shards``.
  """
  diff = tuple(args[n] for n in options.argnums)
  scatter = devices.plan is not None and devices.plan.scatters_per_microbatch

  def body(acc, xs):
    index, chunk, cotangent = xs
    chunk_args = _chunk_args(options, call, args, index, chunk, devices)

    def embed(*diff_values):
      embed_args = list(chunk_args)
      for n, value in zip(options.argnums, diff_values):
        embed_args[n] = value
      return embed_fn(*embed_args, **kwargs)

    _, pull = jax.vjp(embed, *diff)
    grads = _across_devices.scatter(devices.plan, pull(cotangent), acc.total)
    # Every term enters the sum: dropping one would bias the gradient silently;
    # a non-finite step is judged as a whole in _finalise.
    acc, _ = _core.add(acc, grads, refuse_nonfinite=False)
    return acc, None

  xs = (
      jnp.arange(options.num_microbatches, dtype=jnp.int32),
      {n: _split(options, args[n]) for n in call.batch_argnums},
      _split(options, cotangents),
  )
  start = _core.init(shards if scatter else diff, options.accumulator_dtype, in_loop=True)
  acc, _ = jax.lax.scan(jax.named_call(body, name="accum_jax_pull_back"), start, xs)
  return acc


def _finalise(options, args, loss: _Loss, acc: _core.Accumulator, devices) -> Any:
  """The direct gradient added, the sum cast to the parameters' dtypes, judged finite.

  Every device computed the same loss, so its direct gradient is added once (a
  sharded leaf's: this device's shard of it).
  """
  direct = _across_devices.own_shards(devices.plan, loss.direct)
  acc, _ = _core.add(acc, direct, refuse_nonfinite=False)
  diff = tuple(args[n] for n in options.argnums)
  grads = _core.result(acc, diff, "sum")
  value = loss.value
  num_chunks = options.num_microbatches * devices.num
  num_skipped = jnp.zeros((), jnp.int32)
  if options.checks_finite:
    # No chunk can be dropped from a batch-coupled loss: a non-finite loss or
    # gradient makes the whole step NaN, as on the full batch, and counted.
    finite = devices.agreed(jnp.isfinite(value) & _core.all_finite(grads))
    value, grads = jax.tree.map(
        lambda x: jnp.where(finite, x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
        (value, grads),
    )
    num_skipped = jnp.where(finite, 0, num_chunks).astype(jnp.int32)
  grads = grads[0] if options.single_argnum else grads
  out = (value, loss.aux) if options.has_aux else value
  if options.return_info:
    total_weight = (num_chunks - num_skipped).astype(jnp.float32)
    return out, grads, MicrobatchInfo(num_skipped, total_weight)
  return out, grads


def _step(embed_fn, loss_fn, options, call, kwargs, args, devices) -> Any:
  """One call on one device (or one device's rows of the batch and shards of the
  parameters, gathered for both passes: XLA would hoist a gather per chunk)."""
  shards = tuple(args[n] for n in options.argnums)
  full = list(args)
  for n, x in zip(options.argnums, _across_devices.gather(devices.plan, shards)):
    full[n] = x
  embeddings = _embed(embed_fn, options, call, full, kwargs, devices)
  loss = _loss(loss_fn, options, call, full, kwargs, embeddings, devices)
  acc = _pull_back(embed_fn, options, call, full, kwargs, loss.cotangents, devices, shards)
  return _finalise(options, args, loss, devices.reduce(acc), devices)


def _data_parallel(step, args, *, batch_argnums, argnums, plan: _sharding.Plan, out_specs) -> Any:
  """``step`` on each device's rows of the batch, inside ``jax.shard_map``
  (:func:`_across_devices.map_devices`).

  The parameters enter as the plan says: replicated over the data axes, or this
  device's shard (gathered in the step, reduce-scattered back). Non-array
  leaves of the arguments stay outside ``shard_map``.
  """
  def per_device(args, shard_index):
    return step(args, _Devices(plan.axes, shard_index, plan.num_shards, plan))

  return _across_devices.map_devices(
      per_device, args, batch_argnums=batch_argnums, param_argnums=argnums, plan=plan,
      out_specs=out_specs,
  )


def _plan(options: _options.Options, call: _call.Bound) -> _sharding.Plan:
  """The call's reduction plan over the differentiated arguments as a tuple, as
  this door always holds them."""
  if not options.single_argnum:
    return call.plan
  return call.plan._replace(treedef=jax.tree_util.treedef_tuple([call.plan.treedef]))


@_arguments.takes_options(
    "cached_value_and_grad", options_of=_microbatch.value_and_grad, refused=_REFUSED
)
def cached_value_and_grad(
    embed_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    **options: Any,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` of a loss that couples the batch, embedded in chunks.

  For losses that compare each example with the others (CLIP, SigLIP, InfoNCE):
  the value and gradient of ``loss_fn(params, embed_fn(params, batch), batch)``,
  with one chunk's activations alive at a time (gradient caching): the
  embeddings of every chunk without residuals, the loss and its gradient on
  them, then each chunk's pull-back, summed in float32. See the guide:
  :doc:`/guides/contrastive`.

  Args:
    embed_fn: ``embed_fn(params, chunk, ...)``: the embeddings of one chunk of
      the batch arguments, a pytree of floating arrays with the chunk's rows first.
    loss_fn: ``loss_fn(params, embeddings, batch, ...)``: the scalar loss of the
      whole batch (``(loss, aux)`` with ``has_aux``), given every chunk's
      embeddings in batch order.
    num_microbatches: the number of chunks, an int >= 1 dividing the batch.
    **options: the options of :func:`value_and_grad` that mean something here:
      ``argnums``, ``batch_argnums``, ``has_aux``, ``rng_argnums``,
      ``accumulator_dtype``, ``on_nonfinite`` (``"propagate"`` or ``"unchecked"``),
      ``data_parallel`` and ``return_info``.

  Returns:
    A function of ``(params, batch, ...)`` returning ``(loss, grads)`` as
    ``jax.value_and_grad`` of the whole batch's loss would (and a
    :class:`MicrobatchInfo` counting chunks with ``return_info``).

  Examples:
    >>> import jax, jax.numpy as jnp, accum_jax
    >>> def embed(params, batch):
    ...   return {"a": jnp.tanh(batch["a"] @ params["wa"]), "b": batch["b"] @ params["wb"]}
    >>> def clip_loss(params, emb, batch):
    ...   logits = jnp.exp(params["t"]) * emb["a"] @ emb["b"].T
    ...   return -jnp.mean(jnp.diag(jax.nn.log_softmax(logits)))
    >>> params = {"wa": jnp.eye(3), "wb": jnp.eye(3) / 2, "t": jnp.zeros(())}
    >>> batch = {"a": jnp.sin(jnp.arange(24.0)).reshape(8, 3),
    ...          "b": jnp.cos(jnp.arange(24.0)).reshape(8, 3)}
    >>> vg = jax.jit(accum_jax.cached_value_and_grad(embed, clip_loss, num_microbatches=4))
    >>> loss, grads = vg(params, batch)
    >>> full = jax.grad(lambda p, b: clip_loss(p, embed(p, b), b))(params, batch)
    >>> bool(jnp.allclose(grads["t"], full["t"]))
    True
  """
  parsed = _options.make(
      num_microbatches, caller="cached_value_and_grad", refused=_REFUSED, **options
  )
  if parsed.on_nonfinite == "skip_microbatch":
    raise ValueError(
        "cached_value_and_grad does not take on_nonfinite='skip_microbatch': no chunk of a"
        " batch-coupled loss can be left out. Pass 'propagate' (the default) or 'unchecked'."
    )

  def wrapped(*args, **kwargs):
    call = _call.bind(parsed, args, kwargs)
    step = functools.partial(_step, embed_fn, loss_fn, parsed, call, kwargs)
    if call.mesh is None:
      return step(args, _ONE_DEVICE)
    plan = _plan(parsed, call)
    grad_specs = _across_devices.grad_specs(plan)
    out_specs = (P(), grad_specs[0] if parsed.single_argnum else grad_specs)
    return _data_parallel(
        step, args, batch_argnums=call.batch_argnums, argnums=parsed.argnums, plan=plan,
        out_specs=out_specs + ((P(),) if parsed.return_info else ()),
    )

  return wrapped
