"""The monitor: the status of the line, its display and its loggers.

- ``live``: the first drafter's monitor (rates, MFU, the status every interval) and the other drafters'
  publishing; the FLOP counts and peaks it reads are ``sizing``'s.
- ``gpu``, ``clocks``: memory, utilisation and clocks per GPU (NVML when installed), never raising.
- ``status``: ``LineStatus`` (one snapshot = one ``kind: "train"`` record) and ``RateMeter``.
- ``dashboard``: a live ``rich`` panel on a terminal, plain lines in a log; ``balance_advice``.
- ``loggers``: metrics.jsonl, TensorBoard, W&B, and the null logger of non-logging ranks.
"""
