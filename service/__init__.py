"""The driver side of an evaluation: planning, dispatch, and the lm-eval ``LM`` that ties them.

Public entry points: :class:`service.lm.RayEvalLM` (an lm-eval ``LM``) and
:func:`service.runner.run_evaluation` (what ``rayeval run`` calls). Modules are imported lazily by
callers; importing this package is cheap.
"""
