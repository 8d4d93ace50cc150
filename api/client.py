"""A Python client of the rayeval REST service (what ``rayeval submit/status/results/cancel`` use).

::

    from rayeval.api.client import RayEvalClient

    with RayEvalClient("http://127.0.0.1:8000", token=None) as client:
        body = {"model_args": {"pretrained": "/models/m"}, "tasks": ["hellaswag"]}
        evaluation = client.submit(body)
        final = client.wait(evaluation["id"])  # polls until it ends (bounded if asked)
        results = client.results(evaluation["id"])  # lm-eval's results JSON

Every answer is the service's JSON; a refused request raises :class:`ServiceError` carrying the
server's explanation (which names the fix). No torch, no Ray: this runs anywhere httpx does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx

from rayeval.actors.errors import RayEvalError

#: States after which an evaluation never changes.
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


class ServiceError(RayEvalError):
    """The service refused a request, or could not be reached.

    Args:
        message: The server's ``detail`` (or why it could not be reached).
        status: The HTTP status (0 when no answer came).
    """

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class RayEvalClient:
    """Submit, follow, fetch and cancel evaluations on one rayeval server.

    Args:
        url: The server, e.g. ``http://127.0.0.1:8000``.
        token: The server's API token, when it has one.
        timeout_s: Bound on each HTTP request.
    """

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> RayEvalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------- requests
    def submit(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Queue an evaluation (the body of ``POST /evaluations``); returns it, queued."""
        return self._json("POST", "/evaluations", json=dict(body))

    def get(self, evaluation_id: str) -> dict[str, Any]:
        """State, progress, throughput and links of an evaluation."""
        return self._json("GET", f"/evaluations/{evaluation_id}")

    def list_evaluations(
        self, statuses: list[str] | None = None, limit: int = 50
    ) -> dict[str, Any]:
        """A page of evaluations, newest first (``items``, ``total``)."""
        params: dict[str, Any] = {"limit": limit}
        if statuses:
            params["status"] = statuses
        return self._json("GET", "/evaluations", params=params)

    def results(self, evaluation_id: str) -> dict[str, Any]:
        """lm-eval's results JSON of a succeeded evaluation."""
        return self._json("GET", f"/evaluations/{evaluation_id}/results")

    def results_text(self, evaluation_id: str) -> str:
        """lm-eval's results file, verbatim."""
        return self._request("GET", f"/evaluations/{evaluation_id}/results").text

    def samples_text(self, evaluation_id: str, task: str) -> str:
        """One task's samples JSONL, verbatim (with ``log_samples``)."""
        return self._request("GET", f"/evaluations/{evaluation_id}/samples/{task}").text

    def sweep(self, evaluation_id: str) -> dict[str, Any]:
        """A checkpoint sweep's summary so far, each checkpoint with links to its files."""
        return dict(self._json("GET", f"/evaluations/{evaluation_id}/sweep"))

    def sweep_table(self, evaluation_id: str) -> str:
        """A checkpoint sweep as a plain-text table (a row per metric, a column per step)."""
        path = f"/evaluations/{evaluation_id}/sweep"
        return self._request("GET", path, params={"format": "text"}).text

    def text(self, path: str) -> str:
        """A file the server links to (``links`` of an evaluation or a sweep), verbatim."""
        return self._request("GET", path).text

    def samples(self, evaluation_id: str, task: str) -> list[dict[str, Any]]:
        """One task's samples, one dict per document."""
        text = self.samples_text(evaluation_id, task)
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def cancel(self, evaluation_id: str) -> dict[str, Any]:
        """Cancel an evaluation (its actors are released); returns it, cancelled."""
        return self._json("DELETE", f"/evaluations/{evaluation_id}")

    def retry(self, evaluation_id: str) -> dict[str, Any]:
        """Queue a failed or cancelled evaluation again (computes only what is missing)."""
        return self._json("POST", f"/evaluations/{evaluation_id}/retry")

    def timeline(self, evaluation_id: str, after: int = 0) -> dict[str, Any]:
        """Progress points over time (``points``, ``last_seq``, ``complete``)."""
        return self._json("GET", f"/evaluations/{evaluation_id}/timeline", params={"after": after})

    def audit(
        self, actor: str | None = None, action: str | None = None, limit: int = 100
    ) -> dict[str, Any]:
        """The audit trail, newest first (``items``, ``total``); admins only."""
        params: dict[str, Any] = {"limit": limit}
        params.update({k: v for k, v in (("actor", actor), ("action", action)) if v})
        return self._json("GET", "/audit", params=params)

    def me(self) -> dict[str, Any]:
        """Who the client's key is (``name``, ``role``)."""
        return self._json("GET", "/me")

    def compare(self, a: str, b: str) -> dict[str, Any]:
        """The paired comparison of two succeeded evaluations (``b - a``), as the server
        computes it (``GET /compare``)."""
        return self._json("GET", "/compare", params={"a": a, "b": b})

    def metrics(self) -> str:
        """The Prometheus text of ``GET /metrics``."""
        return self._request("GET", "/metrics").text

    def events(self, evaluation_id: str, after: int = 0) -> Iterator[dict[str, Any]]:
        """The evaluation's events (``{id, event, data}``) from ``after`` on, live, until the end.

        Raises:
            ServiceError: a refused request, or a connection that dropped.
        """
        timeout = httpx.Timeout(self._http.timeout.connect, read=None)
        try:
            with self._http.stream(
                "GET",
                f"/evaluations/{evaluation_id}/events",
                params={"after": after},
                timeout=timeout,
            ) as response:
                if response.status_code != 200:
                    response.read()
                    raise _error(response)
                current: dict[str, Any] = {}
                for line in response.iter_lines():
                    if not line:
                        if "event" in current:
                            current["data"] = json.loads(current.get("data", "null"))
                            yield current
                        current = {}
                    elif not line.startswith((":", "retry:")):
                        name, _, value = line.partition(": ")
                        current[name] = int(value) if name == "id" else value
        except httpx.HTTPError as exc:
            raise ServiceError(f"the event stream of {self.url} broke: {exc}") from exc

    def wait(
        self,
        evaluation_id: str,
        timeout_s: float | None = None,
        poll_s: float = 1.0,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll until the evaluation ends; return its final state.

        Args:
            evaluation_id: The evaluation.
            timeout_s: Give up after this long (None: wait as long as it runs).
            poll_s: Pause between two polls.
            on_update: Called with every state read (progress bars use it).

        Raises:
            TimeoutError: ``timeout_s`` passed first (the evaluation goes on).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            evaluation = self.get(evaluation_id)
            if on_update is not None:
                on_update(evaluation)
            if evaluation["status"] in TERMINAL:
                return evaluation
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"evaluation {evaluation_id} is still {evaluation['status']} after "
                    f"{timeout_s:g}s; it goes on: follow it with `rayeval status {evaluation_id}`"
                )
            time.sleep(poll_s)

    # ---------------------------------------------------------------------- internals
    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ServiceError(
                f"cannot reach the rayeval server at {self.url} ({exc}): check --url "
                "(or RAYEVAL_URL) and that `rayeval serve` runs there"
            ) from exc
        if response.status_code >= 400:
            raise _error(response)
        return response


def _error(response: httpx.Response) -> ServiceError:
    try:
        detail = response.json()["detail"]
    except (ValueError, KeyError, TypeError):
        detail = response.text or response.reason_phrase
    return ServiceError(f"{response.status_code}: {detail}", status=response.status_code)
