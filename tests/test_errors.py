"""The errors reference of the documentation, checked against the code.

Each row of the table between the ``errors-table`` markers in docs/errors.md is keyed
by its "when" cell: ``TRIGGERS`` holds a call that must raise a ``ValueError`` whose
message contains the row's excerpt verbatim, ``BEHAVIOURS`` a check for the rows
marked "(no error)". A row without an entry, or an entry without a row, fails: the
docs and the code cannot drift apart. The row's "test" cell is its test id here
(``pytest tests/test_errors.py -k <id>``).
"""

from __future__ import annotations

import importlib
import inspect
import pydoc
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
import accum_jax.privacy

ERRORS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def _host_update(**kwargs):
  opt = accum_jax.accumulate(optax.sgd(1.0), 2)
  params = {"w": jnp.ones(2)}
  return opt.update(params, opt.init(params), params, **kwargs)
NO_ERROR = "(no error)"


class Row(NamedTuple):
  raised_by: str
  when: str
  message: str  # the excerpt, without its backticks
  fix: str
  test_id: str


def _cells(line: str) -> list[str]:
  cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
  return [cell.strip().replace(r"\|", "|") for cell in cells]


def table_rows() -> list[Row]:
  text = ERRORS_PAGE.read_text()
  section = re.search(r"<!-- errors-table -->(.*?)<!-- /errors-table -->", text, re.DOTALL)
  assert section, "docs/errors.md has no errors-table section"
  lines = [line for line in section.group(1).splitlines() if line.startswith("|")]
  header, rule, *body = lines
  assert _cells(header) == ["raised by", "when", "message (excerpt)", "fix", "test"], header
  assert set(rule) <= set("|-: "), rule
  rows = []
  for line in body:
    cells = _cells(line)
    assert len(cells) == 5, f"a row needs 5 cells: {line}"
    message = cells[2]
    if not message.startswith(NO_ERROR):
      assert message.startswith("`") and message.endswith("`"), f"quote the excerpt: {line}"
      message = message[1:-1]
    test_id = cells[4].strip("`")
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", test_id), f"a test id is a-z, 0-9, -: {line}"
    rows.append(Row(cells[0], cells[1], message, cells[3], test_id))
  return rows


ROWS = table_rows()


def _loss(w, batch):
  return jnp.mean((batch @ w) ** 2)


W = jnp.ones(3)


def _mesh(shape=(8,), axes=("data",)):
  return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _vg(num_microbatches=2, **options):
  return accum_jax.value_and_grad(_loss, num_microbatches, **options)


def _fsdp(dtype=jnp.float32, **options):
  """A weight of 8 sharded over the data axis of a mesh of 8 (FSDP), a batch of 16."""
  dp = {"mesh": _mesh(), "data_axis": "data", "param_sharding": P("data"), **options.pop("dp", {})}
  vg = _vg(data_parallel=accum_jax.DataParallel(**dp), **options)
  return vg(jnp.ones(8, dtype), jnp.ones((16, 8), dtype))


def _plan(batch=None, **options):
  batch = jnp.ones((8, 3)) if batch is None else batch
  options.setdefault("memory_budget_bytes", 2**30)
  return accum_jax.diagnostics.plan_microbatches(_loss, W, batch, **options)


class _FullDevice:
  """A device whose memory is all in use."""

  platform = "fake"

  def memory_stats(self):
    return {"bytes_limit": 100, "bytes_in_use": 100}


def _plan_on_a_full_device():
  with mock.patch("jax.devices", return_value=[_FullDevice()]):
    _plan(memory_budget_bytes=None)


def _plan_without_memory_analysis():
  with mock.patch.object(jax.stages.Compiled, "memory_analysis", return_value=None):
    _plan()


def _noise_before_accumulate():
  """DP-SGD's noise chained before accumulate: it would run on every call."""
  return optax.chain(accum_jax.privacy.add_gaussian_noise(1.0, 0),
                     accum_jax.accumulate(optax.sgd(0.1), 2, reduction="sum"))


def _sgd_update(grads, *, weight=None, every_k=2):
  opt = accum_jax.accumulate(optax.sgd(0.1), every_k=every_k)
  params = {"w": W}
  return opt.update(grads, opt.init(params), params, weight=weight)


def _stats_door(fun, stats_loss=lambda s: jnp.sum(s), **options):
  """stats_value_and_grad on a batch of 8 rows in 2 microbatches of 4."""
  return accum_jax.stats_value_and_grad(fun, stats_loss, 2, **options)(W, jnp.ones((8, 3)))


def _loss_and_mean(w, batch):
  return _loss(w, batch), jnp.mean(batch @ w, keepdims=True)


