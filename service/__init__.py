"""The driver side: one evaluation's engine, and the job service around it.

- :mod:`service.config` — the one configuration object of an evaluation (every entry point).
- :mod:`service.engine` — one evaluation: the lm-eval ``LM``, planning, dispatch, outputs.
- :mod:`service.jobs` — the long-lived service: validation, admission, the manager, the store,
  the runner actor.
Modules are imported lazily by callers; importing this package is cheap.
"""
