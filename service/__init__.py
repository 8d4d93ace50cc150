"""The driver side: one evaluation's engine, and the job service around it.

- :mod:`rayeval.service.config` — the one configuration object of an evaluation (every entry point).
- :mod:`rayeval.service.events` — typed progress and events, from the engine to the clients.
- :mod:`rayeval.service.errors` — the errors only the job service raises.
- :mod:`rayeval.service.engine` — one evaluation: the lm-eval ``LM``, planning, dispatch, outputs.
- :mod:`rayeval.service.jobs` — the long-lived service: validation, admission, the manager, the
store, the runner actor.
Modules are imported lazily by callers; importing this package is cheap.
"""
