"""``python -m jaxtrain check [--config PATH] [key=value ...]``: device and collective health check."""

import sys

from jaxtrain.commands import add_config_arguments, start


def add_arguments(p):
    p.description = ("Check every device's matmul (bfloat16 8192x8192 on GPUs) and the collectives (all-reduce, "
                     "all-gather, reduce-scatter, all-to-all) over every mesh axis, with bus bandwidth as "
                     "nccl-tests defines it, against the hardware file's peak and link rates (check.hardware, else the "
                     "shipped file listing the devices' exact kind; none: measured and reported, nobody excluded). "
                     "A bound missed on more than check.bound_misfit_fraction of the nodes does not fit the hardware: "
                     "reported, not a failure. Other misses exit 1 naming the node; process 0 prints 'check: exclude "
                     "hosts: NODE,...' (at most check.max_exclude_fraction of the nodes), which launch/slurm.sbatch "
                     "excludes before requeueing. Uses the same mesh and process settings as train.")
    add_config_arguments(p)


def run(args) -> int:
    cfg = start(args)
    import jax

    from jaxtrain.health import check as health

    decision = health.run(cfg)  # the same on every process; process 0 says it
    if jax.process_index() == 0:
        for f in decision.failures:
            print(f"check failed: node {f.host}: {f.detail}", file=sys.stderr, flush=True)
        nodes = sorted({f.host for f in decision.failures})
        if decision.failed:
            print(f"\ncheck FAILED on {len(nodes)} node(s): {', '.join(nodes)} (lines above)", flush=True)
        else:
            print(f"\ncheck passed{' (bounds that do not fit this hardware: see above)' if decision.misfits else ''}",
                  flush=True)
    return 1 if decision.failed else 0
