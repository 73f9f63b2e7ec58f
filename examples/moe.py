"""Mixture of experts: a load-balancing loss of the whole batch, exact over microbatches.

A Switch/GShard load-balancing loss, ``alpha * E * sum_i f_i * p_i`` per MoE layer, is a
product of two batch means: the fraction ``f_i`` of the batch's routed slots that go to
expert ``i`` and the batch's mean router probability ``p_i`` for it. It is no mean over
microbatches, so averaging each microbatch's own balance loss (what
``accum_jax.value_and_grad`` of the per-microbatch total loss computes, and MaxText does)
balances every microbatch instead of the batch. Split the loss into the part that adds
up and the statistics that do not::

  grad_fn = accum_jax.stats_value_and_grad(loss_and_stats, balance_loss, num_microbatches,
                                           weight_fn=valid_tokens)

``loss_and_stats(params, batch)`` returns a microbatch's token-mean cross-entropy and its
routing statistics (``f`` and ``p`` of each layer, means over its valid tokens);
``balance_loss(stats)`` is the loss of the whole batch's statistics. The result is
``jax.value_and_grad`` of ``loss + balance_loss(stats)`` on the whole batch, at one more
forward pass per microbatch.

The model is a small decoder-only Transformer in Flax NNX (2 blocks of causal attention
and a top-2 mixture of 4 experts, width 32), used through NNX's functional API:
``graphdef, params, rest = nnx.split(model, nnx.Param, ...)`` and a pure
``loss_and_stats(params, batch)`` that merges and applies it. The data are generated: 4
sources, each a Markov chain on its own 16 tokens, sequences of varying length (a token
mask), each batch sorted by source as a packing loader delivers it, so each microbatch
holds mostly one source. The script

  1. compares, at initialisation, the loss and the routers' gradient with the full
     batch's: ``stats_value_and_grad`` to float32 round-off, plain accumulation of the
     per-microbatch total loss (the token-weighted mean of the microbatches' balance
     losses) far from it;
  2. trains with Adam from the same initialisation on the same batches three ways: (a)
     the full batch, (b) ``stats_value_and_grad``, (c) plain accumulation (micro-batch
     balancing), and prints how far (b)'s and (c)'s loss curves are from (a)'s;
  3. prints the load of each expert after training, over a held-out batch and per
     source, for (b) global-batch balancing and (c) micro-batch balancing, and plots the
     loss curves and the per-source loads to ``examples/out/moe.png``.

Global-batch balancing leaves the router free to send each source to its own experts as
long as the batch as a whole is balanced; micro-batch balancing forces every microbatch,
here nearly one source, to spread over all experts (Qiu et al. 2025, "Demons in the
Detail: On Implementing Load Balancing Loss for Training Specialized Mixture-of-Expert
Models", https://arxiv.org/abs/2501.11873).

  python examples/moe.py            # 60 steps, under a minute on 2 CPU cores
  python examples/moe.py --quick    # 10 steps: a smoke test

The guide: docs/guides/moe.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import accum_jax

SOURCES = 4
TOKENS_PER_SOURCE = 16
VOCAB = SOURCES * TOKENS_PER_SOURCE
CONTEXT = 16  # predicted positions per sequence; a sequence holds CONTEXT + 1 tokens
WIDTH = 32
HEADS = 2
HIDDEN = 64  # each expert's hidden width
EXPERTS = 4
TOP_K = 2
LAYERS = 2
# The balance loss's weight, per layer: 10 times Switch's 0.01, so that 60 steps of a
# model this small show where the tokens go.
ALPHA = 0.1
BATCH_SIZE = 64
EVAL_SIZE = 256  # held-out sequences, EVAL_SIZE / SOURCES of each source
LEARNING_RATE = 3e-3
# Exact: float32 round-off is ~1e-7 relative; anything real is far above this.
PARITY_TOLERANCE = 1e-4
OUT = Path(__file__).resolve().parent / "out"
FULL, GLOBAL, MICRO = "full batch", "stats_value_and_grad", "value_and_grad"
BALANCING = {GLOBAL: "global-batch", MICRO: "micro-batch"}


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """The mean of ``x`` (batch, position, ...) over the valid positions."""
  weights = mask.reshape(*mask.shape, *([1] * (x.ndim - mask.ndim)))
  return jnp.sum(x * weights, axis=(0, 1)) / jnp.maximum(jnp.sum(mask), 1.0)


class MoE(nnx.Module):
  """Top-2 of 4 experts (two-layer GELU MLPs), dense dispatch through one-hot gates."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.router = nnx.Linear(WIDTH, EXPERTS, use_bias=False, rngs=rngs)
    init = nnx.initializers.lecun_normal(batch_axis=(0,))  # fan-in per expert
    self.w_in = nnx.Param(init(rngs.params(), (EXPERTS, WIDTH, HIDDEN)))
    self.w_out = nnx.Param(init(rngs.params(), (EXPERTS, HIDDEN, WIDTH)))

  def __call__(self, x, mask):
    """``x`` (batch, position, WIDTH); returns the layer's output and its statistics."""
    probs = jax.nn.softmax(self.router(x))  # (batch, position, expert)
    top_p, top_i = jax.lax.top_k(probs, TOP_K)
    slots = jax.nn.one_hot(top_i, EXPERTS)  # (batch, position, k, expert)
    gates = jnp.einsum("btk,btke->bte", top_p / jnp.sum(top_p, -1, keepdims=True), slots)
    hidden = jax.nn.gelu(jnp.einsum("btd,edh->bteh", x, self.w_in[...]))
    y = jnp.einsum("bte,bteh,ehd->btd", gates, hidden, self.w_out[...])
    # f: the fraction of routed slots per expert, a count: no gradient, as in Switch.
    stats = {"f": jax.lax.stop_gradient(masked_mean(jnp.sum(slots, 2) / TOP_K, mask)),
             "p": masked_mean(probs, mask)}
    return y, stats