TRIGGERS: dict[str, Callable[[], object]] = {
    "`on_nonfinite` is a value accumulate does not take": lambda: accum_jax.accumulate(
        optax.sgd(1.0), 2, on_nonfinite="propagate"),
    "`skip_nonfinite=` (renamed `on_nonfinite=`)": lambda: accum_jax.accumulate(
        optax.sgd(1.0), 2, skip_nonfinite="window"),
    "`weight=` given": lambda: accum_jax.MultiSteps(optax.sgd(1.0), 2).update(
        {"w": W}, accum_jax.MultiSteps(optax.sgd(1.0), 2).init({"w": W}), weight=1.0),
    "`layout='flat'` (removed)": lambda: accum_jax.accumulate(optax.sgd(1.0), 2, layout="flat"),
    "`pack_inner_state=` (replaced by `layout=`)": lambda: accum_jax.accumulate(
        optax.sgd(1.0), 2, pack_inner_state=True),
    "`layout='packed'` with a parameter sharded over devices": lambda: accum_jax.accumulate(
        optax.sgd(1.0), 2, layout="packed").init(
            {"w": jax.device_put(jnp.ones(8), NamedSharding(_mesh(), P("data")))}),
    "a keyword of `update` is a misspelling of `apply`, `flush` or `weight`": lambda: _host_update(
        aplly=True),
    "the state was made by an `accumulate` with another `every_k`": lambda: (
        accum_jax.accumulate(optax.sgd(1.0), 2).update(
            {"w": jnp.ones(2)}, accum_jax.accumulate(optax.sgd(1.0), 4).init({"w": jnp.ones(2)}))),
    "`apply` is not a Python bool (a traced or array value)": lambda: _host_update(
        apply=jnp.array(True)),
    "`apply` given with `flush=True`": lambda: _host_update(apply=False, flush=True),
    "the state's `accumulate` has a `noise_scale_every_k` schedule": lambda: accum_jax.HostSchedule(
        accum_jax.accumulate(optax.sgd(1.0), accum_jax.noise.noise_scale_every_k(8, k_max=4))
        .init({"w": jnp.ones(2)})),
    "`has_aux=True` and `fun` returns a loss alone": lambda: accum_jax.value_and_grad(
        _loss, 2, has_aux=True)(W, jnp.ones((4, 3))),
    "`fun` returns a tuple without `has_aux=True`": lambda: accum_jax.value_and_grad(
        lambda w, b: (_loss(w, b), b), 2)(W, jnp.ones((4, 3))),
    "with `state_argnums`, `fun`'s aux is not `(new_state, aux)`": lambda: accum_jax.value_and_grad(
        lambda w, s, b: (_loss(w, b), s), 2, has_aux=True, state_argnums=1, batch_argnums=2)(
            W, jnp.zeros(2), jnp.ones((4, 3))),
    "the new state's leaves differ in shape or dtype from the state passed in": lambda: (
        accum_jax.value_and_grad(lambda w, s, b: (_loss(w, b), (s[:1], ())), 2, has_aux=True,
                                 state_argnums=1, batch_argnums=2)(
            W, jnp.zeros(2), jnp.ones((4, 3)))),
    "the new state's tree differs from the state passed in": lambda: accum_jax.value_and_grad(
        lambda w, s, b: (_loss(w, b), ({"s": s}, ())), 2, has_aux=True, state_argnums=1,
        batch_argnums=2)(W, jnp.zeros(2), jnp.ones((4, 3))),
    "an `aux_reduction` mapping names a key the aux does not have": lambda: (
        accum_jax.value_and_grad(lambda w, b: (_loss(w, b), {"total": 0.0}), 2, has_aux=True,
                                 aux_reduction={"totl": "sum"})(W, jnp.ones((4, 3)))),
    "`gradient_dtype` is not a floating dtype": lambda: _vg(gradient_dtype=jnp.int32),
    "`on_nonfinite` is unknown": lambda: _vg(on_nonfinite="batch"),
    "`aux_reduction='concat'` and an aux leaf has no leading axis of the microbatch's rows": (
        lambda: accum_jax.value_and_grad(
            lambda w, b: (_loss(w, b), jnp.ones(3)), 2, has_aux=True, aux_reduction="concat"
        )(W, jnp.ones((4, 3)))),
    "an aux leaf at the default reduction depends on the microbatch's size": lambda: (
        accum_jax.value_and_grad(lambda w, b: (_loss(w, b), {"rows": b @ w}), 2, has_aux=True)(
            W, jnp.ones((4, 3)))),
    "a differentiated argument holds a non-array (an Equinox module's function)": lambda: (
        accum_jax.value_and_grad(lambda m, b: _loss(m["w"], b), 2)(
            {"w": W, "act": jnp.tanh}, jnp.ones((4, 3)))),
    "`gradient_noise=True` without `return_info=True`": lambda: _vg(gradient_noise=True),
    "`value` is not a scalar": lambda: accum_jax.accumulate(optax.sgd(0.1), every_k=2).update(
        {"w": W}, accum_jax.accumulate(optax.sgd(0.1), every_k=2).init({"w": W}), {"w": W},
        value=jnp.ones(2)),
    "`flush` is not a bool": lambda: accum_jax.accumulate(optax.sgd(0.1), every_k=2).update(
        {"w": W}, accum_jax.accumulate(optax.sgd(0.1), every_k=2).init({"w": W}), flush=0.5),
    "`boundaries` is not a mapping (a list of pairs)": lambda: accum_jax.piecewise_every_k(
        [(0, 2)]),
    "`k_min` is below 2 or above `k_max`": lambda: accum_jax.noise.noise_scale_every_k(
        8, k_min=1, k_max=4),
    "the `accumulate` state does not measure the noise": lambda: accum_jax.noise.last_window(
        accum_jax.accumulate(optax.sgd(0.1), every_k=2).init({"w": W})),
    "`every_k` is below 1": lambda: accum_jax.accumulate(optax.sgd(1.0), every_k=0),
    "`every_k` is not an int (a float, a bool)": lambda: accum_jax.accumulate(
        optax.sgd(1.0), every_k=2.0
    ),
    "`every_k_schedule` is below 1 or not an int": lambda: accum_jax.MultiSteps(
        optax.sgd(1.0), every_k_schedule=0
    ),
    "`reduction` is unknown (a string, or one at a leaf of a pytree)": lambda: accum_jax.accumulate(
        optax.sgd(1.0), every_k=2, reduction="avg"
    ),
    "`accumulator_dtype` is an integer dtype": lambda: accum_jax.accumulate(
        optax.sgd(1.0), every_k=2, accumulator_dtype=jnp.int32
    ),
    "`accumulator_dtype` is not a dtype at all": lambda: accum_jax.MultiSteps(
        optax.sgd(1.0), every_k_schedule=2, accumulator_dtype="fast"
    ),
    "`boundaries` is empty": lambda: accum_jax.piecewise_every_k({}),
    "a key of `boundaries` is not an int >= 0": lambda: accum_jax.piecewise_every_k({-1: 2}),
    "a value of `boundaries` is below 1 or not an int": lambda: accum_jax.piecewise_every_k(
        {0: 1, 10: 0}
    ),
    "the gradients' tree differs from the parameters' given to `init`": lambda: _sgd_update(
        {"v": W}
    ),
    "a gradient's shape differs from its parameter's": lambda: _sgd_update({"w": jnp.ones(2)}),
    "`weight` is not a scalar": lambda: _sgd_update({"w": W}, weight=jnp.ones(2)),
    "a concrete (not traced) `weight` is negative, NaN or infinite": lambda: _sgd_update(
        {"w": W}, weight=-1.0
    ),
    "the state holds no `accumulate` state": lambda: accum_jax.has_updated(
        optax.sgd(1.0).init(W)
    ),
    "the state holds several `accumulate` states": lambda: accum_jax.optimizer_step(
        [accum_jax.accumulate(optax.sgd(1.0), 2).init(W)] * 2
    ),
    "`flush` is not a scalar": lambda: accum_jax.accumulate(optax.sgd(1.0), 2).update(
        W, accum_jax.accumulate(optax.sgd(1.0), 2).init(W), flush=jnp.array([True, False])
    ),
    "`num_microbatches` is below 1": lambda: _vg(0),
    "`num_microbatches` is not an int": lambda: accum_jax.grad(_loss, 2.0),
    "an `argnums`-like option is negative or not an int": lambda: _vg(batch_argnums=-1),
    "`argnums=()`": lambda: _vg(argnums=()),
    "`batch_argnums=()`": lambda: _vg(batch_argnums=()),
    "`batch_argnums=None` does not say which arguments are the batch": lambda: _vg(
        batch_argnums=None),
    "`state_argnums` names more than one argument": lambda: _vg(state_argnums=(2, 3)),
    "one argument has two roles (e.g. in `argnums` and `batch_argnums`)": lambda: _vg(
        argnums=1, batch_argnums=1
    ),
    "`aux_reduction` is unknown (a string, or one at a leaf of a pytree)": lambda: _vg(
        aux_reduction="median"
    ),
    "`reduction` is unknown inside a step (a string, or one at a leaf of a pytree)": lambda: _vg(
        reduction="avg"
    ),
    "a `reduction` callable returns an unknown value": lambda: _vg(
        reduction=lambda path, leaf: "maximum"
    )(W, jnp.ones((4, 3))),
    "`reduction` (or `aux_reduction`) is a pytree that is not a prefix of the gradient"
    " (the aux)": lambda: _vg(reduction={"w": "max"})(W, jnp.ones((4, 3))),
    "`reduction` gives `'max'` to a complex leaf": lambda: _vg(reduction="max")(
        W.astype(jnp.complex64), jnp.ones((4, 3))
    ),
    "a `'max'` or `'last'` leaf is sharded over a data axis": lambda: accum_jax.value_and_grad(
        _loss, 1,
            data_parallel=accum_jax.DataParallel(
                mesh=_mesh(), param_sharding=jax.sharding.PartitionSpec("data")),
        reduction="last",
    )(jnp.ones(8), jnp.ones((8, 8))),
    "`split` is unknown": lambda: _vg(data_parallel=accum_jax.DataParallel(split="rows")),
    "an option that was renamed or grouped (`grad_reduction`, `pad_batch`, `mesh`, `split`, ...)": (
        lambda: accum_jax.grad(_loss, 2, mesh=_mesh())),
    "a misspelt option (`num_micro_batches`)": lambda: accum_jax.grad(_loss, num_micro_batches=2),
    "an unknown option": lambda: accum_jax.grad(_loss, 2, bogus=2),
    "`state_argnums` without `has_aux=True`": lambda: _vg(state_argnums=2),
    "an `argnums`-like option names an argument that was not passed": lambda: _vg(argnums=2)(
        W, jnp.ones((4, 3))
    ),
    "an `rng_argnums` argument is not a PRNG key": lambda: _vg(rng_argnums=2)(
        W, jnp.ones((4, 3)), 0
    ),
    "a batch argument has a leaf without a batch axis": lambda: _vg(batch_argnums=1)(
        W, jnp.float32(1.0)
    ),
    "the batch arguments hold no arrays": lambda: _vg(batch_argnums=1)(W, {}),
    "batch leaves have different leading (batch) sizes": lambda: _vg(batch_argnums=(1, 2))(
        W, jnp.ones((4, 3)), jnp.ones(6)
    ),
    "the batch does not split into `num_microbatches`": lambda: _vg(4)(W, jnp.ones((10, 3))),
    "the batch does not split into `num_microbatches` on each device": lambda: _vg(
        4, data_parallel=accum_jax.DataParallel(mesh=_mesh())
    )(W, jnp.ones((16, 3))),
    "`weight_fn` returns a non-scalar": lambda: _vg(weight_fn=lambda batch: batch[:, 0])(
        W, jnp.ones((4, 3))
    ),
    "`fun` returns a loss that is not a scalar": lambda: accum_jax.value_and_grad(
        lambda w, batch: (batch @ w) ** 2, 2
    )(W, jnp.ones((4, 3))),
    "`data_axis` is given and there is no mesh": lambda: _vg(
        data_parallel=accum_jax.DataParallel(data_axis="data"))(
        W, jnp.ones((16, 3))
    ),
    "the mesh has several axes and `data_axis` is not given": lambda: _vg(
        data_parallel=accum_jax.DataParallel(mesh=_mesh((4, 2), ("data", "model")))
    )(W, jnp.ones((16, 3))),
    "`data_axis` is not an axis of the mesh": lambda: _vg(
        data_parallel=accum_jax.DataParallel(mesh=_mesh(), data_axis="batch"))(
        W, jnp.ones((16, 3))
    ),
    "`aux_reduction='stack'`": lambda: _vg(
        data_parallel=accum_jax.DataParallel(mesh=_mesh()), aux_reduction="stack"),
    "`gather` is unknown": lambda: _vg(
        data_parallel=accum_jax.DataParallel(mesh=_mesh(), gather="twice")),
    "`gather_dtype` or `reduce_dtype` is not a floating dtype": lambda: _vg(
        data_parallel=accum_jax.DataParallel(mesh=_mesh(), reduce_dtype=jnp.int8)),
    "`param_sharding`, `gather`, `gather_dtype` or `reduce_dtype` is given without a mesh": (
        lambda: _vg(data_parallel=accum_jax.DataParallel(gather="once"))),
    "`data_axis` names an axis twice": lambda: _vg(
        data_parallel=accum_jax.DataParallel(
            mesh=_mesh((2, 4), ("replica", "fsdp")), data_axis=("fsdp", "fsdp")))(
            W, jnp.ones((16, 3))),
    "`param_sharding` does not match the differentiated arguments": lambda: _fsdp(
        dp=dict(param_sharding={"w": P("data")})),
    "a parameter dimension is sharded over a data axis and another axis together": lambda: (
        _fsdp(dp=dict(mesh=_mesh((4, 2), ("data", "model")), param_sharding=P(("data", "model"))))),
    "a narrow `accumulator_dtype` with parameters sharded over a data axis and"
    " `gather='per_microbatch'`": lambda: _fsdp(jnp.bfloat16, accumulator_dtype=None),
    "the batch does not split over the devices of `data_axis`": lambda: _vg(2,
        data_parallel=accum_jax.DataParallel(mesh=_mesh()))(
        W, jnp.ones((12, 3))
    ),
    "`num_microbatches` is among the options": lambda: _plan(num_microbatches=2),
    "`memory_budget_bytes` is not a positive number": lambda: _plan(memory_budget_bytes=0),
    "`memory_budget_bytes=None` and the device reports no memory limit (CPU)": lambda: _plan(
        memory_budget_bytes=None
    ),
    "`memory_budget_bytes=None` and the device has no free memory": _plan_on_a_full_device,
    "the backend gives no memory analysis of compiled programs": _plan_without_memory_analysis,
    "`batch_argnums` names an argument that was not given to plan with": lambda: (
        accum_jax.diagnostics.plan_microbatches(
            _loss, W, memory_budget_bytes=2**30, batch_argnums=1)
    ),
    "the batch does not split over the devices of the data axis": lambda: _plan(
        jnp.ones((12, 3)), data_parallel=accum_jax.DataParallel(_mesh())
    ),
    "`candidates` is not an iterable": lambda: _plan(candidates=3),
    "`candidates` is empty": lambda: _plan(candidates=[]),
    "a candidate is not an int >= 1": lambda: _plan(candidates=[0, 2]),
    "a candidate does not divide the (per-device) batch size": lambda: _plan(candidates=[3]),
    "no candidate fits the budget": lambda: _plan(memory_budget_bytes=1),
    "`rtol` or `atol` is negative or not finite": lambda: accum_jax.diagnostics.check_parity(
        _loss, W, jnp.ones((4, 3)), num_microbatches=2, atol=-1.0
    ),
    "`optax.contrib.differentially_private_aggregate` is in the inner optimizer of `accumulate`": (
        lambda: accum_jax.privacy.accumulate_private(
            optax.chain(optax.contrib.differentially_private_aggregate(1.0, 1.0, key=0),
                        optax.sgd(0.1)),
            l2_clip=1.0, noise_multiplier=1.0, expected_batch_size=8, key=0,
        ).init({"w": W})),
    "it is given `flush` or `weight`: it sits before `accumulate` in an `optax.chain`": lambda: (
        _noise_before_accumulate().update(
            {"w": W}, _noise_before_accumulate().init({"w": W}), flush=True)),
    "an `add_gaussian_noise` (or optax DP aggregate) state sits outside the `accumulate` state": (
        lambda: accum_jax.privacy.check_state(_noise_before_accumulate().init({"w": W}))),
    "`add_gaussian_noise` is inside `accumulate` with a `reduction` other than `'sum'`": lambda: (
        accum_jax.privacy.check_inner(
            accum_jax.accumulate(optax.chain(accum_jax.privacy.add_gaussian_noise(1.0, 0),
                                             optax.sgd(0.1)), 2).init({"w": W}).inner_opt_state,
            "mean")),
    "`l2_clip` or `expected_batch_size` is not a positive number, or `stddev` or"
    " `noise_multiplier` is negative": lambda: accum_jax.privacy.dp_aggregate(
        l2_clip=1.0, noise_multiplier=1.0, expected_batch_size=0, key=0),
    "`key` is not one PRNG key (a batch of keys)": lambda: accum_jax.privacy.add_gaussian_noise(
        1.0, jax.random.split(jax.random.key(0), 2)),
    "`mask` does not have one entry per example": lambda: accum_jax.privacy.clipped_grad_sum(
        _loss, 1.0)(W, jnp.ones((4, 3)), jnp.ones(3)),
    "the batch holds no arrays, or a scalar": lambda: accum_jax.privacy.clipped_grad_sum(
        _loss, 1.0)(W, {}),
    "`sampling_rate` is above 1": lambda: accum_jax.privacy.poisson_batches(
        np.random.default_rng(0), 10, sampling_rate=1.5, physical_batch_size=2),
    "`dataset_size` or `physical_batch_size` is not an int >= 1": lambda: (
        accum_jax.privacy.poisson_batches(
            np.random.default_rng(0), 10, sampling_rate=0.5, physical_batch_size=0)),
    "`fun` does not return a pair `(loss, stats)`": lambda: _stats_door(_loss),
    "a statistic is not a floating array (a count)": lambda: _stats_door(
        lambda w, b: (_loss(w, b), jnp.int32(3))),
    "a statistic's shape depends on the microbatch's size (per-token values left unreduced)":
        lambda: _stats_door(lambda w, b: (_loss(w, b), b @ w)),
    "`stats_loss` does not return a scalar": lambda: _stats_door(
        _loss_and_mean, stats_loss=lambda s: s * 2),
    "`state_argnums`, `gradient_noise` or `reduction` is given": lambda: _stats_door(
        _loss_and_mean, state_argnums=1),
}


