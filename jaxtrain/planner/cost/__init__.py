"""What a step costs: its compiled program read as data, and the cost model that prices it with hardware figures.

``hlo`` (HLO text -> instructions, computations, shapes, loop trip counts; pure text), ``collectives`` (the
collectives a program states: kind, bytes per device, executions per step, replica groups), ``passes`` (XLA:GPU's
collective passes that XLA:CPU does not run, re-created on the parsed HLO), ``memory`` (closed forms of the memory
per device: state, gradients, activations, an MoE layer's buffers), ``model`` (the cost model: bytes per link class,
time per part of a step, closed forms of communication; other modules import it as ``cost``),
``measure`` (the hardware at hand: the CPU measured, an accelerator recognised), ``calibration`` (what ``check``
measured, saved for the planner; the health check writes it), ``measured`` (a shipped GPU's measured rates,
``jaxtrain/configs/hardware/measured/``, with their provenance).

May import: errors, config, models (FLOP and parameter counts, the model ``measure`` times) and parallel (the parallel
facts, the closed forms of the expert dispatch and the pipeline); never the rest of the planner.
"""
