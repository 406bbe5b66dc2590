"""Sizing: what a run costs and whether it fits, before and while it runs.

- ``shapes``: the sizes the FLOP counter and the memory model read from a config.
- ``flops``: the project's one FLOP counter, layer by layer (docs/FLOPS.md).
- ``peak``: the GPU table (spec peaks, memory, links), the measured matmul ceiling, MFU.
- ``workload``: the reference workload, defined once: its length mix, its synthetic batches (sampled
  from the mix, or the preflight's worst case), its FLOPs per sample.
- ``plan``, ``memory_estimate``: the node's layouts, rates and memory per GPU (``draftline plan`` and
  ``train``'s default split).
- ``preflight``, ``peak_fit``: the memory check before training; the peaks it measures and their fit.
- ``demo``: the demo's size for this machine.
"""
