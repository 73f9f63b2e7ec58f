"""Restore targets for a state saved mid-window, on any mesh (Orbax), in either layout.

:func:`abstract_state` and :func:`abstract_tree` give the shapes, dtypes and
shardings to restore a train state into, the accumulator sharded as its
parameters. :func:`convert` moves :func:`accum_jax.accumulate`'s state between
its layouts (``"packed"``, ``"tree"``), and :func:`load` restores a checkpoint
saved in either, or by accum_jax 0.1.0. See the guide: :doc:`/guides/checkpoints`.
"""

from accum_jax._across_calls._convert import convert
from accum_jax._across_calls._resume import abstract_state, abstract_tree, load

__all__ = ("abstract_state", "abstract_tree", "convert", "load")
