"""``rayeval serve --demo``'s submitter: once the server answers, one demo evaluation goes in.

It talks to the server over HTTP like any client, from a daemon thread beside uvicorn, and says
where to look (dashboard, ``curl`` lines) on stdout.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def submit_demo(settings: Any, model_dir: str, ready_timeout_s: float = 300.0) -> None:
    """Once the server answers, submit the bundled demo evaluation and say where to look.

    Args:
        settings: The server's ``Settings`` (where it listens, its API token).
        model_dir: The bundled tiny model's directory.
        ready_timeout_s: How long to wait for ``/healthz`` before giving up (said on stderr).
    """
    import httpx

    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    base = f"http://{host}:{settings.port}"
    token = settings.api_token.get_secret_value() if settings.api_token else None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if not _wait_until_up(base, ready_timeout_s):
        print(
            f"rayeval serve --demo: the server did not answer at {base} within "
            f"{ready_timeout_s:g}s; the demo evaluation was not submitted",
            file=sys.stderr,
        )
        return
    body = {
        "model": "hf",
        "model_args": {"pretrained": model_dir, "dtype": "float32"},
        "tasks": ["demo"],
        "batch_size": "auto",
        "log_samples": True,
        "parallelism": {"num_replicas": 2, "shard_size": 1},
    }
    response = httpx.post(f"{base}/evaluations", json=body, headers=headers, timeout=120)
    if response.status_code != 202:
        print(
            f"rayeval serve --demo: submitting failed ({response.status_code}): {response.text}",
            file=sys.stderr,
        )
        return
    _say_where_to_look(base, response.json()["id"], with_token=token is not None)


def _wait_until_up(base: str, timeout_s: float) -> bool:
    """Whether ``GET /healthz`` answered 200 within ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def _say_where_to_look(base: str, evaluation: str, with_token: bool) -> None:
    auth = ' -H "Authorization: Bearer $RAYEVAL_API_TOKEN"' if with_token else ""
    print(
        f"\nrayeval demo: evaluation {evaluation} submitted (bundled tiny model, tasks: demo, "
        f"layout 2x1).\n"
        f"  dashboard:   {base}/\n"
        f"  status:      curl{auth} {base}/evaluations/{evaluation}\n"
        f"  live events: curl -N{auth} {base}/evaluations/{evaluation}/events\n"
        f"  results:     curl{auth} {base}/evaluations/{evaluation}/results\n"
        f"  API docs:    {base}/docs\n"
        "Stop the server with Ctrl-C.\n",
        flush=True,
    )
