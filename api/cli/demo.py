"""``rayeval serve --demo``'s submitter: once the server answers, one demo evaluation goes in.

It talks to the server over HTTP like any client (:class:`rayeval.api.client.RayEvalClient`), from a
daemon thread beside uvicorn: it says where to look (dashboard, ``curl`` lines), follows the
evaluation with one progress bar per request type, and says how it ended, with lm-eval's table.
"""

from __future__ import annotations

import time
from typing import Any

#: The demo evaluation: the bundled tiny model on every demo task, on two replicas. On CPU
#: whatever the machine holds: ``auto`` would pick CUDA as soon as Ray sees a GPU, and 2x1 would
#: then be refused on a one-GPU machine (the tiny model gains nothing from a GPU).
DEMO_BODY: dict[str, Any] = {
    "model": "hf",
    "tasks": ["demo"],
    "batch_size": "auto",
    "log_samples": True,
    "device": "cpu",
    "parallelism": {"num_replicas": 2, "shard_size": 1},
}


def demo_body(model_dir: str) -> dict[str, Any]:
    """What ``serve --demo`` submits: :data:`DEMO_BODY` on the bundled model in ``model_dir``."""
    return {**DEMO_BODY, "model_args": {"pretrained": model_dir, "dtype": "float32"}}


def submit_demo(settings: Any, model_dir: str, shown: Any, ready_timeout_s: float = 300.0) -> None:
    """Once the server answers, submit the bundled demo evaluation, say where to look, follow it
    to its end and show its results.

    Args:
        settings: The server's ``Settings`` (where it listens, its API token).
        model_dir: The bundled tiny model's directory.
        shown: The command's console (:class:`rayeval.api.cli.console.Console`).
        ready_timeout_s: How long to wait for ``/healthz`` before giving up (said on the console).
    """
    from rayeval.api.client import RayEvalClient, ServiceError

    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    base = f"http://{host}:{settings.port}"
    token = settings.api_token.get_secret_value() if settings.api_token else None
    if not _wait_until_up(base, ready_timeout_s):
        print(
            f"rayeval serve --demo: the server did not answer at {base} within "
            f"{ready_timeout_s:g}s; the demo evaluation was not submitted",
            file=shown.err,
            flush=True,
        )
        return
    body = demo_body(model_dir)
    try:
        with RayEvalClient(base, token=token) as client:
            evaluation = client.submit(body)
            _say_where_to_look(base, evaluation["id"], token is not None, shown.out)
            _follow(client, evaluation["id"], shown)
    except ServiceError as exc:
        print(f"rayeval serve --demo: {exc}", file=shown.err, flush=True)


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


def _say_where_to_look(base: str, evaluation: str, with_token: bool, out: Any) -> None:
    auth = ' -H "Authorization: Bearer $RAYEVAL_API_TOKEN"' if with_token else ""
    print(
        f"\nrayeval demo: evaluation {evaluation} submitted (bundled tiny model, tasks: demo, "
        f"layout 2x1).\n"
        f"  dashboard:   {base}/#{evaluation}\n"
        f"  status:      curl{auth} {base}/evaluations/{evaluation}\n"
        f"  live events: curl -N{auth} {base}/evaluations/{evaluation}/events\n"
        f"  results:     curl{auth} {base}/evaluations/{evaluation}/results\n"
        f"  API docs:    {base}/docs\n",
        file=out,
        flush=True,
    )


def _follow(client: Any, evaluation_id: str, shown: Any) -> None:
    """Progress bars until the evaluation ends; then how it ended and lm-eval's table."""
    from lm_eval.utils import make_table

    from rayeval.api.cli.remote import watch

    started = time.monotonic()
    final = watch(client, evaluation_id, shown.err)
    took = time.monotonic() - started
    out = shown.out
    if final["status"] != "succeeded":
        reason = f": {final['error']}" if final.get("error") else ""
        print(f"rayeval demo: evaluation {evaluation_id} {final['status']}{reason}", file=out)
    else:
        results = client.results(evaluation_id)
        print(f"rayeval demo: evaluation {evaluation_id} succeeded in {took:.0f} s", file=out)
        print(make_table(results), file=out)
        if "groups" in results:
            print(make_table(results, "groups"), file=out)
        print(
            f"Submit more with `rayeval submit --url {client.url} ...`; compare two with "
            f"`rayeval compare ID_A ID_B --url {client.url}` or the dashboard.",
            file=out,
        )
    print("Stop the server with Ctrl-C.", file=out, flush=True)
