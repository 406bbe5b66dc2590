"""The training line: targets compute features, drafters train on them.

::

    dataset -> Prefetcher -q_pre-> TargetWorker -> sender =(transport)=> receiver -> loop.train
                (thread)           frozen target   outbox (q_hs)          claims      DrafterWorker: passes,
                                   features                                           objective -> loss,
                                                                                      all-reduce -> AdamW
                                                                                      -> monitor, checkpoint,
                                                                                         evaluation

Who waits on whom: a target waits for built batches (``q_pre``) and for room in its outbox
(``q_hs``, freed as drafters claim and receive); a drafter waits for the features of the batches of
its share of a step and, sharded, for the other drafters at each pass's gathers and at the step's
all-reduce; ranks 1.. wait for rank 0's setup. Every wait polls ``Health.check`` (``waits``), so a
failure anywhere ends them all.

``run.run_training`` is the entry point; docs/ARCHITECTURE.md gives the job of every module.
"""
