"""HF evaluate's ``code_eval`` execution module, pinned and shipped (Apache-2.0).

lm-eval's ``humaneval*`` and ``mbpp*`` tasks score with ``evaluate.load("code_eval")``, which
downloads the metric's script from the Hub at run time. rayeval ships the one file that decides
an outcome, ``execute.py``, byte for byte as upstream has it (checked by its sha256 before every
use), and never fetches it: :mod:`rayeval.service.sandbox.metric` calls it, inside a sandbox.

Upstream: https://github.com/huggingface/evaluate, ``metrics/code_eval/execute.py`` (last changed
in b81696c40c028fecef70a0a8493f287fc74e1502; identical at a7dd338386a4fae9a1767e05eb9ef9479513d9e8),
Copyright 2020 The HuggingFace Datasets Authors, Apache License 2.0; adapted by them from OpenAI's
human-eval (MIT).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: The shipped file.
EXECUTE_PATH = Path(__file__).with_name("execute.py")

#: sha256 of upstream's ``metrics/code_eval/execute.py`` (git blob 53517a80).
EXECUTE_SHA256 = "1c905e8de742d67e73f9bf4cd217d8ccd5e327bfc0f8db9d89077d7551e9cdb6"

#: Where it comes from, as results record it.
UPSTREAM = (
    "huggingface/evaluate@a7dd338386a4fae9a1767e05eb9ef9479513d9e8:metrics/code_eval/execute.py"
)


def execute_sha256() -> str:
    """The shipped file's sha256, or ValueError when it is not upstream's."""
    digest = hashlib.sha256(EXECUTE_PATH.read_bytes()).hexdigest()
    if digest != EXECUTE_SHA256:
        raise ValueError(
            f"{EXECUTE_PATH} is not the pinned code_eval execute.py (sha256 {digest}, pinned "
            f"{EXECUTE_SHA256}): reinstall rayeval"
        )
    return digest
