"""Greedy speculative decoding is lossless: its output is the target's own greedy decoding.

Three drafters on tiny Qwen3, Llama and Qwen3.5-hybrid targets: a random one (almost nothing accepted), a trained
one (whole blocks accepted on its prompts), and an oracle proposer that drafts the target's own
continuation except at chosen positions, which pins the exact acceptance lengths and checks the
loop's bookkeeping (the anchor is the last committed token, the context ends right before it).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from draftline.checkpoint.export import load_drafter
from draftline.errors import DraftlineError
from draftline.evaluate.speculative import speculative_generate, target_generate

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [120, 7], [33, 33, 60, 201, 9, 9, 14, 77, 150, 2, 88]]


class OracleProposer:
    """Drafts ``reference[p]`` for position p, or a wrong token where p is in ``wrong``."""

    def __init__(self, reference: list[int], vocab_size: int, block_size: int, wrong: set[int] = frozenset()):
        self.reference, self.vocab_size, self.block_size, self.wrong = reference, vocab_size, block_size, wrong
        self.mask_token_id = vocab_size - 1
        self.target_layer_ids = [0]
        self.seen = 0

    def reset(self):
        self.seen = 0

    def draft_logits(self, block_ids, anchor_pos, new_features):
        self.seen += new_features.shape[0]
        assert self.seen == anchor_pos, "the drafter's context must end right before the anchor"
        assert int(block_ids[0]) == self.reference[anchor_pos], "the anchor must be the last committed token"
        assert bool((block_ids[1:] == self.mask_token_id).all())
        tokens = []
        for pos in range(anchor_pos + 1, anchor_pos + block_ids.shape[0]):
            token = self.reference[pos] if pos < len(self.reference) else 0
            tokens.append((token + 1) % self.vocab_size if pos in self.wrong else token)
        return torch.nn.functional.one_hot(torch.tensor(tokens), self.vocab_size).float() * 10


def expected_lengths(num_prompt: int, max_new_tokens: int, block_size: int, wrong: set[int]) -> list[int]:
    """Acceptance lengths when every draft is right except at the ``wrong`` positions."""
    start, end, lengths = num_prompt, num_prompt + max_new_tokens, []
    while start + 1 < end:
        size = min(block_size, end - start)
        accepted = 0
        while accepted < size - 1 and start + 1 + accepted not in wrong:
            accepted += 1
        lengths.append(min(accepted + 1, end - start - 1))
        start += lengths[-1]
    return lengths


# With flash-linear-attention installed, transformers runs Gated DeltaNet with its GPU-only kernels.
_no_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                             reason="flash-linear-attention installed: hybrid targets run on GPU only")


@pytest.fixture(params=["qwen3", "llama", pytest.param("qwen3_5", marks=_no_fla)])
def target(request):
    """A target and its loaded model; qwen3_5 is a hybrid, whose recurrent layers cannot be cropped."""
    return request.getfixturevalue(f"{request.param}_target"), request.getfixturevalue(f"{request.param}_model")


def test_target_only_baseline_is_hf_greedy_generate(qwen3_model):
    prompt = PROMPTS[0]
    ours = target_generate(qwen3_model, prompt, max_new_tokens=20).output_ids
    hf = qwen3_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert ours == hf[0].tolist()


def test_lossless_with_a_random_drafter(target, make_drafter):
    target_dir, model = target
    drafter = make_drafter(target_dir, num_layers=2, block_size=4)
    for prompt in PROMPTS:
        reference = target_generate(model, prompt, max_new_tokens=18).output_ids
        result = speculative_generate(model, drafter, prompt, max_new_tokens=18)
        assert result.output_ids == reference
        assert sum(result.acceptance_lengths) == 18 - 1  # the first token comes from the prefill


def test_lossless_with_a_trained_drafter(qwen3_model, trained_drafter):
    path, prompts = trained_drafter
    drafter = load_drafter(path)
    lengths = []
    for prompt in prompts + [PROMPTS[0]]:
        reference = target_generate(qwen3_model, prompt, max_new_tokens=30).output_ids
        result = speculative_generate(qwen3_model, drafter, prompt, max_new_tokens=30)
        assert result.output_ids == reference
        lengths += result.acceptance_lengths
    assert max(lengths) == 8 and sum(lengths) / len(lengths) > 2  # whole blocks on what it learnt


@pytest.mark.parametrize("block_size,wrong", [(4, set()), (5, {9, 10, 16, 23, 24, 25}), (8, {12, 13, 21})])
def test_oracle_drafts_give_exact_acceptance_lengths(target, block_size, wrong):
    _, model = target
    _check_oracle(model, block_size, wrong)


def _check_oracle(model, block_size: int, wrong: set[int]) -> None:
    prompt, new = PROMPTS[0], 21
    reference = target_generate(model, prompt, max_new_tokens=new).output_ids
    oracle = OracleProposer(reference, model.config.vocab_size, block_size, wrong)
    result = speculative_generate(model, oracle, prompt, max_new_tokens=new)
    assert result.output_ids == reference
    assert result.acceptance_lengths == expected_lengths(len(prompt), new, block_size, wrong)


def test_stop_token_inside_an_accepted_block_ends_the_output_there(qwen3_model):
    prompt = PROMPTS[2]
    reference = target_generate(qwen3_model, prompt, max_new_tokens=24).output_ids
    stop_pos = len(prompt) + 9  # drafted in the middle of the second block of 8
    stop = reference[stop_pos]
    first = reference.index(stop, len(prompt))  # the token may occur earlier
    oracle = OracleProposer(reference, qwen3_model.config.vocab_size, 8)
    result = speculative_generate(qwen3_model, oracle, prompt, max_new_tokens=24, stop_token_ids=[stop])
    assert result.output_ids == reference[: first + 1]
    assert result.output_ids == target_generate(qwen3_model, prompt, max_new_tokens=24, stop_token_ids=[stop]).output_ids
    assert sum(result.acceptance_lengths) == first - len(prompt)


def test_token_limits(qwen3_target, qwen3_model, make_drafter):
    drafter = make_drafter(qwen3_target, num_layers=1, block_size=4)
    prompt = PROMPTS[1]
    one = speculative_generate(qwen3_model, drafter, prompt, max_new_tokens=1)
    assert len(one.output_ids) == len(prompt) + 1 and one.acceptance_lengths == []
    stopped_at_first = speculative_generate(qwen3_model, drafter, prompt, max_new_tokens=9,
                                            stop_token_ids=[one.output_ids[-1]])
    assert stopped_at_first.output_ids == one.output_ids and stopped_at_first.acceptance_lengths == []
    with pytest.raises(DraftlineError):
        speculative_generate(qwen3_model, drafter, prompt, max_new_tokens=0)
    with pytest.raises(DraftlineError):
        speculative_generate(qwen3_model, drafter, [], max_new_tokens=4)


def _agree_up_to_near_ties(model, reference: list[int], output: list[int]) -> bool:
    """Whether ``output`` is ``reference``, or leaves it only where the target's top two logits there are
    within fp32/tf32 rounding of each other (GPU kernels add their rounding; greedy decoding then may
    take the other of two near-equal tokens)."""
    if output == reference:
        return True
    first = next(i for i, (a, b) in enumerate(zip(reference, output)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([reference[:first]], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return bool(top[0] - top[1] <= 1e-3 * logits.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention (its GPU kernels)")
@pytest.mark.parametrize("block_size,wrong", [(4, set()), (5, {9, 10, 16, 23, 24, 25}), (8, {12, 13, 21})])
def test_a_hybrid_target_on_cuda_rolls_back_its_linear_attention_exactly(qwen3_5_target, make_drafter, block_size,
                                                                        wrong):
    """On CUDA with flash-linear-attention's kernels: the oracle's acceptance lengths are exact (the recurrent
    states roll back to the committed tokens, through transformers' own rewind or the restore and rerun of
    an older transformers), and a random drafter's decoding is the target's own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_5_target, dtype=torch.float32).cuda().eval()
    _check_oracle(model, block_size, wrong)
    drafter = make_drafter(qwen3_5_target, num_layers=2, block_size=block_size).cuda()
    for prompt in PROMPTS:
        reference = target_generate(model, prompt, max_new_tokens=18).output_ids
        output = speculative_generate(model, drafter, prompt, max_new_tokens=18).output_ids
        assert _agree_up_to_near_ties(model, reference, output), (reference, output)