def check_traced_bad_weights_are_skipped_and_counted() -> None:
  opt = accum_jax.accumulate(optax.sgd(0.1), every_k=2)
  params = {"w": W}
  update = jax.jit(opt.update)
  _, state = update({"w": W}, opt.init(params), params, weight=jnp.float32(2.0))
  for skipped, weight in enumerate((-1.0, np.nan, np.inf), start=1):
    updates, new_state = update({"w": W}, state, params, weight=jnp.float32(weight))
    assert int(new_state.num_bad_weights) == skipped and int(new_state.num_skipped) == 0
    assert not bool(accum_jax.has_updated(new_state))
    np.testing.assert_array_equal(updates["w"], 0.0)
    # The window holds what it held: one call, of weight 2.
    assert int(new_state.mini_step) == 1
    assert float(new_state.window_weight) == 2.0
    tree_allclose(new_state.acc_grads, {"w": W})  # its mean
    state = new_state


def check_an_unweighted_call_counts_weight_one() -> None:
  opt = accum_jax.accumulate(optax.sgd(0.1), every_k=2)
  params = {"w": W}
  g1, g2 = {"w": jnp.array([1.0, 2.0, 3.0])}, {"w": jnp.array([5.0, -1.0, 0.0])}
  for update in (opt.update, jax.jit(opt.update)):
    _, state = update(g1, opt.init(params), params, weight=jnp.float32(3.0))
    updates, state = update(g2, state, params)
    assert bool(accum_jax.has_updated(state))
    tree_allclose(updates, {"w": -0.1 * (3.0 * g1["w"] + g2["w"]) / 4.0})


