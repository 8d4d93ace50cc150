"""Settings of the REST service: one ``Settings`` object, from flags, environment or defaults.

Every field can be set by an environment variable ``RAYEVAL_<FIELD>`` (``RAYEVAL_API_TOKEN``,
``RAYEVAL_DATABASE_URL``, ``RAYEVAL_INCLUDE_PATHS='["/srv/tasks"]'``, ...); ``rayeval serve`` flags
override the environment: each field is a flag (``rayeval.api.cli.settings_flags`` makes them,
from the field's type, description and default; a field spelt otherwise than ``--field-name`` says
so in its ``json_schema_extra``). Settings are validated on construction: among other things, a
server without an API token refuses to listen on anything but a loopback address.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import socket
from pathlib import Path

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rayeval.service.trackers import Trackers


class Settings(BaseSettings):
    """How the service listens, where it keeps its data, and how it reaches Ray."""

    model_config = SettingsConfigDict(env_prefix="RAYEVAL_", extra="forbid")

    host: str = Field(
        "127.0.0.1",
        description="Address to listen on; any but a loopback address needs an API token.",
    )
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on; 0: any free port.")
    data_dir: Path = Field(
        Path(".rayeval/service"),
        description="Where the SQLite database (and the response cache) lives; the default is "
        "what `make run` serves, and where `rayeval users` looks (default .rayeval/service).",
    )
    database_url: str | None = Field(
        None, description="Any SQLAlchemy URL; default: the SQLite file under data_dir."
    )
    include_paths: list[str] = Field(
        default_factory=list,
        description="Directories of lm-eval task YAMLs evaluations may use.",
        json_schema_extra={"flag": "--include-path", "metavar": "DIR"},
    )
    model_roots: list[str] = Field(
        default_factory=list,
        description="Directories under which a request may name local models and tokenizers; "
        "none: hub ids only.",
        json_schema_extra={"flag": "--model-root", "metavar": "DIR"},
    )
    allow_hub_models: bool = Field(
        True, description="Whether requests may name Hugging Face hub ids (org/name)."
    )
    allow_remote_code: bool = Field(
        False,
        description="Whether requests may set trust_remote_code, which runs the model "
        "repository's Python on the cluster as the server's user.",
    )
    allow_code_execution: bool = Field(
        False,
        description="Whether evaluations may use tasks that run model-written code to score it "
        "(humaneval, mbpp: unsafe_code in their config); each candidate then runs in a "
        "bubblewrap sandbox (Debian's bubblewrap package), and nowhere else. Off: such tasks "
        "are refused at submission.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host headers accepted without an API token, besides the loopback names and "
        "the listening host; guards against DNS rebinding.",
        json_schema_extra={"flag": "--allowed-host"},
    )
    stall_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="An evaluation with no progress for this long (beyond its own load or step "
        "timeout) fails, naming where it stopped, and its actors are released.",
    )
    warm_replicas: int = Field(
        0,
        ge=0,
        le=64,
        description="Runners kept loaded after an evaluation succeeds, for the next evaluation of "
        "the same model and layout (released when a queued evaluation needs the room, and on "
        "shutdown). 0: every evaluation starts and loads its own ranks.",
    )
    rank_niceness: int = Field(
        15,
        ge=0,
        le=19,
        description="OS niceness of the rank processes (0: the node's default, 19: the lowest "
        "priority; 15 is what Ray gives its workers). Runners, each evaluation's driver, run at "
        "the node's default: on a node that also runs the API server, the runners, Ray's own "
        "processes or the database, compute yields to them.",
    )
    response_cache: bool = Field(
        True,
        description="Keep every answered request in a cache under data_dir (keyed by model and "
        "request), so a retried or overlapping evaluation computes only what is missing.",
    )
    api_token: SecretStr | None = Field(
        None,
        description="Bearer token every endpoint but /healthz requires (none: no authentication). "
        "Prefer the environment variable: command lines are visible to other users.",
    )
    require_api_keys: bool = Field(
        False,
        description="Refuse every request without a user's API key or the --api-token, even "
        "before any user exists (a team's server: add users with `rayeval users add`). Without "
        "it, a server with no --api-token and no users answers everyone as its admin.",
    )
    ray_address: str | None = Field(
        None, description="Existing Ray cluster; default: $RAY_ADDRESS, else an embedded Ray."
    )
    num_cpus: int | None = Field(
        None, ge=1, description="Logical CPUs of an embedded Ray; default: the machine's cores."
    )
    ray_namespace: str = Field("rayeval", description="Ray namespace of the runner actors.")
    poll_interval_s: float = Field(
        0.5, gt=0, description="Seconds between two rounds of polling runners and admission."
    )
    runner_unreachable_s: float = Field(
        120.0, gt=0, description="A runner that does not answer for this long fails its evaluation."
    )
    cancel_timeout_s: float = Field(
        30.0, gt=0, description="Bound on waiting for Ray to release a cancelled evaluation."
    )
    task_index_wait_s: float = Field(
        20.0, ge=0, description="Bound on waiting for lm-eval's task index in a request."
    )
    sse_heartbeat_s: float = Field(
        15.0, gt=0, description="Seconds between keep-alive comments on SSE."
    )
    sse_max_stream_s: float = Field(
        3600.0, gt=0, description="SSE streams end after this; clients resume (Last-Event-ID)."
    )
    runner_scan_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Bound on waiting, at start, for the runner actors a previous server left "
        "to say which evaluation they run (to re-attach them).",
    )

    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking server that evaluations asking to be tracked are recorded in "
        '("tracking" in the body): one run each, with its configuration, metrics, files and a '
        "link back; the cluster's nodes must reach it. Credentials: MLFLOW_TRACKING_TOKEN (or "
        "_USERNAME/_PASSWORD) in the server's environment",
        json_schema_extra={"metavar": "URI"},
    )
    wandb_project: str | None = Field(
        None,
        description="W&B project that evaluations asking to be tracked are recorded in, through "
        "lm-eval's W&B logger. Credentials: WANDB_API_KEY (or WANDB_MODE=offline) in the "
        "server's environment",
    )
    public_url: str | None = Field(
        None,
        description="The address people reach this server at, for the links it hands out "
        "(tracked runs link back to their evaluation); default http://HOST:PORT",
        json_schema_extra={"metavar": "URL"},
    )

    @field_validator("mlflow_tracking_uri", "wandb_project")
    @classmethod
    def _tracker_installed(cls, value: str | None, info: ValidationInfo) -> str | None:
        if not value:
            return None
        package = "mlflow" if info.field_name == "mlflow_tracking_uri" else "wandb"
        if importlib.util.find_spec(package) is None:
            raise ValueError(
                f"recording evaluations in {package} needs the {package} package: "
                f"pip install 'rayeval[{package}]'"
            )
        return value

    @field_validator("api_token")
    @classmethod
    def _empty_token_is_none(cls, token: SecretStr | None) -> SecretStr | None:
        return token if token is not None and token.get_secret_value() else None

    @field_validator("include_paths", "model_roots")
    @classmethod
    def _directories_exist(cls, paths: list[str], info: ValidationInfo) -> list[str]:
        missing = [p for p in paths if not Path(p).expanduser().is_dir()]
        if missing:
            flag = "--include-path" if info.field_name == "include_paths" else "--model-root"
            raise ValueError(f"{missing} are not directories: pass existing directories to {flag}")
        return [str(Path(p).expanduser().resolve()) for p in paths]

    @model_validator(mode="after")
    def _token_or_loopback(self) -> Settings:
        if not self.keys_required and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host!r} without an API token: anyone who can reach "
                "it could run evaluations on the cluster. Set --api-token (or RAYEVAL_API_TOKEN) "
                "or --require-api-keys (users' keys: `rayeval users add`), or listen on 127.0.0.1"
            )
        return self

    @property
    def keys_required(self) -> bool:
        """Whether every request needs a key whatever the database holds (a token or
        ``require_api_keys``); otherwise only once a user exists."""
        return self.api_token is not None or self.require_api_keys

    @property
    def trusted_hosts(self) -> list[str]:
        """Host headers a tokenless server answers: loopback names, its host, allowed_hosts."""
        return list(
            dict.fromkeys(
                ["127.0.0.1", "localhost", "::1", "[::1]", self.host, *self.allowed_hosts]
            )
        )

    @property
    def response_cache_prefix(self) -> str | None:
        """The response cache's path prefix (``rayeval run --use_cache``'s), or None."""
        return (
            str((self.data_dir / "response-cache" / "answers").resolve())
            if self.response_cache
            else None
        )

    @property
    def trackers(self) -> Trackers:
        """The experiment trackers of the server, and the address its runs link back to."""
        url = self.public_url
        if url is None and self.port:
            host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
            url = f"http://{host}:{self.port}"
        return Trackers(self.mlflow_tracking_uri, self.wandb_project, server_url=url)

    @property
    def effective_database_url(self) -> str:
        """``database_url``, or the SQLite file ``<data_dir>/rayeval.db``."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'rayeval.db').resolve()}"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # any other host name may resolve to a public address
