"""The small Linen model of the Flax and checkpoint tests: BatchNorm and dropout."""

from typing import Any

import flax.linen as nn
import optax
from flax.training import train_state


class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    # No bias before BatchNorm: its gradient is zero up to round-off, which Adam
    # scales up to full steps of either sign, so no two summation orders agree.
    x = nn.Dense(8, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.Dropout(0.25, deterministic=not train)(nn.relu(x))
    return nn.Dense(3)(x)


class TrainState(train_state.TrainState):
  """A TrainState that also holds BatchNorm's statistics."""

  batch_stats: Any


# Built once: a TrainState's apply_fn is static, and a new one would recompile.
NET = Net()


def loss_fn(params, batch_stats, batch, key):
  """Cross-entropy in training mode; returns ``(loss, (new_batch_stats, ()))``."""
  logits, updates = NET.apply(
      {"params": params, "batch_stats": batch_stats},
      batch["x"],
      train=True,
      rngs={"dropout": key},
      mutable=["batch_stats"],
  )
  loss = optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss, (updates["batch_stats"], ())

