"""Planning: lm-eval's requests made into layout-independent work before any replica runs it.

The driver's tokeniser (:mod:`.encoder`, with tokeniser actors in :mod:`.tokenisers`) and its
weightless model (:mod:`.model_shell`); requests that cannot measure their task (:mod:`.checks`);
score rows cut by a token budget (:mod:`.planner`), generation as static micro-batches or
continuous-batching groups (:mod:`.generation_planner`), and the budgets of both
(:mod:`.budgets`).
"""
