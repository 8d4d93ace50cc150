"""A tiny training run for the checkpoint tests: DCP checkpoints of the demo Llama saved by FSDP2
over two gloo ranks in Ray actors, by one process, or in accelerate's layout; and merged
safetensors copies of them (DCP's own ``dcp_to_torch_save``) for lm-eval's hf reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def perturbed_model(model_dir: Path, scale: float, seed: int) -> Any:
    """The model of ``model_dir`` with seeded noise (``scale`` x each tensor's std) added."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.add_(scale * param.std() * noise)
    return model


class _TrainerRank:
    """One rank of a training job: FSDP2 over a gloo group, saving DCP checkpoints."""

    def __init__(self, rank: int, world: int) -> None:
        self._rank, self._world = rank, world

    def rendezvous(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def save(self, rendezvous: tuple[str, int], model_dir: str, out: str, scale: float,
             seed: int, accelerate: bool) -> list[str]:  # fmt: skip
        import ray
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from rayeval.actors.process import pin_socket_interfaces

        pin_socket_interfaces(ray.util.get_node_ip_address())
        dist.init_process_group(
            "gloo", init_method=f"tcp://{rendezvous[0]}:{rendezvous[1]}",
            rank=self._rank, world_size=self._world,
        )  # fmt: skip
        try:
            model = perturbed_model(Path(model_dir), scale, seed)
            mesh = init_device_mesh("cpu", (self._world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            state = get_model_state_dict(model)
            target = Path(out) / "pytorch_model_fsdp_0" if accelerate else Path(out)
            dcp.save({"model": state} if accelerate else state, checkpoint_id=str(target))
            return [str(p.name) for p in target.iterdir()]
        finally:
            dist.destroy_process_group()


def save_sharded(model_dir: Path, out: Path, scale: float, seed: int, accelerate: bool) -> None:
    """Save a checkpoint from FSDP2 over two gloo ranks in Ray actors."""
    import ray

    remote = ray.remote(num_cpus=1)(_TrainerRank)
    ranks = [remote.remote(rank, 2) for rank in range(2)]
    try:
        rendezvous = ray.get(ranks[0].rendezvous.remote(), timeout=60)
        files = ray.get(
            [r.save.remote(rendezvous, str(model_dir), str(out), scale, seed, accelerate)
             for r in ranks],
            timeout=300,
        )  # fmt: skip
    finally:
        for rank in ranks:
            ray.kill(rank, no_restart=True)
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files[0])


def save_one_process(model_dir: Path, out: Path, scale: float, seed: int) -> None:
    import torch.distributed.checkpoint as dcp

    model = perturbed_model(model_dir, scale, seed)
    dcp.save(model.state_dict(), checkpoint_id=str(out), no_dist=True)


def merge(checkpoint: Path, model_dir: Path, out: Path) -> Path:
    """The checkpoint's weights as a safetensors model, merged with DCP's own utility."""
    import torch
    import transformers
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    nested = checkpoint / "pytorch_model_fsdp_0"
    dcp_to_torch_save(str(nested if nested.is_dir() else checkpoint), str(out.with_suffix(".pt")))
    state = torch.load(out.with_suffix(".pt"), weights_only=True)
    state = state.get("model", state)  # accelerate's {"model": state_dict}
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.generation_config = transformers.GenerationConfig.from_pretrained(model_dir)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out
