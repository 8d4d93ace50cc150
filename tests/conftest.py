"""Shared fixtures: offline Hugging Face, the bundled tiny model and tasks, one real local Ray;
and the test tiers.

Everything is real: a Ray cluster started in this process (4 logical CPUs on a 2-core machine is
fine), gloo process groups inside the rank actors, and lm-eval's own HF backend as reference.

Every test carries exactly one tier marker (registered in pyproject.toml): ``unit`` (no Ray
cluster, no server, no model evaluation: seconds; ``make test-fast``), ``service`` (a real Ray,
uvicorn server, gloo process group or the built tiny model, but small) or ``e2e`` (evaluations
compared with lm-eval's, browsers, simulated multi-node clusters). Collection fails naming any
test without one. ``slow`` is kept as the name of everything outside the unit tier, so
``-m 'not slow'`` is the fast tier.
"""

from __future__ import annotations

import os

# Offline before anything imports huggingface_hub / datasets; the rank actors inherit this.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local test clusters only
# A loaded 2-core CI machine can take longer than Ray's default to start a dashboard agent.
os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")

from collections.abc import Iterator

import pytest

from rayeval.service.demo import DemoAssets, ensure_demo_assets
from tests.postgres import PostgresServer, find_binaries

RAY_CPUS = 4
TIERS = ("unit", "service", "e2e")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: it must see the `slow` marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check that each test has one tier; mark every test outside the unit tier ``slow``."""
    untiered = []
    for item in items:
        tiers = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if len(tiers) != 1:
            untiered.append(f"{item.nodeid}: {', '.join(sorted(tiers)) or 'none'}")
        elif "unit" not in tiers:
            item.add_marker(pytest.mark.slow)
    if untiered:
        raise pytest.UsageError(
            "every test needs exactly one tier marker, @pytest.mark.unit, service or e2e "
            "(see tests/conftest.py); these have another number:\n  " + "\n  ".join(untiered)
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How far lm-eval hf's own bf16/fp16 answers moved between its batch sizes on this machine,
    and how far rayeval's were from them (tests.helpers.HfSpread), one line per check."""
    from tests.helpers import SPREADS

    if SPREADS:
        import torch

        capped = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
                  if k in os.environ]  # fmt: skip
        kernels = f"ATen kernels {torch.backends.cpu.get_cpu_capability()}"
        kernels += f", capped by {' '.join(capped)}" if capped else ""
        terminalreporter.write_sep("-", f"lm-eval hf's spread and rayeval's distance ({kernels})")
        for line in SPREADS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    """The bundled tiny Llama and demo tasks, built once per test session."""
    return ensure_demo_assets(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole session (starting Ray costs seconds)."""
    import ray

    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def task_manager(demo: DemoAssets):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False, include_path=str(demo.tasks_dir))


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One real PostgreSQL server for the session (``make test`` installs Debian's package)."""
    binaries = find_binaries()
    if binaries is None:
        pytest.skip(
            "PostgreSQL is not installed (no pg_ctl): `make postgres` installs Debian's package"
        )
    if os.geteuid() == 0 and not _has_user("postgres"):
        pytest.skip("as root, PostgreSQL runs as the user 'postgres', which Debian's package makes")
    server = PostgresServer(binaries)
    server.start()
    yield server
    server.destroy()


@pytest.fixture
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An empty database of the backend named by the test's parameter (``tests.postgres``'s
    ``DATABASES``): a SQLite file, or a new database on the session's PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('db') / 'rayeval.db'}"
    server: PostgresServer = request.getfixturevalue("postgres")
    return server.create_database()


def _has_user(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
