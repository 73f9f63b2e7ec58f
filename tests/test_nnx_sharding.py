"""The NNX door under a mesh reads Variables' sharding metadata in every form Flax takes.

The model is the JAX AI Stack miniGPT tutorial's, shrunk: an embedding and two
``nnx.Linear`` layers whose parameters carry ``nnx.with_partitioning`` metadata,
trained on a (4, 2) ``("batch", "model")`` mesh with ``nnx.Optimizer`` in an
``nnx.jit`` train step. The annotation is written as Flax accepts it: a tuple of
mesh axes, a ``PartitionSpec``, a ``NamedSharding`` (the tutorial's form), or
logical axis names with rules (per Variable, or from ``nnx.logical_axis_rules``).
Each step is compared with plain ``nnx.value_and_grad`` on one device, and each
gradient must come back sharded as its parameter is annotated.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ATOL, RTOL, tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax.flax
import accum_jax.testing

VOCAB, EMBED, HIDDEN, SEQ, BATCH = 16, 8, 16, 4, 16
NUM_MICROBATCHES = 4
STEPS = 3

# Logical names per annotated parameter, and the rules mapping them onto the mesh:
# the tutorial's tensor parallelism over "model" (the embedding split by vocabulary,
# the MLP column- then row-parallel), and the embedding dimension sharded over the
# data axis (FSDP), which only the metadata can show the door under nnx.jit.
NAMES = {
    ("embedding", "embedding"): ("vocab", "embed"),
    ("hidden", "kernel"): ("embed", "mlp"),
    ("hidden", "bias"): ("mlp",),
    ("out", "kernel"): ("mlp", "embed"),
    ("out", "bias"): ("embed",),
}
RULES = (("vocab", "model"), ("embed", "batch"), ("mlp", "model"))
FORMS = ("tuple", "PartitionSpec", "NamedSharding", "sharding_rules", "logical_axis_rules")


def _mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((4, 2), ("batch", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _axes(names: tuple[str, ...]) -> tuple[str | None, ...]:
  return tuple(dict(RULES)[name] for name in names)


def _partitioned(form: str | None, mesh: jax.sharding.Mesh) -> Callable[..., Any]:
  """``(init, names)`` to ``init`` annotated in ``form`` (None: not annotated)."""

  def partitioned(init, names):
    if form is None:
      return init
    if form == "sharding_rules":
      return nnx.with_partitioning(init, names, sharding_rules=RULES)
    if form == "logical_axis_rules":
      return nnx.with_partitioning(init, names)
    sharding = {
        "tuple": _axes(names),
        "PartitionSpec": P(*_axes(names)),
        "NamedSharding": NamedSharding(mesh, P(*_axes(names))),
    }[form]
    return nnx.with_partitioning(init, sharding)

  return partitioned


class MiniGPT(nnx.Module):
  """Token embedding, a residual MLP, LayerNorm, and logits from the tied embedding."""

  def __init__(self, partitioned: Callable[..., Any], rngs: nnx.Rngs):
    normal, xavier = nnx.initializers.normal(1.0), nnx.initializers.xavier_uniform()
    bias = nnx.initializers.normal(0.1)
    self.embedding = nnx.Embed(
        VOCAB, EMBED, embedding_init=partitioned(normal, NAMES["embedding", "embedding"]),
        rngs=rngs,
    )
    self.hidden = nnx.Linear(
        EMBED, HIDDEN, kernel_init=partitioned(xavier, NAMES["hidden", "kernel"]),
        bias_init=partitioned(bias, NAMES["hidden", "bias"]), rngs=rngs,
    )
    self.out = nnx.Linear(
        HIDDEN, EMBED, kernel_init=partitioned(xavier, NAMES["out", "kernel"]),
        bias_init=partitioned(bias, NAMES["out", "bias"]), rngs=rngs,
    )
    self.norm = nnx.LayerNorm(EMBED, rngs=rngs)  # not annotated: replicated

  def __call__(self, tokens):
    x = self.embedding(tokens)
    x = self.norm(x + self.out(nnx.relu(self.hidden(x))))
    return self.embedding.attend(x)


def loss_fn(model, batch):
  logits = model(batch[0])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
  return loss, logits


def _rules(form: str | None) -> Any:
  """Where the rules come from the context, the context; else nothing."""
  if form == "logical_axis_rules":
    return nnx.logical_axis_rules(RULES)
  return contextlib.nullcontext()


def _create(form: str | None, mesh: jax.sharding.Mesh) -> tuple[MiniGPT, nnx.Optimizer]:
  """The model and its optimizer, placed as the annotations say (on one device if none)."""

  def create():
    model = MiniGPT(_partitioned(form, mesh), nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  if form in (None, "NamedSharding"):
    # As in the tutorial: a NamedSharding carries its mesh. (Flax also refuses one
    # whose mesh is not the jax.set_mesh mesh, which is abstract there.)
    return create()
  # Flax places Variables annotated with axis names on the ambient mesh.
  with jax.set_mesh(mesh), _rules(form):
    return create()


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, (STEPS, BATCH, SEQ + 1)).astype(np.int32)
  return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train_step(grad_fn: Callable[..., Any]) -> Callable[..., Any]:
  @nnx.jit
  def train_step(model, optimizer, batch):
    (loss, _), grads = grad_fn(model, batch)
    optimizer.update(model, grads)
    return loss, grads

  return train_step


def _padded(spec: P, ndim: int) -> P:
  return P(*spec, *(None,) * (ndim - len(spec)))


def _expected_spec(path: tuple[Any, ...], ndim: int) -> P:
  """The annotation's ``PartitionSpec`` in mesh axes, replicated where there is none."""
  return _padded(P(*_axes(NAMES[path])) if path in NAMES else P(), ndim)


