"""The errors a user can meet, and the exit status each maps to (``cli`` is the one place that maps them).

No JAX here: the CLI and config loading use these before the runtime starts.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in the config, command line or input files; one line on stderr, exit status 2, nothing
    written."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be read or written (a failed background save, a damaged step); exit status 1."""


class NonFiniteError(RuntimeError):
    """train.max_nonfinite_steps steps in a row had a non-finite loss or gradients: the run cannot make progress;
    exit status 1."""


class DistributedError(RuntimeError):
    """The job's processes could not form or keep a group (a peer never arrived, or died); exit status 1."""


# Expected failures: reported as one line (no traceback) with this exit status. Anything else is a bug or a
# runtime failure whose traceback matters (exit 1).
EXIT_STATUS: dict[type[Exception], int] = {ConfigError: 2, CheckpointError: 1, NonFiniteError: 1,
                                          DistributedError: 1}

# A train run that stopped before train.steps (a preemption or time-limit signal; its checkpoint is saved) exits with
# this status, EX_TEMPFAIL of sysexits.h: "try again later". 0 means the run finished. Launchers restart on it: the
# JobSet's failurePolicy (launch/k8s/jaxtrain.yaml) and the sbatch script's requeue (launch/slurm.sbatch).
EXIT_PREEMPTED = 75


def one_line(e: BaseException, limit: int | None = None) -> str:
    """An exception's message on one line (whitespace runs collapsed), cut at ``limit`` characters."""
    text = " ".join(str(e).split())
    return text if limit is None else text[:limit]
