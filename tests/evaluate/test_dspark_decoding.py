"""DSpark decoding: lossless, and equal token for token to a one-token-at-a-time oracle.

The oracle shares nothing with ``evaluate.speculative`` but the drafter's weights: for every draft it reruns
the target on the whole prefix (no cache) for the context features, reruns the drafter on the whole block with
the dense training mask (no cache), reads the ONE slot it drafts, adds the Markov bias written out by hand
(``W2 W1[previous draft]``), and verifies the drafts with a full rerun of the target. Its drafts, committed
tokens and acceptance lengths must be ours. A drafter trained for a few dozen steps on the target's own
continuations makes the comparison meaningful (whole blocks accepted); a random one with a strong Markov head
makes the correction decide the drafts.
"""

from __future__ import annotations

import pytest
import torch

from draftline.errors import DraftlineError
from draftline.evaluate.dspark_proposer import DSparkProposer
from draftline.evaluate.sampling import Sampling, probabilities
from draftline.evaluate.speculative import speculative_generate, target_generate
from draftline.model.attention import BlockLayout, make_attention
from draftline.model.target import load_target_config
from helpers import make_dspark_drafter

TRAIN_PROMPTS = [[17, 5, 230, 44, 91, 8], [3, 150, 150, 27, 260, 99], [201, 11, 64, 64, 7, 180]]
OTHER_PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [120, 7]]


def _dspark(target_dir, **options):
    return make_dspark_drafter(load_target_config(target_dir), target_layer_ids=(1, 5), **options)


@pytest.fixture(scope="module")
def trained(qwen3_target, qwen3_model):
    """A block-6 DSpark drafter trained 40 steps on the target's greedy continuations of TRAIN_PROMPTS."""
    from draftline.data.batch import PackedBatch
    from draftline.model.target import TargetFeatures, load_embedding_and_head
    from draftline.objective.dspark import DSparkObjective
    from draftline.objective.loss import ObjectiveSettings

    torch.set_num_threads(1)
    docs = []
    for prompt in TRAIN_PROMPTS:
        ids = target_generate(qwen3_model, prompt, max_new_tokens=36).output_ids
        docs.append((ids, [i >= len(prompt) for i in range(len(ids))]))
    drafter = _dspark(qwen3_target, block_size=6, markov_rank=16, std=0.02).train()
    batch = PackedBatch.from_documents(docs)
    features = TargetFeatures(qwen3_target, drafter.target_layer_ids, dtype=torch.float32, final_hidden=True)(batch)
    embed, head = load_embedding_and_head(qwen3_target, dtype=torch.float32)
    objective = DSparkObjective(drafter, embed, head, ObjectiveSettings(max_anchors=16, attention="dense"))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=4e-3)
    for step in range(40):
        objective.settings.seed = step
        blocks = objective.blocks(batch)
        loss_sum, metrics = objective(features, blocks)
        optimizer.zero_grad()
        (loss_sum / blocks.label_weights.sum()).backward()
        optimizer.step()
    return drafter.eval()


@torch.no_grad()
def oracle_generate(target, drafter, prompt, max_new_tokens):
    """Greedy speculative decoding with the DSpark drafter, one draft per drafter call, nothing cached."""
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    size, mask = drafter.block_size, drafter.config.dflash_config["mask_token_id"]
    end = len(prompt) + max_new_tokens
    tokens = list(prompt) + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
    lengths = []
    while len(tokens) < end:
        s = len(tokens) - 1  # the anchor: the last committed token
        states = target(torch.tensor([tokens[:s]]), output_hidden_states=True).hidden_states
        context = torch.cat([states[i + 1][0] for i in drafter.target_layer_ids], dim=-1)
        layout = BlockLayout(torch.zeros(s, dtype=torch.long), torch.arange(s), torch.zeros(1, dtype=torch.long),
                             torch.tensor([s]), size)
        block = torch.tensor([tokens[s]] + [mask] * (size - 1))
        drafts, previous = [], tokens[s]
        for slot in range(min(size, end - s - 1)):
            hidden = drafter(embed[block], context, layout.block_positions(), torch.arange(s),
                             make_attention(layout, drafter.config, "dense"))[slot]
            logits = head @ hidden + w2 @ w1[previous]
            previous = int(logits.argmax())
            drafts.append(previous)
        best = target(torch.tensor([tokens + drafts])).logits[0, s:].argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == best[accepted]:
            accepted += 1
        committed = (drafts[:accepted] + [best[accepted]])[: end - len(tokens)]
        tokens += committed
        lengths.append(len(committed))
    return tokens, lengths


def test_greedy_is_lossless_and_equals_the_oracle(trained, qwen3_model):
    lengths_seen = []
    for prompt in TRAIN_PROMPTS[:2] + OTHER_PROMPTS:
        ours = speculative_generate(qwen3_model, DSparkProposer(trained, qwen3_model), prompt, max_new_tokens=24)
        assert ours.output_ids == target_generate(qwen3_model, prompt, max_new_tokens=24).output_ids
        tokens, lengths = oracle_generate(qwen3_model, trained, prompt, 24)
        assert ours.output_ids == tokens and ours.acceptance_lengths == lengths
        lengths_seen += lengths
    # Whole blocks accepted (B drafts + the target's token) and rejections too: the comparison has teeth.
    assert max(lengths_seen) == trained.block_size + 1 and min(lengths_seen) == 1, lengths_seen


