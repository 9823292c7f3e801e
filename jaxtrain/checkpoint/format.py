"""Asynchronous Orbax checkpoints: save, resume (exactly, or onto another mesh), and stop cleanly on preemption.

A checkpoint step holds two items: ``state`` (parameters, optimizer state and its step counter, each array written
shard by shard from the devices that hold it) and ``meta`` (JSON: the Grain iterator state, the effective config,
mesh, versions and time). Orbax writes a step into a temporary directory and renames it when complete, so a save
that was interrupted is never seen as a step. Restoring reads each array straight into the shardings of the
*current* mesh: nothing is gathered on one host, and the mesh may differ from the one that saved.

This module owns the on-disk format: finding steps (:func:`existing_steps`, :func:`resolve`), reading a step's
``meta`` (:func:`read_meta`, :func:`saved_config`), naming leaves (:func:`leaf_name`), reading parameters alone
(:func:`restore_params`) and writing a step outside training (:func:`write`); ``convert`` and ``generate`` use these.
Every step is written by :meth:`Checkpointer.save`, training's and :func:`write`'s alike: the same ``meta`` (the
writer's facts from :func:`describe`, versions, step, data iterator state, time) and the same fingerprint.
The Orbax and JAX mechanics beneath it (manager, handlers, checksums) are in :mod:`.orbax_io`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import jax
from etils import epath

from jaxtrain import __version__, rundir
from jaxtrain.checkpoint import local as checkpoint_local
from jaxtrain.checkpoint import object_store
from jaxtrain.checkpoint.orbax_io import (
    META,
    STATE,
    background_failure,
    everyone_ok,
    fingerprint,
    leaf_name,
    leaf_path,
    make_manager,
    ocp,
    params_only,
    partial_restore,
    quiet_closed_loop_callbacks,
    reason,
    save_in_flight,
    saved_tree,
    with_fresh_rest,
)
from jaxtrain.config import Config, to_dict
from jaxtrain.errors import CheckpointError, ConfigError

_META_FILE = os.path.join(META, "metadata")  # the JsonCheckpointHandler's file
_STATE_METADATA = os.path.join(STATE, "_METADATA")  # the PyTree handler's tree of array metadata
_COMMITTED = "commit_success.txt"  # Orbax's marker of a complete step (atomicity.COMMIT_SUCCESS_FILE)
# Model settings that shape no array of a checkpoint (how it is computed, not what it holds).
COMPUTE_ONLY = ("model.dtype", "model.attention", "model.remat")


@dataclass(frozen=True)
class RestoreSource:
    """Where training starts: nothing (fresh), a full train state, or parameters only (``init_from``)."""

    kind: str  # "fresh" | "resume" | "params"
    directory: str = ""  # unused when fresh
    step: int = 0  # unused when fresh
    # checkpoint.resume=auto: the older steps, newest first, to fall back on if ``step`` turns out damaged when read.
    older: tuple[int, ...] = ()
    # A local step (checkpoint_local): the persistent source if it cannot be read; the run's persistent directory.
    fallback: RestoreSource | None = None
    run_key: str = ""


def checkpoint_dir(cfg: Config) -> str:
    return object_store.absolute(rundir.checkpoints(cfg.run.dir, cfg.checkpoint.dir))


def describe(config: dict, mesh: str, devices: int) -> dict:
    """The writer's facts stored in every step's ``meta``: its effective config (``to_dict``), mesh (its label),
    devices and processes."""
    return {"config": config, "mesh": mesh, "processes": jax.process_count(), "devices": devices}


def existing_steps(directory: str) -> list[int]:
    """Complete steps in ``directory``, read from the file system alone: every process of a job must decide alike,
    and creating a CheckpointManager here would be a collective step that the processes could take unevenly."""
    if not epath.Path(directory).is_dir():  # a local path, or s3:// / gs:// (object_store)
        return []
    steps = sorted(ocp.utils.checkpoint_steps(directory))
    if object_store.is_remote(directory):  # Orbax's commit-file protocol there: complete once its marker is written
        steps = [s for s in steps if epath.Path(object_store.join(directory, str(s), _COMMITTED)).exists()]
    return steps


def resolve(path: str, what: str = "checkpoint path") -> tuple[str, int]:
    """(directory of steps, step) for a path given by the user: a run directory, its checkpoints directory, one
    step inside it (``.../40``), or the output directory of ``convert from-hf``; the newest step unless a step
    directory is named. ConfigError (naming ``what``) when it holds no complete checkpoint."""
    given, path = path, object_store.absolute(path.rstrip("/") or "/")
    if not epath.Path(path).is_dir():
        there = epath.Path(path).exists()
        raise ConfigError(f"{what} {given!r} {'is not a directory' if there else 'does not exist'}")
    parent, _, base = path.rpartition("/")
    parent = parent or "/"
    if base.isdigit() and int(base) in existing_steps(parent):
        return parent, int(base)
    for directory in (object_store.join(path, rundir.CHECKPOINTS), path):
        steps = existing_steps(directory)
        if steps:
            return directory, steps[-1]
    beside = existing_steps(parent) if base.isdigit() else []
    raise ConfigError(f"{what} {given!r} holds no complete checkpoint (expected a run directory, its checkpoints "
                      "directory, a step inside it, or the output of convert from-hf)"
                      + (f"; steps in {parent}: {beside}" if beside else ""))


def read_meta(directory: str, step: int) -> dict:
    """The ``meta`` item of step ``directory/step``: the effective config (``"config"``) and what else its writer
    recorded (versions, mesh, data iterator state, fingerprint; ``"hf"`` for an import)."""
    path = epath.Path(object_store.join(directory, str(step), _META_FILE))
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {directory}/{step} has no readable metadata ({type(e).__name__}); it was not "
                          "written by jaxtrain") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"checkpoint {directory}/{step}: {_META_FILE} is not a JSON object")
    return meta


def saved_config(directory: str, step: int) -> dict | None:
    """The config (as :func:`jaxtrain.config.to_dict` writes it: the effective config of the run that saved) stored
    in the meta of step ``directory/step``; None when the meta cannot be read or holds no config."""
    try:
        config = read_meta(directory, step).get("config")
    except ConfigError:
        return None
    return config if isinstance(config, dict) and config else None


def changed_settings(saved: dict | None, current: dict, sections: tuple[str, ...] = ("model",),
                     ignore: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) for each setting of ``sections`` that differs between a saved config
    (:func:`saved_config`) and ``current`` (``to_dict`` of a config); keys only one side has are skipped (a config
    written before the key existed). Compare effective configs (``Layout.effective_config``) where ``auto`` or a
    -1 mesh axis would otherwise differ from what the saving run resolved."""
    out: list[tuple[str, Any, Any]] = []

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in b:
                if k in a:
                    walk(f"{prefix}.{k}", a[k], b[k])
        elif a != b and prefix not in ignore:
            out.append((prefix, a, b))

    for section in sections:
        walk(section, (saved or {}).get(section, {}), current.get(section, {}))
    return out