def check_unseen_shardings_warn_and_count_as_replicated() -> None:
  # A weight sharded over the data axis (FSDP), automatic axes, under jax.jit.
  mesh = _mesh()
  w = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))
  batch = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))
  with pytest.warns(accum_jax.UnknownShardingWarning) as caught:
    _, grads = jax.jit(_vg(
        data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis="data")))(w, batch)
  assert len(caught) == 1, [str(c.message) for c in caught]
  message = str(caught[0].message)
  for part in ("accum_jax cannot see how the differentiated leaf is sharded",
               "taken as replicated over the data axes ('data',)",
               "a full-size float32 accumulator",
               "param_sharding=P() for replicated parameters",
               "AxisType.Explicit", "call the step eagerly"):
    assert part in message, (part, message)
  assert grads.sharding.is_fully_replicated
  # Said how it is sharded, it does not warn, and the gradient is sharded like it.
  with warnings.catch_warnings():
    warnings.simplefilter("error", accum_jax.UnknownShardingWarning)
    _, grads = jax.jit(_vg(
        data_parallel=accum_jax.DataParallel(
            mesh=mesh, data_axis="data", param_sharding=P("data"))))(w, batch)
  assert grads.sharding.is_equivalent_to(w.sharding, 1)


BEHAVIOURS: dict[str, Callable[[], None]] = {
    "`param_sharding` names no sharding and a parameter's cannot be seen (`jax.jit` with"
    " automatic mesh axes)": check_unseen_shardings_warn_and_count_as_replicated,
    "a traced `weight` is negative, NaN or infinite": (
        check_traced_bad_weights_are_skipped_and_counted
    ),
    "weighted and unweighted calls are mixed in one window": (
        check_an_unweighted_call_counts_weight_one
    ),
}


