"""``plan``'s search over meshes: every candidate layout's real train step compiled ahead of time and read.

``target`` (what a plan is for: the hardware, the devices that compile, the node count, the config as it would run
there, the meshes to plan), ``meshes`` (candidate meshes, pruning, compiling the train step for each, its reading
and rank; other modules import it as ``search``), ``report`` (the plan as a table and as JSON, the training budget).

May import: errors, config, models, parallel, train (the step it compiles) and ``planner.cost``; never
``planner.auto`` or ``planner.xla_gpu`` (a GPU compiler reaches the search as an argument).
"""
