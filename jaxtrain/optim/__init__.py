"""The optimizer and the train state: AdamW with global-norm clipping and its learning-rate schedule, and the
parameters and optimizer state as one NNX graph (:mod:`.state`), sharded like the parameters.

May import: config and models.
"""
