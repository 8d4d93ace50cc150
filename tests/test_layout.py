"""ParallelLayout: validation, rank arithmetic, and the fits-the-cluster check."""

from __future__ import annotations

import pytest

from rayeval.actors.errors import LayoutError
from rayeval.actors.layout import DeviceKind, ParallelLayout, PlacementPolicy

pytestmark = pytest.mark.unit


def test_ranks_are_replica_major() -> None:
    layout = ParallelLayout(num_replicas=2, shard_size=3)
    assert layout.world == 6 and layout.sharded
    assert [(c.replica, c.shard_rank, c.global_rank) for c in layout.coords()][:4] == [
        (0, 0, 0),
        (0, 1, 1),
        (0, 2, 2),
        (1, 0, 3),
    ]


def test_invalid_numbers_are_all_reported() -> None:
    with pytest.raises(LayoutError) as info:
        ParallelLayout(num_replicas=0, shard_size=-1)
    assert "num_replicas must be an integer >= 1, got 0" in str(info.value)
    assert "shard_size must be an integer >= 1, got -1" in str(info.value)


def test_placement_policy_is_validated_and_described() -> None:
    layout = ParallelLayout(1, 2, placement="spread")  # type: ignore[arg-type]  # as JSON has it
    assert layout.placement is PlacementPolicy.SPREAD
    assert layout.describe() == "1x2 (2 cpu ranks, spread)"
    assert ParallelLayout(1, 2).describe() == "1x2 (2 cpu ranks)"
    with pytest.raises(LayoutError, match="placement must be one of auto, pack, spread, got 'x'"):
        ParallelLayout(1, 2, placement="x")  # type: ignore[arg-type]


def test_fits_names_requested_and_available() -> None:
    gpu = ParallelLayout(num_replicas=4, shard_size=2, device=DeviceKind.CUDA)
    assert gpu.total_resources() == {"GPU": 8.0, "CPU": 8.0}
    gpu.check_fits({"GPU": 8, "CPU": 64})
    with pytest.raises(LayoutError, match=r"8 GPU requested, 4 in the cluster.*--num_replicas"):
        gpu.check_fits({"GPU": 4, "CPU": 64})
    ParallelLayout(2, 2).check_fits({"CPU": 4})


def test_gpus_asked_of_a_cluster_without_any_name_the_cpu_device() -> None:
    """No GPU at all: fewer replicas would not help; the fix is the CPU (or auto)."""
    with pytest.raises(LayoutError) as info:
        ParallelLayout(1, 1, device=DeviceKind.CUDA).check_fits({"CPU": 8})
    message = str(info.value)
    assert "1 GPU requested, 0 in the cluster" in message
    assert "--device cpu" in message and "--device auto" in message
    assert "--num_replicas" not in message


def test_shard_strategy_is_settled_from_the_model_and_the_placement() -> None:
    """auto: TP where it can work, else FSDP; tp that cannot work is refused naming why."""
    import transformers

    from rayeval.actors.errors import ConfigError
    from rayeval.actors.layout import ShardStrategy
    from rayeval.actors.parallel.strategies import model_obstacles, settle

    def tp_obstacles(config, shard_size):
        return model_obstacles(config, shard_size)[ShardStrategy.TP]

    def tp_obstacles_from_json(config_json, shard_size):
        return model_obstacles(config_json, shard_size)[ShardStrategy.TP]

    def tp(obstacles):
        return {ShardStrategy.TP: obstacles}

    llama = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    assert tp_obstacles(llama, 2) == []
    assert tp_obstacles(llama, 4) == ["num_key_value_heads=2 is not divisible by shard_size 4"]
    gpt2 = transformers.GPT2Config(n_embd=64, n_head=4)
    assert tp_obstacles(gpt2, 2) == [
        "transformers has no tensor-parallel plan for the gpt2 architecture"
    ]
    assert tp_obstacles_from_json(llama.to_dict(), 4) == tp_obstacles(llama, 4)

    assert settle("auto", 2, tp([]), []) is ShardStrategy.TP
    assert settle("auto", 1, tp([]), []) is ShardStrategy.FSDP
    assert settle("auto", 4, tp(["heads"]), []) is ShardStrategy.FSDP
    assert settle("auto", 2, tp([]), [0]) is ShardStrategy.FSDP  # a replica across nodes
    assert settle("fsdp", 2, tp([]), []) is ShardStrategy.FSDP
    with pytest.raises(ConfigError, match="num_key_value_heads=2 is not divisible"):
        settle("tp", 4, tp(tp_obstacles(llama, 4)), [])
    with pytest.raises(LayoutError, match=r"replica\(s\) \[1\] were placed across nodes"):
        settle("tp", 2, tp([]), [1])
