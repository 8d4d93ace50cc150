"""deploy/: every manifest parses and carries what KubeRay / the Ray launcher require, and the
container recipes install what deploy/README.md says they install, in that order.

There is no Kubernetes, Docker or cloud here: these are static checks of the files, plus one real
check of the commands the manifests run — every ``rayeval`` command line in them parses with the
``rayeval`` CLI's own parser.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DOCKERFILES = {
    "cuda": DEPLOY / "docker" / "Dockerfile",
    "cpu": DEPLOY / "docker" / "Dockerfile.cpu",
}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _kind(kind: str, path: Path) -> dict[str, Any]:
    (document,) = [doc for doc in _documents(path) if doc.get("kind") == kind]
    return document


def _ray_requirement() -> Requirement:
    (ray,) = [
        Requirement(dep) for dep in PYPROJECT["project"]["dependencies"] if dep.startswith("ray")
    ]
    return ray


def _rayeval_argv(command: str) -> list[str]:
    """The arguments after ``rayeval`` in a shell command line."""
    words = shlex.split(command)
    return words[words.index("rayeval") + 1 :]


# --------------------------------------------------------------------------- manifests
def test_every_manifest_parses() -> None:
    manifests = sorted(DEPLOY.rglob("*.yaml"))
    assert {p.relative_to(DEPLOY).as_posix() for p in manifests} >= {
        "kuberay/raycluster.yaml",
        "kuberay/rayjob.yaml",
        "ray-up/cluster.yaml",
    }
    for path in manifests:
        documents = _documents(path)
        assert documents, f"{path} is empty"
        for document in documents:
            assert isinstance(document, dict), f"{path}: a document is not a mapping"


def _check_pod_template(template: dict[str, Any], where: str, gpus: bool) -> dict[str, Any]:
    spec = template["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True, where
    (ray_container, *_sidecars) = spec["containers"]
    for container in spec["containers"]:
        assert container["name"] and container["image"], f"{where}: container without image"
        assert container["image"].endswith(f"/rayeval:{VERSION}-cuda"), (
            f"{where}: {container['image']} is not this version's GPU image"
        )
        resources = container["resources"]
        assert resources["limits"]["cpu"] and resources["limits"]["memory"], where
    limits = ray_container["resources"]["limits"]
    if gpus:
        assert int(limits["nvidia.com/gpu"]) >= 1, f"{where}: no nvidia.com/gpu limit"
        assert ray_container["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
        assert any(v["mountPath"] == "/dev/shm" for v in ray_container["volumeMounts"]), where
    else:
        assert "nvidia.com/gpu" not in limits, f"{where}: the head should not hold a GPU"
    mounted = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
    assert mounted <= {v["name"] for v in spec.get("volumes", [])}, f"{where}: undeclared volume"
    return ray_container


def _check_ray_cluster_spec(spec: dict[str, Any], where: str) -> dict[str, Any]:
    """The fields KubeRay requires of a RayCluster spec (also RayJob's rayClusterSpec)."""
    assert Version(spec["rayVersion"]) in _ray_requirement().specifier, (
        f"{where}: rayVersion {spec['rayVersion']} is not the Ray pyproject.toml installs"
    )
    head = spec["headGroupSpec"]
    params = head["rayStartParams"]
    assert isinstance(params, dict), where
    assert all(isinstance(v, str) for v in params.values()), f"{where}: rayStartParams not strings"
    assert params.get("num-cpus") == "0", f"{where}: ranks must not land on the head"
    head_container = _check_pod_template(head["template"], f"{where} head", gpus=False)
    groups = spec["workerGroupSpecs"]
    assert groups, f"{where}: no worker group"
    for group in groups:
        name = group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], (where, name)
        assert isinstance(group["rayStartParams"], dict), (where, name)
        _check_pod_template(group["template"], f"{where} {name}", gpus=True)
    return head_container


def test_raycluster_has_head_gpu_workers_and_the_rest_service() -> None:
    path = DEPLOY / "kuberay" / "raycluster.yaml"
    cluster = _kind("RayCluster", path)
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["name"]
    _check_ray_cluster_spec(cluster["spec"], "RayCluster")

    # The REST service runs beside the head, sharing /tmp/ray, and a Service exposes its port.
    head_spec = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    (service_container,) = [
        c for c in head_spec["containers"] if "rayeval serve" in " ".join(c.get("args", []))
    ]
    (port,) = service_container["ports"]
    for container in head_spec["containers"]:
        assert {"name": "ray-tmp", "mountPath": "/tmp/ray"} in container["volumeMounts"]
    env = {e["name"]: e for e in service_container["env"]}
    assert "secretKeyRef" in env["RAYEVAL_API_TOKEN"]["valueFrom"], "the API token is a secret"
    assert service_container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    service = _kind("Service", path)
    assert service["spec"]["selector"] == {
        "ray.io/cluster": cluster["metadata"]["name"],
        "ray.io/node-type": "head",
    }
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    claims = {
        doc["metadata"]["name"]
        for doc in _documents(path)
        if doc["kind"] == "PersistentVolumeClaim"
    }
    volumes = {v["name"]: v for v in head_spec["volumes"]}
    assert volumes["results"]["persistentVolumeClaim"]["claimName"] in claims


def test_rayjob_runs_rayeval_run_on_its_own_cluster() -> None:
    path = DEPLOY / "kuberay" / "rayjob.yaml"
    job = _kind("RayJob", path)
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    assert spec["entrypoint"].startswith("rayeval run ")
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["activeDeadlineSeconds"] > 0
    _check_ray_cluster_spec(spec["rayClusterSpec"], "RayJob")
    claims = {
        doc["metadata"]["name"]
        for doc in _documents(path)
        if doc["kind"] == "PersistentVolumeClaim"
    }
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (results,) = [v for v in head["volumes"] if "persistentVolumeClaim" in v]
    assert results["persistentVolumeClaim"]["claimName"] in claims


