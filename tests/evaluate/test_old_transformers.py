"""The linear-attention rollback of a transformers older than 5.25 (``speculative._LinearStates``), run for real.

transformers 5.25 rewinds a Gated DeltaNet layer's recurrent state itself; before it, the decoder saves
the states before each verification, puts them back when drafts are rejected and runs the kept rows once
more. That path runs here in a subprocess on transformers 5.24.0, installed ``--no-deps`` beside the test
environment by ``make test`` (the GPU machines' preinstalled 5.17 takes the same path): the oracle's
acceptance lengths must be exact and the output the target's own greedy decoding, with the states
restored at least once per rejected block.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OLD_VERSION = "5.24.0"
OLD_DIR = Path(os.environ.get("DRAFTLINE_OLD_TRANSFORMERS", Path(sys.prefix) / "compat" / f"transformers-{OLD_VERSION}"))
TESTS = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, tempfile
import torch, transformers
from transformers import AutoModelForCausalLM
from draftline.evaluate import speculative
from helpers import make_qwen3_5_target
from test_speculative import PROMPTS, OracleProposer, expected_lengths
from conftest import random_drafter

torch.set_num_threads(1)
restores = 0
restore = speculative._LinearStates.restore
def counted(self):
    global restores
    restores += 1
    restore(self)
speculative._LinearStates.restore = counted

target_dir = make_qwen3_5_target(tempfile.mkdtemp())
model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
prompt, new, block, wrong = PROMPTS[0], 21, 5, {9, 10, 16, 23, 24, 25}
reference = speculative.target_generate(model, prompt, max_new_tokens=new).output_ids
oracle = speculative.speculative_generate(model, OracleProposer(reference, model.config.vocab_size, block, wrong), prompt,
                                          max_new_tokens=new)
drafter = random_drafter(target_dir, num_layers=1, block_size=4)
random = speculative.speculative_generate(model, drafter, PROMPTS[2], max_new_tokens=10)
print(json.dumps({
    "version": transformers.__version__, "rewinds": speculative.rewinds_linear_attention(), "restores": restores,
    "oracle_equal": oracle.output_ids == reference,
    "oracle_lengths": oracle.acceptance_lengths, "expected_lengths": expected_lengths(len(prompt), new, block, wrong),
    "random_equal": random.output_ids == speculative.target_generate(model, PROMPTS[2], max_new_tokens=10).output_ids,
}))
"""


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                    reason="flash-linear-attention installed: hybrid targets run on GPU only")
@pytest.mark.skipif(not (OLD_DIR / "transformers").is_dir(),
                    reason=f"transformers {OLD_VERSION} --no-deps in {OLD_DIR} (make test installs it)")
def test_the_rollback_of_an_older_transformers_is_exact():
    src = Path(importlib.util.find_spec("draftline").origin).parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(OLD_DIR), str(src), str(TESTS / "evaluate"), str(TESTS)]))
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["version"] == OLD_VERSION and result["rewinds"] is False  # the old path, not 5.25's rewind
    assert result["oracle_lengths"] == result["expected_lengths"] and result["oracle_equal"]
    assert result["restores"] >= 4  # the rejected blocks (wrong drafts at 9, 16, 23) and the random drafter's
    assert result["random_equal"]
