"""The benchmarks' models: GPT-2 small in Flax NNX, and a narrow GPT-2-shaped tree.

``GPT2_SMALL`` (bench_gpu.py; bench_loop.py on a GPU): 12 layers, width 768, 12 heads,
MLP 3072, vocabulary 50304 (GPT-2's 50257 rounded up to a multiple of 64), context
1024, learned position embeddings, pre-LayerNorm, GELU, the output head tied to the
token embedding (124M parameters, 148 leaves); bfloat16 parameters and compute, a
float32 loss (the mean next-token cross-entropy), random tokens drawn with NumPy. The
loss is a pure function of ``nnx.split(model, nnx.Param)``'s parameters. ``TINY`` is
the same code at a CPU's size.

:func:`gpt2_tree` (bench_micro_step.py; bench_loop.py's plain arrays): the same 148
leaves as plain arrays, width 64 by default, bfloat16, with :func:`loss_fn` over one
sequence. bench_loop.py's ``nnx.State`` parameters are :class:`GPT`'s at the same sizes.
"""

from __future__ import annotations

import dataclasses
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
  dtype: str = "bfloat16"  # of the parameters and the compute


GPT2_SMALL = Config(layers=12, width=768, heads=12, mlp=3072, vocab=50304, context=1024)
TINY = Config(layers=2, width=64, heads=2, mlp=256, vocab=256, context=32)


class Block(nnx.Module):
  """Pre-LayerNorm: x + attention(LN(x)), then x + MLP(LN(x))."""

  def __init__(self, config: Config, attention: str, *, rngs: nnx.Rngs):
    kw = {"dtype": jnp.dtype(config.dtype), "param_dtype": jnp.dtype(config.dtype), "rngs": rngs}
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
    attention = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                             implementation=self.attention)
    x = x + self.proj(attention.reshape(b, t, d))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
  """Token and learned position embeddings, blocks, final LayerNorm, tied head."""

  def __init__(self, config: Config, attention: str, *, rngs: nnx.Rngs):
    kw = {"dtype": jnp.dtype(config.dtype), "param_dtype": jnp.dtype(config.dtype), "rngs": rngs}
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
  """``(graphdef, params)``: the model built abstractly and its parameters filled with
  NumPy, GPT-2's initialisation (std 0.02, the residual projections' scaled by
  ``1 / sqrt(2 layers)``), so that no eager jax op leaves temporaries on the device."""
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


def model_loss(model: GPT, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy of (batch, T + 1) tokens, in float32."""
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_loss(graphdef: Any) -> Callable[[Any, jax.Array], jax.Array]:
  """:func:`model_loss` as a function of ``nnx.split(model, nnx.Param)``'s parameters."""

  def loss_fn(params, tokens):
    return model_loss(nnx.merge(graphdef, params), tokens)

  return loss_fn


def host_tokens(rows: int, context: int, vocab: int, seed: int = 0) -> np.ndarray:
  """``rows`` random sequences of ``context + 1`` tokens, a host NumPy array."""
  return np.random.default_rng(seed).integers(0, vocab, (rows, context + 1), np.int32)


def make_tokens(batch: int, config: Config, seed: int = 0) -> jax.Array:
  return jax.device_put(host_tokens(batch, config.context, config.vocab, seed))


def resolve_attention(requested: str, config: Config) -> str:
  """``auto``: cuDNN's fused kernel on a GPU where its gradient compiles, else XLA's."""
  if requested != "auto":
    return requested
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


def gpt2_tree(layers: int = 12, width: int = 64, vocab: int = 128, context: int = 16,
              dtype: Any = jnp.bfloat16) -> Any:
  """Parameters shaped like GPT-2's (148 leaves at 12 layers), narrow, in bfloat16."""
  keys = iter(jax.random.split(jax.random.key(0), 8 * layers + 4))

  def norm():
    return {"scale": jnp.ones(width), "bias": jnp.zeros(width)}

  def dense(n_in, n_out):
    return {"w": 0.02 * jax.random.normal(next(keys), (n_in, n_out)), "b": jnp.zeros(n_out)}

  params: dict[str, Any] = {
      "wte": 0.02 * jax.random.normal(next(keys), (vocab, width)),
      "wpe": 0.02 * jax.random.normal(next(keys), (context, width)),
      "ln_f": norm(),
  }
  for i in range(layers):
    params[f"h{i:02d}"] = {
        "ln_1": norm(), "ln_2": norm(),
        "attn": {"qkv": dense(width, 3 * width), "proj": dense(width, width)},
        "mlp": {"fc": dense(width, 4 * width), "proj": dense(4 * width, width)},
    }
  return jax.tree.map(lambda x: x.astype(dtype), params)


def _layer_norm(p: Any, x: jax.Array) -> jax.Array:
  mean = x.mean(-1, keepdims=True)
  x = (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
  return x * p["scale"] + p["bias"]


def _block(p: Any, x: jax.Array, heads: int = 4) -> jax.Array:
  t, width = x.shape
  q, k, v = jnp.split(_layer_norm(p["ln_1"], x) @ p["attn"]["qkv"]["w"]
                      + p["attn"]["qkv"]["b"], 3, axis=-1)
  q, k, v = (y.reshape(t, heads, width // heads) for y in (q, k, v))
  attention = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
  x = x + attention.reshape(t, width) @ p["attn"]["proj"]["w"] + p["attn"]["proj"]["b"]
  hidden = jax.nn.gelu(_layer_norm(p["ln_2"], x) @ p["mlp"]["fc"]["w"] + p["mlp"]["fc"]["b"])
  return x + hidden @ p["mlp"]["proj"]["w"] + p["mlp"]["proj"]["b"]


def loss_fn(params: Any, tokens: jax.Array, heads: int = 4) -> jax.Array:
  """Next-token cross-entropy of one sequence of :func:`gpt2_tree`, in float32."""
  inputs, targets = tokens[:-1], tokens[1:]
  x = params["wte"][inputs] + params["wpe"][: inputs.shape[0]]
  for name in sorted(k for k in params if k.startswith("h")):
    x = _block(params[name], x, heads)
  logits = (_layer_norm(params["ln_f"], x) @ params["wte"].T).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