@pytest.fixture(scope="module")
def reference_steps() -> tuple[list[Any], Any]:
  """Plain ``nnx.value_and_grad`` on one device: each step's loss and gradients,
  and the parameters after the last step (the same for every form)."""
  reference, reference_optimizer = _create(None, _mesh())
  reference_step = _train_step(nnx.value_and_grad(loss_fn, has_aux=True))
  steps = []
  for batch in _batches():
    loss, grads = reference_step(reference, reference_optimizer, batch)
    steps.append((loss, nnx.to_pure_dict(grads)))
  return steps, nnx.to_pure_dict(nnx.state(reference, nnx.Param))


@pytest.mark.parametrize("form", FORMS)
def test_the_tutorials_train_step_on_a_mesh_equals_one_device_and_keeps_the_annotations(
    form, reference_steps
):
  mesh = _mesh()
  model, optimizer = _create(form, mesh)
  expected_steps, expected_params = reference_steps
  for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if path in NAMES:  # Flax placed it; the others are wherever JAX put them
      assert param[...].sharding.spec == _expected_spec(path, param[...].ndim), path

  # The logits are per example: they come back in batch order, as the reference's.
  grad_fn = accum_jax.flax.nnx_value_and_grad(
      loss_fn, NUM_MICROBATCHES, has_aux=True, aux_reduction="concat",
          data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis="batch")
  )
  train_step = _train_step(grad_fn)
  rows = NamedSharding(mesh, P("batch", None))
  # Under nnx.jit only the metadata shows that a parameter is sharded over the data
  # axis: then each microbatch's gradient is reduce-scattered into its shard.
  with _rules(form):
    compiled = nnx.jit(grad_fn).lower(model, jax.device_put(_batches()[0], rows)).compile()
  found = accum_jax.testing.collectives(compiled.as_text(), mesh)
  per_microbatch = [c for c in found if c.in_loop and not c.in_branch]
  scattered = [c.axes for c in per_microbatch if c.kind == "reduce-scatter"]
  assert scattered == [("batch",)] * sum("batch" in _axes(names) for names in NAMES.values())

  for batch, expected in zip(_batches(), expected_steps, strict=True):
    with _rules(form):
      loss, grads = train_step(model, optimizer, jax.device_put(batch, rows))
    tree_allclose((loss, nnx.to_pure_dict(grads)), expected, rtol=RTOL, atol=ATOL)
    for path, grad in nnx.to_flat_state(grads):
      spec = _padded(grad[...].sharding.spec, grad[...].ndim)
      assert spec == _expected_spec(path, grad[...].ndim), (path, grad[...].sharding)
  tree_allclose(nnx.to_pure_dict(nnx.state(model, nnx.Param)), expected_params,
                rtol=RTOL, atol=ATOL)


def test_logical_names_without_their_rules_name_the_variable_and_the_fix():
  mesh = _mesh()
  model, _ = _create("logical_axis_rules", mesh)  # made with the rules in context
  # The logits are per example: they come back in batch order, as the reference's.
  grad_fn = accum_jax.flax.nnx_value_and_grad(
      loss_fn, NUM_MICROBATCHES, has_aux=True, aux_reduction="concat",
          data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis="batch")
  )
  batch = jax.device_put(_batches()[0], NamedSharding(mesh, P("batch", None)))
  # Called outside nnx.logical_axis_rules, nothing maps "vocab" onto the mesh.
  with pytest.raises(ValueError, match=re.escape("embedding.embedding")) as error:
    nnx.jit(grad_fn)(model, batch)
  message = str(error.value)
  assert "('vocab', 'embed')" in message and "vocab" in message
  assert "sharding_rules" in message and "param_sharding=" in message
