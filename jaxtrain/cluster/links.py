"""What a collective over a mesh axis measures, and which node a process runs on: shared by the health check
(``jaxtrain.health``) and the in-run collective probe (``jaxtrain.observe``).

Bus bandwidth follows nccl-tests' definition (docs/health-check.md): the algorithm bandwidth (bytes / seconds) times
a factor of the group size that makes the figure comparable with the link's rate whatever the collective.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

# Bus bandwidth / algorithm bandwidth of each collective over a group of n devices (nccl-tests' PERFORMANCE.md).
BUS_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
              "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n}


@dataclass
class Measurement:
    """One timed collective: ``op`` over mesh ``axis`` (``n`` devices), ``size_bytes`` per device, mean
    ``seconds`` per call, and whether its values were right."""

    axis: str
    op: str
    size_bytes: int
    seconds: float
    correct: bool
    n: int

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth, GB/s."""
        return self.size_bytes / self.seconds / 1e9

    @property
    def busbw(self) -> float:
        """Bus bandwidth, GB/s: comparable with the link's rate."""
        return self.algbw * BUS_FACTOR[self.op](self.n)


def node_name() -> str:
    """This process's node as the scheduler names it (SLURMD_NODENAME, what --exclude takes), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
