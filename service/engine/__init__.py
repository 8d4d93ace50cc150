"""The engine: one evaluation, from lm-eval's requests to lm-eval's results.

:class:`rayeval.service.engine.lm.RayEvalLM` (an lm-eval ``LM``) plans layout-independent
micro-batches (:mod:`.planner`) and hands them to the replicas (:mod:`.dispatch`);
:func:`.runner.run_evaluation` runs a whole evaluation as ``lm_eval run`` does and writes lm-eval's
files (:mod:`.outputs`). Modules are imported lazily by callers; importing this package is cheap.
"""