def choose_restore(cfg: Config, abstract_state: Any) -> RestoreSource:
    """Decide what to restore and check it fits ``abstract_state``, without reading any array or writing anything."""
    c, own = cfg.checkpoint, checkpoint_dir(cfg)
    own_steps = existing_steps(own)
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
        source = RestoreSource("resume", *resolve(c.resume, "checkpoint.resume"))
    if source.kind == "fresh" and c.init_from:
        source = RestoreSource("params", *resolve(c.init_from, "checkpoint.init_from"))
    if source.kind != "fresh":
        source = _first_readable(source, _target(source, abstract_state), cfg)
    if c.local_every and c.resume == "auto":  # a newer local step, if every process (or its peer) holds it
        source = checkpoint_local.choose(c.local_dir, own, abstract_state, source, cfg.train.steps)
    if source.kind == "resume" and source.step > cfg.train.steps:
        raise ConfigError(f"the checkpoint to resume is at step {source.step}, beyond train.steps={cfg.train.steps}; "
                          f"raise train.steps or set checkpoint.resume")
    return source


def _target(source: RestoreSource, abstract_state: Any) -> Any:
    return abstract_state if source.kind == "resume" else {"model": params_only(abstract_state["model"])}


def _damaged(source: RestoreSource, step: int, damage: str, tried: list[str]) -> None:
    """Report a damaged step: exit 2 (ConfigError) when it was asked for by name, else one warning line."""
    where = f"{source.directory}/{step}"
    tried.append(f"{step} ({damage})")
    if not (source.kind == "resume" and (source.older or len(tried) > 1)):
        what = "checkpoint.init_from" if source.kind == "params" else "the checkpoint to resume"
        raise ConfigError(f"{what} {where} is damaged: {damage}; name another step, or move it aside")
    from jaxtrain import log

    log.info(f"warning: skipping damaged checkpoint {where}: {damage}")


