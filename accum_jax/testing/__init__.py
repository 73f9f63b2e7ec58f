"""Testing utilities: which collectives a compiled step runs, where the host waits, and
what XLA:GPU does with its conditionals.

:func:`collectives` reads a compiled function's HLO text and lists its
all-reduces, reduce-scatters, all-gathers, all-to-alls and collective permutes:
whether each sits inside a loop (run once per microbatch) or inside a
conditional branch (run only when the branch is taken), how many bytes it
moves, and, given the mesh, over which mesh axes it runs. A test (ours or a
user's) can then check that a microbatched step reduces its gradient once,
after the loop, or reduce-scatters it into shards per microbatch, and nothing
more. :func:`collective_counts` summarises.

:func:`host_syncs` lists the loops and conditionals of a compiled program: which
loops have a trip count XLA proved, and which conditionals or uncounted loops sit
inside loops, where XLA:GPU makes the host wait for the device once per iteration.
:func:`assert_no_host_syncs_in_loops` fails on the latter.

:func:`gpu_conditionals` predicts, from the program before optimisation, which
conditionals XLA:GPU keeps and which it replaces by selects, running both branches
on every call (a rewrite the CPU compiler never makes, so a CPU-compiled program
cannot show it). :func:`assert_conditionals_kept` fails on the latter.

:func:`opcode_counts`, :func:`copied_shapes` and :func:`kernel_counts` count the
instructions of a compiled program as kernels go: the top-level fusions (on a GPU
about one kernel launch each), the copies XLA inserted and the shapes they move, the
conditionals; :func:`hlo_shape` spells an array's shape as the HLO text does. Not
imported by ``import accum_jax``.
"""

from accum_jax.testing._collectives import (
    Collective,
    CollectiveCounts,
    collective_counts,
    collectives,
)
from accum_jax.testing._counts import (
    KernelCounts,
    copied_shapes,
    hlo_shape,
    kernel_counts,
    opcode_counts,
)
from accum_jax.testing._gpu_conditionals import (
    GpuConditional,
    assert_conditionals_kept,
    gpu_conditionals,
)
from accum_jax.testing._host_syncs import (
    Conditional,
    HostSyncs,
    Loop,
    assert_no_host_syncs_in_loops,
    host_syncs,
)

__all__ = (
    "Collective",
    "CollectiveCounts",
    "Conditional",
    "HostSyncs",
    "GpuConditional",
    "KernelCounts",
    "Loop",
    "assert_conditionals_kept",
    "assert_no_host_syncs_in_loops",
    "collective_counts",
    "collectives",
    "copied_shapes",
    "gpu_conditionals",
    "hlo_shape",
    "host_syncs",
    "kernel_counts",
    "opcode_counts",
)