class Block(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, keep_rngs=False,
                                            rngs=rngs)
    self.moe_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.moe = MoE(rngs=rngs)

  def __call__(self, x, mask):
    causal = nnx.make_causal_mask(mask)
    x = x + self.attention(self.attention_norm(x), mask=causal)
    y, stats = self.moe(self.moe_norm(x), mask)
    return x + y, stats


class Decoder(nnx.Module):
  """Token and position embeddings, LAYERS blocks, a final norm and the logits."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (CONTEXT, WIDTH)))
    self.blocks = nnx.List([Block(rngs=rngs) for _ in range(LAYERS)])
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens, mask):
    """Logits (batch, CONTEXT, VOCAB) and, per block, the statistics over ``mask``."""
    x = self.embed(tokens) + self.position[...]
    stats = []
    for block in self.blocks:
      x, block_stats = block(x, mask)
      stats.append(block_stats)
    return self.head(self.norm(x)), stats


def balance_loss(stats: list) -> jax.Array:
  """Switch/GShard load balancing of the statistics, summed over the layers."""
  return ALPHA * EXPERTS * sum(jnp.sum(s["f"] * s["p"]) for s in stats)


def valid_tokens(batch) -> jax.Array:
  """A microbatch's weight: its predicted tokens."""
  return jnp.sum(batch["mask"])


