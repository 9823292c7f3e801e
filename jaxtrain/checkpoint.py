"""Asynchronous Orbax checkpoints: save, resume (exactly, or onto another mesh), and stop cleanly on preemption.

A checkpoint step holds two items: ``state`` (parameters, optimizer state and its step counter, each array written
shard by shard from the devices that hold it) and ``meta`` (JSON: the Grain iterator state, the effective config,
mesh, versions and time). Orbax writes a step into a temporary directory and renames it when complete, so a save
that was interrupted is never seen as a step. Restoring reads each array straight into the shardings of the
*current* mesh: nothing is gathered on one host, and the mesh may differ from the one that saved.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, replace
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxtrain import __version__
from jaxtrain.config import Config, ConfigError


class CheckpointError(RuntimeError):
    """A save failed (directory not writable, disk full, ...): training must not go on without checkpoints."""


@dataclass(frozen=True)
class RestoreSource:
    """Where training starts: nothing (fresh), a full train state, or parameters only (``init_from``)."""

    kind: str  # "fresh" | "resume" | "params"
    directory: str = ""  # unused when fresh
    step: int = 0  # unused when fresh
    # checkpoint.resume=auto: the older steps, newest first, to fall back on if ``step`` turns out damaged when read.
    older: tuple[int, ...] = ()


def checkpoint_dir(cfg: Config) -> str:
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(cfg.run.dir, "checkpoints"))


def _manager(directory: str, cfg: Config | None = None, *, read_only: bool = False,
             partial: bool = False) -> ocp.CheckpointManager:
    """Orbax's manager for ``directory``; ``partial`` reads ``state`` with the PyTree handler, which can restore a
    subtree (the standard handler's on-disk format is the same)."""
    c = cfg.checkpoint if cfg else None
    options = ocp.CheckpointManagerOptions(
        create=not read_only,
        read_only=read_only,
        enable_async_checkpointing=c.async_save if c else False,
        # When to save is decided by Checkpointer.should_save (every N steps, the last step, preemption) and
        # passed with force=True; Orbax decides what to keep.
        preservation_policy=ocp.checkpoint_managers.LatestN(c.keep) if c else None,
    )
    handlers = {"state": ocp.PyTreeCheckpointHandler() if partial else ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _step_dir(path: str) -> tuple[str, int | None]:
    """A checkpoint path given by the user: a step directory (``.../40``) or a directory of steps."""
    path = os.path.abspath(path.rstrip("/"))
    base = os.path.basename(path)
    if base.isdigit():
        return os.path.dirname(path), int(base)
    return path, None


def _existing_steps(directory: str) -> list[int]:
    """Complete steps in ``directory``, read from the file system alone: every process of a job must decide alike,
    and creating a CheckpointManager here would be a collective step that the processes could take unevenly."""
    if not os.path.isdir(directory):
        return []
    return sorted(ocp.utils.checkpoint_steps(directory))


def choose_restore(cfg: Config, abstract_state: Any) -> RestoreSource:
    """Decide what to restore and check it fits ``abstract_state``, without reading any array or writing anything."""
    c, own = cfg.checkpoint, checkpoint_dir(cfg)
    own_steps = _existing_steps(own)
    source = RestoreSource("fresh")
    if c.resume == "never":
        if own_steps:
            raise ConfigError(f"checkpoint.resume=never but {own} already holds steps {own_steps}; use a new run.dir "
                              "or checkpoint.dir (existing checkpoints are never overwritten)")
    elif c.resume == "auto":
        if own_steps:
            source = RestoreSource("resume", own, own_steps[-1], tuple(reversed(own_steps[:-1])))
    elif c.resume.isdigit():
        step = int(c.resume)
        if step not in own_steps:
            raise ConfigError(f"checkpoint.resume={step}: no such step in {own}; steps there: {own_steps or 'none'}")
        source = RestoreSource("resume", own, step)
    else:
        directory, named = _step_dir(c.resume)
        steps = _existing_steps(directory)
        if named is None and steps:
            named = steps[-1]
        if named is None or named not in steps:
            raise ConfigError(f"checkpoint.resume={c.resume!r} holds no complete checkpoint; steps there: "
                              f"{steps or 'none'}")
        source = RestoreSource("resume", directory, named)
    if source.kind == "fresh" and c.init_from:
        directory, named = _step_dir(c.init_from)
        steps = _existing_steps(directory)
        named = steps[-1] if named is None and steps else named
        if named is None or named not in steps:
            raise ConfigError(f"checkpoint.init_from={c.init_from!r} holds no complete checkpoint; steps there: "
                              f"{steps or 'none'}")
        source = RestoreSource("params", directory, named)
    if source.kind != "fresh":
        source = _first_readable(source, _target(source, abstract_state))
    if source.kind == "resume" and source.step > cfg.train.steps:
        raise ConfigError(f"the checkpoint to resume is at step {source.step}, beyond train.steps={cfg.train.steps}; "
                          f"raise train.steps or set checkpoint.resume")
    return source


def _target(source: RestoreSource, abstract_state: Any) -> Any:
    return abstract_state if source.kind == "resume" else {"model": abstract_state["model"]}


def _damaged(source: RestoreSource, step: int, damage: str, tried: list[str]) -> None:
    """Report a damaged step: exit 2 (ConfigError) when it was asked for by name, else one warning line."""
    where = f"{source.directory}/{step}"
    tried.append(f"{step} ({damage})")
    if not (source.kind == "resume" and (source.older or len(tried) > 1)):
        what = "checkpoint.init_from" if source.kind == "params" else "the checkpoint to resume"
        raise ConfigError(f"{what} {where} is damaged: {damage}; name another step, or move it aside")
    from jaxtrain.metrics import log_info

    log_info(f"warning: skipping damaged checkpoint {where}: {damage}")


def _none_readable(source: RestoreSource, tried: list[str]) -> ConfigError:
    return ConfigError(f"no checkpoint in {source.directory} can be restored: {'; '.join(tried)}. Move them aside "
                       "(nothing was deleted) or resume from another directory")


def _first_readable(source: RestoreSource, target: Any) -> RestoreSource:
    """``source``, or under resume=auto the newest step whose metadata reads, warning once per damaged newer step.
    A checkpoint of another model shape is a ConfigError, not damage."""
    tried: list[str] = []
    candidates = (source.step, *source.older)
    for i, step in enumerate(candidates):
        damage = _metadata_damage(source.directory, step)
        if damage is None:
            _check_shapes(replace(source, step=step), target)
            return replace(source, step=step, older=candidates[i + 1:])
        _damaged(source, step, damage, tried)
    raise _none_readable(source, tried)


def _metadata_damage(directory: str, step: int) -> str | None:
    """What is wrong with the metadata of step ``directory/step`` (read without any array), or None."""
    path = os.path.join(directory, str(step))
    if not os.listdir(path):
        return "the step directory is empty"
    for rel in ("state/_METADATA", "meta/metadata"):
        if not os.path.isfile(os.path.join(path, rel)):
            return f"{rel} is missing"
    try:
        with open(os.path.join(path, "meta", "metadata"), "rb") as f:
            if not isinstance(json.loads(f.read().decode("utf-8")), dict):
                return "meta/metadata is not a JSON object"
    except (ValueError, OSError) as e:
        return f"meta/metadata cannot be read: {_reason(e)}"
    try:
        _saved_tree(path)
    except Exception as e:  # Orbax raises whatever its JSON and TensorStore readers raise
        return f"state/_METADATA cannot be read: {_reason(e)}"
    return None


def _saved_tree(step_path: str) -> Any:
    """The array metadata tree of a step's ``state`` item (no array is read)."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        return handler.metadata(epath.Path(step_path) / "state").tree
    finally:
        handler.close()  # its background event loop, else it complains at exit


def _leaf_name(path) -> str:
    keys = (str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return ".".join(k for k in keys if k not in ("value", ".value"))


def _check_shapes(source: RestoreSource, target: Any) -> None:
    saved = _saved_tree(os.path.join(source.directory, str(source.step)))
    saved_shapes = {_leaf_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        name = _leaf_name(path)
        if name not in saved_shapes:
            raise ConfigError(f"checkpoint {source.directory}/{source.step} has no {name!r} (the model or optimizer "
                              "differs from the one that saved it)")
        if saved_shapes[name] != tuple(leaf.shape):
            raise ConfigError(f"checkpoint {source.directory}/{source.step} does not fit this model: {name} has shape "
                              f"{saved_shapes[name]} there but {tuple(leaf.shape)} here")


def restore(source: RestoreSource, abstract_state: Any, fresh_state):
    """(state, step, data iterator state or None). ``fresh_state()`` makes a new state where the source needs one.

    A step whose arrays cannot be read (a truncated or overwritten file) is damage: under resume=auto the next older
    step is tried (all processes agree on the outcome of each try), else ConfigError naming the damage.
    """
    if source.kind == "fresh":
        return fresh_state(), 0, None
    tried: list[str] = []
    target = _target(source, abstract_state)
    for i, step in enumerate((source.step, *source.older)):
        if i:  # an older fallback: its metadata has not been looked at yet
            damage = _metadata_damage(source.directory, step)
            if damage is not None:
                _damaged(source, step, damage, tried)
                continue
            _check_shapes(replace(source, step=step), target)
        try:
            out, error = _restore_step(source, step, abstract_state, fresh_state), None
        except Exception as e:  # TensorStore/Orbax raise plain Exception, ValueError, OSError, JSONDecodeError
            out, error = None, e
        if _everyone_ok(error is None):
            return out
        why = _reason(error) if error else "on another process"
        _damaged(source, step, f"its arrays do not restore: {why}", tried)
    raise _none_readable(source, tried)


def _restore_step(source: RestoreSource, step: int, abstract_state: Any, fresh_state):
    manager = _manager(source.directory, read_only=True, partial=source.kind == "params")
    try:
        return _read_step(manager, source, step, abstract_state, fresh_state)
    finally:
        manager.close()


def _read_step(manager, source: RestoreSource, step: int, abstract_state: Any, fresh_state):
    if source.kind == "resume":
        out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                          meta=ocp.args.JsonRestore()))
        _verify(out["state"], out["meta"])
        return out["state"], step, out["meta"]["data_iterator"]
    # Parameters only: read the model subtree, keep the fresh optimizer state.
    # restore_args carry the target shardings: without them Orbax restores onto the mesh that saved the
    # checkpoint (e.g. an import sharded fsdp=8), which the train step compiled for this mesh then rejects.
    item = {"model": abstract_state["model"]}
    out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True),
        meta=ocp.args.JsonRestore()))
    _verify({"model": out["state"]["model"]}, out["meta"])
    state = fresh_state()
    state["model"] = out["state"]["model"]
    return state, 0, None


def _verify(state: Any, meta: dict) -> None:
    """ValueError when restored values differ from the fingerprint saved with them (checkpoints written before
    fingerprints existed, or by ``convert``, have none to compare)."""
    saved = (meta or {}).get("fingerprint")
    if not saved:
        return
    _, sums = fingerprint(state)
    bad = [name for name, value in sums.items() if name in saved and saved[name] != value]
    if bad:
        raise ValueError(f"{len(bad)} array(s) hold other values than were saved (checksum mismatch), e.g. {bad[0]}")


def _everyone_ok(ok: bool) -> bool:
    """True when ``ok`` on every process: a damaged shard may be read by one process only, and all must move on to
    the same older step together."""
    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def set_aside_damaged(directory: str, restored_step: int) -> list[str]:
    """After a resume=auto restore of ``restored_step``: rename every newer step (each one found damaged) to
    ``<step>.damaged`` so that a later save of that step number cannot meet or mix with its files, and nothing is
    deleted (Orbax ignores such names). Called by every process: process 0 renames, then all meet, so that no
    process lists the old names afterwards. Returns the new names (on process 0)."""
    moved = []
    for step in _existing_steps(directory) if jax.process_index() == 0 else []:
        if step > restored_step:
            new, n = os.path.join(directory, f"{step}.damaged"), 1
            while os.path.exists(new):
                n += 1
                new = os.path.join(directory, f"{step}.damaged-{n}")
            os.rename(os.path.join(directory, str(step)), new)
            moved.append(new)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxtrain: damaged checkpoints set aside")
    return moved


class Checkpointer:
    """Saves into ``checkpoint_dir(cfg)``; wraps Orbax errors as CheckpointError."""

    def __init__(self, cfg: Config, metadata: dict):
        """``metadata``: JSON-able facts stored with every step (effective config, mesh, ...)."""
        self.cfg, self.directory = cfg, checkpoint_dir(cfg)
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".write-probe-{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"checkpoint directory {self.directory!r} is not writable: {e.strerror}") from None
        self._manager = _manager(self.directory, cfg)
        self._meta = {**metadata, "jaxtrain_version": __version__, "jax_version": jax.__version__}

    def should_save(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def save(self, step: int, state: Any, data_iterator_state: dict) -> float:
        """Start saving ``step``; returns the seconds the save held the caller once the state was computed."""
        jax.block_until_ready(state)  # a save needs the values anyway; don't count the step's compute as save cost
        t0 = time.perf_counter()
        # Skipped non-finite steps leave the state finite; should anything else ever make it non-finite, the run
        # stops here rather than write a checkpoint that every resume would restore.
        finite, sums = fingerprint(state)
        if not finite:
            raise CheckpointError(f"refusing to save step {step} in {self.directory}: the train state holds "
                                  "non-finite values (the previous checkpoints are intact)")
        meta = {**self._meta, "step": step, "data_iterator": data_iterator_state, "time": time.time(),
                "fingerprint": sums}
        try:
            self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # an earlier async save's failure surfaces here too
            raise CheckpointError(f"a checkpoint save in {self.directory} failed (seen when saving step {step}): "
                                  f"{_reason(e)}") from e
        return time.perf_counter() - t0

    def raise_if_failed(self) -> None:
        """Raise CheckpointError now if a background save has failed, rather than at the next save (called after
        every step; cheap: a few attribute reads)."""
        try:
            self._manager.check_for_errors()
            failure = _background_failure(self._manager)
            if failure is not None:
                raise failure
        except Exception as e:
            raise CheckpointError(f"a checkpoint save in {self.directory} failed: {_reason(e)}") from e

    def wait(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise CheckpointError(f"writing checkpoints in {self.directory} failed: {_reason(e)}") from e

    def close(self) -> None:
        self.wait()
        self._manager.close()


def _background_failure(manager: ocp.CheckpointManager) -> BaseException | None:
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
        sums[_leaf_name(path)] = jnp.sum(x.astype(jnp.uint32), dtype=jnp.uint32)
    return (jnp.all(jnp.stack(finite)) if finite else jnp.bool_(True)), sums


def fingerprint(state: Any) -> tuple[bool, dict[str, int]]:
    """:func:`_fingerprint`'s values on the host."""
    finite, sums = jax.device_get(_fingerprint(state))
    return bool(finite), {k: int(v) for k, v in sums.items()}


def _reason(e: BaseException) -> str:
    while True:
        inner = e.__cause__ or e.__context__
        if inner is None:
            break
        e = inner
    text = " ".join(f"{type(e).__name__}: {e}".split()).split(" [tensorstore_spec=")[0]
    return text if len(text) <= 400 else text[:150] + " ... " + text[-250:]  # the OS error is at the end


class PreemptionWatch:
    """SIGTERM/SIGINT -> stop after the current step, at a step all processes agree on.

    With ``jax.distributed`` initialised, JAX's preemption service catches SIGTERM and Orbax's
    ``reached_preemption`` returns True on every process at the same step; SIGINT is turned into SIGTERM so it takes
    the same road. Without it (e.g. a library caller that set up JAX itself), a local flag does the job for one process.
    """

    def __init__(self, checkpointer: Checkpointer):
        self._manager, self._flag, self._old = checkpointer._manager, False, {}
        self._service = jax.distributed.is_initialized()
        handlers = ({signal.SIGINT: self._forward} if self._service
                    else {signal.SIGINT: self._set, signal.SIGTERM: self._set})
        for sig, handler in handlers.items():
            self._old[sig] = signal.signal(sig, handler)

    def _forward(self, *_):
        os.kill(os.getpid(), signal.SIGTERM)

    def _set(self, *_):
        self._flag = True

    def reached(self, step: int) -> bool:
        return self._manager.reached_preemption(step) if self._service else self._flag

    def close(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
