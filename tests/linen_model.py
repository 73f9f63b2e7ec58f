"""The small Linen model of the Flax and checkpoint tests: BatchNorm and dropout."""

from typing import Any

import flax.linen as nn
from flax.training import train_state


class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.Dropout(0.25, deterministic=not train)(nn.relu(x))
    return nn.Dense(3)(x)


class TrainState(train_state.TrainState):
  """A TrainState that also holds BatchNorm's statistics."""

  batch_stats: Any