def make_loss_fns(graphdef, rest):
  """The pure functions of the parameters: ``loss_and_stats`` and the total loss."""

  def loss_and_stats(params, batch):
    """The masked next-token cross-entropy and each layer's routing statistics."""
    model = nnx.merge(graphdef, params, rest)
    logits, stats = model(batch["tokens"][:, :-1], batch["mask"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    return masked_mean(nll, batch["mask"]), stats

  def total_loss(params, batch):
    """Cross-entropy plus the balance loss of the statistics of ``batch``."""
    loss, stats = loss_and_stats(params, batch)
    return loss + balance_loss(stats)

  return loss_and_stats, total_loss


class Sources:
  """SOURCES Markov chains, each on its own TOKENS_PER_SOURCE tokens, each token
  followed mostly by a few others."""

  def __init__(self, rng: np.random.Generator):
    self.rng = rng
    self.transitions = rng.dirichlet(np.full(TOKENS_PER_SOURCE, 0.1),
                                     (SOURCES, TOKENS_PER_SOURCE))

  def sample(self, sources: np.ndarray) -> dict[str, np.ndarray]:
    """One sequence per entry of ``sources``, each of 3 to CONTEXT + 1 valid tokens,
    padded with token 0; ``mask`` marks the predicted positions that are valid."""
    n = len(sources)
    states = np.empty((n, CONTEXT + 1), np.int64)
    states[:, 0] = self.rng.integers(0, TOKENS_PER_SOURCE, n)
    for t in range(CONTEXT):
      cumulative = np.cumsum(self.transitions[sources, states[:, t]], axis=-1)
      u = self.rng.random((n, 1))
      states[:, t + 1] = np.minimum((u > cumulative).sum(-1), TOKENS_PER_SOURCE - 1)
    lengths = self.rng.integers(3, CONTEXT + 2, n)
    valid = np.arange(CONTEXT + 1)[None, :] < lengths[:, None]
    tokens = np.where(valid, states + TOKENS_PER_SOURCE * sources[:, None], 0)
    return {"tokens": tokens.astype(np.int32), "mask": valid[:, 1:].astype(np.float32)}

  def batch(self) -> dict[str, np.ndarray]:
    """A training batch: random sources, sorted, as a packing loader delivers them."""
    return self.sample(np.sort(self.rng.integers(0, SOURCES, BATCH_SIZE)))


def relative_difference(a, b, scale=None) -> float:
  """max |a - b| / max |scale| over the leaves (``scale`` is ``b`` unless given), on the
  host in float64."""

  def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])

  scale = b if scale is None else scale
  return float(np.max(np.abs(flat(a) - flat(b))) / np.max(np.abs(flat(scale))))


def routers(grads) -> list:
  return [block["moe"]["router"]["kernel"] for block in grads["blocks"].values()]


