"""Weights: reading a model's tensors from where they are saved, region by region.

:mod:`.hf_files` reads Hugging Face checkpoints (safetensors or ``.bin`` files, the config and
the generation config), :mod:`.dcp` torch Distributed Checkpoint directories,
:mod:`.checkpoint_dirs` finds the checkpoints of a training run, and :mod:`.sources` fills each
parameter a rank holds with exactly its region of either.
"""
