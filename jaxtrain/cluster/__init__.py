"""Where a job runs: processes and ``jax.distributed``, GPU drivers, and the runtime packages jaxtrain needs."""
