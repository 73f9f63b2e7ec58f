"""Failures in bench_gpu.py: running out of memory is a result, not a failure.

A configuration that fails is recorded with its status (``OOM``, ``timeout`` or
the error's first line) and the run goes on to the next.
"""

from __future__ import annotations

import subprocess
import traceback


def is_oom(error: BaseException) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def error_status(error: BaseException) -> str:
  if is_oom(error):
    return "OOM"
  return f"error: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def worker_status(error: BaseException) -> str:
  """A fresh-process measurement that failed: OOM, timeout or error."""
  if isinstance(error, subprocess.TimeoutExpired):
    return "timeout"
  return error_status(error)


def report_failure(name: str, error: BaseException) -> str:
  """Prints a failure (with its traceback unless out of memory) and returns its status."""
  status = error_status(error)
  if status != "OOM":
    traceback.print_exc()
  print(f"    {name}: {status}", flush=True)
  return status
