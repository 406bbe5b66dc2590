"""pipeline/spec.py: the run resolved once: how the drafter starts, a warm start's shape, the feature width."""

from __future__ import annotations

import json

import pytest
import torch

from draftline.checkpoint.export import save_drafter
from draftline.config import ModelConfig, OptimConfig, TrainConfig
from draftline.errors import DraftlineError
from draftline.model.drafter import DFlashDrafter
from draftline.pipeline.build import build_drafter
from draftline.pipeline.spec import INIT_DRAFTER, INIT_RANDOM, INIT_TARGET, ModelSpec, RunSpec


def _config(target, **model) -> TrainConfig:
    return TrainConfig(out="unused", model=ModelConfig(target=str(target), **model))


def test_the_drafter_starts_from_the_target_by_default_and_random_when_asked(qwen3_target):
    default = ModelSpec.resolve(_config(qwen3_target, draft_layers=2, block_size=4))
    assert default.init == INIT_TARGET and "target's top layers" in default.describe_init()
    random = ModelSpec.resolve(_config(qwen3_target, draft_layers=2, block_size=4, init_from_target=False))
    assert random.init == INIT_RANDOM
    started = {m.init: build_drafter(RunSpec.standalone(_config(qwen3_target), m, torch.device("cpu")))
               for m in (default, random)}
    from safetensors.torch import load_file

    target = load_file(qwen3_target / "model.safetensors")
    top = target["model.layers.7.mlp.down_proj.weight"]  # the target's last layer starts the drafter's last
    assert torch.equal(started[INIT_TARGET].layers[1].mlp.down_proj.weight, top)
    assert not torch.equal(started[INIT_RANDOM].layers[1].mlp.down_proj.weight, top)


def test_the_feature_width_counts_the_teacher_with_soft_labels(qwen3_target):
    config = _config(qwen3_target, draft_layers=2, block_size=4)
    plain = ModelSpec.resolve(config)
    config.optim = OptimConfig(distill=0.5, loss="dflash")
    soft = ModelSpec.resolve(config)
    assert plain.feature_width == 2 * 64 and soft.feature_width == 3 * 64
    assert soft.layers_run == 8 and plain.layers_run == max(plain.layer_ids) + 1


@pytest.fixture()
def released(qwen3_target, tmp_path):
    config = ModelSpec.resolve(_config(qwen3_target, draft_layers=2, block_size=4)).drafter_config
    return save_drafter(DFlashDrafter(config).float(), tmp_path / "released")


def test_a_warm_start_takes_the_drafters_shape_and_refuses_flags_that_contradict_it(qwen3_target, released,
                                                                                     monkeypatch):
    from draftline.checkpoint import export

    reads = []

    def counted(path, _read=export.read_drafter_config_json):
        reads.append(path)
        return _read(path)

    monkeypatch.setattr(export, "read_drafter_config_json", counted)  # the check and the config: one read
    spec = ModelSpec.resolve(_config(qwen3_target, init_drafter=str(released)))
    assert len(reads) == 1
    monkeypatch.undo()
    assert spec.init == INIT_DRAFTER and spec.block_size == 4 and spec.drafter_config.num_hidden_layers == 2
    from safetensors.torch import load_file

    started = build_drafter(RunSpec.standalone(_config(qwen3_target), spec, torch.device("cpu"))).state_dict()
    saved = load_file(released / "model.safetensors")
    assert saved and all(torch.equal(started[name], value.float()) for name, value in saved.items())
    assert ModelSpec.resolve(_config(qwen3_target, init_drafter=str(released), block_size=4)).block_size == 4
    with pytest.raises(DraftlineError) as info:
        ModelSpec.resolve(_config(qwen3_target, init_drafter=str(released), draft_layers=5, block_size=8))
    message = str(info.value)
    assert "--draft-layers 5 (the drafter has 2)" in message and "--block-size 8 (the drafter has 4)" in message
    with pytest.raises(DraftlineError, match="--init-drafter and --init-from-target"):
        ModelSpec.resolve(_config(qwen3_target, init_drafter=str(released), init_from_target=True))


