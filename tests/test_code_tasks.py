"""A code task over REST, end to end: refused unless the operator allows code execution; then
every candidate runs in the sandbox and the results equal lm-eval hf's own code_eval path.

The reference is lm-eval's ``hf`` backend on the same model and task, scored by code_eval's own
unsandboxed ``check_correctness`` (the pinned module, forked from this process as lm-eval forks
it): the only difference offline is that ``evaluate.load("code_eval")`` is answered locally
instead of from the Hub.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_results, hf_reference
from tests.test_sandbox import Unsandboxed, skip_without_bwrap
from tests.test_service import (
    ServerThread,
    finished,
    lm_eval_files,
    make_settings,
    parse_samples,
    submit,
    wait_for,
)

LIMIT = 4


def _body(demo: Any) -> dict[str, Any]:
    return {
        "model": "hf",
        "model_args": {"pretrained": str(demo.model_dir), "dtype": "float32"},
        "tasks": ["demo_code"],
        "limit": LIMIT,
        "log_samples": True,
        "parallelism": {"num_replicas": 1, "shard_size": 1},
    }


@pytest.mark.e2e
@skip_without_bwrap
def test_code_task_is_refused_unless_allowed_then_sandboxed_and_equal_to_lm_eval_hf(
    demo: Any, ray_session: None, tmp_path: Path
) -> None:
    from rayeval.service.demo.code_task import write_code_task
    from rayeval.service.sandbox.code_eval import EXECUTE_SHA256

    code_dir = write_code_task(tmp_path / "code_tasks")
    detail = _refusal_without_the_setting(demo, code_dir, tmp_path / "closed")
    assert "--allow-code-execution" in detail, detail

    settings = make_settings(tmp_path / "open", demo.tasks_dir, allow_code_execution=True)
    settings.include_paths.append(str(code_dir))
    server = ServerThread(settings)
    server.start()
    try:
        with server.client() as client:
            evaluation = submit(client, _body(demo))
            final = wait_for(client, evaluation["id"], finished, timeout_s=300)
            assert final["status"] == "succeeded", final["error"]
            ours = client.get(f"/evaluations/{evaluation['id']}/results").json()
            text = client.get(final["links"]["samples"]["demo_code"]).text
    finally:
        server.stop()
    where = ours["code_execution"]
    assert where["program"] == "bubblewrap" and where["network"] == "none"
    assert where["execution_module_sha256"] == EXECUTE_SHA256

    reference = _lm_eval_hf(demo, code_dir)
    _, written = lm_eval_files(reference, tmp_path / "reference")  # as lm-eval writes them
    ref_samples = {"demo_code": parse_samples(written["demo_code"], "generate_until")}
    ours_samples = {"demo_code": parse_samples(text, "generate_until")}
    assert len(ours_samples["demo_code"]) == LIMIT
    assert_same_results(
        {"results": reference["results"], "samples": ref_samples},
        {"results": ours["results"], "samples": ours_samples},
    )
    assert "pass@1,create_test" in ours["results"]["demo_code"]


def _refusal_without_the_setting(demo: Any, code_dir: Path, data_dir: Path) -> str:
    """The 422's detail for the code task on a server without ``--allow-code-execution``."""
    closed = ServerThread(make_settings(data_dir, demo.tasks_dir))
    closed.settings.include_paths.append(str(code_dir))
    closed.start()
    try:
        with closed.client() as client:
            response = client.post("/evaluations", json=_body(demo))
    finally:
        closed.stop()
    assert response.status_code == 422, response.text
    return str(response.json()["detail"])


def _lm_eval_hf(demo: Any, code_dir: Path) -> dict[str, Any]:
    """lm-eval hf on the code task, scored by code_eval's own path: the pinned
    ``check_correctness`` forked from this process, no walls."""
    from lm_eval.tasks import TaskManager

    from rayeval.service.sandbox.metric import sandboxed_code_eval

    with sandboxed_code_eval() as metric:
        metric.sandbox = Unsandboxed()  # type: ignore[assignment]
        manager = TaskManager(include_defaults=False, include_path=str(code_dir))
        return hf_reference(
            demo.model_dir, manager, ["demo_code"], limit=LIMIT, confirm_run_unsafe_code=True
        )
