"""--activation-checkpointing (which the out-of-memory message recommends) recomputes each drafter
layer in backward and trains exactly as without it (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch.utils.checkpoint

from draftline.cli import main
from line_helpers import base_args, step_losses


def _counting_checkpoint(calls: dict):
    real = torch.utils.checkpoint.checkpoint

    def checkpoint(function, *args, **kwargs):
        calls["wrapped"] += 1

        def counted(*a, **k):
            calls["layer_forwards"] += 1
            return function(*a, **k)

        return real(counted, *args, **kwargs)

    return checkpoint


def test_activation_checkpointing_recomputes_the_layers_and_changes_no_loss(qwen3_target, line_data, tmp_path,
                                                                             monkeypatch):
    calls = {"wrapped": 0, "layer_forwards": 0}
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", _counting_checkpoint(calls))
    runs = {}
    for name, extra in (("plain", []), ("checkpointed", ["--activation-checkpointing"])):
        out = tmp_path / name
        before = dict(calls)
        args = base_args(qwen3_target, line_data, out, max_steps=4, trace=True, draft_layers=2, dtype="float32")
        assert main(["train", *args, *extra]) == 0
        runs[name] = (step_losses(out), {k: calls[k] - before[k] for k in calls})
    (plain, plain_calls), (checkpointed, checkpointed_calls) = runs["plain"], runs["checkpointed"]
    assert plain_calls == {"wrapped": 0, "layer_forwards": 0}
    # Every wrapped layer call ran its forward twice: once in forward, once recomputed in backward.
    assert checkpointed_calls["wrapped"] > 0
    assert checkpointed_calls["layer_forwards"] == 2 * checkpointed_calls["wrapped"]
    assert plain.keys() == checkpointed.keys() == {1, 2, 3, 4}
    for step, loss in plain.items():
        assert checkpointed[step] == pytest.approx(loss, rel=1e-6, abs=1e-9), step
