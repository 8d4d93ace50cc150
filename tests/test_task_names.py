"""An unknown task name gets the same "did you mean" through both doors: ``rayeval run`` (lm-eval's
own message kept) and the service's catalog (a 422 over REST). Not the unit tier: lm-eval's
built-in index of ~15k tasks is scanned (seconds each time); no Ray, no model."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayeval.actors.errors import ConfigError

pytestmark = pytest.mark.service


@pytest.fixture
def tasks_dir(tmp_path: Path) -> Path:
    (tmp_path / "tiny.yaml").write_text("task: tiny_arithmetic\noutput_type: loglikelihood\n")
    return tmp_path


def test_both_doors_name_the_nearest_task(tasks_dir: Path) -> None:
    from rayeval.api.cli import build_parser
    from rayeval.api.cli.evaluation_flags import config_from_args
    from rayeval.service.engine.runner import resolve_tasks
    from rayeval.service.jobs.tasks import TaskCatalog
    from rayeval.service.vocabulary.config import HostOptions

    argv = ["run", "--model_args", "pretrained=/m", "--include_path", str(tasks_dir),
            "--tasks", "tiny_arithmetc"]  # fmt: skip
    config, host = config_from_args(build_parser().parse_args(argv))
    with pytest.raises(ConfigError) as cli:
        resolve_tasks(config.evaluator_config(HostOptions(include_paths=host.include_paths)))
    said = str(cli.value)
    assert "Tasks not found: tiny_arithmetc" in said and "--include_path" in said
    hint = "'tiny_arithmetc' (did you mean tiny_arithmetic"
    assert hint in said
    with pytest.raises(ConfigError) as rest:
        TaskCatalog([str(tasks_dir)]).check(["tiny_arithmetc"], wait_s=300)
    assert hint in str(rest.value)
