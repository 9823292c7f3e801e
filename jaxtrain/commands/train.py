"""``python -m jaxtrain train [--config PATH] [key=value ...]``."""

import gc

from jaxtrain.commands import add_config_arguments, start
from jaxtrain.errors import EXIT_PREEMPTED


def add_arguments(p):
    p.description = ("Train a model. Overrides are dotted key=value pairs, e.g. train.steps=100 mesh.ici.fsdp=8 "
                     "runtime.cpu_devices=8. Running the same command again resumes from the latest checkpoint. "
                     f"Exit status 0: finished; {EXIT_PREEMPTED}: stopped by a signal (preemption, time limit) before "
                     "train.steps with its checkpoint saved: run it again to continue.")
    add_config_arguments(p)


def run(args) -> int:
    collecting = gc.isenabled()
    gc.disable()  # the imports' objects live for the whole process: collecting while they arrive finds nothing
    try:
        cfg = start(args)
        from jaxtrain.train import loop
    finally:
        gc.freeze()  # and later collections skip them
        if collecting:
            gc.enable()
    import jax

    from jaxtrain import log
    from jaxtrain.config import config_warnings

    for line in config_warnings(cfg) if jax.process_index() == 0 else []:  # valid, but probably not what was
        log.info(f"warning: {line}")  # meant: said once per job, before the long work
    compiled = None
    if cfg.mesh.auto:  # the planner picks the layout where it is first needed (docs/auto-layout.md)
        from jaxtrain.planner.auto import choose as auto

        cfg, compiled = auto.resolve(cfg, log.info)  # and its search's compile of the choice, reused
    result = loop.train(cfg, compiled=compiled)
    # EX_TEMPFAIL, not 0: a scheduler must tell "finished" from "saved and stopped early" to restart the latter
    # (a JobSet counts a pod that exits 0 as completed and never restarts it).
    # A signal at the last step changes nothing: that run finished.
    stopped_early = result.preempted_at is not None and result.preempted_at < cfg.train.steps
    return EXIT_PREEMPTED if stopped_early else 0
