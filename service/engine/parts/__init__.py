"""Planning in parts: a large request type made and planned a part at a time on a background
thread while the replicas compute the parts before (:mod:`.pipeline`), for loglikelihood
(:mod:`.score`) and generation (:mod:`.generate`).
"""
