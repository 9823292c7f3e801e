"""Process-level JAX settings that must be made before the first JAX computation touches a backend."""

from __future__ import annotations

import jax

from jaxtrain import distributed
from jaxtrain.config import Config, resolved_cpu_devices


def configure(cfg: Config) -> None:
    """Emulated CPU devices (``runtime.cpu_devices``; no effect on GPU/TPU devices), then ``jax.distributed``."""
    jax.config.update("jax_num_cpu_devices", resolved_cpu_devices(cfg))
    distributed.initialize_single_process()


def quiet_logs() -> None:
    """Orbax and JAX log routine events as absl warnings; keep the console for jaxtrain's own lines and errors."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
