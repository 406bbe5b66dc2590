"""Training methods: what differs between DFlash and DSpark (and the next family member), in one object each.

A method builds, for a drafter config resolved from the target's (``model.config.build_drafter_config``):

| | DFlash (``methods.dflash``) | DSpark (``methods.dspark``) |
|---|---|---|
| ``build_config`` | the config as it is | + the heads' fields (``model.dspark``) |
| ``build_drafter`` | ``DFlashDrafter`` | ``DSparkDrafter``: the same backbone + Markov and confidence heads |
| ``objective`` | ``DFlashObjective`` | ``DSparkObjective``: anchor = first slot, CE + L1 + BCE |
| ``needs_final_hidden`` | with soft labels only | always (the target's distribution) |
| ``first_slot`` | 1 (slot 0 is the anchor) | 0 (the anchor's slot drafts) |
| ``drafts_per_block`` | B - 1 | B |
| ``proposer`` | ``DFlashProposer`` | ``DSparkProposer``: the Markov head slot by slot |
| export | ``DFlashDraftModel``, ``dflash_config`` | ``Qwen3DSparkModel``, fields at the top level |
| ``serving_commands`` | SGLang ``DFLASH``, vLLM ``dflash`` | SGLang ``DSPARK``, vLLM ``dspark`` (vanilla head only) |

Everything else (the target's features, the passes, the attention, the transport, sharding, checkpoints) is
shared and reads what it needs from the method. ``get_method`` resolves a name (``--method``), ``method_for``
the method of a config (a saved drafter says which it is). A third method is a new module here and one line
in each of the two functions.
"""

from __future__ import annotations

from typing import Any

METHODS = ("dflash", "dspark")


def get_method(name: str):
    """The method called ``name`` ('dflash' or 'dspark')."""
    if name == "dflash":
        from draftline.methods.dflash import DFlash

        return DFlash()
    if name == "dspark":
        from draftline.methods.dspark import DSpark

        return DSpark()
    raise ValueError(f"method {name!r} unknown: use one of {', '.join(METHODS)}")


def method_for(config: Any):
    """The method a drafter config (object or config.json dict) was built by."""
    from draftline.model.dspark import is_dspark_config

    return get_method("dspark" if is_dspark_config(config) else "dflash")
