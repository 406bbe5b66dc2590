"""Fixtures for the evaluation tests: loaded tiny targets, a random and a trained drafter, a chi-square.

The trained drafter makes acceptance tests meaningful: a random drafter is accepted almost never
(tau ~ 1), which would let a decoder that never accepts a draft pass every comparison. It is
trained for a few dozen steps on the target's own greedy continuations of a few prompts, so on
those prompts it is accepted often (whole blocks), and partly on others.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models are all per-op overhead; two threads on two shared cores only contend.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_target(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_drafter(target_dir, *, num_layers=2, block_size=4, layer_types=None, sliding_window=None, seed=0, std=0.1):
    from draftline.model.config import build_drafter_config
    from draftline.model.drafter import DFlashDrafter
    from draftline.model.target import load_target_config

    config = build_drafter_config(
        load_target_config(target_dir), num_hidden_layers=num_layers, block_size=block_size,
        layer_types=layer_types, sliding_window=sliding_window,
    )
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config).float()
    drafter.reset_parameters(std=std)
    return drafter.eval()


@pytest.fixture(scope="session")
def qwen3_model(qwen3_target):
    return load_target(qwen3_target)


@pytest.fixture(scope="session")
def llama_model(llama_target):
    return load_target(llama_target)


@pytest.fixture(scope="session")
def qwen3_5_target(tmp_path_factory):
    """A tiny Qwen3.5 hybrid: Gated DeltaNet layers (recurrent states) between full-attention ones."""
    from helpers import make_qwen3_5_target

    return make_qwen3_5_target(tmp_path_factory.mktemp("qwen3_5_target"))


@pytest.fixture(scope="session")
def qwen3_5_model(qwen3_5_target):
    return load_target(qwen3_5_target)


TRAIN_PROMPTS = [[17, 5, 230, 44, 91, 8], [3, 150, 150, 27, 260, 99], [201, 11, 64, 64, 7, 180]]


@pytest.fixture(scope="session")
def trained_drafter(qwen3_target, qwen3_model, tmp_path_factory):
    """(drafter dir, prompts): a [full, sliding(6)] block-8 drafter that memorised the target's replies."""
    from draftline.checkpoint.export import save_drafter
    from draftline.data.batch import PackedBatch
    from draftline.evaluate.speculative import target_generate
    from draftline.model.target import TargetFeatures, load_embedding_and_head
    from draftline.objective.loss import DFlashObjective, ObjectiveSettings

    torch.set_num_threads(1)
    docs = []
    for prompt in TRAIN_PROMPTS:
        ids = target_generate(qwen3_model, prompt, max_new_tokens=36).output_ids
        docs.append((ids, [i >= len(prompt) for i in range(len(ids))]))
    drafter = random_drafter(qwen3_target, num_layers=2, block_size=8,
                             layer_types=["full_attention", "sliding_attention"], sliding_window=6, std=0.02)
    drafter.train()
    features = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float32)
    batch = PackedBatch.from_documents(docs)
    hidden = features(batch)
    embed, head = load_embedding_and_head(qwen3_target, dtype=torch.float32)
    objective = DFlashObjective(drafter, embed, head, ObjectiveSettings(max_anchors=16, attention="dense"))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=4e-3)
    for step in range(40):
        objective.settings.seed = step  # new anchors every step
        blocks = objective.blocks(batch)
        loss_sum, _ = objective(hidden, blocks)
        optimizer.zero_grad()
        (loss_sum / blocks.label_weights.sum()).backward()
        optimizer.step()
    path = save_drafter(drafter.eval(), tmp_path_factory.mktemp("trained") / "drafter", dtype=torch.float32)
    return path, [list(p) for p in TRAIN_PROMPTS]


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's goodness of fit of ``counts`` [V] to ``probs`` [V]; cells expected < min_expected are pooled."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    if (counts[probs == 0] > 0).any():
        return 0.0  # an impossible outcome happened
    expected = counts.sum() * probs
    small = expected < min_expected
    observed_cells = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected_cells = torch.cat([expected[~small], expected[small].sum().view(1)])
    if expected_cells[-1] < min_expected:  # the pool itself too small: fold it into the largest cell
        observed_cells[expected_cells[:-1].argmax()] += observed_cells[-1]
        expected_cells[expected_cells[:-1].argmax()] += expected_cells[-1]
        observed_cells, expected_cells = observed_cells[:-1], expected_cells[:-1]
    if expected_cells.min() <= 0 or observed_cells.shape[0] < 2:
        return 1.0 if observed_cells.shape[0] < 2 else 0.0
    stat = ((observed_cells - expected_cells) ** 2 / expected_cells).sum()
    dof = observed_cells.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.fixture
def make_drafter():
    """``random_drafter(target_dir, num_layers=, block_size=, layer_types=, sliding_window=, seed=, std=)``."""
    return random_drafter


@pytest.fixture
def chi_square():
    return chi_square_pvalue
