"""Training: the compiled step (loss, gradient strategies: plain, accumulated over microbatches, pipelined; the
optimizer update; :mod:`.step`), the loop (batches, metrics, evaluation, checkpoints, stops, the summary;
:mod:`.loop`) and the memory checks made before anything is allocated (:mod:`.guards`).

May import: every room below it: config, cluster, models, optim, parallel, checkpoint, data, observe.
"""
