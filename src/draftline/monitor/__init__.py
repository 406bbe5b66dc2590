"""The monitor: FLOP counting and MFU, GPU stats, the status snapshot, its display and its loggers.

- ``flops``: the project's one FLOP counter, layer by layer (docs/FLOPS.md); ``shapes``: the sizes it
  reads from a config; ``reference``: the reference workload; ``peak``: the spec peak MFU is quoted
  against, the measured matmul ceiling, GPU specs by name.
- ``gpu``: memory and utilisation per GPU (NVML when installed), never raising.
- ``status``: ``LineStatus`` (one snapshot = one ``kind: "train"`` record) and ``RateMeter``.
- ``dashboard``: a live ``rich`` panel on a terminal, plain lines in a log; ``balance_advice``.
- ``loggers``: metrics.jsonl, TensorBoard, W&B, and the null logger of non-logging ranks.
"""
