"""``python -m jaxtrain sweep``: short real runs of several layouts against the planner's figures for them: the
experiment's spec, running it and the report comparing measured with planned.

May import: errors, config, rundir, parallel and the planner.
"""
