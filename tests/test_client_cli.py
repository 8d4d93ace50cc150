"""The client commands' exit statuses: 2 only for a usage error (flags that cannot make a
request); a server's refusal (401, 403, 404, 409, 422) or an unreachable server exits 1, with the
server's message. A real server on a real Ray here."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rayeval.api.cli import main
from tests.test_service import ServerThread, make_settings

pytestmark = pytest.mark.service

TOKEN = "client-exit-token"


@pytest.fixture(scope="module")
def server(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("client-exit")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny.yaml").write_text("task: tiny_task\noutput_type: loglikelihood\n")
    handle = ServerThread(make_settings(root / "data", tasks, api_token=TOKEN))
    handle.start()
    yield handle
    handle.stop()


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, err.getvalue()


def test_server_answers_exit_1_with_its_message_and_usage_errors_2(
    server: Any, tmp_path: Path
) -> None:
    at = ["--url", server.url, "--token", TOKEN]
    status, said = _cli("status", "nope", *at)
    assert status == 1 and "rayeval status: error: 404: no evaluation with id 'nope'" in said
    assert "`rayeval status`" in said
    status, said = _cli("cancel", "nope", *at)
    assert status == 1 and "404" in said
    status, said = _cli("status", "--url", server.url, "--token", "wrong")
    assert status == 1 and "401" in said
    outside = tmp_path / "model"  # not under the server's model roots
    status, said = _cli("submit", "--model_args", f"pretrained={outside}", "--tasks", "tiny_task",
                        *at)  # fmt: skip
    assert status == 1 and "rayeval submit: error: 422: " in said
    # Usage: flags the server's operator sets are refused before any request.
    status, said = _cli("submit", "--model_args", "pretrained=x", "--tasks", "tiny_task",
                        "--use_cache", "c", *at)  # fmt: skip
    assert status == 2 and "--use_cache" in said and "server's operator" in said
    status, said = _cli("status", "--url", "http://127.0.0.1:9")
    assert status == 1 and "cannot reach the rayeval server" in said
