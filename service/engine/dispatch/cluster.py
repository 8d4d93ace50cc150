"""Connecting the driver to Ray: an existing cluster, or an embedded one sized for the layout;
and the check, before an embedded Ray starts, that this machine can hold the layout."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from rayeval.actors.errors import ConfigError
from rayeval.actors.layout import DeviceKind, ParallelLayout

if TYPE_CHECKING:
    from rayeval.service.vocabulary.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Connection:
    """How this process is a Ray driver.

    Args:
        how: ``"existing session"``, the cluster's address, or ``"embedded"``.
        started: This call started or joined Ray (its caller shuts it down); False when an
            initialised session was reused.
    """

    how: str
    started: bool

    def __str__(self) -> str:
        return self.how


def connect(
    address: str | None,
    *,
    embedded_cpus: int | None = None,
    namespace: str | None = None,
    cluster_logs: bool = True,
) -> Connection:
    """Make this process a Ray driver: the one way rayeval connects (the engine, the service).

    An already initialised Ray session is reused. Otherwise ``address`` (or the ``RAY_ADDRESS``
    environment variable, as set inside ``ray job submit``) names an existing cluster; without one,
    a local Ray starts.

    Args:
        address: A Ray address (``auto``, ``ray://host:10001``, ``host:6379``) or None.
        embedded_cpus: Logical CPUs of an embedded Ray (None: the machine's cores); logical CPUs
            may exceed cores.
        namespace: The driver's Ray namespace (None: Ray's anonymous one).
        cluster_logs: Print an existing cluster's workers' output in this process too (an
            embedded Ray's workers always print here; the service, on a shared cluster: no).
    """
    if ray.is_initialized():
        logger.info("using the Ray session already initialised in this process")
        return Connection("existing session", started=False)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=cluster_logs)
        logger.info("connected to the Ray cluster at %s", address)
        return Connection(address, started=True)
    ray.init(
        num_cpus=embedded_cpus,
        namespace=namespace,
        include_dashboard=False,
        log_to_driver=True,
    )
    logger.info("started an embedded Ray with %s logical CPUs", embedded_cpus or os.cpu_count())
    return Connection("embedded", started=True)


def embedded_cpus(layout: ParallelLayout) -> int:
    """Logical CPUs of a Ray embedded for ``layout``: the machine's cores, or one per rank's
    CPUs and one for the driver where that is more."""
    return max(os.cpu_count() or 1, layout.world * layout.cpus_per_rank + 1)


def pick_device(requested: str | None) -> DeviceKind:
    """What a rank holds: ``cpu``/``cuda`` as asked; ``auto``/None: GPUs if the cluster has any.

    Must be called after :func:`connect`.
    """
    if requested in (None, "", "auto"):
        return DeviceKind.CUDA if ray.cluster_resources().get("GPU", 0) > 0 else DeviceKind.CPU
    kind = str(requested).split(":")[0]
    if kind not in {k.value for k in DeviceKind}:
        raise ConfigError(f"unknown device {requested!r}: use auto, cpu or cuda")
    return DeviceKind(kind)


def machine_resources() -> dict[str, float]:
    """What a Ray embedded in this process would have: this machine's CPUs and GPUs."""
    import torch  # the engine needs it anyway; the count does not initialise CUDA

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cpus = float(os.cpu_count() or 1)
    return {"CPU": cpus, "GPU": float(gpus)} if gpus else {"CPU": cpus}


def preflight(config: EngineConfig, address: str | None, oversubscribe: bool = False) -> None:
    """Refuse, before Ray starts, a layout that a Ray embedded here could never hold
    (:func:`check_machine` on this machine's resources).

    An existing cluster (``address``, ``RAY_ADDRESS``, a Ray already initialised) is only known
    once connected; the ranks' group checks it then, with the same rule, before placing.

    Args:
        config: The evaluation.
        address: The Ray address asked for (None: ``RAY_ADDRESS``, else an embedded Ray).
        oversubscribe: Start more CPU ranks than cores (see :func:`check_machine`).

    Raises:
        LayoutError: naming what the layout needs, what this machine has and the fixes.
    """
    if ray.is_initialized() or address or os.environ.get("RAY_ADDRESS"):
        return
    check_machine(config, machine_resources(), oversubscribe)


def check_machine(
    config: EngineConfig, machine: Mapping[str, float], oversubscribe: bool = False
) -> None:
    """The service's rule (:meth:`ParallelLayout.check_fits`) applied to one machine: its cores
    for CPU ranks, its GPUs for GPU ranks (``auto`` takes GPUs where it has some).

    Args:
        config: The evaluation.
        machine: The machine's resources (:func:`machine_resources`).
        oversubscribe: CPU slots may outnumber cores (an embedded Ray then gets a logical CPU
            per rank: slower, the same results); GPUs are never oversubscribed.

    Raises:
        LayoutError: naming what the layout needs, what the machine has and the fixes.
    """
    have = dict(machine)
    wants_gpu = config.device == "cuda" or (config.device == "auto" and have.get("GPU", 0) > 0)
    layout = config.layout(DeviceKind.CUDA if wants_gpu else DeviceKind.CPU)
    if oversubscribe:
        have["CPU"] = math.inf
    more = "run on a Ray cluster (--address)"
    if not wants_gpu:
        more += ", or pass --oversubscribe to run more ranks than cores (slower, same results)"
    layout.check_fits(have, where="this machine", more=more)
