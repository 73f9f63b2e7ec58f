"""Sphinx configuration for the accum_jax documentation.

Build (offline, warnings are errors):

  sphinx-build -W -n -b html docs docs/_build/html
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "_ext"))

from api_coverage import public_modules  # noqa: E402

import accum_jax  # noqa: E402

project = "accum_jax"
author = "accum_jax contributors"
copyright = "2026, accum_jax contributors"  # noqa: A001
release = accum_jax.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_nb",
    "api_coverage",
]

templates_path = ["_templates"]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}
root_doc = "index"

# -- API reference -----------------------------------------------------------
# autosummary generates one page per public name; a module's members are the
# names in its __all__, so a new export gets its page without editing the docs.
autosummary_generate = True
autosummary_ignore_module_all = False
autosummary_imported_members = True
# The package page lists its public submodules (accum_jax.flax, accum_jax.testing, ...),
# found on disk, so that a new one gets its pages too.
autosummary_context = {"public_submodules": public_modules()[1:]}
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
add_module_names = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False


def _untyped_property_docstrings(app, what, name, obj, options, lines):
  # Napoleon reads "words: more words" on a property's first line as "type:
  # description"; accum_jax's property docstrings are sentences, not typed.
  if what == "property" and lines and ": " in lines[0]:
    lines[0] = lines[0].replace(": ", " \N{EM DASH} ", 1)


def _skip_fields_described_by_the_class(app, what, name, obj, skip, options):
  # A NamedTuple field without its own docstring ("Alias for field number 0") is
  # described by its class's "Attributes:" section; autodoc's member would be a
  # second, empty entry of the same name.
  if type(obj).__name__ == "_tuplegetter" and (obj.__doc__ or "").startswith("Alias for"):
    return True
  return None

# The reference is built offline, without intersphinx inventories: names from
# other libraries in signatures are shown as written but not linked.
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|optax|flax|equinox|numpy|np|jnp|chex|orbax|nnx)(\..*)?"),
    (r"py:.*", r"(typing|collections|types|enum|builtins|abc)\..*"),
    (r"py:class", r"(Any|Callable|Sequence|Mapping|Iterable|NamedTuple|Protocol|PyTree|ArrayLike)"),
    (r"py:class", r".*\.(TrainStateT|T|P|R)"),
    (r"py:class", r"(TrainStateT|T|P|R|optional|callable|pytree|array|scalar)"),
    (r"py:obj", r"accum_jax\..*\.(count|index)"),
    # Private protocols and type variables in public signatures have no page.
    (r"py:class", r"accum_jax\.[\w.]*\._\w+"),
    (r"py:class", r"(accum_jax\.)?(_\w+\.)+\w+"),  # a type of a private module
    # optax's own alias, in the docstring of optax.MultiStepsState (accum_jax.MultiStepsState).
    (r"py:class", r"ArrayTree"),
]

# -- Notebooks (myst-nb) -----------------------------------------------------
nb_execution_mode = "force"
nb_execution_allow_errors = False
nb_execution_raise_on_error = True
nb_execution_timeout = 300
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

# -- HTML --------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "accum_jax"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "home_page_in_toc": True,
}
html_static_path: list[str] = []
html_last_updated_fmt = None
# The theme's light/dark switch starts from this mode.
html_context = {"default_mode": "light"}
os.environ.setdefault("JAX_PLATFORMS", "cpu")


class _NoGuidesYet(logging.Filter):
  """Quiet the warning of the guides' glob while docs/guides/ holds no page yet."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "glob pattern 'guides/*'" not in record.getMessage()


def _allow_an_empty_guides_folder(app):
  if not any((HERE / "guides").glob("*.md")):
    for handler in logging.getLogger("sphinx").handlers:
      handler.filters.insert(0, _NoGuidesYet())


def setup(app):
  app.connect("builder-inited", _allow_an_empty_guides_folder)
  # Before napoleon (priority 500) parses the docstring.
  app.connect("autodoc-process-docstring", _untyped_property_docstrings, priority=400)
  app.connect("autodoc-skip-member", _skip_fields_described_by_the_class)
