"""The driver side's words, shared by the engine, the job service and the API (no torch, no Ray):
the evaluation's configuration (:mod:`.config`, its groups :mod:`.config_groups`, how each door
names a field :mod:`.config_fields`, lm-eval's own options :mod:`.lm_eval_options`), typed
progress and events (:mod:`.events`), the states of an evaluation (:mod:`.states`) and the job
service's errors (:mod:`.errors`). The layout words (R x G, devices, strategies, timeouts) are
the ranks' own: :mod:`rayeval.actors.layout`.
"""
