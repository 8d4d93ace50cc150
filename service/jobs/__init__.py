"""The job service: evaluations submitted over REST, queued, run and followed until they end.

:mod:`.validation` checks a submission, :mod:`.admission` decides what starts, :mod:`.manager`
follows runners and cancels, :mod:`.store` keeps everything in a database, :mod:`.runner_actor`
carries one evaluation inside the cluster (calling the engine), :mod:`.states` is the state
machine and :mod:`.tasks` the catalog of task names. No torch is imported here.
"""
