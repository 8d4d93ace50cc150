"""Connecting the driver to Ray: an existing cluster, or an embedded one sized for the layout."""

from __future__ import annotations

import logging
import os

import ray

from rayeval.actors.errors import ConfigError
from rayeval.actors.layout import DeviceKind, ParallelLayout

logger = logging.getLogger(__name__)


def connect(address: str | None, layout: ParallelLayout) -> str:
    """Make sure this process is a Ray driver and return how it is connected.

    An already initialised Ray session is reused. Otherwise ``address`` (or the ``RAY_ADDRESS``
    environment variable, as set inside ``ray job submit``) names an existing cluster; without one,
    a local Ray starts with enough logical CPUs for every rank (logical CPUs may exceed cores).

    Args:
        address: A Ray address (``auto``, ``ray://host:10001``, ``host:6379``) or None.
        layout: The layout to size an embedded cluster for.

    Returns:
        ``"existing session"``, the address, or ``"embedded"``.
    """
    if ray.is_initialized():
        return "existing session"
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return address
    cpus = max(os.cpu_count() or 1, layout.world * layout.cpus_per_rank + 1)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    logger.info("started an embedded Ray with %d logical CPUs", cpus)
    return "embedded"


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
