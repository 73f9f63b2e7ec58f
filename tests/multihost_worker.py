"""One of the processes of tests/test_multihost.py (not a test itself).

Run as ``python multihost_worker.py PORT PROCESS_ID NUM_PROCESSES``, with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` in its environment: it joins the
coordinator on 127.0.0.1:PORT, builds the global mesh over every process's CPU
devices, takes the microbatched value and gradient of ``loss`` on the global batch of
``problem()`` with ``mesh=``, ``data_axis=`` and ``param_sharding=`` (``w`` sharded
over the 8 devices, FSDP; ``b`` replicated, data parallel), traces the same call without
``param_sharding=`` (the natural call, which cannot see the shardings and warns), and
prints one line ``RESULT {json}`` with the shards of the gradients this process holds
and the warnings the natural call gave.

jax is imported inside the functions: the test process imports ``problem`` and
``loss`` for its reference, and the worker must configure jax before importing it.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import numpy as np

BATCH_SIZE = 32
NUM_MICROBATCHES = 2
INITIALIZATION_TIMEOUT_S = 60
# w's rows over the data axis (FSDP); b replicated (data parallel).
SPECS = {"w": ("data", None), "b": ()}


def problem() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """The parameters and the global batch, the same in every process."""
  rng = np.random.default_rng(0)
  params = {
      "w": rng.standard_normal((8, 3)).astype(np.float32) / 2,
      "b": rng.standard_normal(3).astype(np.float32) / 2,
  }
  batch = {
      "x": rng.standard_normal((BATCH_SIZE, 8)).astype(np.float32),
      "y": rng.standard_normal((BATCH_SIZE, 3)).astype(np.float32),
  }
  return params, batch


def loss(params: Any, batch: Any) -> Any:
  import jax.numpy as jnp

  prediction = jnp.tanh(batch["x"] @ params["w"] + params["b"])
  return jnp.mean((prediction - batch["y"]) ** 2)


def _global(x: np.ndarray, sharding: Any) -> Any:
  """The global array of ``x``: each process supplies its own devices' shards."""
  import jax

  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _shards(g: Any) -> list[dict[str, Any]]:
  """This process's shards of ``g``: where each starts, and its values."""
  return [
      {"start": [s.start or 0 for s in shard.index] if shard.index else [],
       "data": np.asarray(shard.data).tolist()}
      for shard in g.addressable_shards
  ]


def main(port: int, process_id: int, num_processes: int) -> None:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}",
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=INITIALIZATION_TIMEOUT_S,
  )
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import accum_jax
  from accum_jax.testing import collectives

  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  params, batch = problem()
  specs = {name: P(*spec) for name, spec in SPECS.items()}
  global_batch = {name: _global(x, NamedSharding(mesh, P("data"))) for name, x in batch.items()}
  global_params = {name: _global(x, NamedSharding(mesh, specs[name])) for name, x in params.items()}
  vg = accum_jax.value_and_grad(
      loss, NUM_MICROBATCHES,
          data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis="data", param_sharding=specs)
  )
  compiled = jax.jit(vg).lower(global_params, global_batch).compile()
  value, grads = compiled(global_params, global_batch)
  # The natural call: under jax.jit with automatic axes each process's trace cannot
  # see that w is sharded. Traced only (lowered), never run.
  natural = accum_jax.value_and_grad(loss, NUM_MICROBATCHES,
      data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis="data"))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(natural).lower(global_params, global_batch)
  result = {
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "device_count": jax.device_count(),
      "local_device_count": jax.local_device_count(),
      "sharded_as_parameter": {
          name: g.sharding.is_equivalent_to(global_params[name].sharding, g.ndim)
          for name, g in grads.items()
      },
      "collectives": [
          [c.kind, c.in_loop, c.in_branch] for c in collectives(compiled.as_text(), mesh)
      ],
      "value": float(value),
      "grads": {name: _shards(g) for name, g in grads.items()},
      "natural_call_warnings": [[w.category.__name__, str(w.message)] for w in caught],
  }
  print("RESULT " + json.dumps(result), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*(int(arg) for arg in sys.argv[1:4]))
