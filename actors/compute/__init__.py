"""Compute: what a rank does with its model once loaded.

:mod:`.rank_model` is the model, device and tokenizer every computation runs with;
:mod:`.scoring` scores log-likelihood micro-batches (:mod:`.packing`: several requests in one
row); :mod:`.generation` runs ``generate`` on static micro-batches; :mod:`.continuous` is the
continuous-batching engine, with :mod:`.logits_setup` (``generate``'s logits processors, row by
row).
"""
