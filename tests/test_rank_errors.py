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


def _raise_in_a_rank() -> None:
    torch.ones(3).split([1, 1])  # raised under torch's own Python code


def test_the_message_names_where_the_rank_raised_and_the_log_holds_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The console's one line names torch's frame and rayeval's (here: this test file, in the
    checkout); the log holds the whole traceback, which the raised error cannot carry. The
    error is Ray's driver-side copy of the cause (``as_instanceof_cause``), as ``ray.get``
    raises it: it has no attributes of its own but the cause."""
    import traceback

    try:
        _raise_in_a_rank()
    except RuntimeError as cause:
        text = traceback.format_exc()
        exc = RayTaskError("step", text, cause).as_instanceof_cause()
    with caplog.at_level("ERROR", logger="rayeval.actors.group"):
        failure = rank_failure(exc, RayEvalError, "computing a batch", HINT)
    message = str(failure)
    assert failure.traceback == str(exc)  # for REST's failed state event
    assert message.startswith("a rank failed while computing a batch: RuntimeError: ")
    line = _raise_in_a_rank.__code__.co_firstlineno + 1
    assert " (at torch/_tensor.py:" in message, message
    assert f", from tests/test_rank_errors.py:{line} in _raise_in_a_rank)" in message, message
    assert HINT not in message
    (record,) = caplog.records
    logged = record.getMessage()
    assert logged.startswith("a rank failed while computing a batch:")
    assert f'test_rank_errors.py", line {line}, in _raise_in_a_rank' in logged, logged
    assert text.rstrip().splitlines()[-1] in logged  # the exception's own line


def test_raised_at_reads_the_innermost_frame() -> None:
    from rayeval.actors.group import raised_at

    text = (
        'Traceback (most recent call last):\n  File "/x/site-packages/torch/f.py", line 7, in g\nE'
    )
    assert raised_at(text) == "torch/f.py:7 in g"
    assert raised_at("no frames here") is None
