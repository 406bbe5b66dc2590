"""The training line: targets compute features, drafters train on them.

::

    dataset -> Prefetcher -q_pre-> TargetWorker -> sender =(transport)=> receiver -> DrafterWorker
                (thread)           frozen target   outbox (q_hs)          claims   objective.passes,
                                   features                                        objective -> loss,
                                                                                   GradSync -> optimizer
                                                                                   -> checkpoint, monitor

Who waits on whom: a target waits for built batches (``q_pre``) and for room in its outbox
(``q_hs``, freed as drafters claim and receive); a drafter waits for the features of the batch it
claimed and, at a step's end, for the other drafters (all-reduce); ranks 1.. wait for rank 0's
setup. Every wait polls ``Health.check`` (``waits``), so a failure anywhere ends them all.

``run.run_training`` is the entry point; docs/ARCHITECTURE.md gives the job of every module.
"""