def plot(curves: dict, loads: dict, path: Path) -> None:
  """The loss curves and their differences from the full batch's; beside them each
  (source, expert) load of (b) and (c), layer by layer."""
  import matplotlib

  matplotlib.use("Agg")  # files only, no display needed
  import matplotlib.pyplot as plt

  fig = plt.figure(figsize=(11.5, 5.5), layout="constrained")
  grid = fig.add_gridspec(LAYERS, 3, width_ratios=(1.3, 1, 1))
  top, bottom = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[1, 0])
  steps = np.arange(1, len(curves[FULL]) + 1)
  for (name, curve), style in zip(curves.items(), ("-", "--", ":")):
    top.plot(steps, curve, style, lw=2, label=name)
    if name != FULL:
      difference = np.maximum(np.abs(curve - curves[FULL]), 1e-9)  # 0 on a log scale
      bottom.plot(steps, difference, style, lw=1.5, color=top.lines[-1].get_color())
  top.set_ylabel("loss + balance loss")
  top.set_title(f"Adam, batch {BATCH_SIZE} sorted by source", fontsize=10)
  top.legend()
  bottom.set_yscale("log")
  bottom.set_xlabel("Adam step")
  bottom.set_ylabel("|difference| from full batch")
  for column, name in enumerate((GLOBAL, MICRO), start=1):
    for layer in range(LAYERS):
      ax = fig.add_subplot(grid[layer, column])
      load = loads[name][layer]  # (source, expert)
      ax.imshow(load, vmin=0, vmax=0.5, cmap="viridis")
      for (s, e), value in np.ndenumerate(load):
        ax.text(e, s, f"{value:.2f}", ha="center", va="center",
                color="white" if value < 0.3 else "black", fontsize=8)
      ax.set_xticks(range(EXPERTS))
      ax.set_yticks(range(SOURCES))
      ax.set_ylabel(f"layer {layer + 1}: source")
      if layer == 0:
        ax.set_title(f"{BALANCING[name]} balancing ({name})", fontsize=10)
      if layer == LAYERS - 1:
        ax.set_xlabel("expert")
  fig.suptitle("Training curves; after training, each expert's share of a source's routed"
               " slots (held-out data)")
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60, help="Adam steps (default 60)")
  parser.add_argument("--num-microbatches", type=int, default=4,
                      help=f"microbatches per batch of {BATCH_SIZE} (default 4)")
  parser.add_argument("--quick", action="store_true", help="10 steps: a smoke test")
  parser.add_argument("--plot", type=Path, default=OUT / "moe.png",
                      help="where to write the plot (default examples/out/moe.png)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  steps = 10 if args.quick else args.steps
  n = args.num_microbatches
  if steps < 1 or BATCH_SIZE % n:
    parser.error(f"--steps={steps} must be >= 1 and --num-microbatches={n} divide"
                 f" {BATCH_SIZE}")
  start = time.perf_counter()

  model = Decoder(rngs=nnx.Rngs(args.seed))
  graphdef, init_params, rest = nnx.split(model, nnx.Param, ...)
  loss_and_stats, total_loss = make_loss_fns(graphdef, rest)
  data = Sources(np.random.default_rng(args.seed))
  batches = [data.batch() for _ in range(steps)]
  held_out = data.sample(np.repeat(np.arange(SOURCES), EVAL_SIZE // SOURCES))

  grad_fns = {
      FULL: jax.value_and_grad(total_loss),
      GLOBAL: accum_jax.stats_value_and_grad(loss_and_stats, balance_loss, n,
                                             weight_fn=valid_tokens),
      MICRO: accum_jax.value_and_grad(total_loss, n, weight_fn=valid_tokens),
  }
  print(f"{LAYERS} blocks of top-{TOP_K} of {EXPERTS} experts; batch {BATCH_SIZE} sorted by"
        f" source, {n} microbatches; balance loss alpha = {ALPHA}")
  print(f"(a) {FULL}: jax.value_and_grad of loss + balance_loss(batch statistics)")
  print(f"(b) {GLOBAL}: the same, over {n} microbatches")
  print(f"(c) {MICRO}: loss + balance_loss(microbatch statistics), over {n} microbatches")

  # Training from the same initialisation, on the same batches. The first step's
  # value and gradient are those at initialisation.
  optimizer = optax.adam(LEARNING_RATE)

  @jax.jit
  def objective(params, batch):
    return total_loss(params, batch)

  curves, first, trained = {}, {}, {}
  for name, grad_fn in grad_fns.items():

    @jax.jit
    def train_step(params, opt_state, batch, grad_fn=grad_fn):
      loss, grads = grad_fn(params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss, grads

    params, opt_state, curve = init_params, optimizer.init(init_params), []
    for step, batch in enumerate(batches):
      # (c)'s own value is the mean of its microbatches' balance losses, another
      # objective: evaluate its parameters on the batch's.
      value = objective(params, batch) if name == MICRO else None
      params, opt_state, loss, grads = train_step(params, opt_state, batch)
      if step == 0:
        first[name] = (loss, grads)
      curve.append(float(loss if value is None else value))
    curves[name], trained[name] = np.array(curve), params

  # 1. The loss and the routers' gradient at initialisation, against the full batch's.
  # The cross-entropy's part of the gradient is the same in all three, so a
  # difference in the routers' gradient is one in the balance loss's part of it.
  full_value, full_grads = first[FULL]
  balance_grads = jax.jit(jax.grad(lambda p, b: balance_loss(loss_and_stats(p, b)[1])))(
      init_params, batches[0])
  print("at initialisation, max |difference| / max |full batch| (routers: every layer's"
        " kernel):")
  deviations = {}
  for name in (GLOBAL, MICRO):
    value, grads = first[name]
    deviations[name] = (relative_difference(value, full_value),
                        relative_difference(grads, full_grads))
    print(f"{name}, loss: {deviations[name][0]:.1e}")
    print(f"{name}, gradient: {deviations[name][1]:.1e}")
    print(f"{name}, router gradient: "
          f"{relative_difference(routers(grads), routers(full_grads)):.1e}")
    difference = relative_difference(routers(grads), routers(full_grads),
                                     routers(balance_grads))
    print(f"{name}, router gradient of the balance loss: {difference:.1e}")

  # 2. The training curves.
  print(f"loss + balance loss of the batch over {steps} Adam steps:")
  for name, curve in curves.items():
    print(f"{name}: first {curve[0]:.4f}, last {curve[-1]:.4f}")
  for name in (GLOBAL, MICRO):
    print(f"max loss-curve difference from the full batch, {name}:"
          f" {np.max(np.abs(curves[name] - curves[FULL])):.1e}")

  # 3. Where the tokens go: each expert's share of the routed slots, held-out data.
  @jax.jit
  def loads(params, batch):
    """Per layer, (source, expert) loads, and the whole batch's loads."""
    by_source = []
    for s in range(SOURCES):
      rows = (np.arange(EVAL_SIZE) // (EVAL_SIZE // SOURCES) == s)[:, None]
      by_source.append(loss_and_stats(params, {**batch, "mask": batch["mask"] * rows})[1])
    loss, whole = loss_and_stats(params, batch)
    return ([jnp.stack([stats[layer]["f"] for stats in by_source]) for layer in range(LAYERS)],
            [stats["f"] for stats in whole], loss)

  per_source, whole, held_out_loss = {}, {}, {}
  for name in (GLOBAL, MICRO):
    per_source[name], whole[name], held_out_loss[name] = jax.tree.map(
        np.asarray, loads(trained[name], held_out))
  print(f"load per expert after training, held-out batch of {EVAL_SIZE} (fraction of the"
        " routed slots):")
  print(f"{'':34s}" + "".join(f"{f'expert {e}':>10s}" for e in range(EXPERTS)))
  for name in (GLOBAL, MICRO):
    label = BALANCING[name]
    for layer in range(LAYERS):
      rows = [("whole batch", whole[name][layer])]
      rows += [(f"source {s}", per_source[name][layer][s]) for s in range(SOURCES)]
      for what, load in rows:
        print(f"{f'{label}, layer {layer + 1}, {what}':34s}"
              + "".join(f"{x:10.3f}" for x in load))
  # Specialisation: the L1 distance of each source's load from uniform (0 when every
  # source spreads evenly over the experts, 1 when each uses only its top 2), and that
  # of the whole batch's load, which is what the balance loss asks to be small.
  print("L1 distance from uniform load, mean over layers (0: even, 1: 2 experts take all):")
  for name in (GLOBAL, MICRO):
    label = BALANCING[name]
    spread = np.mean([np.abs(per_source[name][layer] - 1 / EXPERTS).sum(-1).mean()
                      for layer in range(LAYERS)])
    imbalance = np.mean([np.abs(whole[name][layer] - 1 / EXPERTS).sum()
                         for layer in range(LAYERS)])
    print(f"{label}, per source: {spread:.3f}")
    print(f"{label}, whole batch: {imbalance:.3f}")
  for name in (GLOBAL, MICRO):
    print(f"{BALANCING[name]}, held-out cross-entropy: {held_out_loss[name]:.4f}")

  largest = max(*deviations[GLOBAL], float(np.max(np.abs(curves[GLOBAL] - curves[FULL]))))
  verdict = "exact" if largest < PARITY_TOLERANCE else "FAILED"
  print(f"verdict: {GLOBAL} is {verdict}: up to {largest:.1e} from the full batch (loss,"
        f" gradient, loss curve); {MICRO} up to"
        f" {float(np.max(np.abs(curves[MICRO] - curves[FULL]))):.1e} on the loss curve")

  plot(curves, per_source, args.plot)
  print(f"plot: {args.plot}")
  print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
  main()