def _none_readable(source: RestoreSource, tried: list[str]) -> ConfigError:
    return ConfigError(f"no checkpoint in {source.directory} can be restored: {'; '.join(tried)}. Move them aside "
                       "(nothing was deleted) or resume from another directory")


def _first_readable(source: RestoreSource, target: Any, cfg: Config) -> RestoreSource:
    """``source``, or under resume=auto the newest step whose metadata reads, warning once per damaged newer step.
    A checkpoint of another model shape is a ConfigError, not damage."""
    tried: list[str] = []
    candidates = (source.step, *source.older)
    for i, step in enumerate(candidates):
        damage = _metadata_damage(source.directory, step)
        if damage is None:
            _check_shapes(replace(source, step=step), target, cfg)
            return replace(source, step=step, older=candidates[i + 1:])
        _damaged(source, step, damage, tried)
    raise _none_readable(source, tried)


def _metadata_damage(directory: str, step: int) -> str | None:
    """What is wrong with the metadata of step ``directory/step`` (read without any array), or None."""
    path = object_store.join(directory, str(step))
    if not any(epath.Path(path).iterdir()):
        return "the step directory is empty"
    for rel in (_STATE_METADATA, _META_FILE):
        if not epath.Path(path, rel).is_file():
            return f"{rel} is missing"
    try:
        if not isinstance(json.loads(epath.Path(path, _META_FILE).read_bytes().decode("utf-8")), dict):
            return f"{_META_FILE} is not a JSON object"
    except (ValueError, OSError) as e:
        return f"{_META_FILE} cannot be read: {reason(e)}"
    try:
        saved_tree(path)
    except Exception as e:  # Orbax raises whatever its JSON and TensorStore readers raise
        return f"{_STATE_METADATA} cannot be read: {reason(e)}"
    return None


