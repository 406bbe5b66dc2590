"""The training config: each option declared once (its field and ``opt``), flags and checks derived from
that; batches per optimizer step; the checks between fields."""

from __future__ import annotations

import argparse

import torch

from draftline.commands.train import add_arguments, config_from_args
from draftline.config import DSPARK_ONLY, TrainConfig, default_q_hs
from draftline.pipeline.spec import default_batches_per_step as grad_accum_batches


def test_grad_accum_is_per_drafter():
    config = TrainConfig()
    config.optim.grad_accum = 2
    assert [grad_accum_batches(config, d) for d in (1, 2, 7)] == [2, 4, 14]


def test_global_batch_tokens_round_up_to_an_equal_share_per_drafter():
    config = TrainConfig()
    config.data.token_budget = 32768
    config.optim.global_batch_tokens = 100_000  # 4 batches
    assert [grad_accum_batches(config, d) for d in (1, 3, 5)] == [4, 6, 5]


def test_colocated_flag_reaches_the_topology():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--target", "t", "--data", "d", "--out", "o", "--colocated"]))
    assert config.topology.colocated is True
    assert config_from_args(parser.parse_args(["--target", "t", "--data", "d", "--out", "o"])).topology.colocated is False


def test_q_hs_defaults_by_layout_and_a_given_one_is_kept():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = ["--target", "t", "--data", "d", "--out", "o"]
    assert config_from_args(parser.parse_args(args)).topology.q_hs is None
    assert (default_q_hs(None, colocated=True), default_q_hs(None, colocated=False)) == (2, 8)
    given = config_from_args(parser.parse_args([*args, "--q-hs", "5"])).topology.q_hs
    assert given == 5 and default_q_hs(given, colocated=True) == default_q_hs(given, colocated=False) == 5


def test_loss_gamma_flag_and_its_check():
    import pytest

    from draftline.config import validate
    from draftline.errors import DraftlineError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--target", "t", "--data", "d", "--out", "o", "--loss", "dflash",
                                                 "--loss-gamma", "2"]))
    assert config.optim.loss_gamma == 2.0
    config.optim.loss_gamma = 0.0
    with pytest.raises(DraftlineError, match="loss_gamma"):
        validate(config)


def test_distill_flag_and_its_range():
    import pytest

    from draftline.config import validate
    from draftline.errors import DraftlineError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--target", "t", "--data", "d", "--out", "o", "--loss", "dflash",
                                                 "--distill", "0.5"]))
    assert config.optim.distill == 0.5
    validate(config)
    config.optim.distill = 1.5
    with pytest.raises(DraftlineError, match=r"--distill\) must be in \[0, 1\]"):
        validate(config)


def test_final_acceptance_settings_flags_defaults_and_checks():
    import pytest

    from draftline.config import validate
    from draftline.errors import DraftlineError
    from draftline.pipeline.build import build_evaluation

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--target", "t", "--data", "d", "--out", "o"]
    config = config_from_args(parser.parse_args(base))
    # The final measurement defaults to what `draftline eval` measures: every prompt, 256 tokens.
    assert (config.monitor.eval_final_num_prompts, config.monitor.eval_final_max_new_tokens) == (None, 256)
    config = config_from_args(parser.parse_args([*base, "--eval-num-prompts", "4", "--eval-max-new-tokens", "32",
                                                 "--eval-final-num-prompts", "24", "--eval-final-max-new-tokens", "64"]))
    import torch
    from transformers import Qwen3Config

    from draftline.model.config import build_drafter_config
    from draftline.distributed.shard import DrafterGroup
    from draftline.pipeline.spec import ModelSpec, RunSpec

    target = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = ModelSpec.from_configs(target, build_drafter_config(target, num_hidden_layers=1, block_size=4))
    evaluation = build_evaluation(RunSpec.standalone(config, model, torch.device("cpu")), DrafterGroup(), None)
    assert evaluation.settings(final=False) == (4, 32) and evaluation.settings(final=True) == (24, 64)
    validate(config)
    config.monitor.eval_final_num_prompts = 0
    with pytest.raises(DraftlineError, match="eval_final_num_prompts"):
        validate(config)


def test_grad_accum_and_global_batch_tokens_together_are_refused():
    """Both set the batches of a step; before, --grad-accum was silently ignored."""
    import pytest

    from draftline.config import validate
    from draftline.errors import DraftlineError

    config = TrainConfig(out="o")
    config.model.target, config.data.data = "t", ["d"]
    config.optim.global_batch_tokens, config.optim.grad_accum = 65536, 2
    with pytest.raises(DraftlineError, match="both set the batches of an optimizer step; pick one"):
        validate(config)
    config.optim.grad_accum = 1
    validate(config)
    config.optim.global_batch_tokens = 0
    with pytest.raises(DraftlineError, match="global_batch_tokens"):
        validate(config)


