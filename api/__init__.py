"""User-facing entry points: the ``rayeval`` CLI and the FastAPI REST service.

Never imports torch: the heavy work runs in ``service`` (the runner actor holds lm-eval and torch).
"""
