"""Mistakes a new user makes, caught at submission (a 422 naming the field and the fix), and what
still fails at run time named by its field rather than by a bare Python exception name.

The REST side (the same bodies posted to a running server) is in ``tests/test_team.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rayeval.actors.errors import ConfigError
from rayeval.service.jobs.failures import explain
from rayeval.service.jobs.validation import chat_template_problems
from rayeval.service.vocabulary.config import EvaluationConfig

BASE: dict[str, Any] = {"model_args": {"pretrained": "org/model"}, "tasks": ["demo_mc"]}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "words"),
    [
        (
            {"model_args": {"pretrained": "org/m", "dtype": {}}},
            "model_args.dtype: {} is not a dtype",
        ),
        ({"model_args": {"pretrained": "org/m", "dtype": None}}, "model_args.dtype: None"),
        ({"model_args": "pretrained=org/m,dtype=fp17"}, "model_args.dtype: 'fp17' is not a dtype"),
        ({"model_args": {"pretrained": "org/m", "softmax_dtype": "x"}}, "model_args.softmax_dtype"),
        ({"bootstrap_iters": 1}, "use 0 to skip stderrs, or 2 or more"),
        ({"scheduling": {"priority": "high"}}, "valid integer"),
        ({"scheduling": {"priority": 1000}}, "less than or equal to 100"),
        ({"scheduling": {"preemptible": "yes"}}, "valid boolean"),
        ({"priority": 3}, '"scheduling": {"priority": N}'),
    ],
    ids=lambda v: str(v)[:40],
)
def test_the_config_refuses_naming_the_field(change: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError) as refused:
        EvaluationConfig.model_validate({**BASE, **change})
    assert words in str(refused.value)


@pytest.mark.unit
def test_accepted_dtypes_and_bootstrap_iters() -> None:
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        EvaluationConfig.model_validate(
            {**BASE, "model_args": {"pretrained": "o/m", "dtype": dtype}}
        )
    for iters in (0, 2, 100000):
        assert EvaluationConfig.model_validate({**BASE, "bootstrap_iters": iters})


@pytest.mark.unit
def test_a_chat_template_is_needed_for_apply_chat_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    config = EvaluationConfig.model_validate(
        {**BASE, "model_args": {"pretrained": str(tmp_path)}, "apply_chat_template": True}
    )
    (problem,) = chat_template_problems(config)
    assert problem.startswith("apply_chat_template: the tokenizer at") and "false" in problem
    assert chat_template_problems(config.model_copy(update={"apply_chat_template": False})) == []
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert chat_template_problems(config) == []


@pytest.mark.unit
@pytest.mark.parametrize(
    ("error", "field"),
    [
        (ValueError("Duplicate task 'demo_mc': found in both 'demo_mc' and 'demo'"), "tasks:"),
        (ZeroDivisionError("float division by zero"), "bootstrap_iters or limit:"),
        (
            ValueError(
                "Cannot use chat template functions because tokenizer.chat_template is not set"
            ),
            "apply_chat_template:",
        ),
        (AttributeError("module 'torch' has no attribute 'fp17' (dtype)"), "model_args.dtype:"),
        (KeyError("doc_to_text"), "lm-eval stopped while running this evaluation"),
    ],
)
def test_run_time_failures_name_the_field(error: Exception, field: str) -> None:
    message = explain(error)
    assert message.startswith(field), message
    assert not message.startswith(type(error).__name__)


@pytest.mark.service
def test_a_pattern_over_a_group_and_its_tasks_is_refused(demo: Any) -> None:
    from rayeval.service.jobs.tasks import TaskCatalog

    catalog = TaskCatalog([str(demo.tasks_dir)])
    with pytest.raises(ConfigError) as refused:
        catalog.check(["*"], wait_s=0)
    message = str(refused.value)
    assert (
        message.startswith("tasks: '*' matches the groups or tags") and "Duplicate task" in message
    )
    catalog.check(["demo_mc", "demo_c*"], wait_s=0)  # tasks only: fine
    catalog.check(["demo"], wait_s=0)  # the group alone: fine