def test_drafter_state_flag_and_its_values():
    import pytest

    from draftline.config import validate
    from draftline.errors import DraftlineError
    from draftline.distributed.shard import replicates

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--target", "t", "--data", "d", "--out", "o",
                                                 "--drafter-state", "replicate"]))
    assert config.topology.drafter_state == "replicate"
    validate(config)
    assert replicates("replicate", torch.device("cuda")) and not replicates("shard", torch.device("cpu"))
    assert replicates("auto", torch.device("cpu")) and not replicates("auto", torch.device("cuda"))
    config.topology.drafter_state = "mirror"
    with pytest.raises(DraftlineError, match=r"topology.drafter_state \(--drafter-state\) must be auto, shard or replicate"):
        validate(config)


# ---------------------------------------------------------------- each option declared once: the field and its opt()
import ast  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402
import typing  # noqa: E402
from pathlib import Path  # noqa: E402
from types import MappingProxyType  # noqa: E402

import pytest  # noqa: E402

import draftline  # noqa: E402
from draftline.cli import COMMANDS, command_parser  # noqa: E402
from draftline.config import EngineConfig, declared_fields, sections, validate  # noqa: E402
from draftline.config_io import field_types  # noqa: E402
from draftline.config_options import OneOf, Option, Within, option  # noqa: E402
from draftline.errors import DraftlineError  # noqa: E402

SRC = Path(draftline.__file__).parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")
DECLARED = {switch: (section, f.name) for section, _, f in declared_fields() for switch in option(f).switches}
CHECKED = [(section, f.name) for section, _, f in declared_fields() if option(f).check is not None]


def _valid() -> TrainConfig:
    config = TrainConfig(out="o")
    config.model.target, config.data.data = "t", ["d"]
    return config


def _is_bool(hint) -> bool:
    return _plain(hint) is bool


def _plain(hint):
    """``X`` of ``X | None``."""
    if typing.get_origin(hint) in (typing.Union, type(int | None)):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def test_every_field_is_declared_with_opt_and_each_flag_belongs_to_one_field():
    seen: dict[str, str] = {}
    for cls in (TrainConfig, *sections().values()):
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory):
                continue  # a section
            declared = option(f)
            assert declared is not None, f"{cls.__name__}.{f.name}: declare it with opt() (opt(default): no flag)"
            for switch in declared.switches:
                assert FLAG.fullmatch(switch), switch
                assert switch not in seen, f"{switch} is the flag of {seen[switch]} and of {f.name}"
                seen[switch] = f.name
            default = getattr(cls(), f.name)
            if not _is_bool(field_types(cls)[f.name]):
                assert declared.off is None, f"{f.name}: only a bool has an off-switch"
            elif default is True:  # its switch turns it off
                assert not declared.flags and declared.off and declared.off.startswith("--no-"), f.name
            elif default is False:
                assert declared.flags and declared.off is None, f.name
    assert len(seen) == len(DECLARED) > 60


def test_train_takes_exactly_the_declared_flags_and_the_launchers():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    taken = {o for action in parser._actions for o in action.option_strings}
    assert taken - set(DECLARED) == {"-h", "--help", "--config", "--max-restarts"}
    assert set(DECLARED) <= taken


def _flag_value(hint, default, declared: Option):
    """A value the flag can set (not the default, within the field's range) and how it is typed."""
    hint = _plain(hint)
    if isinstance(declared.check, OneOf):
        value = next(c for c in declared.check.choices if c != default)
        return value, [value]
    if hint in (int, float):
        value = hint(3) if hint is int else 0.5  # inside every declared range
        return value, [str(value)]
    if hint is str:
        return "x", ["x"]
    items = [1, 2] if typing.get_args(hint)[0] is int else [0.5, 0.25] if typing.get_args(hint)[0] is float else ["a", "b"]
    if typing.get_origin(hint) is tuple:  # as many items as the tuple has
        items = (items * 2)[: len(typing.get_args(hint))]
    value = tuple(items) if typing.get_origin(hint) is tuple else items
    return value, list(map(str, items)) if declared.nargs else [",".join(map(str, items))]


@pytest.mark.parametrize("section, name", [(s, f.name) for s, _, f in declared_fields() if option(f).switches],
                         ids=lambda x: x or "top")
