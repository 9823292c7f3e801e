"""The job's processes seen through JAX's coordination service (a key-value store that ``jax.distributed``
starts): every process's host name, gathered once at the start, and the client the straggler exchange posts
through. Nothing here touches the devices, except the fallback when JAX's client cannot be found.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxtrain.cluster.links import node_name

# Every key the observer writes to the coordination service starts with this.
KV_PREFIX = "jaxtrain/observe"


def kv_client():
    """JAX's coordination-service client (set by jax.distributed.initialize), or None."""
    from jax._src import distributed

    return getattr(distributed.global_state, "client", None)


def exchange_hosts(timeout_s: int = 120) -> list[str]:
    """Every process's node name (index = process index), through the coordination service."""
    if jax.process_count() == 1:
        return [node_name()]
    client = kv_client()
    if client is None:  # JAX moved its client: fall back to a (one-off) device all-gather
        from jax.experimental import multihost_utils

        name = np.frombuffer(node_name().encode()[:64].ljust(64, b"\0"), np.uint8)
        names = np.asarray(multihost_utils.process_allgather(name)).reshape(jax.process_count(), 64)
        return [bytes(n).rstrip(b"\0").decode() for n in names]
    client.key_value_set(f"{KV_PREFIX}/host/{jax.process_index()}", node_name())
    return [client.blocking_key_value_get(f"{KV_PREFIX}/host/{p}", timeout_s * 1000)
            for p in range(jax.process_count())]
