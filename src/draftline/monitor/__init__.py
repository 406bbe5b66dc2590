"""The monitor: FLOP counting and MFU, GPU stats, the status snapshot, its display and its loggers.

- ``flops``: the project's one FLOP counter (docs/PERF.md) and the peak MFU is measured against.
- ``gpu``: memory and utilisation per GPU (NVML when installed), never raising.
- ``status``: ``LineStatus`` (one snapshot = one ``kind: "train"`` record) and ``RateMeter``.
- ``dashboard``: a live ``rich`` panel on a terminal, plain lines in a log; ``balance_advice``.
- ``loggers``: metrics.jsonl, TensorBoard, W&B, and the null logger of non-logging ranks.
"""
