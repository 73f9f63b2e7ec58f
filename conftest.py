import atexit
import os
import re
import shutil
import tempfile

import pytest

# Compiling took most of the suite's time. The tests compile with XLA's backend
# optimisations off (LLVM's -O0, jax_disable_most_optimizations) and with XLA:CPU's
# elemental code emitters in place of its fusion emitters
# (--xla_cpu_use_fusion_emitters=false), which halved the suite's time (366 s to
# 175 s on the idle 2-core machine). The HLO passes differ a little: a lone
# elementwise op stays bare rather than a fusion of its own, a scatter becomes a
# loop, and some copies and layouts move. Over the suite's 3,080 programs the
# collectives, conditionals and output bytes are the same; the temporary bytes differ
# in 127, by at most 16 KiB, and the results by float32 round-off.
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 leaves both as XLA sets them: CI runs so the tests
# that read compiled programs (.ci/run) and the oldest and newest versions' jobs.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
_FAST_COMPILE = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
# Eight CPU devices for the sharding tests; must be set before jax is imported.
_FLAGS = ["--xla_force_host_platform_device_count=8"]
if _FAST_COMPILE:
  _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FLAGS]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same program from closures of their own, which jax.jit's
# in-memory cache cannot match: a compilation cache keyed by the program (JAX's
# persistent cache) compiles each once per run, for both workers and the scripts
# the tests start. A fresh directory each run, made by the process that starts the
# workers (they inherit it), removed when the run ends: every run compiles from
# nothing, as on a fresh machine. A directory given in the environment is used as is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE = tempfile.mkdtemp(prefix="accum_jax-xla-")
  atexit.register(shutil.rmtree, _RUN_CACHE, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist picks its default, --dist load
def pytest_cmdline_main(config):
  """Under ``-n`` without ``--dist``, distributes the tests by ``worksteal``.

  Each worker starts on one half of the tests, in order, and takes from the other's
  queue when its own is done: a module's tests run on one worker, which builds the
  compiled functions they share (module-scoped fixtures, cached builders) once;
  ``--dist load`` hands both workers tests of the same modules, and each builds them.
  """
  if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
    config.option.dist = "worksteal"


# Tests the README's command leaves out unless a ``-m`` expression names their marker;
# CI runs them in a step of its own (``python -m pytest -n 2 -m "scripts or bench or
# pages"``). They check what surrounds the library rather than the library, and took
# most of a full run's time:
LEFT_OUT = {
    "scripts": "an example's or a benchmark's script, run in a fresh interpreter",
    "bench": "a benchmark's builders, loops and tables, on tiny models",
    "pages": "a documentation page's code blocks, against the output the page shows",
}


def pytest_collection_modifyitems(config, items):
  """Leaves out the tests of the :data:`LEFT_OUT` markers that ``-m`` does not name."""
  named = config.getoption("markexpr") or ""
  left_out = [m for m in LEFT_OUT if not re.search(rf"\b{m}\b", named)]
  deselected = [item for item in items if any(item.get_closest_marker(m) for m in left_out)]
  if deselected:
    config.hook.pytest_deselected(items=deselected)
    items[:] = [item for item in items if not any(item.get_closest_marker(m) for m in left_out)]
