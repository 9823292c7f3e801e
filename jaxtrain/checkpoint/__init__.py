"""Checkpoints: the format (Orbax save and restore of the train state with its metadata, checksums, damaged steps,
restoring onto another mesh; :mod:`.format`), the Orbax I/O details and preemption signals (:mod:`.orbax_io`), and
local (emergency) copies on a host-local directory with a peer's copy (:mod:`.local`).

May import: errors, log, config, rundir (and the package's version). Never the model, the step or the loop: a
checkpoint is a tree of arrays plus JSON, whatever wrote it.
"""
