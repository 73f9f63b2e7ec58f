"""One of the processes of tests/test_multihost.py (not a test itself).

Run as ``python multihost_worker.py PORT PROCESS_ID NUM_PROCESSES``, with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` in its environment: it joins the
coordinator on 127.0.0.1:PORT, builds the global mesh over every process's CPU
devices, takes the microbatched value and gradient of ``loss`` on the global batch of
``problem()`` with ``mesh=`` and ``data_axis=``, and prints one line ``RESULT {json}``.

jax is imported inside the functions: the test process imports ``problem`` and
``loss`` for its reference, and the worker must configure jax before importing it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

BATCH_SIZE = 32
NUM_MICROBATCHES = 2
INITIALIZATION_TIMEOUT_S = 60


def problem() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """The parameters and the global batch, the same in every process."""
  rng = np.random.default_rng(0)
  params = {
      "w": rng.standard_normal((6, 3)).astype(np.float32) / 2,
      "b": rng.standard_normal(3).astype(np.float32) / 2,
  }
  batch = {
      "x": rng.standard_normal((BATCH_SIZE, 6)).astype(np.float32),
      "y": rng.standard_normal((BATCH_SIZE, 3)).astype(np.float32),
  }
  return params, batch


def loss(params: Any, batch: Any) -> Any:
  import jax.numpy as jnp

  prediction = jnp.tanh(batch["x"] @ params["w"] + params["b"])
  return jnp.mean((prediction - batch["y"]) ** 2)


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
  from accum_jax.testing import collective_counts

  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  params, batch = problem()
  # Each process supplies the rows of its own devices' shards of the global batch.
  batch_sharding = NamedSharding(mesh, P("data"))
  global_batch = {
      name: jax.make_array_from_callback(x.shape, batch_sharding, lambda index, x=x: x[index])
      for name, x in batch.items()
  }
  replicated = NamedSharding(mesh, P())
  global_params = {
      name: jax.make_array_from_callback(x.shape, replicated, lambda index, x=x: x[index])
      for name, x in params.items()
  }
  vg = accum_jax.value_and_grad(loss, NUM_MICROBATCHES, mesh=mesh, data_axis="data")
  compiled = jax.jit(vg).lower(global_params, global_batch).compile()
  value, grads = compiled(global_params, global_batch)
  counts = collective_counts(compiled.as_text())
  result = {
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "device_count": jax.device_count(),
      "local_device_count": jax.local_device_count(),
      "fully_replicated": all(g.sharding.is_fully_replicated for g in jax.tree.leaves(grads)),
      "in_loop": counts.in_loop,
      "outside_loop": counts.outside_loop,
      "value": float(value),
      "grads": {name: np.asarray(g).tolist() for name, g in grads.items()},
  }
  print("RESULT " + json.dumps(result), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(*(int(arg) for arg in sys.argv[1:4]))
