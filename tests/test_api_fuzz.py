"""Fuzzing the live REST server from its own OpenAPI document (schemathesis, bounded, loopback).

Every generated request must get a non-5xx answer whose status, content type and body the
document declares. The fuzzed server may run nothing — it names no model roots and takes no hub
ids — so every submission it accepts the shape of is still refused, and fuzzing costs no
evaluation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.test_service import ServerThread

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def fuzzed_server(
    demo: Any, ray_session: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    from rayeval.api.settings import Settings

    server = ServerThread(
        Settings(
            host="127.0.0.1",
            data_dir=Path(tmp_path_factory.mktemp("fuzz")),
            include_paths=[str(demo.tasks_dir)],
            allow_hub_models=False,
            poll_interval_s=0.2,
            sse_max_stream_s=2.0,
        )
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: ServerThread) -> Any:
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def test_no_5xx_and_answers_match_the_document(api_schema: Any) -> None:
    """Every operation, 40 generated requests each (hypothesis, no example database)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8, [op.label for op in operations]
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=40,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: Any) -> None:
            case.call_and_validate(checks=CHECKS, timeout=30)

        fuzz()
