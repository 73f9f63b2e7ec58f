"""accum_jax.cached_value_and_grad against the plain full-batch computation.

Every reference is ``jax.value_and_grad`` of ``loss_fn(params, embed_fn(params,
batch), batch)`` on the whole batch, written without accum_jax; with dropout,
its embeddings are taken chunk by chunk with the keys ``jax.random.fold_in`` gives
each chunk, then concatenated, so that the masks are the same.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RTOL, normal, tolerance_for, tree_all_finite, tree_allclose
from jax.sharding import PartitionSpec as P

import accum_jax
import accum_jax.testing
from accum_jax.testing import collective_counts

BATCH_SIZE = 16
IMAGE_FEATURES, TEXT_FEATURES, WIDTH, EMBED = 6, 5, 8, 4
NUM_CLASSES = 3
DROPOUT = 0.25


def make_params(dtype=jnp.float32):
  def tower(seed, features):
    return {"w1": normal(seed, (features, WIDTH), 0.7), "b1": normal(seed + 1, (WIDTH,), 0.1),
            "w2": normal(seed + 2, (WIDTH, EMBED), 0.7)}

  params = {"image": tower(0, IMAGE_FEATURES), "text": tower(10, TEXT_FEATURES),
            "log_t": np.float32(np.log(5.0)), "bias": np.float32(-1.0)}
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def make_batch(batch_size=BATCH_SIZE, seed=20):
  x = normal(seed, (batch_size, IMAGE_FEATURES))
  # Paired views: the text is a noisy linear image of the image features.
  y = x[:, :TEXT_FEATURES] + normal(seed + 1, (batch_size, TEXT_FEATURES), 0.5)
  label = np.random.default_rng(seed + 2).integers(0, NUM_CLASSES, batch_size)
  return {"x": x, "y": y, "label": label.astype(np.int32)}


def tower(params, x, key):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  if key is not None:
    h = h * jax.random.bernoulli(key, 1 - DROPOUT, h.shape) / (1 - DROPOUT)
  z = h @ params["w2"]
  return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def embed_two(params, batch, key=None):
  """Two towers: a dict of embeddings."""
  keys = (None, None) if key is None else jax.random.split(key)
  return {"image": tower(params["image"], batch["x"], keys[0]),
          "text": tower(params["text"], batch["y"], keys[1])}


def embed_one(params, batch, key=None):
  """One tower: a single array of embeddings."""
  return tower(params["image"], batch["x"], key)


def clip_loss(params, emb, batch, *unused):
  """Symmetric InfoNCE with a learned temperature."""
  logits = jnp.exp(params["log_t"]) * emb["image"] @ emb["text"].T
  diagonal = jnp.arange(logits.shape[0])
  image_to_text = jax.nn.log_softmax(logits, axis=1)[diagonal, diagonal]
  text_to_image = jax.nn.log_softmax(logits, axis=0)[diagonal, diagonal]
  return -jnp.mean(image_to_text + text_to_image) / 2


def siglip_loss(params, emb, batch, *unused):
  """The pairwise sigmoid loss with a learned temperature and bias."""
  logits = jnp.exp(params["log_t"]) * emb["image"] @ emb["text"].T + params["bias"]
  signs = 2 * jnp.eye(logits.shape[0]) - 1
  return -jnp.sum(jax.nn.log_sigmoid(signs * logits)) / logits.shape[0]


def supcon_loss(params, z, batch, *unused):
  """Supervised contrastive: the positives of an anchor are the others of its label."""
  n = z.shape[0]
  logits = jnp.exp(params["log_t"]) * z @ z.T
  self_mask = jnp.eye(n, dtype=bool)
  log_prob = jax.nn.log_softmax(jnp.where(self_mask, -jnp.inf, logits), axis=1)
  positive = (batch["label"][:, None] == batch["label"][None, :]) & ~self_mask
  per_anchor = jnp.sum(jnp.where(positive, log_prob, 0.0), axis=1)
  return -jnp.mean(per_anchor / jnp.maximum(positive.sum(axis=1), 1))


LOSSES = {
    "CLIP InfoNCE, two towers": (embed_two, clip_loss),
    "SigLIP sigmoid, two towers": (embed_two, siglip_loss),
    "supervised contrastive, one tower": (embed_one, supcon_loss),
}


@functools.cache
def full_batch(embed_fn, loss_fn):
  """The plain reference: the whole batch at once."""
  return jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, embed_fn(p, b), b)))


def chunked_dropout_reference(embed_fn, loss_fn, num_chunks, key_of_chunk):
  """The whole batch at once, chunk ``i`` embedded with the key ``key_of_chunk(i)``."""
  keys = jnp.stack([key_of_chunk(i) for i in range(num_chunks)])

  def loss(params, batch):
    chunks = jax.tree.map(lambda x: x.reshape(num_chunks, -1, *x.shape[1:]), batch)
    parts = jax.vmap(embed_fn, in_axes=(None, 0, 0))(params, chunks, keys)
    return loss_fn(params, jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), parts), batch)

  return jax.jit(jax.value_and_grad(loss))


@functools.cache
def cached(name, num_microbatches, **options):
  embed_fn, loss_fn = LOSSES[name]
  return jax.jit(accum_jax.cached_value_and_grad(
      embed_fn, loss_fn, num_microbatches, **options))


def relative_deviation(a, b):
  a, b = jax.flatten_util.ravel_pytree(a)[0], jax.flatten_util.ravel_pytree(b)[0]
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# Every N for one loss, two for the others: each case is one more compile.
EXACTNESS_CASES = [
    *(("CLIP InfoNCE, two towers", n) for n in (1, 2, 8, BATCH_SIZE)),
    ("SigLIP sigmoid, two towers", 2), ("SigLIP sigmoid, two towers", 8),
    ("supervised contrastive, one tower", 8),
    ("supervised contrastive, one tower", BATCH_SIZE),
]


@pytest.mark.parametrize(("name", "num_microbatches"), EXACTNESS_CASES)
def test_equals_the_full_batch(name, num_microbatches):
  params, batch = make_params(), make_batch()
  loss, grads = cached(name, num_microbatches)(params, batch)
  full_loss, full_grads = full_batch(*LOSSES[name])(params, batch)
  tree_allclose(loss, full_loss)
  tree_allclose(grads, full_grads)


def test_the_learned_temperature_and_bias_get_their_gradient():
  # Only loss_fn uses them: their gradient is the direct one, added once.
  params, batch = make_params(), make_batch()
  _, grads = cached("SigLIP sigmoid, two towers", 8)(params, batch)
  _, full_grads = full_batch(*LOSSES["SigLIP sigmoid, two towers"])(params, batch)
  assert abs(float(full_grads["bias"])) > 1e-3 and abs(float(full_grads["log_t"])) > 1e-3
  tree_allclose((grads["bias"], grads["log_t"]), (full_grads["bias"], full_grads["log_t"]))


@pytest.mark.parametrize("name", list(LOSSES))
def test_value_and_grad_over_microbatches_is_another_loss(name):
  # The reason for this door: each microbatch sees only its own negatives.
  embed_fn, loss_fn = LOSSES[name]
  params, batch = make_params(), make_batch()
  plain = jax.jit(accum_jax.value_and_grad(lambda p, b: loss_fn(p, embed_fn(p, b), b), 8))
  _, grads = plain(params, batch)
  _, full_grads = full_batch(embed_fn, loss_fn)(params, batch)
  _, cached_grads = cached(name, 8)(params, batch)
  assert relative_deviation(grads, full_grads) > 0.05
  assert relative_deviation(cached_grads, full_grads) < 10 * RTOL


def test_dropout_uses_the_same_key_for_a_chunk_in_both_passes():
  params, batch, key = make_params(), make_batch(), jax.random.key(3)
  num_chunks = 4
  vg = cached("CLIP InfoNCE, two towers", num_chunks, rng_argnums=2, return_info=True)
  loss, grads, info = vg(params, batch, key)
  assert int(info.num_skipped) == 0 and float(info.total_weight) == num_chunks
  reference = chunked_dropout_reference(
      embed_two, clip_loss, num_chunks, lambda i: jax.random.fold_in(key, i))
  full_loss, full_grads = reference(params, batch)
  tree_allclose(loss, full_loss)
  tree_allclose(grads, full_grads)
  # The masks matter: without them the loss is another.
  no_dropout_loss, _ = full_batch(embed_two, clip_loss)(params, batch)
  assert abs(float(loss) - float(no_dropout_loss)) > 1e-3


def test_aux_and_info_come_from_the_whole_batch():
  def loss_with_aux(params, emb, batch):
    logits = emb["image"] @ emb["text"].T
    accuracy = jnp.mean(jnp.argmax(logits, axis=1) == jnp.arange(logits.shape[0]))
    return clip_loss(params, emb, batch), {"accuracy": accuracy, "logits": logits}

  params, batch = make_params(), make_batch()
  vg = jax.jit(accum_jax.cached_value_and_grad(
      embed_two, loss_with_aux, 4, has_aux=True, return_info=True))
  (loss, aux), grads, info = vg(params, batch)
  (full_loss, full_aux), full_grads = jax.jit(jax.value_and_grad(
      lambda p, b: loss_with_aux(p, embed_two(p, b), b), has_aux=True))(params, batch)
  tree_allclose((loss, aux, grads), (full_loss, full_aux, full_grads))
  assert aux["logits"].shape == (BATCH_SIZE, BATCH_SIZE)
  assert int(info.num_skipped) == 0 and float(info.total_weight) == 4


def test_several_differentiated_arguments_and_the_batch_in_two_arguments():
  # f(image_params, text_params, images, texts): argnums=(0, 1), two batch arguments.
  def embed(image_params, text_params, images, texts):
    return {"image": tower(image_params, images, None), "text": tower(text_params, texts, None)}

  def loss(image_params, text_params, emb, images, texts):
    return clip_loss({"log_t": text_params["log_t"]}, emb, None)

  params, batch = make_params(), make_batch()
  image_params, text_params = params["image"], dict(params["text"], log_t=params["log_t"])
  vg = jax.jit(accum_jax.cached_value_and_grad(embed, loss, 4, argnums=(0, 1),
                                               batch_argnums=(2, 3)))
  value, grads = vg(image_params, text_params, batch["x"], batch["y"])
  full_value, full_grads = jax.jit(jax.value_and_grad(
      lambda a, b, x, y: loss(a, b, embed(a, b, x, y), x, y), argnums=(0, 1)
  ))(image_params, text_params, batch["x"], batch["y"])
  tree_allclose((value, grads), (full_value, full_grads))


def test_strided_split_equals_the_full_batch():
  params, batch = make_params(), make_batch()
  _, grads = cached("supervised contrastive, one tower", 4,
      data_parallel=accum_jax.DataParallel(split="strided"))(params, batch)
  _, full_grads = full_batch(embed_one, supcon_loss)(params, batch)
  tree_allclose(grads, full_grads)


@pytest.mark.parametrize("accumulator_dtype", [jnp.float32, None], ids=["float32 sums",
                                                                      "bfloat16 running mean"])
def test_bfloat16_parameters_get_bfloat16_gradients(accumulator_dtype):
  params, batch = make_params(jnp.bfloat16), make_batch()
  _, grads = cached("CLIP InfoNCE, two towers", 8, accumulator_dtype=accumulator_dtype)(
      params, batch)
  _, full_grads = full_batch(embed_two, clip_loss)(make_params(), batch)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  # The bfloat16 forward itself rounds; the sums must add nothing beyond that.
  tree_allclose(grads, full_grads, rtol=8 * tolerance_for(jnp.bfloat16)["rtol"], atol=0.05)


def data_mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


DATA_PARALLEL_CHUNKS, DATA_PARALLEL_KEY = 2, 4


@functools.cache
def data_parallel_program():
  """CLIP with dropout over 8 devices x 2 chunks x 2 rows, compiled once (test_xla_facts.py
  reads it too)."""
  vg = jax.jit(accum_jax.cached_value_and_grad(
      embed_two, clip_loss, DATA_PARALLEL_CHUNKS, rng_argnums=2,
          data_parallel=accum_jax.DataParallel(
              mesh=data_mesh(), param_sharding=P()), return_info=True))
  return vg.lower(make_params(), make_batch(32), jax.random.key(DATA_PARALLEL_KEY)).compile()


def test_data_parallel_equals_the_full_batch_with_one_gradient_reduction():
  # 8 devices x 2 chunks x 2 rows, dropout on: chunk i of device d uses
  # fold_in(fold_in(key, i), d), as accum_jax.value_and_grad does.
  num_chunks, key = DATA_PARALLEL_CHUNKS, jax.random.key(DATA_PARALLEL_KEY)
  params, batch = make_params(), make_batch(32)
  compiled = data_parallel_program()
  loss, grads, info = compiled(params, batch, key)

  def key_of_chunk(c):  # c counts the chunks in batch order: device-major
    device, i = divmod(c, num_chunks)
    return jax.random.fold_in(jax.random.fold_in(key, i), device)

  full_loss, full_grads = chunked_dropout_reference(
      embed_two, clip_loss, 8 * num_chunks, key_of_chunk)(params, batch)
  tree_allclose((loss, grads), (full_loss, full_grads))
  assert float(info.total_weight) == 8 * num_chunks

  # Reduced after the loop, not per chunk; into how many all-reduces XLA makes that
  # one reduction of the loss, gradient and weights is its choice: test_xla_facts.py.
  counts = collective_counts(compiled.as_text())
  assert counts.in_loop == 0 and counts.outside_loop >= 1, counts


def test_data_parallel_mesh_from_jax_set_mesh():
  params, batch = make_params(), make_batch(32)
  vg = jax.jit(accum_jax.cached_value_and_grad(embed_one, supcon_loss, 2,
      data_parallel=accum_jax.DataParallel(data_axis="data", param_sharding=P())))
  with jax.set_mesh(data_mesh()):
    loss, grads = vg(params, batch)
  full_loss, full_grads = full_batch(embed_one, supcon_loss)(params, batch)
  tree_allclose((loss, grads), (full_loss, full_grads))


def test_a_non_finite_loss_makes_the_whole_step_non_finite_and_counted():
  params, batch = make_params(), make_batch()
  batch["x"][5, 0] = np.nan
  vg = cached("CLIP InfoNCE, two towers", 4, rng_argnums=2, return_info=True)
  loss, grads, info = vg(params, batch, jax.random.key(3))
  assert np.isnan(float(loss))
  assert all(bool(jnp.all(jnp.isnan(g))) for g in jax.tree.leaves(grads))
  assert int(info.num_skipped) == 4 and float(info.total_weight) == 0


def test_a_non_finite_gradient_under_a_finite_loss_is_caught():
  # A zero embedding before normalisation: its norm's gradient is NaN, the loss is not.
  def embed(params, batch):
    z = batch["x"] @ params["w"]
    return {"image": z / jnp.sqrt(jnp.sum(z**2, axis=1, keepdims=True) + 1.0),
            "text": jnp.linalg.norm(z, axis=1, keepdims=True) * batch["y"]}

  params = {"w": jnp.asarray(normal(0, (IMAGE_FEATURES, TEXT_FEATURES))), "log_t": jnp.zeros(())}
  batch = make_batch()
  batch["x"][3] = 0.0
  plain_loss, plain_grads = full_batch(embed, clip_loss)(params, batch)
  assert np.isfinite(float(plain_loss)) and not tree_all_finite(plain_grads)

  skipped = jax.jit(accum_jax.cached_value_and_grad(embed, clip_loss, 4, return_info=True))
  loss, grads, info = skipped(params, batch)
  assert np.isnan(float(loss)) and int(info.num_skipped) == 4
  assert all(bool(jnp.all(jnp.isnan(g))) for g in jax.tree.leaves(grads))

  as_computed = jax.jit(
      accum_jax.cached_value_and_grad(embed, clip_loss, 4, on_nonfinite="unchecked"))
  tree_allclose(as_computed(params, batch), (plain_loss, plain_grads))


def test_memory_holds_one_chunk_of_activations():
  # A tower whose hidden layer dwarfs the embeddings: chunked, the compiled step
  # needs a fraction of the full batch's memory.
  def embed(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return {"image": h @ params["w2"], "text": batch["y"] @ params["w3"]}

  wide = 1024
  params = {"w1": jnp.zeros((IMAGE_FEATURES, wide)), "w2": jnp.zeros((wide, EMBED)),
            "w3": jnp.zeros((TEXT_FEATURES, EMBED)), "log_t": jnp.zeros(())}
  batch = make_batch(128)

  def memory(fn):
    stats = jax.jit(fn).lower(params, batch).compile().memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes

  full = memory(jax.value_and_grad(lambda p, b: clip_loss(p, embed(p, b), b)))
  chunked = memory(accum_jax.cached_value_and_grad(embed, clip_loss, 16))
  activations = 128 * wide * 4  # one float32 hidden layer of the full batch
  assert full > activations
  assert chunked < full - activations / 2, (chunked, full)


@pytest.mark.parametrize("option", ["weight_fn", "state_argnums", "aux_reduction",
                                    "gradient_noise", "reduction", "gradient_dtype"])
def test_options_that_mean_nothing_here_are_refused(option):
  with pytest.raises(ValueError, match=re.escape(f"does not take {option}=")):
    accum_jax.cached_value_and_grad(embed_one, supcon_loss, 2, **{option: None})


def test_an_unknown_option_is_a_value_error_that_lists_the_options():
  with pytest.raises(ValueError, match="got an unknown option num_micro_batches=2"):
    accum_jax.cached_value_and_grad(embed_one, supcon_loss, 2, num_micro_batches=2)


def test_batch_statistics_from_embed_fn_are_named():
  def embed_with_stats(params, batch):
    z = embed_one(params, batch)
    return z, {"mean": jnp.mean(z, axis=0)}  # what a BatchNorm in training mode returns

  vg = accum_jax.cached_value_and_grad(embed_with_stats, supcon_loss, 2)
  with pytest.raises(ValueError, match=r"\[1\]\['mean'\] of shape \(4,\).*BatchNorm"):
    jax.jit(vg)(make_params(), make_batch())


def test_a_batch_that_does_not_split_names_both_numbers():
  vg = accum_jax.cached_value_and_grad(embed_one, supcon_loss, 3)
  with pytest.raises(ValueError, match=re.escape(
      "A batch of 16 does not split into num_microbatches=3. Pad it to a multiple of 3 with"
      " rows that count for nothing (zero weight, or masked), or choose num_microbatches among"
      " [1, 2, 4, 8, 16].")):
    jax.jit(vg)(make_params(), make_batch())


def test_a_loss_that_is_not_a_scalar_is_refused():
  vg = accum_jax.cached_value_and_grad(embed_one, lambda p, z, b: z @ z.T, 2)
  with pytest.raises(ValueError, match=r"loss_fn must return the scalar loss.*\(16, 16\)"):
    jax.jit(vg)(make_params(), make_batch())


# FSDP: each tower's parameters sharded over the 8 devices of the data axis,
# the temperature replicated. The loss also uses a sharded leaf directly (a
# decay term), whose gradient every device computes whole.
FSDP_TOWER = {"w1": jax.sharding.PartitionSpec(None, "data"),
              "b1": jax.sharding.PartitionSpec("data"),
              "w2": jax.sharding.PartitionSpec("data", None)}
FSDP_SPECS = {"image": FSDP_TOWER, "text": FSDP_TOWER, "log_t": jax.sharding.PartitionSpec(),
              "bias": jax.sharding.PartitionSpec()}


def decayed_clip_loss(params, emb, batch):
  return clip_loss(params, emb, batch) + 0.1 * jnp.sum(params["image"]["w2"] ** 2)


@pytest.mark.parametrize("gather", ["per_microbatch", "once"])
def test_fsdp_parameters_stay_sharded_and_their_gradients_are_reduce_scattered(gather):
  mesh = data_mesh()
  shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), FSDP_SPECS)
  params = jax.device_put(make_params(), shardings)
  batch = jax.device_put(make_batch(32), jax.sharding.NamedSharding(mesh, FSDP_TOWER["b1"]))
  vg = jax.jit(accum_jax.cached_value_and_grad(
      embed_two, decayed_clip_loss, 2,
          data_parallel=accum_jax.DataParallel(
              mesh=mesh, param_sharding=FSDP_SPECS, gather=gather)))
  compiled = vg.lower(params, batch).compile()
  loss, grads = compiled(params, batch)
  tree_allclose((loss, grads), full_batch(embed_two, decayed_clip_loss)(make_params(),
                                                                        make_batch(32)))
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)
  found = accum_jax.testing.collectives(compiled.as_text(), mesh)
  in_loop = sorted(c.kind for c in found if c.in_loop)
  scatters = [c for c in found if c.kind == "reduce-scatter"]
  # The six sharded leaves: reduce-scattered per chunk into sharded accumulators,
  # or, gathered once, after the loops.
  assert len(scatters) == 6 and all(c.in_loop == (gather == "per_microbatch") for c in scatters)
  assert in_loop == (["reduce-scatter"] * 6 if gather == "per_microbatch" else []), in_loop
  # Nothing full-size is all-reduced: the replicated scalars and the flags only.
  assert all(c.result_bytes <= 64 for c in found if c.kind == "all-reduce"), found


def test_fsdp_a_non_finite_gradient_in_one_devices_shard_skips_the_step_on_every_device():
  # The decay's derivative is NaN at b1[5] alone, in device 5's shard of the
  # image tower's b1; the loss stays finite. Each device judges its own shards,
  # and all must agree to skip, as one device would.
  def loss(params, emb, batch):
    b1 = params["image"]["b1"]
    return clip_loss(params, emb, batch) + jnp.sum(jnp.sqrt(jnp.abs(b1 - b1[5])))

  mesh = data_mesh()
  shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), FSDP_SPECS)
  params = jax.device_put(make_params(), shardings)
  batch = jax.device_put(make_batch(32), jax.sharding.NamedSharding(mesh, FSDP_TOWER["b1"]))
  vg = jax.jit(accum_jax.cached_value_and_grad(
      embed_two, loss, 2, data_parallel=accum_jax.DataParallel(mesh, param_sharding=FSDP_SPECS),
      return_info=True))
  value, grads, info = vg(params, batch)
  assert np.isnan(float(value)) and int(info.num_skipped) == 8 * 2
  assert all(bool(jnp.all(jnp.isnan(g))) for g in jax.tree.leaves(grads))


def test_fsdp_with_a_bfloat16_running_mean_gathers_once_or_is_refused():
  mesh = data_mesh()
  shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), FSDP_SPECS)
  params = jax.device_put(make_params(jnp.bfloat16), shardings)
  batch = jax.device_put(make_batch(32), jax.sharding.NamedSharding(mesh, FSDP_TOWER["b1"]))

  def cached_fsdp(gather):
    return jax.jit(accum_jax.cached_value_and_grad(
        embed_two, decayed_clip_loss, 2,
            data_parallel=accum_jax.DataParallel(
                mesh=mesh, param_sharding=FSDP_SPECS, gather=gather), accumulator_dtype=None))

  with pytest.raises(ValueError, match="a narrow accumulator keeps a running mean"):
    cached_fsdp("per_microbatch").lower(params, batch)
  loss, grads = cached_fsdp("once")(params, batch)
  _, full_grads = full_batch(embed_two, decayed_clip_loss)(make_params(), make_batch(32))
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)
  tree_allclose(grads, full_grads, rtol=8 * tolerance_for(jnp.bfloat16)["rtol"], atol=0.05)
