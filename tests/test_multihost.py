"""Many hosts: two processes of 4 CPU devices each, joined by jax.distributed.

The test launches two copies of tests/multihost_worker.py on 127.0.0.1, which meet at
a coordinator on a free port, reduce across processes with gloo, and run
``value_and_grad(..., mesh=mesh, data_axis="data")`` on one global batch spread over
the 8 devices of both. Their results must equal the full-batch ``jax.value_and_grad``
computed here, in one process. Every wait is bounded: the workers' distributed
initialisation times out, and the test kills them if they outlive ``TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import tree_allclose
from multihost_worker import loss, problem

WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
REPO_ROOT = WORKER.parent.parent
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 4
TIMEOUT_S = 120


def _gloo_available() -> bool:
  # The factory jax's CPU client calls for jax_cpu_collectives_implementation="gloo".
  from jax._src.lib import _jax

  return hasattr(_jax, "make_gloo_tcp_collectives")


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers() -> list[str]:
  env = dict(os.environ)
  # Replaces the 8 devices the root conftest.py asks for in this process.
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
  port = _free_port()
  workers = [
      subprocess.Popen(
          [sys.executable, str(WORKER), str(port), str(i), str(NUM_PROCESSES)],
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
      )
      for i in range(NUM_PROCESSES)
  ]
  outputs = []
  try:
    for worker in workers:
      outputs.append(worker.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    for worker in workers:
      worker.kill()
    partial = [worker.communicate()[0] for worker in workers]
    pytest.fail(f"the workers did not finish within {TIMEOUT_S} s:\n" + "\n---\n".join(partial))
  for worker, output in zip(workers, outputs):
    assert worker.returncode == 0, f"a worker failed (exit {worker.returncode}):\n{output}"
  return outputs


def _result(output: str) -> dict:
  lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
  assert len(lines) == 1, f"no RESULT line in the worker's output:\n{output}"
  return json.loads(lines[0].removeprefix("RESULT "))


@pytest.mark.skipif(not _gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_reduce_once_and_match_the_single_process_full_batch_gradient():
  results = sorted((_result(out) for out in _run_workers()), key=lambda r: r["process_index"])
  params, batch = problem()
  expected_value, expected_grads = jax.value_and_grad(loss)(params, batch)
  for process_index, result in enumerate(results):
    assert result["process_index"] == process_index
    assert result["process_count"] == NUM_PROCESSES
    assert result["local_device_count"] == DEVICES_PER_PROCESS
    assert result["device_count"] == NUM_PROCESSES * DEVICES_PER_PROCESS
    assert result["fully_replicated"]
    # One reduction per call, after the loop, across the processes too.
    assert result["in_loop"] == 0 and result["outside_loop"] > 0, result
    tree_allclose(np.float32(result["value"]), expected_value)
    grads = {name: np.asarray(g, np.float32) for name, g in result["grads"].items()}
    tree_allclose(grads, expected_grads)