def _check_shapes(source: RestoreSource, target: Any, cfg: Config | None) -> None:
    """ConfigError, saying what differs and what to do, when ``target`` does not fit the step's arrays."""
    saved = saved_tree(object_store.join(source.directory, str(source.step)))
    saved_shapes = {leaf_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        name = leaf_name(path)
        if name not in saved_shapes:
            raise _mismatch(source, f"has no {name!r} (the model or optimizer differs from the one that saved it)",
                            cfg)
        if saved_shapes[name] != tuple(leaf.shape):
            raise _mismatch(source, f"does not fit this model: {name} has shape {saved_shapes[name]} there but "
                                    f"{tuple(leaf.shape)} here", cfg)


def _mismatch(source: RestoreSource, differs: str, cfg: Config | None) -> ConfigError:
    """The one-line error for a checkpoint of another model: where, what differs (the first leaf, and the model
    settings that differ from the config saved with the step), and what to do."""
    where = f"{source.directory}/{source.step}"
    own = cfg is not None and source.kind == "resume" and source.directory == checkpoint_dir(cfg)
    head = (f"run.dir {os.path.abspath(cfg.run.dir)} cannot resume: its checkpoint {where}" if own and cfg
            else f"checkpoint {where}")
    text = f"{head} {differs}"
    if cfg is not None:
        changed = changed_settings(saved_config(source.directory, source.step), to_dict(cfg), ("model",),
                                   ignore=COMPUTE_ONLY)
        if changed:
            text += "; settings that differ from the checkpoint's config: " + ", ".join(
                f"{key}={json.dumps(here)} here, {json.dumps(there)} there" for key, there, here in changed)
    if source.kind == "params":
        todo = ("point checkpoint.init_from at a checkpoint of this model, or set the changed settings to the "
                "checkpoint's")
    elif own:
        todo = (f"to train this model, use another run.dir (or checkpoint.dir), or move {source.directory} aside; "
                "to continue the saved run, set the changed settings back to the checkpoint's. "
                "checkpoint.resume=never does not start afresh here: it refuses a checkpoint directory that holds "
                "steps (and deletes none)")
    else:
        todo = ("point checkpoint.resume at a checkpoint of this model, or set the changed settings back to the "
                "checkpoint's")
    return ConfigError(f"{text}. What to do: {todo}")


def restore(source: RestoreSource, abstract_state: Any, fresh_state):
    """(state, step, data iterator state or None). ``fresh_state()`` makes a new state where the source needs one.

    A step whose arrays cannot be read (a truncated or overwritten file) is damage: under resume=auto the next older
    step is tried (all processes agree on the outcome of each try), else ConfigError naming the damage.
    """
    if source.fallback is not None:  # a local step (checkpoint_local); its fallback if some process cannot read it
        source, out = checkpoint_local.restore_source(source, abstract_state)
        if out is not None:
            return out
    if source.kind == "fresh":
        return fresh_state(), 0, None
    tried: list[str] = []
    target = _target(source, abstract_state)
    quiet_closed_loop_callbacks()
    for i, step in enumerate((source.step, *source.older)):
        if i:  # an older fallback: its metadata has not been looked at yet
            damage = _metadata_damage(source.directory, step)
            if damage is not None:
                _damaged(source, step, damage, tried)
                continue
            _check_shapes(replace(source, step=step), target, None)
        try:
            out, error = _restore_step(source, step, abstract_state, fresh_state), None
        except Exception as e:  # TensorStore/Orbax raise plain Exception, ValueError, OSError, JSONDecodeError
            out, error = None, e
        if everyone_ok(error is None):
            return out
        why = reason(error) if error else "on another process"
        _damaged(source, step, f"its arrays do not restore: {why}", tried)
    raise _none_readable(source, tried)


def _restore_step(source: RestoreSource, step: int, abstract_state: Any, fresh_state):
    manager = make_manager(source.directory, read_only=True, partial=source.kind == "params")
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
    params = params_only(abstract_state["model"])  # the rest (FP8 amax histories) starts afresh
    out = manager.restore(step, args=ocp.args.Composite(state=partial_restore({"model": params}),
                                                      meta=ocp.args.JsonRestore()))
    _verify({"model": out["state"]["model"]}, out["meta"])
    state = fresh_state()
    state["model"] = with_fresh_rest(state["model"], out["state"]["model"])
    return state, 0, None


def restore_params(directory: str, step: int, abstract_params: Any, only: tuple[str, ...] | None = None) -> Any:
    """The parameters (``state["model"]``) of step ``directory/step``, a train state's or an import's, read straight
    into the shardings of ``abstract_params`` (``Layout.abstract_params``); ``only``: just the parameter at that path
    inside the model (:func:`leaf_path` less ``"model"``), as a single array. The optimizer state is not read."""
    if only is not None:
        leaf = next(leaf for p, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]
                    if leaf_path(p) == only)
        item: Any = {"value": leaf}
        for key in reversed(only):
            item = {key: item}
    else:
        item = abstract_params
    manager = make_manager(directory, read_only=True, partial=True)
    try:
        out = manager.restore(step, args=ocp.args.Composite(state=partial_restore({"model": item})))["state"]["model"]
    finally:
        manager.close()
    if only is None:
        return out
    for key in only:
        out = out[key]
    return out["value"]


def write(directory: str, step: int, state: Any, meta: dict) -> None:
    """Save ``state`` (e.g. ``{"model": params}``) as step ``directory/step``, synchronously, by training's writer
    (:meth:`Checkpointer.save`: ``meta``, e.g. :func:`describe`'s facts, then the versions, step, time and
    fingerprint; no data iterator state): a checkpoint made outside training (``convert from-hf``)."""
    writer = Checkpointer(None, meta, directory=directory)
    try:
        writer.save(step, state, None)
    finally:
        writer.close()


def _versions() -> dict:
    return {"jaxtrain_version": __version__, "jax_version": jax.__version__}


def _verify(state: Any, meta: dict) -> None:
    """ValueError when restored values differ from the fingerprint saved with them (checkpoints written before
    fingerprints existed have none to compare)."""
    saved = (meta or {}).get("fingerprint")
    if not saved:
        return
    _, sums = fingerprint(state)
    bad = [name for name, value in sums.items() if name in saved and saved[name] != value]
    if bad:
        raise ValueError(f"{len(bad)} array(s) hold other values than were saved (checksum mismatch), e.g. {bad[0]}")


