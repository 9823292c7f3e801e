"""``python -m jaxtrain check [--config PATH] [key=value ...]``: device and collective health check."""

import sys

from jaxtrain.commands import add_config_arguments, start


def add_arguments(p):
    p.description = ("Check every device's matmul (bfloat16 8192x8192 on GPUs) and the collectives (all-reduce, "
                     "all-gather, reduce-scatter, all-to-all, up to 1 GiB on GPUs) over every mesh axis, with bus "
                     "bandwidth as nccl-tests defines it, against the hardware file's peak and link rates "
                     "(check.hardware, else the shipped file matching the devices). Exits 1 naming the device or axis "
                     "that is slow or wrong; a process whose node is to blame prints 'check: exclude hosts: NODE' "
                     "(launch/slurm.sbatch excludes those nodes and requeues). Uses the same mesh and process "
                     "settings as train.")
    add_config_arguments(p)


def run(args) -> int:
    cfg = start(args)
    import jax

    from jaxtrain import health, log

    failures = health.run(cfg)
    tag = log.process_tag()
    for failure in failures:
        print(f"check failed: {tag}{failure}", file=sys.stderr)
    passed, failed = health.verdict(failures)  # every process agrees; process 0 says it
    if jax.process_index() == 0:
        if passed:
            print("\ncheck passed")
        else:
            print(f"\ncheck FAILED on {failed} of {jax.process_count()} process(es) (their lines above)", flush=True)
    return 0 if passed else 1