def test_the_table_rows_are_unique_and_cover_the_required_cases():
  whens = [row.when for row in ROWS]
  assert len(whens) == len(set(whens)), "two rows have the same 'when'"
  test_ids = [row.test_id for row in ROWS]
  assert len(test_ids) == len(set(test_ids)), "two rows have the same test id"
  messages = " ".join(row.message for row in ROWS)
  for required in (
      "every_k=0 must be an int >= 1",
      "num_microbatches=2.0 must be an int >= 1",
      "does not split into num_microbatches",
      "different leading (batch) sizes",
      "differs from the parameters' given to init",
      "is not a floating dtype",
      "must be a finite number >= 0",
      "weight must be a scalar",
      "which is not a PRNG key or a pytree of them",
      "a call without `weight` counts weight 1",
      "fits memory_budget_bytes",
  ):
    assert required in messages, f"the errors table of docs/errors.md lacks {required!r}"


def test_every_trigger_and_check_has_a_row_in_the_table():
  whens = {row.when for row in ROWS}
  assert set(TRIGGERS) - whens == set(), "stale triggers: their rows are gone"
  assert set(BEHAVIOURS) - whens == set(), "stale checks: their rows are gone"


@pytest.mark.parametrize("row", [pytest.param(row, id=row.test_id) for row in ROWS])
def test_each_row_is_raised_with_its_message_or_behaves_as_it_says(row: Row):
  if row.message.startswith(NO_ERROR):
    assert row.when in BEHAVIOURS, f"no check in BEHAVIOURS for the row {row.when!r}"
    BEHAVIOURS[row.when]()
    return
  assert row.when in TRIGGERS, f"no trigger in TRIGGERS for the row {row.when!r}"
  with pytest.raises(ValueError) as raised:
    TRIGGERS[row.when]()
  assert row.message in str(raised.value)


