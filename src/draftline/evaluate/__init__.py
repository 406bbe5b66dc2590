"""Evaluation: does the drafter get tokens accepted, and how fast is decoding with it.

- ``sampling``: the sampling distribution; greedy and rejection verification (the maths).
- ``speculative``: DFlash speculative decoding with a Hugging Face target, and target-only decoding.
- ``acceptance``: tau, the histogram, acceptance by slot; ``measure_acceptance`` for training.
- ``benchmark``: a prompt set with the target-only baseline (wall-clock speedup on GPU).
- ``prompts``: evaluation prompts from JSONL.
- ``run_log``, ``report``: plots and a summary of a run directory's metrics.jsonl.
"""
