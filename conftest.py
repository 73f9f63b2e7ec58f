import os
import re

import pytest

# Eight CPU devices for the sharding tests; must be set before jax is imported.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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


def pytest_collection_modifyitems(config, items):
  """Leaves the ``scripts`` tests out unless a ``-m`` expression names the marker.

  They run an example's or a benchmark's script in a fresh interpreter, as a user runs
  it: they check the scripts rather than the library, and took most of a full run's
  time. CI runs them in a step of its own (``python -m pytest -n 2 -m scripts``).
  """
  if re.search(r"\bscripts\b", config.getoption("markexpr") or ""):
    return
  scripts = [item for item in items if item.get_closest_marker("scripts")]
  if scripts:
    config.hook.pytest_deselected(items=scripts)
    items[:] = [item for item in items if not item.get_closest_marker("scripts")]