def set_aside_damaged(directory: str, restored_step: int) -> list[str]:
    """After a resume=auto restore of ``restored_step``: rename every newer step (each one found damaged) to
    ``<step>.damaged`` so that a later save of that step number cannot meet or mix with its files, and nothing is
    deleted (Orbax ignores such names). Called by every process: process 0 renames, then all meet, so that no
    process lists the old names afterwards. Returns the new names (on process 0)."""
    moved = []
    for step in existing_steps(directory) if jax.process_index() == 0 else []:
        if step > restored_step:
            new, n = object_store.join(directory, f"{step}.damaged"), 1
            while epath.Path(new).exists():
                n += 1
                new = object_store.join(directory, f"{step}.damaged-{n}")
            epath.Path(object_store.join(directory, str(step))).rename(new)  # on an object store: a copy
            moved.append(new)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxtrain: damaged checkpoints set aside")
    return moved


class Checkpointer:
    """Writes every checkpoint step: training's into ``checkpoint_dir(cfg)``, asynchronously where configured, and
    :func:`write`'s (``cfg`` None) into ``directory``, synchronously; wraps Orbax errors as CheckpointError."""

    def __init__(self, cfg: Config | None, metadata: dict, *, directory: str | None = None):
        """``metadata``: JSON-able facts stored with every step (:func:`describe`'s, and any more)."""
        self.cfg = cfg
        if cfg is None:
            assert directory is not None, "a writer without a config writes into the directory it is given"
            self.directory = object_store.absolute(directory)
        else:
            self.directory = checkpoint_dir(cfg)
        object_store.write_probe(self.directory)
        self._made: Any = None  # Orbax's manager, made (and Orbax imported) at the first save, not before step 1
        self._meta = {**metadata, **_versions()}

    @property
    def _manager(self) -> Any:
        if self._made is None:
            self._made = make_manager(self.directory, self.cfg)
        return self._made

    def should_save(self, step: int) -> bool:
        assert self.cfg is not None  # training's writer
        every = self.cfg.checkpoint.every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def save(self, step: int, state: Any, data_iterator_state: dict | None) -> float:
        """Start saving ``step`` (with the data iterator's state, None outside training); returns the seconds the
        save held the caller once the state was computed."""
        jax.block_until_ready(state)  # a save needs the values anyway; don't count the step's compute as save cost
        t0 = time.perf_counter()
        # Skipped non-finite steps leave the state finite; should anything else ever make it non-finite, the run
        # stops here rather than write a checkpoint that every resume would restore.
        finite, sums = fingerprint(state)
        if not finite:
            raise CheckpointError(f"refusing to save step {step} in {self.directory}: the state holds non-finite "
                                  "values (the previous checkpoints are intact)")
        meta = {**self._meta, "step": step, "data_iterator": data_iterator_state, "time": time.time(),
                "fingerprint": sums}
        while save_in_flight(self._manager):  # see save_in_flight: a failed write must not wait on its peers
            self.raise_if_failed()
            time.sleep(0.01)
        self.raise_if_failed()
        try:
            self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # an earlier async save's failure surfaces here too
            raise CheckpointError(f"a checkpoint save in {self.directory} failed (seen when saving step {step}): "
                                  f"{reason(e)}") from e
        return time.perf_counter() - t0

    def raise_if_failed(self) -> None:
        """Raise CheckpointError now if a background save has failed, rather than at the next save (called after
        every step; cheap: a few attribute reads)."""
        if self._made is None:  # nothing saved yet, nothing failed
            return
        try:
            self._manager.check_for_errors()
            failure = background_failure(self._manager)
            if failure is not None:
                raise failure
        except Exception as e:
            raise CheckpointError(f"a checkpoint save in {self.directory} failed: {reason(e)}") from e

    def wait(self) -> None:
        if self._made is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise CheckpointError(f"writing checkpoints in {self.directory} failed: {reason(e)}") from e

    def close(self) -> None:
        self.wait()
        if self._made is not None:
            self._made.close()