def test_a_released_drafter_an_engine_would_load_wrongly_is_refused_before_training(qwen3_target, released):
    config = json.loads((released / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 7]  # the target's last layer: read after its norm only here
    (released / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftlineError, match="target_layer_ids"):
        ModelSpec.resolve(_config(qwen3_target, init_drafter=str(released)))


def test_a_drafter_for_another_target_is_refused_naming_the_field(qwen3_target, released):
    config = json.loads((released / "config.json").read_text())
    config["hidden_size"] = 2 * config["hidden_size"]
    (released / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftlineError, match="hidden_size") as info:
        ModelSpec.resolve(_config(qwen3_target, init_drafter=str(released)))
    assert "train a drafter for this target" in str(info.value)


def test_the_builders_take_the_targets_config_from_the_spec_and_read_it_no_more(qwen3_target, monkeypatch):
    import draftline.model.target as target_module
    from draftline.data.batch import PackedBatch
    from draftline.model.target import TargetFeatures
    from draftline.pipeline.build import build_target, target_embedding_and_head

    config = _config(qwen3_target, draft_layers=2, block_size=4)
    model = ModelSpec.resolve(config)
    spec = RunSpec.standalone(config, model, torch.device("cpu"), dtype=torch.float32)
    reference = TargetFeatures(qwen3_target, list(model.layer_ids), dtype=torch.float32)

    def refuse(*_):
        raise AssertionError("the target's config was read again after ModelSpec.resolve")

    monkeypatch.setattr(target_module, "load_target_config", refuse)  # warm_start takes the config it is given
    target = build_target(spec)
    drafter = build_drafter(spec)  # a start from the target's top layers
    embed, head = target_embedding_and_head(spec, None)
    batch = PackedBatch.from_documents([(list(range(5, 17)), [True] * 12), (list(range(20, 29)), [True] * 9)])
    torch.testing.assert_close(target(batch), reference(batch))
    assert target.layers_run == max(model.layer_ids) + 1 and len(drafter.layers) == 2
    assert torch.equal(embed, reference.embed_weight())
    assert model.target_file_config.num_hidden_layers == 8  # the spec's copy is not truncated by the builder


def _with_mask_tokenizer(qwen3_target, path):
    """The target's config beside a tokenizer with <|MASK|> at 300."""
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    path.mkdir()
    shutil.copy(qwen3_target / "config.json", path / "config.json")
    Tokenizer(WordLevel({"<unk>": 0, "a": 1, "<|MASK|>": 300}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    return path


def test_the_default_mask_token_is_the_one_the_engines_check(qwen3_target, tmp_path):
    """The target tokenizer's <|MASK|> where it has one (SGLang refuses another id), else today's rule (the last row)."""
    target = _with_mask_tokenizer(qwen3_target, tmp_path / "target")
    assert ModelSpec.resolve(_config(target, draft_layers=2, block_size=4)).drafter_config.dflash_config[
        "mask_token_id"] == 300
    assert ModelSpec.resolve(_config(qwen3_target, draft_layers=2, block_size=4)).drafter_config.dflash_config[
        "mask_token_id"] == 319
    with pytest.raises(DraftlineError, match=r"dflash_config.mask_token_id \(--mask-token-id\): is 5, but the target's"):
        ModelSpec.resolve(_config(target, draft_layers=2, block_size=4, mask_token_id=5))


def test_a_resume_is_refused_when_the_run_resolves_another_drafter_than_the_checkpoint_s(qwen3_target, line_data,
                                                                                       tmp_path):
    """A run started before the default mask token was the tokenizer's, resumed with the same flags, would
    otherwise go on with another mask row: it is refused, naming the value to resume with."""
    from draftline.checkpoint.export import drafter_config_dict
    from draftline.model.config import build_drafter_config
    from draftline.model.target import load_target_config
    from draftline.distributed.roles import COLOCATED, Role
    from draftline.distributed.setup import RunSetup
    from draftline.pipeline.spec import DistEnv, resolve_run

    checkpoint = tmp_path / "checkpoints" / "step-00000003"
    (checkpoint / "drafter").mkdir(parents=True)
    saved = build_drafter_config(load_target_config(qwen3_target), num_hidden_layers=2, block_size=4)  # mask 319
    (checkpoint / "drafter" / "config.json").write_text(json.dumps(drafter_config_dict(saved, torch.float32)))
    config = _config(_with_mask_tokenizer(qwen3_target, tmp_path / "target"), draft_layers=2, block_size=4)
    config.data.data = [str(line_data)]
    model = ModelSpec.resolve(config)  # mask 300 now
    setup = RunSetup("resume", str(checkpoint), 3, str(line_data), 1, 1, True)
    role = Role(0, COLOCATED, 0, 1, 1)
    with pytest.raises(DraftlineError) as info:
        resolve_run(config, model, role, DistEnv(), torch.device("cpu"), setup)
    message = str(info.value)
    assert "--mask-token-id 300 (the checkpoint's drafter has 319)" in message
    assert "resume with --mask-token-id 319" in message
    same = ModelSpec.from_configs(model.target_config, saved)  # the checkpoint's drafter: the resume goes on
    spec, _ = resolve_run(config, same, role, DistEnv(), torch.device("cpu"), setup)
    assert spec.start_step == 3
    # a checkpoint saved with bf16 AdamW moments continues with them only
    bf16 = RunSetup("resume", str(checkpoint), 3, str(line_data), 1, 1, True, moments="bf16")
    with pytest.raises(DraftlineError, match="resume with --moments bf16"):
        resolve_run(config, same, role, DistEnv(), torch.device("cpu"), bf16)
    config.optim.moments = "bf16"
    assert resolve_run(config, same, role, DistEnv(), torch.device("cpu"), bf16)[0].start_step == 3


def test_a_dspark_run_resolves_its_heads_the_final_hidden_state_and_their_costs(qwen3_target):
    from draftline.model.dspark import DSparkDrafter

    config = _config(qwen3_target, draft_layers=2, block_size=4, method="dspark", markov_rank=16,
                     markov_head_type="gated", confidence_head_with_markov=False)
    model = ModelSpec.resolve(config)
    d = model.drafter_config
    assert model.method.name == "dspark" and d.architectures == ["Qwen3DSparkModel"]
    assert (d.markov_rank, d.markov_head_type, d.enable_confidence_head, d.confidence_head_with_markov) == (
        16, "gated", True, False)
    # The target runs every layer and sends its final hidden state beside the 2 feature layers.
    assert model.final_hidden and model.feature_width == 3 * 64 and model.layers_run == 8
    heads = 2 * 320 * 16 + (64 + 16) * 16 + 16 + 64 + 1  # Markov embedding and projection, gate, confidence head
    assert model.drafter_shape.method.head_params == heads and model.drafter_shape.drafted_slots == 4
    drafter = build_drafter(RunSpec.standalone(config, model, torch.device("cpu")))
    assert isinstance(drafter, DSparkDrafter)
    assert sum(p.numel() for head in drafter.heads() for p in head.parameters()) == heads
    dflash = ModelSpec.resolve(_config(qwen3_target, draft_layers=2, block_size=4))
    assert model.num_trained_params == dflash.num_trained_params + heads


def test_a_warm_start_from_a_dspark_drafter_keeps_its_heads_and_refuses_others(qwen3_target, tmp_path):
    from draftline.checkpoint.export import save_drafter
    from draftline.model.dspark import DSparkDrafter

    spec = ModelSpec.resolve(_config(qwen3_target, draft_layers=2, block_size=4, method="dspark", markov_rank=8))
    released = save_drafter(DSparkDrafter(spec.drafter_config).float(), tmp_path / "released")
    warm = ModelSpec.resolve(_config(qwen3_target, init_drafter=str(released)))
    assert warm.method.name == "dspark" and warm.drafter_config.markov_rank == 8 and warm.final_hidden
    for flags, said in (({"method": "dflash"}, "--method dflash (the drafter has dspark)"),
                        ({"method": "dspark", "markov_rank": 16}, "--markov-rank 16 (the drafter has 8)"),
                        ({"method": "dspark", "confidence_head": False}, "--no-confidence-head (the drafter has True)")):
        with pytest.raises(DraftlineError) as info:
            ModelSpec.resolve(_config(qwen3_target, init_drafter=str(released), **flags))
        assert said in str(info.value)


def test_dspark_drafts_with_full_attention_for_a_hybrid_target_unless_told_otherwise(tmp_path):
    """DeepSpec and SpecForge train DSpark with full attention only (SpecForge's Qwen3.6-27B DSpark config: five
    full layers); DFlash keeps the released drafters' sliding x (n-1) + full for a hybrid target."""
    from transformers import Qwen3_5TextConfig

    from helpers import _HYBRID

    Qwen3_5TextConfig(**{**_HYBRID, "intermediate_size": 128}).save_pretrained(tmp_path / "hybrid")
    resolve = lambda **model: ModelSpec.resolve(_config(tmp_path / "hybrid", draft_layers=3, block_size=4,  # noqa: E731
                                                        init_from_target=False, **model)).drafter_config
    assert resolve().layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert resolve(method="dspark").layer_types == ["full_attention"] * 3
    told = resolve(method="dspark", layer_types=["sliding_attention", "full_attention", "full_attention"],
                   sliding_window=64)
    assert told.layer_types[0] == "sliding_attention" and told.sliding_window == 64


def test_the_target_is_built_in_fp8_when_asked(qwen3_target):
    from draftline.model.fp8 import Fp8Linear
    from draftline.pipeline.build import build_target

    config = _config(qwen3_target, draft_layers=2, block_size=4)
    config.model.target_fp8 = True
    spec = RunSpec.standalone(config, ModelSpec.resolve(config), torch.device("cpu"), dtype=torch.float32)
    layers = build_target(spec).decoder.layers
    assert sum(isinstance(m, Fp8Linear) for m in layers.modules()) == 7 * len(layers)  # q, k, v, o, gate, up, down
