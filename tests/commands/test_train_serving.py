"""``draftline train`` and the serving check: a default run exports; a run no engine would serve is refused
before it trains, naming the field, the flag and the fix, with nothing written."""

from __future__ import annotations

import json
import shutil

import pytest

from draftline.checkpoint.serving import check_drafter_dir
from draftline.cli import main
from line_helpers import run, write_dataset


@pytest.fixture(scope="module")
def masked_target(qwen3_target, tmp_path_factory):
    """The 8-layer qwen3 target (vocabulary 320) with a tokenizer that has <|MASK|> at id 300."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    path = shutil.copytree(qwen3_target, tmp_path_factory.mktemp("masked") / "target")
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, 320) if i != 300}, "<|MASK|>": 300}
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    return path


def test_a_default_train_makes_a_drafter_its_own_export_takes(masked_target, tmp_path, capsys):
    """No flag but the step count: the mask token is the tokenizer's <|MASK|> (300), not the last row (319),
    which SGLang would refuse, and export writes what train made."""
    data = write_dataset(tmp_path / "data", num_docs=4, min_len=24, max_len=40)
    out = tmp_path / "run"
    assert main(["train", "--target", str(masked_target), "--data", str(data), "--out", str(out),
                 "--max-steps", "2", "--device", "cpu"]) == 0
    assert json.loads((out / "final" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 300
    capsys.readouterr()
    assert main(["export", str(out), str(tmp_path / "export")]) == 0
    assert "read from the sources of vLLM 0.33.0 and SGLang 0.5.23; no engine code was run" in capsys.readouterr().out
    assert check_drafter_dir(tmp_path / "export", masked_target) == []


_REFUSED = "the drafter this run would train is one vLLM 0.33.0 and SGLang 0.5.23 would not load as it is trained"


@pytest.mark.parametrize("flags,expected", [
    (["--target-layer-ids", "1,7"],
     ["dflash_config.target_layer_ids (--target-layer-ids): [1, 7] holds 7, the target's last layer",
      "Fix: train with target_layer_ids below 7"]),
    (["--mask-token-id", "319"],
     ["dflash_config.mask_token_id (--mask-token-id): is 319, but the target's tokenizer has '<|MASK|>' "
      "(SGLang's default mask token) at 300; SGLang 0.5.23 refuses the conflict at start",
      "Fix: train with mask_token_id 300"]),
], ids=["last-layer", "mask-token"])
def test_train_refuses_a_drafter_no_engine_would_serve_before_it_trains(masked_target, line_data, tmp_path, capsys,
                                                                        flags, expected):
    out = tmp_path / "run"
    code = main(["train", "--target", str(masked_target), "--data", str(line_data), "--out", str(out),
                 "--device", "cpu", "--max-steps", "2", *flags])
    err = capsys.readouterr().err
    assert code == 2 and f"draftline train: error: {_REFUSED}" in err and "nothing was trained" in err, err
    for text in expected:
        assert text in err, err
    assert not out.exists()


def test_the_refusal_is_a_message_and_an_exit_code_not_a_traceback(masked_target, line_data, tmp_path):
    out = tmp_path / "run"
    result = run(["--target", str(masked_target), "--data", str(line_data), "--out", str(out), "--device", "cpu",
                  "--target-layer-ids", "1,7", "--mask-token-id", "319"], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert _REFUSED in result.stderr and "(2 problems;" in result.stderr, result.stderr[-3000:]
    assert not out.exists()


def test_a_resume_continues_its_drafter_with_a_warning_not_a_refusal(masked_target, capsys):
    """A run that an older default started with mask row 319 can still be resumed: the rules are said as a
    warning that export will refuse the drafter until it is mended, not raised."""
    from draftline.config import TrainConfig
    from draftline.pipeline.spec import ModelSpec

    config = TrainConfig()
    config.model.target, config.model.mask_token_id = str(masked_target), 319
    with pytest.raises(Exception, match="would not load as it is trained"):
        ModelSpec.resolve(config)
    config.checkpoint.resume = True
    spec = ModelSpec.resolve(config)
    assert spec.drafter_config.dflash_config["mask_token_id"] == 319
    out = capsys.readouterr().out
    assert "draftline: warning:" in out and "`draftline export` will refuse it" in out and "mask_token_id 300" in out