def test_each_declared_flag_sets_its_field(section, name):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cls = sections()[section] if section else TrainConfig
    declared, hint, default = option(cls.__dataclass_fields__[name]), field_types(cls)[name], getattr(cls(), name)
    base = ["--target", "t", "--data", "d", "--out", "o"]
    if _is_bool(hint):
        cases = [(switch, switch != declared.off, []) for switch in declared.switches]
    else:
        value, words = _flag_value(hint, default, declared)
        cases = [(flag, value, words) for flag in declared.flags]
    for flag, value, words in cases:
        config = config_from_args(parser.parse_args([*base, flag, *words]))
        holder = getattr(config, section) if section else config
        assert getattr(holder, name) == value, f"{flag} {words}"
    untouched = config_from_args(parser.parse_args(base if name not in ("out", "target", "data") else ["--out", "o"]))
    if name not in ("out", "target", "data"):
        assert getattr(getattr(untouched, section) if section else untouched, name) == default


def _outside(check: Within) -> list[float]:
    low = [check.low if check.low_open else check.low - 1]
    return low + ([] if check.high is None else [check.high if check.high_open else check.high + 1])


@pytest.mark.parametrize("section, name", CHECKED, ids=[f"{s}.{n}" for s, n in CHECKED])
def test_validate_names_the_key_and_the_flag_of_each_field_it_rejects(section, name):
    field = sections()[section].__dataclass_fields__[name]
    declared, hint = option(field), field_types(sections()[section])[name]
    kind = _plain(hint)
    if isinstance(declared.check, OneOf):
        bad, edges = ["nonsense"], list(declared.check.choices)
        phrase = " or ".join([", ".join(edges[:-1]), edges[-1]])
    else:
        bad = [kind(v) for v in _outside(declared.check)]
        edges = [kind(v) for v in (declared.check.low, declared.check.high) if v is not None]
        edges = [v for v in edges if declared.check.allows(v)]  # a closed bound is allowed
        phrase = str(declared.check)
    for value in bad:
        config = _valid()
        setattr(getattr(config, section), name, value)
        with pytest.raises(DraftlineError) as info:
            validate(config)
        assert str(info.value) == f"{section}.{name} ({declared.flag}) must be {phrase}, got {value!r}"
    for value in edges:
        config = _valid()
        setattr(getattr(config, section), name, value)
        if (section, name) == ("model", "block_size"):
            config.engine.max_query_rows = max(config.engine.max_query_rows, value)
        if name in DSPARK_ONLY:  # DSpark's heads: with their method
            config.model.method = "dspark"
        if (section, name) in (("optim", "distill"), ("optim", "loss_gamma")):
            config.optim.loss = "dflash"  # they weigh the dflash loss; the default D-PACE loss refuses them
        validate(config)


# The range or choices of each field that validate checks on its own: a change here changes what a config may hold.
RANGES = {
    "> 0": {
        "model.draft_layers", "data.token_budget", "data.max_batch_size", "data.max_anchors", "data.epochs",
        "optim.lr", "optim.loss_gamma", "optim.grad_accum", "optim.global_batch_tokens", "optim.max_steps",
        "optim.max_minutes", "optim.max_bad_steps", "topology.targets", "topology.drafters", "topology.gpus",
        "topology.target_parallel",
        "topology.q_pre", "topology.q_hs", "topology.failure_timeout_s", "checkpoint.keep",
        "monitor.eval_num_prompts", "monitor.eval_max_new_tokens", "monitor.eval_final_num_prompts",
        "monitor.eval_final_max_new_tokens", "engine.head_chunk_rows", "engine.gpu_memory_gib", "model.markov_rank"},
    ">= 2": {"model.block_size"},
    "auto, bfloat16 or float32": {"model.dtype"},
    "dflash or dspark": {"model.method"},
    "vanilla or gated": {"model.markov_head_type"},
    "in [0, 1]": {"optim.min_lr_ratio", "optim.distill"},
    "in [0, 1)": {"optim.warmup_ratio"},
    ">= 0": {"optim.grad_clip"},
    "dpace or dflash": {"optim.loss"},
    "in (0, 1]": {"optim.dpace_alpha"},
    "auto, shard or replicate": {"topology.drafter_state"},
    "auto, cuda or cpu": {"topology.device"},
    "auto, flex, flash or dense": {"engine.attention"},
    "none, cheap or mlp": {"engine.recompute"},
    "fp32 or bf16": {"optim.moments"},
}


