"""The demo's text: conversations cut from the Python standard library's source.

Every machine has the standard library, so the demo needs no download. Files are split into train
and held-out by a hash of their path (stable across machines and Python versions); a file becomes
conversations whose user turn holds code (or a module docstring) and whose assistant turn holds the
lines that follow. Used by the script that trained the shipped tiny target
(``train_tiny_target``) and by ``draftline demo`` (``demo.pipeline``).
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

CONTINUE_INSTRUCTIONS = ["Continue this code:", "Continue this Python code:", "What comes next?",
                         "Continue the code from `{path}`:"]
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass
class CorpusConfig:
    heldout_percent: int = 10
    """Files whose sha256(relative path) mod 100 falls below this are held out (never trained on)."""
    max_file_bytes: int = 400_000
    """Larger files are generated data (pydoc_data/topics.py), not code; they are skipped."""
    prompt_lines: tuple[int, int] = (10, 30)
    """Range (inclusive) of code lines in a user turn."""
    response_lines: tuple[int, int] = (20, 40)
    """Range (inclusive) of code lines in an assistant turn."""
    max_turn_chars: int = 2000
    """A turn longer than this loses lines from its far end (keeps data-table files in check)."""


# --------------------------------------------------------------------------------------------------
# Corpus: the standard library's source, split by file


def is_heldout(relpath: str, heldout_percent: int) -> bool:
    digest = hashlib.sha256(relpath.encode()).hexdigest()
    return int(digest[:8], 16) % 100 < heldout_percent


def _stdlib_sources(root: Path) -> list[Path]:
    """The *.py files under ``root``, sorted, never entering an excluded folder: a Python's site-packages can
    hold many times the stdlib's files (11,563 of the 13,353 under this project's Python 3.11)."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in EXCLUDED_DIRS]
        found.extend(Path(folder, name) for name in names if name.endswith(".py") and not name.startswith("test_"))
    return sorted(found)


def collect_stdlib(cfg: CorpusConfig) -> list[dict]:
    """Every stdlib *.py outside test folders, as {"path", "split", "text"}, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in _stdlib_sources(root):
        rel = path.relative_to(root)
        if path.stat().st_size > cfg.max_file_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        split = "heldout" if is_heldout(rel.as_posix(), cfg.heldout_percent) else "train"
        files.append({"path": rel.as_posix(), "split": split, "text": text})
    return files


# --------------------------------------------------------------------------------------------------
# Conversations: code in the user turn, its continuation in the assistant turn


def _clip(lines: list[str], max_chars: int, keep_end: bool) -> list[str]:
    while len(lines) > 1 and sum(len(x) + 1 for x in lines) > max_chars:
        lines = lines[1:] if keep_end else lines[:-1]
    return lines


def _trim_blank(lines: list[str]) -> list[str]:
    start, end = 0, len(lines)
    while start < end and not lines[start].strip():
        start += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return lines[start:end]


def add_docstrings(files: list[dict]) -> None:
    """Sets item["doc"] (the module docstring or None) and item["doc_end"] (its last line)."""
    for item in files:
        try:
            module = ast.parse(item["text"])
            item["doc"] = ast.get_docstring(module)
        except (SyntaxError, ValueError):  # a few lib2to3 fixtures are Python 2
            item["doc"] = None
        item["doc_end"] = module.body[0].end_lineno if item["doc"] else None


def file_conversations(item: dict, cfg: CorpusConfig, rng: random.Random) -> list[dict]:
    """Tile a file into conversations: each line lands in at most one turn."""
    path, lines = item["path"], item["text"].splitlines()
    convs, cursor = [], rng.randrange(0, 10)
    if item["doc"] and rng.random() < 0.5:
        n = rng.randint(*cfg.response_lines)
        body = _trim_blank(_clip(lines[item["doc_end"]:item["doc_end"] + n], cfg.max_turn_chars, keep_end=False))
        if body:
            doc = "\n".join(_clip(item["doc"].splitlines(), cfg.max_turn_chars, keep_end=False))
            user = f"Write the Python module `{path}`. Its docstring:\n\n{doc}"
            convs.append({"source": path, "messages": [{"role": "user", "content": user},
                                                       {"role": "assistant", "content": "\n".join(body)}]})
            cursor = item["doc_end"] + n
    while cursor < len(lines):
        n_prompt, n_response = rng.randint(*cfg.prompt_lines), rng.randint(*cfg.response_lines)
        code = _trim_blank(_clip(lines[cursor:cursor + n_prompt], cfg.max_turn_chars, keep_end=True))
        body = _trim_blank(_clip(lines[cursor + n_prompt:cursor + n_prompt + n_response], cfg.max_turn_chars,
                                 keep_end=False))
        cursor += n_prompt + n_response
        if not code or not body:
            continue
        instruction = rng.choice(CONTINUE_INSTRUCTIONS).format(path=path)
        user = instruction + "\n\n" + "\n".join(code)
        convs.append({"source": path, "messages": [{"role": "user", "content": user},
                                                   {"role": "assistant", "content": "\n".join(body)}]})
    return convs


def build_conversations(files: list[dict], cfg: CorpusConfig, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [c for item in files for c in file_conversations(item, cfg, rng)]
