"""The training line: targets compute features, drafters train on them.

::

    run.run_training: config -> roles -> setup -> spec.resolve_run -> line.Line.run -> finish

    dataset -> Prefetcher -q_pre-> TargetWorker -> sender =(transport)=> receiver -> loop.train
                (thread)           frozen target   outbox (q_hs)          claims      DrafterWorker: passes,
                                   features                                           objective -> loss,
                                                                                      all-reduce -> AdamW
                                                                                      -> Progress (step, tokens,
                                                                                         clock), monitor,
                                                                                         checkpoint, evaluation

Who waits on whom: a target waits for built batches (``q_pre``) and for room in its outbox
(``q_hs``, freed as drafters claim and receive); a drafter waits for the features of the batches of
its share of a step and, sharded, for the other drafters at each pass's gathers and at the step's
all-reduce; the ranks of a target group (``--target-parallel``) wait for each other before each batch
(``distributed.target_group``) and inside its forward; ranks 1.. wait for rank 0's setup. Every wait polls
``Health.check`` (``distributed.waits``), so a failure anywhere ends them all.

The modules here are the line's own: ``run`` (the entry point), ``spec`` (the run resolved once),
``build`` (the one builder of the workers), ``line`` (a process's part), ``loop`` (the drafter's loop),
``drafter_worker`` and ``target_worker`` (the two roles' steps), ``transport`` (features between them),
``optim`` (AdamW and the schedule) and ``progress`` (how far the training is, one owner). The job's
machinery (roles, process groups, health, failures, the run directory) is ``distributed``; what a run
costs and whether it fits, ``sizing``; the checkpoints, ``checkpoint``; the monitor, ``monitor``; the
measurements during training, ``evaluate``. docs/ARCHITECTURE.md gives the job of every module.
"""
