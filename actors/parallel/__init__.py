"""Parallelism: how a replica shards its model over its G ranks.

:mod:`.sharding` is the strategy interface and :mod:`.strategies` the registry (``auto`` picks
from it). FSDP2 is :mod:`.fsdp`, with :mod:`.fsdp_units` (which modules are units),
:mod:`.fsdp_loading` (each rank reads only its shards) and :mod:`.vocab_chunks` (a large
vocabulary cut into row chunks). Tensor parallelism is :mod:`.tensor_parallel`, with
:mod:`.tp_exact` (plans rewritten so that no sum is split) and :mod:`.shm_collectives` (CPU ranks'
gathers through shared memory).
"""
