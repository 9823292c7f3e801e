"""The processes and machines a run spans: what ``jax.distributed`` gets, from the config, the environment or Slurm,
and the start-up roll call (:mod:`.distributed`); the NVIDIA driver against the installed JAX CUDA plugin
(:mod:`.gpu_env`); process-level JAX settings, emulated CPU devices and the compile cache (:mod:`.process`); what a
collective over a mesh axis measures and which node a process runs on (:mod:`.links`); the runtime packages jaxtrain
needs, named in one line when any is missing (:mod:`.packages`).

May import: errors, log, config, rundir and the device-free ``parallel.dims``; nothing that builds a model or a mesh.
"""
