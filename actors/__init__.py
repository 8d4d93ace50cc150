"""Ray GPU/CPU actors: one rank each, grouped into replicas that run a Hugging Face model.

This package owns torch, torch.distributed, FSDP2 and the model. Importing the package itself is
cheap (no torch): the torch-heavy modules are imported inside the actor processes.

Rooms by role:

- the words the driver and the ranks share: :mod:`.batches` (what a rank is sent and returns),
  :mod:`.layout` (R x G, devices, placement, strategies, timeouts), :mod:`.errors`,
  :mod:`.profiles` (what rayeval knows of each architecture);
- the replica: :mod:`.group` (the driver's handle on the ranks), :mod:`.worker` (one rank),
  :mod:`.placement` (bundles on nodes), :mod:`.process` (a rank's process environment);
- :mod:`.parallel`: how a replica shards its model (FSDP2, tensor parallelism);
- :mod:`.weights`: reading saved tensors (Hugging Face files, DCP, training runs);
- :mod:`.compute`: scoring, generation and continuous batching on a loaded model.
"""