def test_ray_up_config_has_what_the_launcher_requires() -> None:
    config = _documents(DEPLOY / "ray-up" / "cluster.yaml")[0]
    assert config["cluster_name"] and config["provider"]["type"]
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    for name, node_type in types.items():
        assert "node_config" in node_type and "resources" in node_type, name
        if name != config["head_node_type"]:
            assert 0 <= node_type["min_workers"] <= node_type["max_workers"], name
            assert node_type["max_workers"] <= config["max_workers"], name
    assert isinstance(config["setup_commands"], list)
    assert config["docker"]["image"].endswith(f"/rayeval:{VERSION}-cuda")
    assert "--gpus all" in config["docker"]["worker_run_options"]
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("--num-cpus=0" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])


def test_rayeval_command_lines_in_the_manifests_parse() -> None:
    """The entrypoints are real ``rayeval`` command lines (flags exist, values have the types)."""
    from rayeval.api.cli import build_parser

    parser = build_parser()
    job = _kind("RayJob", DEPLOY / "kuberay" / "rayjob.yaml")
    run = parser.parse_args(_rayeval_argv(job["spec"]["entrypoint"]))
    assert run.command == "run" and run.model == "hf" and run.num_replicas * run.shard_size == 8
    cluster = _kind("RayCluster", DEPLOY / "kuberay" / "raycluster.yaml")
    head_spec = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    (script,) = [
        arg for c in head_spec["containers"] for arg in c.get("args", []) if "rayeval serve" in arg
    ]
    (serve_line,) = [line for line in script.splitlines() if "rayeval serve" in line]
    serve = parser.parse_args(_rayeval_argv(serve_line))
    assert serve.command == "serve" and serve.port == 8000 and serve.ray_address


# ------------------------------------------------------------------------ container recipes
def _dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def _arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(
        rest.split("=", 1) for keyword, rest in instructions if keyword == "ARG" and "=" in rest
    )


def _expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)",
        lambda m: variables.get(m.group(1) or m.group(2), m.group(0)),
        text,
    )


def _pip_installs(path: Path) -> list[str]:
    """Every ``pip install`` the recipe runs, in order, with its build arguments' defaults."""
    instructions = _dockerfile_instructions(path)
    variables = _arg_defaults(instructions)
    commands = []
    for keyword, rest in instructions:
        if keyword == "RUN":
            for command in re.split(r"&&|;", _expand(rest, variables)):
                if "pip install" in command:
                    commands.append(" ".join(shlex.split(command)))
    return commands


def _readme_install_steps() -> dict[str, list[str]]:
    """deploy/README.md's install steps, per recipe (a bash block after the recipe's path)."""
    readme = (DEPLOY / "README.md").read_text()
    steps = {}
    for kind, path in DOCKERFILES.items():
        relative = path.relative_to(REPO).as_posix()
        match = re.search(rf"\(`{re.escape(relative)}`\):\n```bash\n(.*?)```", readme, re.DOTALL)
        assert match, f"deploy/README.md does not document the install steps of {relative}"
        steps[kind] = [" ".join(shlex.split(line)) for line in match.group(1).splitlines()]
    return steps


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_recipe_installs_what_the_readme_documents(kind: str) -> None:
    installs = _pip_installs(DOCKERFILES[kind])
    assert installs == _readme_install_steps()[kind]
    torch = next(i for i, c in enumerate(installs) if "torch==" in c)
    project = next(i for i, c in enumerate(installs) if re.search(r"install \.(\[|$)", c))
    assert torch < project, "torch must be installed before the project"
    expected_index = "/whl/cpu" if kind == "cpu" else "/whl/cu"
    assert expected_index in installs[torch]


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_recipe_base_user_and_contents(kind: str) -> None:
    path = DOCKERFILES[kind]
    instructions = _dockerfile_instructions(path)
    variables = _arg_defaults(instructions)
    bases = [
        _expand(rest, variables).split()[0] for keyword, rest in instructions if keyword == "FROM"
    ]
    final_base = bases[-1]
    if kind == "cuda":
        assert final_base.startswith("nvidia/cuda:") and "runtime" in final_base
    else:
        assert final_base.startswith("python:3.11-slim")
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1] not in {"root", "0"}, "the image must not run as root"
    copied = {
        source  # every word but the destination, flags (--chown=...) aside
        for keyword, rest in instructions
        if keyword == "COPY" and "--from" not in rest
        for source in [w for w in rest.split() if not w.startswith("--")][:-1]
    }
    packages = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert {"pyproject.toml", "README.md"} | packages <= copied, f"{path.name} copies {copied}"
    run_text = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert "wget" in run_text, "KubeRay's health probes run wget"
    assert "/etc/profile.d/" in run_text, "KubeRay starts Ray in a login shell"
    ignore = (path.parent / f"{path.name}.dockerignore").read_text().splitlines()
    rules = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert rules[0] == "*", "the build context must be an allow-list (no .venv, no caches)"
    allowed = {rule.removeprefix("!").rstrip("/") for rule in rules if rule.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md"} | packages, allowed


def test_readme_is_a_runbook() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for heading in (
        "## Sizes: choosing R and G",
        "## Where results go",
        "## Scaling",
        "## Upgrading",
        "## Building the images",
    ):
        assert heading in readme, heading
    for path in (*DOCKERFILES.values(), *DEPLOY.rglob("*.yaml")):
        assert path.relative_to(DEPLOY).as_posix() in readme, f"{path} is not described"
