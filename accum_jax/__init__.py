"""accum_jax: exact, lean gradient accumulation for JAX and Optax."""

from importlib import metadata as _metadata

from accum_jax._cached import cached_value_and_grad
from accum_jax._core import Accumulator
from accum_jax._host_schedule import HostSchedule
from accum_jax._microbatch import MicrobatchInfo, grad, value_and_grad
from accum_jax._multisteps import MultiSteps
from accum_jax._noise import GradientNoise, NoiseScaleEMA
from accum_jax._parity import LeafDeviation, ParityReport, check_parity
from accum_jax._planner import MemoryBudgetError, MicrobatchPlan, plan_microbatches
from accum_jax._resume import abstract_state, abstract_tree
from accum_jax._schedules import (
  EveryKSchedule,
  NoiseScaleSchedule,
  every_k_schedule,
  noise_scale_every_k,
)
from accum_jax._sharding import UnknownShardingWarning
from accum_jax._state import AccumulationState, gradient_noise, has_updated, optimizer_step
from accum_jax._stats import stats_value_and_grad
from accum_jax._transform import ShouldSkipUpdateFunction, accumulate

try:
  __version__ = _metadata.version("accum_jax")
except _metadata.PackageNotFoundError:  # running from a source tree
  __version__ = "0.0.0"

__all__ = (
    "Accumulator",
    "AccumulationState",
    "EveryKSchedule",
    "GradientNoise",
    "HostSchedule",
    "LeafDeviation",
    "MemoryBudgetError",
    "MicrobatchInfo",
    "MicrobatchPlan",
    "MultiSteps",
    "NoiseScaleEMA",
    "NoiseScaleSchedule",
    "ParityReport",
    "ShouldSkipUpdateFunction",
    "UnknownShardingWarning",
    "abstract_state",
    "abstract_tree",
    "accumulate",
    "cached_value_and_grad",
    "check_parity",
    "every_k_schedule",
    "grad",
    "gradient_noise",
    "has_updated",
    "noise_scale_every_k",
    "optimizer_step",
    "plan_microbatches",
    "stats_value_and_grad",
    "value_and_grad",
)
