"""The drafter on disk in the z-lab format: ``config.json`` + ``model.safetensors``.

This is the format the official DFlash code, SGLang and vLLM load without conversion: tensor names
without a ``model.`` prefix, no embedding, no LM head (those are the target's). Writes are atomic:
files go to a temporary directory that is renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3Config

from draftline.errors import DraftlineError
from draftline.files import disk_full_error
from draftline.model.config import validate_drafter_config
from draftline.model.drafter import DFlashDrafter
from draftline.model.dspark import DSparkDrafter, is_dspark_config

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def drafter_config_dict(config: Qwen3Config, dtype: torch.dtype) -> dict:
    """config.json content with the fields every loader needs, in a stable order."""
    if is_dspark_config(config):
        from draftline.checkpoint.dspark_export import dspark_config_dict

        return dspark_config_dict(config, dtype)
    data = config.to_dict()
    data["architectures"] = ["DFlashDraftModel"]
    data["model_type"] = "qwen3"
    data["dtype"] = str(dtype).removeprefix("torch.")
    data.pop("torch_dtype", None)
    for name in ("block_size", "num_target_layers", "dflash_config"):
        data[name] = getattr(config, name)
    return dict(sorted(data.items()))


def is_drafter_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file()


def save_drafter(
    drafter: DFlashDrafter,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    weights: dict[str, torch.Tensor] | None = None,
    finish: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``drafter`` to ``out_dir`` atomically (existing contents are replaced).

    ``weights``: its whole weights when the drafter itself holds only a shard of them
    (``shard.DrafterGroup.full_weights``). ``finish(tmp_dir)`` runs on the written files before they are
    moved into place: it may add files (a model card) or raise to refuse them, and then nothing is written
    and ``out_dir`` is untouched.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, tensor in (drafter.state_dict() if weights is None else weights).items()
    }
    existed = out_dir.exists()
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as exc:
        raise _full_disk(exc, out_dir, existed) or exc
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        config = drafter_config_dict(drafter.config, dtype)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        if finish is not None:
            finish(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        full = _full_disk(exc, out_dir, existed)
        if full is not None:
            raise full from exc
        raise
    return out_dir


def _full_disk(exc: BaseException, out_dir: Path, existed: bool) -> Exception | None:
    kept = f"nothing of it was kept and the {out_dir} from before is as it was" if existed else "nothing of it was kept"
    return disk_full_error(exc, out_dir, "the drafter", kept,
                           "free space there (a drafter takes about 2 bytes a weight in bf16, 4 in fp32) or write it "
                           "to a larger disk")


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; an old ``dst`` is moved aside first and removed after."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_drafter_config_json(path: str | Path) -> dict:
    """A drafter directory's config.json as a dict; a missing, malformed or non-object file is named."""
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise DraftlineError(f"{path}: no {CONFIG_NAME}; expected a drafter directory (config.json + model.safetensors)")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise DraftlineError(f"{config_file}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise DraftlineError(f"{config_file}: expected a JSON object")
    return data


def read_drafter_config(path: str | Path) -> tuple[dict, Qwen3Config | None, str]:
    """A drafter directory's config.json, read once: its fields, the config they build (None where they
    build none: the serving checks then name the field) and why not."""
    path = Path(path)
    data = read_drafter_config_json(path)
    try:
        return data, drafter_config_from_json(data, path / CONFIG_NAME), ""
    except Exception as exc:  # noqa: BLE001 - transformers' own validation errors too
        return data, None, str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__


def load_drafter_config(path: str | Path) -> Qwen3Config:
    """A drafter directory's config: its config.json read, checked and built (``drafter_config_from_json``)."""
    path = Path(path)
    return drafter_config_from_json(read_drafter_config_json(path), path / CONFIG_NAME)


def drafter_config_from_json(data: dict, config_file: Path) -> Qwen3Config:
    """The drafter config a config.json's ``data`` describes (``config_file``: where it was read, for errors)."""
    if is_dspark_config(data):
        from draftline.checkpoint.dspark_export import dspark_config_from_json

        return dspark_config_from_json(data, config_file)
    for name in ("block_size", "dflash_config"):
        if name not in data:
            raise DraftlineError(f"{config_file}: field {name!r} missing; this is not a DFlash drafter config")
    extra = {k: data[k] for k in ("block_size", "num_target_layers", "dflash_config") if k in data}
    config = Qwen3Config.from_dict(data)
    for name, value in extra.items():
        setattr(config, name, value)
    if not getattr(config, "num_target_layers", None):
        config.num_target_layers = max(config.dflash_config["target_layer_ids"]) + 1
    validate_drafter_config(config)
    return config


def load_drafter(
    path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    config: Qwen3Config | None = None,
) -> DFlashDrafter:
    """Build a drafter from ``path`` and load its weights; every tensor must match by name and shape.
    ``config``: the directory's config already read (``load_drafter_config``), else read here."""
    path = Path(path)
    config = config if config is not None else load_drafter_config(path)
    with torch.device("meta"):
        drafter = DSparkDrafter(config) if is_dspark_config(config) else DFlashDrafter(config)
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    weights_file = path / WEIGHTS_NAME
    if not weights_file.is_file():
        raise DraftlineError(f"{path}: no {WEIGHTS_NAME}")
    with safe_open(weights_file, framework="pt", device="cpu") as f:
        names = set(f.keys())
        missing = sorted(set(expected) - names)
        extra = sorted(names - set(expected))
        if missing or extra:
            raise DraftlineError(
                f"{weights_file}: tensors do not match the config ({config.num_hidden_layers} layers, "
                f"{len(config.dflash_config['target_layer_ids'])} feature layers): "
                + (f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}" if missing else "")
                + ("; " if missing and extra else "")
                + (f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}" if extra else "")
                + ". A drafter checkpoint holds no embedding or LM head and no 'model.' prefix."
            )
        state = {}
        for name in expected:
            tensor = f.get_tensor(name)
            if tuple(tensor.shape) != expected[name]:
                raise DraftlineError(
                    f"{weights_file}: {name} has shape {tuple(tensor.shape)}, the config needs {expected[name]}"
                )
            state[name] = tensor.to(dtype)
    drafter = drafter.to_empty(device=device)
    drafter.load_state_dict(state, strict=True)
    return drafter.to(dtype)
