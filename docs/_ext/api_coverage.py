"""Fail the build when a public name has no entry in the API reference.

The public names are the ``__all__`` of ``accum_jax`` and of each of its public
submodules (``accum_jax.flax``, ``accum_jax.testing``, ...). After the documents are
read, every one of them must be a documented Python object; otherwise a warning is
emitted, which ``sphinx-build -W`` turns into an error.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


def public_modules(package: str = "accum_jax") -> list[str]:
  """``package`` and its submodules whose names do not start with an underscore."""
  module = importlib.import_module(package)
  names = [package]
  for info in pkgutil.iter_modules(module.__path__):
    if not info.name.startswith("_"):
      names.append(f"{package}.{info.name}")
  return names


def public_names(module_name: str) -> list[str]:
  """The fully qualified names in ``module_name.__all__``."""
  module = importlib.import_module(module_name)
  return [f"{module_name}.{name}" for name in getattr(module, "__all__", ())]


def missing_entries(documented: set[str]) -> list[str]:
  """Public names that are not among ``documented`` (fully qualified names)."""
  missing = []
  for module_name in public_modules():
    try:
      names = public_names(module_name)
    except ImportError as error:  # an optional dependency is absent
      missing.append(f"{module_name} (cannot be imported: {error})")
      continue
    missing.extend(name for name in names if name not in documented)
  return missing


def _check(app: Any, env: Any) -> None:
  from sphinx.util import logging  # imported here: the tests use this module without Sphinx

  logger = logging.getLogger(__name__)
  documented = set(env.get_domain("py").objects)
  for name in missing_entries(documented):
    logger.warning("the API reference has no entry for %s", name, type="api_coverage")


def setup(app: Any) -> dict:
  app.connect("env-check-consistency", _check)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
