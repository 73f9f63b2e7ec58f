"""Restore targets for a state saved mid-window, on any mesh (Orbax).

:func:`abstract_state` and :func:`abstract_tree` give the shapes, dtypes and
shardings to restore a train state into, the accumulator sharded as its
parameters. See the guide: :doc:`/guides/checkpoints`.
"""

from accum_jax._across_calls._resume import abstract_state, abstract_tree

__all__ = ("abstract_state", "abstract_tree")