def test_the_checked_fields_and_their_ranges():
    declared: dict[str, set[str]] = {}
    for section, _, f in declared_fields():
        if option(f).check is not None:
            declared.setdefault(str(option(f).check), set()).add(f"{section}.{f.name}")
    assert declared == RANGES


def test_the_ranges_read_as_the_messages_say_them():
    assert [str(Within(0, low_open=True)), str(Within(0)), str(Within(2))] == ["> 0", ">= 0", ">= 2"]
    assert [str(Within(0, 1)), str(Within(0, 1, high_open=True)), str(Within(0, 1, low_open=True))] == [
        "in [0, 1]", "in [0, 1)", "in (0, 1]"]
    assert str(OneOf(("auto", "cuda", "cpu"))) == "auto, cuda or cpu"
    assert Within(0, 1, high_open=True).allows(0) and not Within(0, 1, high_open=True).allows(1)
    config = _valid()
    config.data.token_budget = None  # set in code, not from a file (whose types are checked)
    with pytest.raises(DraftlineError, match=re.escape("data.token_budget (--token-budget) must be > 0, got None")):
        validate(config)


def _set(config, **fields):
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(config, section), name, value)
    return config


@pytest.mark.parametrize("fields, message", [
    ({"data__max_length": 4096, "data__token_budget": 2048},
     "data.max_length=4096 exceeds data.token_budget=2048: a sample must fit in one batch; lower --max-length or "
     "raise --token-budget"),
    ({"optim__global_batch_tokens": 65536, "optim__grad_accum": 2},
     "optim.global_batch_tokens (--global-batch-tokens 65536) and optim.grad_accum (--grad-accum 2) both set the "
     "batches of an optimizer step; pick one"),
    ({"optim__loss": "dpace", "optim__loss_gamma": 4.0},
     "optim.loss_gamma (--loss-gamma) weighs the dflash loss; --loss dpace sets its own weights: drop --loss-gamma "
     "or use --loss dflash"),
    ({"optim__loss": "dpace", "optim__distill": 0.5},
     "--loss dpace weighs hard labels by the drafter's probability of them; it does not combine with --distill: "
     "drop one"),
    ({"model__init_drafter": "d", "model__init_from_target": True},
     "--init-drafter and --init-from-target both set the starting weights; pick one"),
    ({"model__init_drafter": "d", "model__init_from_target": False},
     "--init-drafter and --random-init both set the starting weights; pick one"),
    ({"checkpoint__resume": True, "checkpoint__from_scratch": True},
     "--resume and --from-scratch contradict each other; pick one"),
    ({"model__block_size": 8, "engine__max_query_rows": 4},
     "engine.max_query_rows (--max-query-rows) = 4 must hold at least one block (8 rows)"),
    ({"model__markov_rank": 64, "model__confidence_head": False},
     "--markov-rank, --confidence-head set DSpark's heads or loss: add --method dspark, or drop them"),
    ({"model__method": "dflash", "optim__dspark_loss_weights": (0.2, 0.8, 1.0)},
     "--dspark-loss-weights sets DSpark's heads or loss: add --method dspark, or drop it"),
    ({"model__method": "dspark", "optim__loss": "dpace", "optim__loss_gamma": 2.0},
     "optim.loss_gamma (--loss-gamma) weighs the dflash loss; --loss dpace sets its own weights: drop --loss-gamma "
     "or use --loss dflash"),
    ({"model__method": "dspark", "optim__distill": 0.5},
     "--distill mixes the target's distribution into DFlash's labels; --method dspark distils it already (its L1 "
     "term): drop --distill"),
    ({"model__method": "dspark", "model__confidence_head": False, "model__confidence_head_with_markov": True},
     "--confidence-with-markov feeds a confidence head that --no-confidence-head turns off: drop one"),
    ({"model__method": "dspark", "optim__dspark_loss_weights": (0.0, 0.0, 1.0)},
     "optim.dspark_loss_weights (--dspark-loss-weights) = [0.0, 0.0, 1.0]: each weight must be >= 0, and CE or L1 "
     "above 0 (the BCE term trains the confidence head alone)"),
    ({"topology__targets": 5, "topology__target_parallel": 2},
     "topology.targets (--targets) = 5 counts the ranks of the target groups of topology.target_parallel "
     "(--target-parallel) = 2: make it a multiple (4 or 6)"),
], ids=lambda x: "+".join(x) if isinstance(x, dict) else None)
def test_the_rules_between_fields_name_their_flags(fields, message):
    with pytest.raises(DraftlineError) as info:
        validate(_set(_valid(), **fields))
    assert str(info.value) == message


