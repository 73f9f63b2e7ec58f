"""The public surface: a small top level, and one name for each idea in every function."""

import inspect

import jax.numpy as jnp
import optax
import pytest

import accum_jax
import accum_jax.equinox
import accum_jax.flax
import accum_jax.privacy
import accum_jax.testing
from accum_jax._inside_step import _options

# The functions that take value_and_grad's options, by the name their errors use.
TAKING_OPTIONS = {
    "grad": lambda **o: accum_jax.grad(lambda w, x: jnp.sum(w * x), 2, **o),
    "cached_value_and_grad": lambda **o: accum_jax.cached_value_and_grad(
        lambda w, x: x * w, lambda w, e, x: jnp.sum(e), 2, **o),
    "stats_value_and_grad": lambda **o: accum_jax.stats_value_and_grad(
        lambda w, x: (jnp.sum(w * x), jnp.mean(x)), jnp.sum, 2, **o),
    "nnx_value_and_grad": lambda **o: accum_jax.flax.nnx_value_and_grad(
        lambda m, x: jnp.sum(x), 2, **o),
    "filter_value_and_grad": lambda **o: accum_jax.equinox.filter_value_and_grad(
        lambda m, x: jnp.sum(x), 2, **o),
    "plan_microbatches": lambda **o: accum_jax.diagnostics.plan_microbatches(
        lambda w, x: jnp.sum(w * x), jnp.ones(2), jnp.ones((4, 2)), memory_budget_bytes=2**30,
        **o),
    "check_parity": lambda **o: accum_jax.diagnostics.check_parity(
        lambda w, x: jnp.sum(w * x), jnp.ones(2), jnp.ones((4, 2)), num_microbatches=2, **o),
}

# Names that the same ideas had before, which no function takes any longer.
RETIRED = {"grad_reduction", "pad_batch", "mesh", "data_axis", "param_sharding", "gather",
           "gather_dtype", "reduce_dtype", "split"}


# The framework doors, which sort their arguments into graph nodes (or modules) and the rest.
FRAMEWORK_DOORS = (accum_jax.flax.nnx_value_and_grad, accum_jax.flax.nnx_grad,
                   accum_jax.equinox.filter_value_and_grad, accum_jax.equinox.filter_grad)


def _keyword_parameters(fun) -> dict[str, inspect.Parameter]:
  kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  return {name: p for name, p in inspect.signature(fun).parameters.items() if p.kind in kinds}


def test_the_top_level_holds_at_most_16_names():
  assert len(accum_jax.__all__) <= 16, accum_jax.__all__
  for module in (accum_jax.noise, accum_jax.diagnostics, accum_jax.checkpoint):
    assert all(hasattr(module, name) for name in module.__all__)


def test_value_and_grad_takes_at_most_14_options_with_the_defaults_checked_in_one_place():
  options = {
      name: p.default for name, p in _keyword_parameters(accum_jax.value_and_grad).items()
      if name not in ("fun", "num_microbatches")
  }
  assert len(options) <= 14, sorted(options)
  assert options == _options.DEFAULTS


@pytest.mark.parametrize("fun", [
    accum_jax.grad, accum_jax.cached_value_and_grad, accum_jax.stats_value_and_grad,
    accum_jax.flax.nnx_value_and_grad, accum_jax.flax.nnx_grad,
    accum_jax.equinox.filter_value_and_grad, accum_jax.equinox.filter_grad,
    accum_jax.diagnostics.plan_microbatches, accum_jax.diagnostics.check_parity,
    accum_jax.accumulate, accum_jax.MultiSteps,
], ids=lambda f: f.__name__)
def test_an_idea_has_one_name_and_one_default_in_every_function(fun):
  parameters = _keyword_parameters(fun)
  assert not set(parameters) & RETIRED, sorted(set(parameters) & RETIRED)
  for name, p in parameters.items():
    if name not in _options.DEFAULTS:
      continue
    default = _options.DEFAULTS[name]
    if fun is accum_jax.equinox.filter_value_and_grad and name == "rng_argnums":
      assert p.default == "auto"  # None folds no key here too; "auto" finds them
    elif name == "batch_argnums" and fun in FRAMEWORK_DOORS and p.default is None:
      # Their own rule, not value_and_grad's: None takes the arguments that hold
      # no graph node or module. value_and_grad's default names the batch (1).
      continue
    elif fun is accum_jax.accumulate and name in ("reduction", "on_nonfinite"):
      # The same values; the default reduction names "mean" itself, and the unit
      # skipped whole is the window across calls where it is the step inside one.
      assert p.default == {"reduction": "mean", "on_nonfinite": "skip_window"}[name]
    else:
      assert p.default == default, (name, p.default, default)


def test_accumulate_and_value_and_grad_name_the_shared_ideas_alike():
  across = set(_keyword_parameters(accum_jax.accumulate))
  inside = set(_keyword_parameters(accum_jax.value_and_grad))
  assert {"reduction", "accumulator_dtype", "on_nonfinite", "gradient_noise"} <= across & inside


@pytest.mark.parametrize("caller", list(TAKING_OPTIONS))
def test_every_function_refuses_an_unknown_option_when_built_in_one_message_shape(caller):
  with pytest.raises(ValueError, match=f"^{caller} got an unknown option bogus=1; its options"):
    TAKING_OPTIONS[caller](bogus=1)


@pytest.mark.parametrize("caller", list(TAKING_OPTIONS))
def test_every_function_names_the_new_home_of_a_grouped_option(caller):
  with pytest.raises(ValueError, match=(
      f"^{caller} takes no gather=: pass data_parallel=accum_jax.DataParallel")):
    TAKING_OPTIONS[caller](gather="once")


def test_a_data_parallel_that_is_not_one_is_refused_with_the_fix():
  with pytest.raises(ValueError, match="is not an accum_jax.DataParallel: pass e.g."):
    accum_jax.value_and_grad(jnp.sum, 2, data_parallel={"data_axis": "data"})


def test_multisteps_keeps_optax_names():
  assert set(_keyword_parameters(accum_jax.MultiSteps)) >= {
      "opt", "every_k_schedule", "use_grad_mean", "should_skip_update_fn"}
  assert callable(accum_jax.MultiSteps(optax.sgd(1.0), 2).init)


def _public_docstrings():
  for module in (accum_jax, accum_jax.noise, accum_jax.diagnostics, accum_jax.checkpoint,
                 accum_jax.flax, accum_jax.equinox, accum_jax.privacy, accum_jax.testing):
    for name in module.__all__:
      obj = getattr(module, name)
      yield f"{module.__name__}.{name}", obj
      if inspect.isclass(obj):
        for attr, value in vars(obj).items():
          documented = inspect.isfunction(value) or isinstance(value, property)
          if documented and not attr.startswith("_"):
            yield f"{module.__name__}.{name}.{attr}", value


def test_every_public_docstring_is_at_most_60_lines_the_guides_hold_the_rest():
  long = {name: len(inspect.getdoc(obj).splitlines()) for name, obj in _public_docstrings()
          if inspect.getdoc(obj) and len(inspect.getdoc(obj).splitlines()) > 60}
  assert not long, long
