"""A small decoder with mixture-of-experts layers, written out in JAX, for the tests.

Two MoE layers of 4 experts with top-2 routing, token masks, and dropout on the
experts' output. ``loss_and_stats`` returns a microbatch's masked token-mean
cross-entropy and, per layer, the Switch/GShard statistics over its valid tokens:
``f`` (the fraction of routed slots per expert, no gradient) and ``p`` (the mean
router probability). ``balance_loss`` is ``alpha * E * sum_i f_i p_i`` per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

EXPERTS, TOP_K, WIDTH, HIDDEN, VOCAB, LAYERS, SEQ = 4, 2, 8, 16, 16, 2, 8
ALPHA = 0.1


def init_params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)

  def normal(*shape, scale=0.5):
    return (rng.standard_normal(shape) * scale).astype(np.float32)

  return {
      "embed": normal(VOCAB, WIDTH),
      "layers": [{
          "router": normal(WIDTH, EXPERTS),
          "w_in": normal(EXPERTS, WIDTH, HIDDEN, scale=0.3),
          "w_out": normal(EXPERTS, HIDDEN, WIDTH, scale=0.3),
      } for _ in range(LAYERS)],
      "head": normal(WIDTH, VOCAB),
  }


def make_batch(batch_size: int, seed: int = 1) -> dict:
  """Token sequences sorted by source, as a packing loader delivers them, and masks
  of varying valid length (at least 2 tokens)."""
  rng = np.random.default_rng(seed)
  sources = np.sort(rng.integers(0, 4, batch_size))
  tokens = (rng.integers(0, VOCAB // 4, (batch_size, SEQ)) + 4 * sources[:, None]) % VOCAB
  lengths = rng.integers(2, SEQ + 1, batch_size)
  mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
  return {"tokens": tokens.astype(np.int32), "mask": mask}


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """The mean of ``x`` (tokens first) over the valid tokens."""
  weights = mask.reshape(-1, *([1] * (x.ndim - 1)))
  return jnp.sum(x * weights, axis=0) / jnp.maximum(jnp.sum(mask), 1.0)


def moe_layer(p: dict, x: jax.Array, mask: jax.Array, key: jax.Array | None):
  """``x`` (tokens, width) through one MoE layer; returns it and its statistics."""
  probs = jax.nn.softmax(x @ p["router"])  # (tokens, experts)
  top_p, top_i = jax.lax.top_k(probs, TOP_K)
  slots = jax.nn.one_hot(top_i, EXPERTS)  # (tokens, k, experts)
  gates = jnp.einsum("tk,tke->te", top_p / jnp.sum(top_p, -1, keepdims=True), slots)
  hidden = jax.nn.gelu(jnp.einsum("td,edh->teh", x, p["w_in"]))
  y = jnp.einsum("te,ted->td", gates, jnp.einsum("teh,ehd->ted", hidden, p["w_out"]))
  if key is not None:
    y = y * jax.random.bernoulli(key, 0.9, y.shape) / 0.9
  stats = {"f": jax.lax.stop_gradient(_masked_mean(slots.sum(1) / TOP_K, mask)),
           "p": _masked_mean(probs, mask)}
  return x + y, stats


def loss_and_stats(params: dict, batch: dict, key: jax.Array | None = None):
  """The masked next-token cross-entropy and each layer's routing statistics."""
  tokens, mask = batch["tokens"], batch["mask"]
  x = params["embed"][tokens[:, :-1]].reshape(-1, WIDTH)
  token_mask = (mask[:, :-1] * mask[:, 1:]).reshape(-1)
  stats = []
  for i, layer in enumerate(params["layers"]):
    layer_key = None if key is None else jax.random.fold_in(key, i)
    x, layer_stats = moe_layer(layer, x, token_mask, layer_key)
    stats.append(layer_stats)
  logp = jax.nn.log_softmax(x @ params["head"])
  nll = -jnp.take_along_axis(logp, tokens[:, 1:].reshape(-1, 1), axis=-1)[:, 0]
  return _masked_mean(nll, token_mask), stats


def balance_loss(stats: list) -> jax.Array:
  """Switch/GShard load balancing of the batch's statistics, summed over layers."""
  return ALPHA * EXPERTS * sum(jnp.sum(s["f"] * s["p"]) for s in stats)


def tokens_of(batch: dict) -> jax.Array:
  """A microbatch's weight: its valid next-token predictions."""
  return jnp.sum(batch["mask"][:, :-1] * batch["mask"][:, 1:])
