"""The private APIs rayeval relies on: all present in the pinned versions, and a moved one named."""

from __future__ import annotations

import logging

import pytest

from rayeval.actors.errors import ConfigError
from rayeval.service import private_apis
from rayeval.service.private_apis import PRIVATE_APIS, PrivateApi, check_private_apis, missing

pytestmark = pytest.mark.unit


def test_every_listed_private_api_is_there() -> None:
    assert [api.name for api in PRIVATE_APIS if missing(api)] == []


def test_a_moved_api_is_named_with_both_versions(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gone_with_fallback = PrivateApi(
        "torch",
        "torch.distributed.fsdp",
        "FSDPModule._no_such_method",
        "2.13.0",
        "a test",
        "slower",
    )
    monkeypatch.setattr(private_apis, "PRIVATE_APIS", (gone_with_fallback,))
    check_private_apis.cache_clear()
    with caplog.at_level(logging.WARNING):
        warnings = check_private_apis()
    import torch

    assert warnings == [
        f"torch {torch.__version__} has no torch.distributed.fsdp.FSDPModule._no_such_method "
        "(checked with torch 2.13.0; used by a test): slower"
    ]
    assert warnings[0] in caplog.text

    gone = PrivateApi("lm_eval", "lm_eval.no_such_module", "thing", "0.4.13", "the CLI")
    monkeypatch.setattr(private_apis, "PRIVATE_APIS", (gone_with_fallback, gone))
    check_private_apis.cache_clear()
    with pytest.raises(
        ConfigError, match=r"lm_eval 0\.4\.13 has no lm_eval\.no_such_module\.thing"
    ):
        check_private_apis()
    check_private_apis.cache_clear()
