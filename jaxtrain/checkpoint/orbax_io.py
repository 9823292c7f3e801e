"""The mechanics beneath the checkpoint format (:mod:`.format`): Orbax's manager and item handlers, a step's
array metadata read without any array, a failed background write spotted at once, the names of a state's leaves and
their checksums, Orbax's errors in one line, and the stop at a preemption (:class:`PreemptionWatch`).
``format.py`` decides what is saved, when and from where it is restored; this module only drives Orbax and JAX
for it. Orbax itself is imported at its first use (a fresh run's first save), not with this module.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
from typing import TYPE_CHECKING, Any

import jax
from etils import epath
from flax import nnx

from jaxtrain import log
from jaxtrain.checkpoint import object_store
from jaxtrain.config import Config

if TYPE_CHECKING:
    import orbax.checkpoint as ocp
else:
    class _Orbax:
        """``orbax.checkpoint``, imported at its first use: a fresh run's first save, not its start (0.4-1 s)."""

        def __getattr__(self, name: str):
            return getattr(importlib.import_module("orbax.checkpoint"), name)

    ocp = _Orbax()

# A step directory <directory>/<step> holds these two Orbax items.
STATE, META = "state", "meta"


def make_manager(directory: str, cfg: Config | None = None, *, read_only: bool = False,
                 partial: bool = False) -> ocp.CheckpointManager:
    """Orbax's manager for ``directory``; ``partial`` reads ``state`` with the PyTree handler, which can restore a
    subtree (the standard handler's on-disk format is the same)."""
    c = cfg.checkpoint if cfg else None
    extra: dict[str, Any] = {}
    if object_store.is_remote(directory):
        # An object store has no rename: Orbax's default (write into a temporary directory, rename it) would copy
        # every object of the step. Its commit-file protocol (the one Orbax uses for gs:// itself) writes in place
        # and marks a complete step with commit_success.txt; arrays go through TensorStore's s3/gcs drivers.
        object_store.teach_orbax_s3()
        extra["atomicity_options"] = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
    options = ocp.CheckpointManagerOptions(
        create=not read_only,
        read_only=read_only,
        enable_async_checkpointing=c.async_save if c else False,
        # When to save is decided by Checkpointer.should_save (every N steps, the last step, preemption) and
        # passed with force=True; Orbax decides what to keep.
        preservation_policy=ocp.checkpoint_managers.LatestN(c.keep) if c else None,
        **extra,
    )
    handlers = {STATE: ocp.PyTreeCheckpointHandler() if partial else ocp.StandardCheckpointHandler(),
                META: ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def saved_tree(step_path: str) -> Any:
    """The array metadata tree of a step's ``state`` item (no array is read)."""
    if object_store.is_remote(step_path):
        object_store.teach_orbax_s3()
    handler = ocp.PyTreeCheckpointHandler()
    try:
        return handler.metadata(epath.Path(step_path) / STATE).tree
    finally:
        handler.close()  # its background event loop, else it complains at exit


def leaf_path(path) -> tuple[str, ...]:
    """A leaf's key path (``jax.tree_util`` keys) as names, NNX's ``value`` wrappers left out:
    ``("model", "blocks", "mlp", "down", "kernel")``."""
    keys = (str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return tuple(k for k in keys if k not in ("value", ".value"))


def leaf_name(path) -> str:
    """A leaf's name in messages and fingerprints: :func:`leaf_path` joined by dots."""
    return ".".join(leaf_path(path))


def partial_restore(item: Any) -> ocp.args.PyTreeRestore:
    """Restore just ``item``'s subtree of a step's ``state`` (a manager made with ``partial=True``), each array into
    its ShapeDtypeStruct's sharding."""
    return ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True)


def everyone_ok(ok: bool) -> bool:
    """True when ``ok`` on every process: a damaged shard may be read by one process only, and all must move on to
    the same older step together."""
    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def background_failure(manager: ocp.CheckpointManager) -> BaseException | None:
    """The error of a background write thread that has already failed, or None.

    Orbax reports a failed asynchronous write only once its background thread has waited for every write thread of
    the save in order, and a thread waiting for a failed peer's completion signal waits out Orbax's coordination
    timeout (minutes) first, while training goes on. The write threads themselves know at once: look at them.
    This reads Orbax internals (0.12) defensively; where their shape differs it finds nothing, and Orbax's own
    check still reports the failure, later.
    """
    import concurrent.futures
    import threading

    async_manager = getattr(getattr(manager, "_checkpointer", None), "_async_manager", None)
    pending = list(getattr(async_manager, "_commit_futures", None) or [])
    while pending:
        f = pending.pop()
        if isinstance(f, threading.Thread):
            error = getattr(f, "_exception", None)
            if error is not None and not f.is_alive() and not isinstance(error, concurrent.futures.CancelledError):
                return error
            continue
        pending += [getattr(f, name) for name in ("_f", "_t") if getattr(f, name, None) is not None]
        pending += list(getattr(f, "_futures", None) or [])
    return None


def save_in_flight(manager: ocp.CheckpointManager) -> bool:
    """True while the manager's previous save is still being finalised in the background.

    A new ``manager.save`` first joins that save, and with several processes the join can wait on a peer forever
    (until Orbax's barrier timeout, minutes): a process whose own write failed sits in Orbax's end-of-save barrier,
    waiting for peers that wait for its write. Waiting here instead, while looking for this process's own write
    failure (:func:`background_failure`), lets the failed process stop at once. Reads Orbax internals (0.12)
    defensively: where their shape differs it says False and ``manager.save`` joins as before.
    """
    ref = getattr(manager, "_finalize_thread", None)
    try:
        thread = ref.get() if ref is not None else None
    except Exception:  # another Orbax version's shape
        return False
    return bool(thread is not None and thread.is_alive())


@jax.jit
def _fingerprint(state: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(every floating-point value finite, {leaf name: wrapping uint32 sum of the leaf's bit patterns}).

    Integer addition modulo 2**32 does not depend on the order of the terms, so the sums are the same on any mesh
    and shard layout: a restore onto another mesh compares them as they were saved. Orbax's compressed chunks catch
    most damage by failing to decode, but bytes overwritten inside an incompressible (stored) block decode fine into
    wrong values; these sums catch that.
    """
    import jax.numpy as jnp

    finite, sums = [], {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jnp.issubdtype(x.dtype, jnp.floating):
            # One pass over the bits for both answers: a value is finite unless its exponent bits are all ones.
            info = jnp.finfo(x.dtype)
            exponent = ((1 << info.nexp) - 1) << info.nmant
            x = jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize])
            finite.append(jnp.all((x & exponent) != exponent))
        sums[leaf_name(path)] = jnp.sum(x.astype(jnp.uint32), dtype=jnp.uint32)
    return (jnp.all(jnp.stack(finite)) if finite else jnp.bool_(True)), sums


def fingerprint(state: Any) -> tuple[bool, dict[str, int]]:
    """:func:`_fingerprint`'s values on the host."""
    finite, sums = jax.device_get(_fingerprint(state))
    return bool(finite), {k: int(v) for k, v in sums.items()}


def reason(e: BaseException) -> str:
    """The innermost cause of ``e`` on one line, TensorStore's spec left out, cut to 400 characters."""
    while True:
        inner = e.__cause__ or e.__context__
        if inner is None:
            break
        e = inner
    text = " ".join(f"{type(e).__name__}: {e}".split()).split(" [tensorstore_spec=")[0]
    # An OCDBT data file's name arrives as dozens of escaped bytes (\x00\x64...): noise that would push the path
    # and the OS error out of the 400 characters.
    text = re.sub(r"(\\x[0-9a-fA-F]{2}){4,}", "", text)
    return text if len(text) <= 400 else text[:150] + " ... " + text[-250:]  # the OS error is at the end


class PreemptionWatch:
    """SIGTERM/SIGINT -> stop after the current step, at a step all processes agree on.

    With ``jax.distributed`` initialised, JAX's preemption service catches SIGTERM and Orbax's
    ``reached_preemption`` returns True on every process at the same step; SIGINT is turned into SIGTERM so it takes
    the same road. Without it (e.g. a library caller that set up JAX itself), a local flag does the job for one process.
    """

    def __init__(self, checkpointer: Any):  # a checkpoint.Checkpointer
        self._checkpointer, self._flag, self._old = checkpointer, False, {}
        self._signal: int | None = None  # the signal this process received, where Python saw it
        self._said = False
        self._service = jax.distributed.is_initialized()
        handlers = ({signal.SIGINT: self._forward} if self._service
                    else {signal.SIGINT: self._set, signal.SIGTERM: self._set})
        for sig, handler in handlers.items():
            self._old[sig] = signal.signal(sig, handler)

    def _forward(self, signum, _frame):
        self._signal = signum
        os.kill(os.getpid(), signal.SIGTERM)

    def _set(self, signum, _frame):
        self._signal, self._flag = signum, True

    def reached(self, step: int) -> bool:
        stop = self._checkpointer._manager.reached_preemption(step) if self._service else self._flag
        if stop and not self._said:  # said here, not in the handler: a write there could re-enter one in progress
            self._said = True
            # JAX's preemption service logs "SIGTERM caught" for a Ctrl-C too (SIGINT is passed on as SIGTERM); a
            # SIGTERM it caught itself never reaches Python.
            what = "interrupted (SIGINT)" if self._signal == signal.SIGINT else "terminated (SIGTERM)"
            log.info(f"{what}: saving step {step}, then stopping")
        return stop

    def close(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def quiet_closed_loop_callbacks() -> None:
    """Drop TensorStore's late callbacks into the event loop of a restore that already failed.

    When an array of a damaged step does not read, Orbax closes its asyncio loop while TensorStore still completes
    the other reads; each completion then raises 'Event loop is closed' with nowhere to go, and Python prints a
    bare traceback before jaxtrain's one-line error. Only that message is dropped; every other unraisable
    exception reaches the hook that was installed before.
    """
    import sys

    previous = sys.unraisablehook
    if getattr(previous, "_jaxtrain_closed_loop", False):
        return

    def hook(unraisable):
        if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook._jaxtrain_closed_loop = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def params_only(model_state: Any) -> Any:
    """A model's state (an nnx.State) with its parameters alone: what a parameters-only restore reads; any other
    state of the model (observed state, e.g. FP8 amax histories) is the fresh run's own."""
    return nnx.filter_state(model_state, nnx.Param) if isinstance(model_state, nnx.State) else model_state


def with_fresh_rest(fresh_model_state: Any, restored: Any) -> Any:
    """Restored parameters with a fresh model state's other variables (none elsewhere): a fine-tuning run's start."""
    if not isinstance(fresh_model_state, nnx.State):
        return restored
    rest = nnx.filter_state(fresh_model_state, nnx.Not(nnx.Param))
    return nnx.merge_state(rest, restored) if jax.tree.leaves(rest) else restored