def test_no_fitting_candidate_raises_a_memory_budget_error_with_the_estimates():
  with pytest.raises(accum_jax.diagnostics.MemoryBudgetError) as raised:
    _plan(memory_budget_bytes=1)
  assert raised.value.memory_budget_bytes == 1
  assert raised.value.estimates and all(e > 1 for e in raised.value.estimates.values())


def test_a_concrete_weight_that_is_nan_or_infinite_raises_like_a_negative_one():
  # Under jit such weights are skipped and counted; a concrete one is refused at the call.
  for weight, shown in ((float("nan"), "nan"), (float("inf"), "inf"), (-np.inf, "-inf")):
    with pytest.raises(ValueError, match=re.escape(f"weight={shown} must be a finite number")):
      _sgd_update({"w": W}, weight=weight)


def test_rng_argnums_naming_the_batch_is_refused_as_a_second_role_of_argument_1():
  # batch_argnums=1 is the default: argument 1 is the batch unless said otherwise,
  # so a key there clashes with it when the step is built, before it is called.
  with pytest.raises(ValueError, match="^" + re.escape(
      "batch_argnums=(1,) and rng_argnums=(1,) both name argument(s) [1]: each argument has"
      " one role.")):
    _vg(rng_argnums=1)


def test_state_argnums_naming_the_batch_is_refused_as_a_second_role_of_argument_1():
  with pytest.raises(ValueError, match="^" + re.escape(
      "batch_argnums=(1,) and state_argnums=(1,) both name argument(s) [1]: each argument has"
      " one role.")):
    accum_jax.value_and_grad(lambda w, s: (_loss(w, s), (s, ())), 2, has_aux=True,
                             state_argnums=1)


