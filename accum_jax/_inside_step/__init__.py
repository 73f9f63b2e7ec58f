"""The inside-step door: ``accum_jax.value_and_grad``, a ``lax.scan`` over
microbatches, and what only it uses (options, binding a call, tracing one
microbatch, sharding, the planner and the parity check)."""
