"""Ray GPU/CPU actors: one rank each, grouped into replicas that run a Hugging Face model.

This package owns torch, torch.distributed, FSDP2 and the model. Importing the package itself is
cheap (no torch): the torch-heavy modules are ``rayeval.actors.worker`` and
``rayeval.actors.model_loading``, which are imported inside the actor processes.
"""
