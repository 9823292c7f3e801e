#!/usr/bin/env bash
# The first minutes on a GPU machine: benchmarks/gpu_check.py does the work (see its docstring, or --help).
#   benchmarks/gpu_check.sh --plan [--quick | --rest] [--budget S]       what a run would do, its caps and total
#   benchmarks/gpu_check.sh --quick --wheels DIR --out DIR [--work DIR]   the headline in at most 5 minutes
#   benchmarks/gpu_check.sh --rest --budget S --wheels DIR --out DIR      the other sections, after a quick run
#   benchmarks/gpu_check.sh --issue41 --wheels DIR --out DIR              issue 41's open figures, at most 9 minutes,
#                                                                         everything under --out
#   benchmarks/gpu_check.sh --smoke [--quick | --issue41]                 on a CPU, at toy sizes
#   benchmarks/gpu_check.sh --fetch-wheels DIR                            on a machine with a registry
exec "${PYTHON:-python3}" -B "$(dirname "$0")/gpu_check.py" "$@"  # -B: no __pycache__ in the checkout
