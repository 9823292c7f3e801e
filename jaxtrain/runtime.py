"""Process-level JAX settings that must be made before the first JAX computation touches a backend."""

from __future__ import annotations

import jax

from jaxtrain.config import Config, resolved_cpu_devices


def configure(cfg: Config) -> None:
    """Emulated CPU devices (``runtime.cpu_devices``); no effect on the devices of a GPU or TPU backend."""
    jax.config.update("jax_num_cpu_devices", resolved_cpu_devices(cfg))