@pytest.mark.parametrize("empty, message", [
    ("out", "out (--out DIR) is required: the run directory for checkpoints and metrics"),
    ("target", "model.target (--target DIR) is required: the target model directory"),
    ("data", "data.data (--data DIR) is required: a prepared dataset directory or input files"),
])
def test_a_required_field_is_named_with_its_flag(empty, message):
    config = _valid()
    holder = {"out": config, "target": config.model, "data": config.data}[empty]
    setattr(holder, empty, [] if empty == "data" else "")
    with pytest.raises(DraftlineError, match=re.escape(message)):
        validate(config)


def test_a_field_without_a_flag_is_set_from_a_config_file_only(tmp_path, monkeypatch):
    monkeypatch.setattr(EngineConfig.__dataclass_fields__["trace"], "metadata", MappingProxyType({"option": Option()}))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "--trace" not in parser.format_help()
    path = tmp_path / "run.toml"
    path.write_text('out = "o"\n[model]\ntarget = "t"\n[data]\ndata = "d"\n[engine]\ntrace = true\n')
    config = config_from_args(parser.parse_args(["--config", str(path)]))
    assert config.engine.trace is True
    validate(config)


def _strings(tree: ast.AST):
    """``(text, where)`` of every string constant: ``where`` is "doc" (a docstring or a field's), "opt" (inside
    an ``opt(...)`` declaration) or "code"."""
    kinds: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            kinds[id(node.value)] = "doc"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "opt":
            for inner in ast.walk(node):
                kinds.setdefault(id(inner), "opt")
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value, kinds.get(id(node), "code")


def _sources():
    return [(path, ast.parse(path.read_text())) for path in sorted(SRC.rglob("*.py"))]


def test_the_config_modules_spell_a_flag_only_in_its_declaration():
    """validate's messages and the flags, metavars and help of train take a flag from its field's opt();
    docstrings (a field's --help text) may name one."""
    for path, tree in _sources():
        if path.parent != SRC or not path.name.startswith("config"):
            continue
        spelled = [(text, flag) for text, where in _strings(tree) if where == "code"
                   for flag in FLAG.findall(text) if flag in DECLARED]
        assert not spelled, f"{path.relative_to(SRC)}: a flag spelled outside its opt(): {spelled}"


def test_no_table_in_src_is_keyed_by_a_train_flag():
    """A table from flags (to fields, metavars, docs, values) declares the options a second time."""
    for path, tree in _sources():
        for node in ast.walk(tree):
            keys = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, ast.Set) else []
            flags = [k.value for k in keys if isinstance(k, ast.Constant) and k.value in DECLARED]
            assert not flags, f"{path.relative_to(SRC)}:{node.lineno}: a table keyed by {flags}: use the fields' opt()"


# Flags that src/ names of other programs: torchrun's, TensorBoard's, the serving engines' (a drafter's
# model card), the demo's tiny-target script's.
OTHER_PROGRAMS = {"--nproc-per-node", "--standalone", "--logdir", "--model-path", "--speculative-algorithm",
                  "--speculative-config", "--speculative-draft-model-path", "--speculative-num-draft-tokens",
                  "--steps", "--prepare-only"}


def test_every_flag_that_src_names_is_an_option_of_a_command():
    """Messages, docstrings and command lines may name a flag (what the user types); a renamed flag
    must not leave them naming one that no longer exists."""
    options = set(OTHER_PROGRAMS)
    for name in COMMANDS:
        options |= {o for action in command_parser(name)[1]._actions for o in action.option_strings}
    unknown = {(flag, str(path.relative_to(SRC))) for path, tree in _sources() for text, _ in _strings(tree)
               for flag in FLAG.findall(text) if flag not in options}
    assert not unknown, sorted(unknown)


# plan's options of the same name as train's that are another value: one dataset to read lengths from,
# the node's GPU count, one GPU's memory, the device --measure times on, the target groups planned (default: every
# size the target splits by).
PLAN_OWN = {"--data", "--gpus", "--gpu-memory-gib", "--device", "--target-parallel"}


def test_plan_takes_the_train_options_it_shares_from_their_fields():
    _, plan = command_parser("plan")
    shared = 0
    for action in plan._actions:
        flag = next((o for o in action.option_strings if o in DECLARED), None)
        if flag is None or flag in PLAN_OWN:
            continue
        section, name = DECLARED[flag]
        assert f"(train's [{section}] {name}" in action.help, flag
        assert action.default == getattr(sections()[section](), name), flag
        assert action.metavar or action.nargs == 0, flag  # a value is named; a switch takes none
        shared += 1
    assert shared == 15
