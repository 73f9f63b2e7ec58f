"""The inside-step door: ``accum_jax.value_and_grad``, a ``lax.scan`` over
microbatches. The plain path: ``_microbatch`` (the public functions), ``_options``
(resolved once), ``_call`` (binding a call), ``_trace`` (one microbatch),
``_batching``, ``_loop`` (the scan) and ``_result``. Built on it, entered only when
asked: ``_sharding`` and ``_across_devices`` (a mesh), ``_cached`` and ``_stats``
(their own doors), ``_planner``, ``_parity`` and ``_diagnosis``."""
