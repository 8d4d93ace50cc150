"""Shared fixtures: offline Hugging Face, the bundled tiny model and tasks, one real local Ray.

Everything is real: a Ray cluster started in this process (4 logical CPUs on a 2-core machine is
fine), gloo process groups inside the rank actors, and lm-eval's own HF backend as reference.
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

RAY_CPUS = 4


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