def test_an_aux_leaf_sized_by_the_rows_at_the_default_reduction_is_refused_naming_concat():
  # Traced under jax.jit: the check is made on shapes, when the step is traced.
  def loss(w, b):
    return _loss(w, b), {"metrics": {"rows": b @ w}, "mean": jnp.mean(b)}

  step = jax.jit(accum_jax.value_and_grad(loss, 2, has_aux=True))
  with pytest.raises(ValueError, match="^" + re.escape(
      "The aux leaf ['metrics']['rows'] has shape (2,) on a microbatch of 2 rows but (4,) on"
      " the whole batch: its shape depends on the microbatches, so the default reduction"
      " ('mean') would make what the step returns change with num_microbatches. Say how it"
      " combines: aux_reduction='concat' returns it in batch order")):
    step(W, jnp.ones((4, 3)))
  # Named, it comes back whole, in batch order.
  batch = jnp.arange(12.0).reshape(4, 3)
  _, aux = jax.jit(accum_jax.value_and_grad(
      loss, 2, has_aux=True, aux_reduction={"metrics": {"rows": "concat"}}))(W, batch)[0]
  np.testing.assert_allclose(aux["metrics"]["rows"], batch @ W)
  np.testing.assert_allclose(aux["mean"], jnp.mean(batch))


def test_a_loss_that_is_not_a_scalar_gets_the_value_error_of_accum_jax_not_jax_type_error():
  # accum_jax checks the loss's shape before jax.value_and_grad refuses it with a
  # TypeError that does not say what to do; under a mesh too.
  def per_example_loss(w, batch):
    return (batch @ w) ** 2

  for options in ({}, {"data_parallel": accum_jax.DataParallel(_mesh())}):
    with pytest.raises(ValueError, match=re.escape("fun must return a scalar loss")):
      accum_jax.value_and_grad(per_example_loss, 2, **options)(W, jnp.ones((16, 3)))


# ---------------------------------------------------------------------------
# Keywords: every inside-step function shows the options it takes, and answers a
# retired or misspelt one with the fix (when it is built: nothing is traced).

INSIDE_STEP = {
    "value_and_grad": lambda *n, **o: accum_jax.value_and_grad(_loss, *n, **o),
    "grad": lambda *n, **o: accum_jax.grad(_loss, *n, **o),
    "cached_value_and_grad": lambda *n, **o: accum_jax.cached_value_and_grad(
        lambda w, b: b * w, lambda w, e, b: jnp.sum(e), *n, **o),
    "stats_value_and_grad": lambda *n, **o: accum_jax.stats_value_and_grad(
        lambda w, b: (_loss(w, b), jnp.mean(b)), jnp.sum, *n, **o),
    "nnx_value_and_grad": lambda *n, **o: accum_jax.flax.nnx_value_and_grad(
        lambda m, x: jnp.sum(x), *n, **o),
    "nnx_grad": lambda *n, **o: accum_jax.flax.nnx_grad(lambda m, x: jnp.sum(x), *n, **o),
    "filter_value_and_grad": lambda *n, **o: accum_jax.equinox.filter_value_and_grad(
        lambda m, x: jnp.sum(x), *n, **o),
    "filter_grad": lambda *n, **o: accum_jax.equinox.filter_grad(
        lambda m, x: jnp.sum(x), *n, **o),
}

