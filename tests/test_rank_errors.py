"""A rank's failure reaches the user with its own cause; the memory hint only when it ran out of
memory (actors/group.py ``rank_failure``)."""

from __future__ import annotations

import pytest
import torch
from ray.exceptions import RayTaskError

from rayeval.actors.errors import ModelLoadError, RayEvalError
from rayeval.actors.group import out_of_memory, rank_failure

pytestmark = pytest.mark.unit

HINT = ". Lower --batch_size."


def _failure(cause: BaseException) -> RayEvalError:
    return rank_failure(RayTaskError("step", "traceback", cause), RayEvalError, "x", HINT)


@pytest.mark.parametrize(
    "cause",
    [
        MemoryError(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 1125899906842624 bytes. Error code 12"
        ),
    ],
)
def test_out_of_memory_gets_the_hint(cause: BaseException) -> None:
    assert out_of_memory(cause)
    message = str(_failure(cause))
    assert message.startswith(f"a rank failed while x: {type(cause).__name__}")
    assert message.endswith(HINT)


@pytest.mark.parametrize(
    "cause",
    [
        ValueError("this group cannot be generated here: beam search"),
        RuntimeError("shape mismatch"),
        KeyError("model.layers.0"),
    ],
)
def test_any_other_cause_is_named_without_the_hint(cause: BaseException) -> None:
    assert not out_of_memory(cause)
    message = str(_failure(cause))
    assert f"{type(cause).__name__}: {cause}" in message
    assert HINT not in message and "memory" not in message


def test_a_rayeval_error_keeps_its_class_and_message() -> None:
    failure = _failure(ModelLoadError("cannot load 'x': no config.json"))
    assert type(failure) is ModelLoadError and str(failure) == "cannot load 'x': no config.json"


def test_a_rank_error_keeps_its_field_marks_for_each_door() -> None:
    from rayeval.actors.errors import ConfigError, field
    from rayeval.service.vocabulary.doors import Door, render

    cause = ConfigError(f"too long: raise {field('parallelism', 'shard_size')}")
    failure = _failure(cause)
    assert str(failure) == "too long: raise --shard_size"
    assert render(failure, Door.REST) == "too long: raise parallelism.shard_size"
    assert render(failure, Door.PYTHON) == "too long: raise shard_size="
