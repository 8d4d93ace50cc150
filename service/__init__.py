"""The driver side: one evaluation's engine, and the job service around it.

- :mod:`rayeval.service.vocabulary` — the torch-free words every part shares: the one
  configuration object of an evaluation (every entry point), typed progress and events, the
  evaluation states, the job service's errors, lm-eval's options.
- :mod:`rayeval.service.engine` — one evaluation: the lm-eval ``LM``, planning, dispatch, outputs.
- :mod:`rayeval.service.jobs` — the long-lived service: validation, admission, the manager, the
  store, the runner actor.
Modules are imported lazily by callers; importing this package is cheap.
"""
