"""Training methods: what differs between DFlash and DSpark (and the next family member), in one object each.

A method builds, for a drafter config resolved from the target's (``model.config.build_drafter_config``):

| | DFlash (``methods.dflash``) | DSpark (``methods.dspark``) |
|---|---|---|
| ``build_config`` | the config as it is | + the heads' fields (``model.dspark``); full attention by default |
| ``build_drafter`` | ``DFlashDrafter`` | ``DSparkDrafter``: the same backbone + Markov and confidence heads |
| ``objective`` | ``DFlashObjective`` | ``DSparkObjective``: anchor = first slot, CE + L1 + BCE |
| ``needs_final_hidden`` | with soft labels only | always (the target's distribution) |
| ``first_slot`` | 1 (slot 0 is the anchor) | 0 (the anchor's slot drafts) |
| ``drafts_per_block`` | B - 1 | B |
| ``proposer`` | ``DFlashProposer`` | ``DSparkProposer``: the Markov head slot by slot |
| ``shape`` (``sizing.shapes.MethodShape``) | nothing added | the heads' weights and FLOPs, the teacher head, the final hidden state, the loss chunk |
| export | ``DFlashDraftModel``, ``dflash_config`` | ``Qwen3DSparkModel``, fields at the top level |
| ``serving_commands`` | SGLang ``DFLASH``, vLLM ``dflash`` | SGLang ``DSPARK``, vLLM ``dspark`` (vanilla head only) |

Everything else (the target's features, the passes, the attention, the transport, sharding, checkpoints, the
monitor) is shared and reads what it needs from the method or from the objective it built (its metrics vector and
summary). ``method_of`` gives the method a run's config asks for, ``get_method`` resolves a name, ``method_for``
the method of a drafter config (a saved drafter says which it is). A third method is a new module here and one
line in each of those functions.

The layers below the methods never import them: they are handed what a method decides (its objective, its
proposer, its ``MethodShape``); the checkpoint layer reads a saved drafter's layout from its own config.
"""

from __future__ import annotations

from typing import Any

METHODS = ("dflash", "dspark")


def get_method(name: str, **options):
    """The method called ``name`` ('dflash' or 'dspark'), with its ``options`` (DSpark: its heads and loss)."""
    if name == "dflash":
        from draftline.methods.dflash import DFlash

        if options:
            raise ValueError(f"the dflash method takes no options, got {sorted(options)}")
        return DFlash()
    if name == "dspark":
        from draftline.methods.dspark import DSpark

        return DSpark(**options)
    raise ValueError(f"method {name!r} unknown: use one of {', '.join(METHODS)}")


def method_for(config: Any):
    """The method a drafter config (object or config.json dict) was built by, with the heads it has."""
    from draftline.model.dspark import is_dspark_config

    if not is_dspark_config(config):
        return get_method("dflash")
    from draftline.methods.dspark import DSpark

    return DSpark.of_config(config)


def method_of(config) -> Any:
    """The method a run's ``TrainConfig`` asks for (``model.method``; None: DFlash), with its options."""
    from draftline.methods.dspark import DSpark

    if (config.model.method or "dflash") == "dflash":
        return get_method("dflash")
    return DSpark.of_train_config(config)
