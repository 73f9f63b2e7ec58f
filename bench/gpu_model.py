"""The model of bench_gpu.py: a GPT-2-small-sized decoder in Flax NNX, and its data.

12 layers, width 768, 12 heads, MLP 3072, vocabulary 50304 (GPT-2's 50257 rounded
up to a multiple of 64), context 1024, learned position embeddings,
pre-LayerNorm, GELU, and the output head tied to the token embedding (GPT-2's
choice; 124M parameters). Parameters and compute are bfloat16; the loss, the mean
next-token cross-entropy, is float32. The loss is a pure function of the
``nnx.split`` state, as in the NNX functional API: ``graphdef, params =
nnx.split(model, nnx.Param)``, and ``loss_fn(params, tokens)`` merges and applies.
The data are random tokens drawn with NumPy.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

_LIST = getattr(nnx, "List", list)


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int
  width: int
  heads: int
  mlp: int
  vocab: int
  context: int


GPT2_SMALL = Config(layers=12, width=768, heads=12, mlp=3072, vocab=50304, context=1024)
TINY = Config(layers=2, width=64, heads=2, mlp=256, vocab=256, context=32)


def _has_fused_attention() -> bool:
  attention = getattr(jax.nn, "dot_product_attention", None)
  return attention is not None and "is_causal" in inspect.signature(attention).parameters


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str) -> jax.Array:
  """Causal self-attention of (batch, time, heads, head_dim) arrays.

  ``implementation``: ``"cudnn"`` or ``"xla"`` for ``jax.nn.dot_product_attention``
  (cuDNN's fused kernel, or XLA's composition of it), ``"manual"`` for the
  softmax written out (float32 logits), where that function is missing.
  """
  if implementation in ("cudnn", "xla"):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
  t = q.shape[1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  logits = logits * q.shape[-1] ** -0.5
  mask = jnp.tril(jnp.ones((t, t), bool))
  weights = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class Block(nnx.Module):
  """Pre-LayerNorm: x + attention(LN(x)), then x + MLP(LN(x))."""

  def __init__(self, config: Config, attention: str, *, rngs: nnx.Rngs):
    kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16, "rngs": rngs}
    self.heads = config.heads
    self.attention = attention
    self.ln1 = nnx.LayerNorm(config.width, **kw)
    self.qkv = nnx.Linear(config.width, 3 * config.width, **kw)
    self.proj = nnx.Linear(config.width, config.width, **kw)
    self.ln2 = nnx.LayerNorm(config.width, **kw)
    self.fc = nnx.Linear(config.width, config.mlp, **kw)
    self.out = nnx.Linear(config.mlp, config.width, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    x = x + self.proj(causal_attention(q, k, v, self.attention).reshape(b, t, d))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
  """Token and learned position embeddings, blocks, final LayerNorm, tied head."""

  def __init__(self, config: Config, attention: str, *, rngs: nnx.Rngs):
    kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16, "rngs": rngs}
    self.wte = nnx.Embed(config.vocab, config.width, **kw)
    self.wpe = nnx.Embed(config.context, config.width, **kw)
    self.blocks = _LIST([Block(config, attention, rngs=rngs) for _ in range(config.layers)])
    self.ln_f = nnx.LayerNorm(config.width, **kw)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
    for block in self.blocks:
      x = block(x)
    return self.wte.attend(self.ln_f(x))  # the tied head: bfloat16 logits


def _path_names(path: tuple[Any, ...]) -> list[str]:
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  return [n for n in names if n != "value"]


def make_model(config: Config, attention: str, seed: int = 0):
  """``(graphdef, params)``: the split model, its parameters on the device.

  The model is built abstractly (``nnx.eval_shape``) and its bfloat16
  parameters filled with NumPy: GPT-2's initialisation (normal, std 0.02, the
  residual projections' scaled by ``1 / sqrt(2 layers)``; LayerNorm scales 1,
  biases 0), with no eager jax op leaving temporaries on the device.
  """
  abstract = nnx.eval_shape(lambda: GPT(config, attention, rngs=nnx.Rngs(0)))
  graphdef, shapes = nnx.split(abstract, nnx.Param)
  rng = np.random.default_rng(seed)

  def fill(path, x):
    names = _path_names(path)
    if names[-1] == "scale":
      value = np.ones(x.shape, np.float32)
    elif names[-1] == "bias":
      value = np.zeros(x.shape, np.float32)
    else:
      std = 0.02 * ((2 * config.layers) ** -0.5 if names[-2] in ("proj", "out") else 1.0)
      value = std * rng.standard_normal(x.shape, np.float32)
    return value.astype(x.dtype)

  return graphdef, jax.device_put(jax.tree.map_with_path(fill, shapes))


def make_loss(graphdef: Any) -> Callable[[Any, jax.Array], jax.Array]:
  def loss_fn(params, tokens):
    """Mean next-token cross-entropy of (batch, T + 1) tokens, in float32."""
    model = nnx.merge(graphdef, params)
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  return loss_fn


def make_tokens(batch: int, config: Config, seed: int = 0) -> jax.Array:
  rng = np.random.default_rng(seed)
  return jax.device_put(rng.integers(0, config.vocab, (batch, config.context + 1), np.int32))


def resolve_attention(requested: str, config: Config) -> str:
  """``auto``: cuDNN's fused kernel on a GPU where its gradient compiles, else XLA's."""
  if requested != "auto":
    return requested
  if not _has_fused_attention():
    return "manual"
  if jax.default_backend() != "gpu":
    return "xla"
  q = jnp.zeros((1, config.context, config.heads, config.width // config.heads), jnp.bfloat16)

  def f(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return out.astype(jnp.float32).sum()

  try:
    jax.block_until_ready(jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, q, q))
  except Exception as e:  # no cuDNN, or none with this attention
    print(f"cuDNN attention unavailable ({type(e).__name__}: {str(e)[:200]}); using XLA's")
    return "xla"
  return "cudnn"


def flops_per_token(config: Config, param_count: int) -> float:
  """nanoGPT's estimate: 6 per parameter (less the position embeddings) + attention."""
  return 6 * (param_count - config.context * config.width) + (
      12 * config.layers * config.width * config.context
  )
