"""Tools beside the two ways of accumulating: choosing ``num_microbatches`` and checking parity.

:func:`plan_microbatches` compiles the step at several numbers of microbatches
and picks the fewest that fit a memory budget; :func:`check_parity` compares a
microbatched gradient with the whole batch's and says which option would fix a
mismatch. See the guide: :doc:`/planner_parity`.
"""

from accum_jax._inside_step._parity import LeafDeviation, ParityReport, check_parity
from accum_jax._inside_step._planner import MemoryBudgetError, MicrobatchPlan, plan_microbatches

__all__ = ("LeafDeviation", "MemoryBudgetError", "MicrobatchPlan", "ParityReport",
           "check_parity", "plan_microbatches")