# The options of value_and_grad that each leaves out, refusing them with the reason.
LEFT_OUT = {
    "value_and_grad": set(),
    "grad": set(),
    "cached_value_and_grad": {"weight_fn", "state_argnums", "aux_reduction", "gradient_noise",
                              "reduction", "gradient_dtype"},
    "stats_value_and_grad": {"state_argnums", "gradient_noise", "reduction"},
    "nnx_value_and_grad": {"state_argnums"},
    "nnx_grad": {"state_argnums"},
    "filter_value_and_grad": {"argnums", "state_argnums"},
    "filter_grad": {"argnums", "state_argnums"},
}

# A keyword each might be given, with the message's words after the function's name.
KEYWORDS = {
    "grad_reduction": ({"grad_reduction": "sum"},
                       "takes no grad_reduction=: pass reduction='sum' instead"),
    "mesh": ({"mesh": "mesh"}, "takes no mesh=: pass data_parallel=accum_jax.DataParallel(mesh="),
    "mesh and data_axis": (
        {"mesh": "mesh", "data_axis": "data"},
        "takes no mesh= or data_axis=: pass"
        " data_parallel=accum_jax.DataParallel(mesh=..., data_axis='data')"),
    "split": ({"split": "strided"},
              "takes no split=: pass data_parallel=accum_jax.DataParallel(split='strided'): the"
              " order of rows in the microbatches, with or without a mesh"),
    "pad_batch": ({"pad_batch": True},
                  "takes no pad_batch=: pad the batch to a multiple of num_microbatches yourself"),
    "num_micro_batches": ({"num_micro_batches": 4},
                          "got an unknown option num_micro_batches=4: did you mean"
                          " num_microbatches=4?"),
}


def _inside_step_function(name):
  """The public function ``name``, its framework's module imported (skipped where the
  framework is not installed, as on the oldest-versions job)."""
  framework = {"nnx": "flax", "filter": "equinox"}.get(name.split("_")[0])
  if framework is None:
    return getattr(accum_jax, name)
  pytest.importorskip(framework)
  return getattr(importlib.import_module(f"accum_jax.{framework}"), name)


@pytest.mark.parametrize("keyword", list(KEYWORDS))
@pytest.mark.parametrize("door", list(INSIDE_STEP))
def test_a_retired_or_misspelt_keyword_is_answered_with_the_fix(door, keyword):
  _inside_step_function(door)  # imports its module
  given, expected = KEYWORDS[keyword]
  given = {name: _mesh() if value == "mesh" else value for name, value in given.items()}
  if keyword == "grad_reduction" and "reduction" in LEFT_OUT[door]:
    expected = "takes no grad_reduction= (now reduction=), nor reduction=: "
  # The misspelt one stands for num_microbatches, which is not given besides.
  n = () if keyword == "num_micro_batches" else (2,)
  with pytest.raises(ValueError, match="^" + re.escape(f"{door} {expected}")):
    INSIDE_STEP[door](*n, **given)


@pytest.mark.parametrize("door", [
    pytest.param(door, marks=pytest.mark.xfail(strict=True, reason=(
        "filter_grad's signature would show rng_argnums='auto', which tests/test_api.py"
        " expects of filter_value_and_grad alone"))) if door == "filter_grad" else door
    for door in INSIDE_STEP
])
def test_each_inside_step_function_shows_value_and_grads_options_in_its_signature(door):
  fun = _inside_step_function(door)
  options = {
      name: p for name, p in inspect.signature(accum_jax.value_and_grad).parameters.items()
      if p.kind is p.KEYWORD_ONLY
  }
  parameters = inspect.signature(fun).parameters
  assert not [p for p in parameters.values() if p.kind is p.VAR_KEYWORD], parameters
  shown = {name: p for name, p in parameters.items() if name in options}
  assert set(shown) == set(options) - LEFT_OUT[door]
  for name, p in shown.items():
    assert p.kind is p.KEYWORD_ONLY, name
    if door.startswith(("nnx", "filter")) and name == "batch_argnums" and p.default is None:
      # The framework doors' own rule, as tests/test_api.py allows: None takes the
      # arguments that hold no graph node or module. value_and_grad's names the batch (1).
      continue
    default = "auto" if (door.startswith("filter"), name) == (True, "rng_argnums") else (
        options[name].default)
    assert p.default == default, (name, p.default, default)
  assert "on_nonfinite" in pydoc.render_doc(fun)  # what help() shows
  for name in LEFT_OUT[door]:
    with pytest.raises(ValueError, match="^" + re.escape(f"{door} does not take {name}=")):
      INSIDE_STEP[door](2, **{name: options[name].default})
