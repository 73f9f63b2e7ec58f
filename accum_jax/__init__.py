"""accum_jax: exact, lean gradient accumulation for JAX and Optax.

Two ways over one accumulation core: :func:`accumulate` across calls (an Optax
transformation) and :func:`value_and_grad` inside one jitted step (a
``lax.scan`` over microbatches). The tools beside them live in submodules:
:mod:`accum_jax.noise`, :mod:`accum_jax.diagnostics`, :mod:`accum_jax.checkpoint`,
:mod:`accum_jax.flax`, :mod:`accum_jax.equinox`, :mod:`accum_jax.privacy` and
:mod:`accum_jax.testing`.
"""

from importlib import metadata as _metadata

from accum_jax import checkpoint as checkpoint
from accum_jax import diagnostics as diagnostics
from accum_jax import noise as noise
from accum_jax._across_calls._host_schedule import HostSchedule
from accum_jax._across_calls._multisteps import MultiSteps, MultiStepsState
from accum_jax._across_calls._schedules import EveryKSchedule, piecewise_every_k
from accum_jax._across_calls._state import AccumulationState, has_updated, optimizer_step
from accum_jax._across_calls._transform import accumulate
from accum_jax._inside_step._cached import cached_value_and_grad
from accum_jax._inside_step._microbatch import grad, value_and_grad
from accum_jax._inside_step._options import DataParallel
from accum_jax._inside_step._result import MicrobatchInfo
from accum_jax._inside_step._sharding import UnknownShardingWarning
from accum_jax._inside_step._stats import stats_value_and_grad

try:
  __version__ = _metadata.version("accum_jax")
except _metadata.PackageNotFoundError:  # running from a source tree
  __version__ = "0.0.0"

__all__ = (
    "AccumulationState",
    "DataParallel",
    "EveryKSchedule",
    "HostSchedule",
    "MicrobatchInfo",
    "MultiSteps",
    "MultiStepsState",
    "UnknownShardingWarning",
    "accumulate",
    "cached_value_and_grad",
    "grad",
    "has_updated",
    "optimizer_step",
    "piecewise_every_k",
    "stats_value_and_grad",
    "value_and_grad",
)
