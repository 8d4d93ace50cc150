"""The job service: evaluations submitted over REST, queued, run and followed until they end.

:mod:`.validation` checks a submission, :mod:`.admission` decides what starts, :mod:`.manager`
follows runners and cancels (its options in :mod:`.options`), with one state object per
evaluation (:mod:`.tracking`), the follow-up and watchdog policies (:mod:`.following`), warm
replicas (:mod:`.kept`) and recovery at start (:mod:`.recovery`); :mod:`.store` keeps everything
in a database (tables in :mod:`.rows`, the records it hands out in :mod:`.records`),
:mod:`.runner_actor` carries one evaluation inside the cluster (calling the engine),
:mod:`.ray_resources` finds and releases what an evaluation holds on Ray, :mod:`.states` is the
state machine and :mod:`.tasks` the catalog of task names. No torch is imported here.
"""
