"""``python -m jaxtrain check [--config PATH] [key=value ...]``: device and collective health check."""

import sys

from jaxtrain.commands import add_config_arguments, start


def add_arguments(p):
    p.description = ("Check every device's matmul and the collectives (all-reduce, all-gather, reduce-scatter, "
                     "all-to-all) over every mesh axis, with bus bandwidth as nccl-tests defines it. Exits 1 naming "
                     "the axis or device that misses check.min_busbw_gbps / check.min_matmul_fraction or computes "
                     "wrong values. Uses the same mesh and process settings as train.")
    add_config_arguments(p)


def run(args) -> int:
    cfg = start(args)
    from jaxtrain import check, runtime

    failures = check.run(cfg)
    tag = runtime.process_tag()
    for failure in failures:
        print(f"check failed: {tag}{failure}", file=sys.stderr)
    if not failures:
        print(f"\n{tag}check passed")
    return 1 if failures else 0
