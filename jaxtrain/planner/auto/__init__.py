"""``mesh.auto``: the planner chooses the layout (mesh, remat, microbatches, pipeline schedule) that ``train`` runs.

``choose`` (the search over the candidates and ``resolve``, which ``train`` calls; other modules import it as
``auto``), ``space`` (the candidate layouts, their closed-form rows, what a search returns), ``figures`` (the memory
pre-check before compiling, the hardware figures it ranks with), ``trial`` (the finalists measured by running their
steps), ``compile_cache`` (each compile's reading on disk, in the user's cache), ``report`` (why the choice won,
the table, JSON; imported as ``auto_report``).

May import: errors, config, cluster (the cache's directory), models, parallel, train (the step, the memory guard),
``planner.cost`` and ``planner.search``; never ``planner.xla_gpu`` (its compiler comes in as an argument).
"""