def test_the_markov_head_decides_the_drafts(qwen3_target, qwen3_model):
    """With a strong Markov head our drafts are the oracle's, and not what the base logits alone would draft."""
    drafter = _dspark(qwen3_target, block_size=5, markov_rank=8, std=0.05).eval()
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.normal_(0.0, 2.0)
        drafter.markov_head.markov_w2.weight.normal_(0.0, 2.0)
    prompt = OTHER_PROMPTS[0]
    ours = speculative_generate(qwen3_model, DSparkProposer(drafter, qwen3_model), prompt, max_new_tokens=12)
    tokens, lengths = oracle_generate(qwen3_model, drafter, prompt, 12)
    assert ours.output_ids == tokens and ours.acceptance_lengths == lengths

    proposer = DSparkProposer(drafter, qwen3_model)
    anchor_pos = len(prompt) - 1  # the prompt's last token is the anchor; the context is the tokens before it
    with torch.no_grad():
        states = qwen3_model(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states
        features = torch.cat([states[i + 1][0] for i in drafter.target_layer_ids], dim=-1)
        drafts, probs = proposer.propose(torch.tensor(prompt[-1]), anchor_pos, features, 5, Sampling(), None)
        assert probs is None and len(proposer.confidences) == 1 and proposer.confidences[0].shape == (5,)
        block = torch.full((5,), drafter.config.dflash_config["mask_token_id"])
        block[0] = prompt[-1]
        proposer.reset()
        assert proposer.confidences == []
        base = proposer.head_logits(proposer.block_hidden(block, anchor_pos, features))
    assert not torch.equal(drafts, base.argmax(-1)), "the Markov bias should change the drafts here"


def test_block_override_is_refused_and_a_stop_token_ends(trained, qwen3_model):
    with pytest.raises(DraftlineError, match="drafts from blocks of 6"):
        speculative_generate(qwen3_model, DSparkProposer(trained, qwen3_model), TRAIN_PROMPTS[0], max_new_tokens=8, block_size=4)
    full = speculative_generate(qwen3_model, DSparkProposer(trained, qwen3_model), TRAIN_PROMPTS[0], max_new_tokens=20)
    stop = full.output_ids[len(TRAIN_PROMPTS[0]) + 5]
    cut = speculative_generate(qwen3_model, DSparkProposer(trained, qwen3_model), TRAIN_PROMPTS[0], max_new_tokens=20, stop_token_ids=[stop])
    assert cut.output_ids == full.output_ids[: full.output_ids.index(stop, len(TRAIN_PROMPTS[0])) + 1]


# ---- sampling: the draft distributions handed to rejection sampling are the corrected ones ---------------

VOCAB, NEW_TOKENS, PROMPT = 8, 4, [1, 4, 2, 6]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """An 8-token target (exact distributions by enumeration) and a random block-3 DSpark drafter whose Markov
    head moves its distributions far from the base logits'."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         initializer_range=0.15, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("small_target")
    Qwen3ForCausalLM(config).float().save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    drafter = make_dspark_drafter(load_target_config(path), num_layers=1, block_size=3, markov_rank=4,
                                  target_layer_ids=(0,), std=0.2)
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.normal_(0.0, 1.5)
        drafter.markov_head.markov_w2.weight.normal_(0.0, 1.5)
    return model, drafter.eval()


def exact_marginals(model, sampling):
    """P(generated token i = v), i = 1..NEW_TOKENS, under target-only sampling, by enumerating every prefix."""
    prefixes = torch.cartesian_prod(*[torch.arange(VOCAB)] * (NEW_TOKENS - 1))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        probs = probabilities(model(ids).logits[:, len(PROMPT) - 1:], sampling).double()
    marginals, path = [], torch.ones(len(prefixes), dtype=torch.float64)
    for i in range(NEW_TOKENS):
        marginals.append((path[:, None] * probs[:, i]).sum(0) / VOCAB ** (NEW_TOKENS - 1 - i))
        if i < NEW_TOKENS - 1:
            path = path * probs[:, i].gather(1, prefixes[:, i : i + 1])[:, 0]
    return marginals


def worst_pvalue(model, drafter, sampling, runs, chi_square):
    generator = torch.Generator().manual_seed(1234)
    out = torch.empty(runs, NEW_TOKENS, dtype=torch.long)
    for r in range(runs):
        result = speculative_generate(model, DSparkProposer(drafter, model), PROMPT, max_new_tokens=NEW_TOKENS, sampling=sampling,
                                      generator=generator)
        out[r] = torch.tensor(result.output_ids[len(PROMPT):])
    marginals = exact_marginals(model, sampling)
    return min(chi_square(torch.bincount(out[:, i], minlength=VOCAB), marginals[i]) for i in range(NEW_TOKENS))


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_p=0.9, top_k=5)], ids=["t1", "t0.8-p0.9-k5"])
def test_sampled_tokens_follow_the_target_distribution(small, sampling, chi_square):
    assert worst_pvalue(*small, sampling, 200, chi_square) > 1e-3


def test_handing_the_uncorrected_distributions_fails_the_same_check(small, chi_square, monkeypatch):
    """Drafts drawn from the corrected distributions but verified against the base logits' break losslessness:
    the check above sees which distributions reach rejection sampling."""
    draw = DSparkProposer.draw

    def uncorrected(self, base, hidden, anchor, sampling, generator):
        drafts, _ = draw(self, base, hidden, anchor, sampling, generator)
        return drafts, probabilities(base, sampling)

    monkeypatch.setattr(DSparkProposer, "draw", uncorrected)
    assert worst_pvalue(*small, Sampling(1.0), 120, chi_square) < 1e-6
