"""The across-calls door: ``accum_jax.accumulate``, an Optax transformation, and
what only it uses (its state, window lengths, the host's schedule, MultiSteps)."""
