"""``python -m jaxtrain sweep``: short real runs of several layouts against the planner's figures for them: the
experiment's spec (:mod:`.spec`: the experiment file and its runs), running it (:mod:`.run`: one training process
per run, the planner's prediction beside it) and the report comparing measured with planned (:mod:`.report`).

May import: errors, config, rundir, parallel and the planner.
"""
