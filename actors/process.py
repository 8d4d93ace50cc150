"""The processes rayeval starts on the cluster: their environment, and what a rank reads of its own.

Every environment variable set for a rank actor or a runner actor is built here
(:func:`rank_environment`, :func:`runner_environment`), so that one place says what a process on
another node sees. The rest are small readings a rank makes of its own process (memory) and
the network interfaces its process group must listen on. No torch here.
"""

from __future__ import annotations

import logging
import os
import resource

from rayeval.actors.layout import DeviceKind

logger = logging.getLogger(__name__)

#: Variables the processes must see as the driver does: offline mode, caches, the hub token.
FORWARDED_ENV = (
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_TOKEN",
    "HF_HUB_CACHE",
)


#: The one command that puts the CUDA build of torch in the venv (``make install`` pins the CPU
#: build). ``benchmarks/gpu_check.py`` says the same (a test keeps the two identical).
INSTALL_CUDA_TORCH = (
    ".venv/bin/pip install torch==2.13.0+cu128 --index-url https://download.pytorch.org/whl/cu128"
)

#: The CUDA caching allocator's setting for GPU ranks unless the user gives one: segments that
#: grow in place instead of new blocks, so that batches of changing shapes (scoring, then
#: generation's prefills and decode steps) do not fragment the memory that the KV cache needs.
CUDA_ALLOC_CONF = "expandable_segments:True"


#: The variable Ray reads, as a worker process starts, for the OS niceness it sets on itself.
RAY_WORKER_NICENESS = "RAY_worker_niceness"


#: Prefixes of the experiment trackers' variables a runner sees as the server does.
TRACKER_ENV_PREFIXES = ("WANDB_", "MLFLOW_")


def _forwarded() -> dict[str, str]:
    env = {key: os.environ[key] for key in FORWARDED_ENV if key in os.environ}
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def rank_environment(device: DeviceKind, niceness: int | None = None) -> dict[str, str]:
    """The environment of a rank actor (or another actor of the cluster) that computes on
    ``device``, at OS niceness ``niceness`` (None: Ray's default for its workers, 15).

    Ray sets each worker process's niceness as it starts (``RAY_worker_niceness``, 15 unless the
    cluster says otherwise); a process whose environment names another value gets that one, and
    the threads torch starts inherit it. Ranks run below the API server, the runners (see
    :func:`runner_environment`), Ray's own processes and the database, so that on a node they
    share, compute yields to the control plane.

    torch's CPU allocator backs allocations of 2 MiB or more with transparent huge pages (where
    the kernel's THP mode is "madvise"): a forward's activations then cost a page fault per 2 MiB
    instead of per 4 KiB. Measured on a 4-layer 512-wide Llama scoring a [38 x 101] batch on one
    core: 2.0 s with it, 2.6 s without (docs/performance-notes.md). A user's own value is kept.

    A CPU actor sees no GPU (``CUDA_VISIBLE_DEVICES`` empty): Ray 2.60 no longer hides the
    node's GPUs from an actor that asked for none, and transformers' tensor parallelism would
    then bind ``cuda:0`` and load a CPU rank onto a GPU that Ray gave another actor. A GPU
    rank's ``CUDA_VISIBLE_DEVICES`` is Ray's (its one GPU), and its CUDA allocator grows
    segments in place (:data:`CUDA_ALLOC_CONF`) unless the driver's ``PYTORCH_CUDA_ALLOC_CONF``
    or ``PYTORCH_ALLOC_CONF`` says otherwise (either is then passed on).
    """
    env = _forwarded()
    if niceness is not None:
        env[RAY_WORKER_NICENESS] = str(niceness)
    env["THP_MEM_ALLOC_ENABLE"] = os.environ.get("THP_MEM_ALLOC_ENABLE", "1")
    if device is DeviceKind.CUDA:
        if os.environ.get("PYTORCH_ALLOC_CONF"):  # torch's newer name, read before the old one
            env["PYTORCH_ALLOC_CONF"] = os.environ["PYTORCH_ALLOC_CONF"]
        else:
            conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def runner_environment() -> dict[str, str]:
    """The environment of a runner actor (the service's driver of one evaluation).

    lm-eval's bootstrap forks a multiprocessing pool from the runner's thread; a forked child
    inherits Ray's signal handlers and can outlive ``terminate()``. Single-process
    (``DISABLE_MULTIPROC``) gives the same numbers: the same seeded chunks, in order. The runner
    records evaluations in the server's experiment trackers: their settings and credentials
    (``WANDB_*``, ``MLFLOW_*``) are the server's.

    A runner drives its evaluation: it runs at the node's default priority, not at the niceness
    Ray gives its workers (15), as Ray's job supervisor does for a job's driver; its ranks yield
    to it (:func:`rank_environment`).
    """
    env = _forwarded()
    env[RAY_WORKER_NICENESS] = "0"
    env.update({k: v for k, v in os.environ.items() if k.startswith(TRACKER_ENV_PREFIXES)})
    env["DISABLE_MULTIPROC"] = "1"
    return env


def rss_mib() -> float:
    """This process's resident memory now (``VmRSS`` of /proc/self/status; 0.0 without /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def host_memory_share(rank_cpus: float, node_cpus: float, meminfo: str = "/proc/meminfo") -> int:
    """A CPU rank's share of its node's available memory (bytes): ``MemAvailable`` times its
    share of the node's CPUs (a node holds at most ``node_cpus / rank_cpus`` such ranks)."""
    with open(meminfo) as lines:
        for line in lines:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                return int(available * min(1.0, rank_cpus / max(node_cpus, rank_cpus)))
    return 0


def pin_socket_interfaces(node_ip: str) -> None:
    """Make gloo and NCCL listen on the interface that holds this node's Ray address.

    Unless ``GLOO_SOCKET_IFNAME`` says otherwise, gloo listens on the address the host name
    resolves to, which on many hosts is a loopback address (Debian's ``127.0.1.1``, containers'
    ``/etc/hosts``). Ranks on other nodes are then told to connect to that address and are
    refused ("Gloo connectFullMesh failed ... Connection refused"). NCCL picks its bootstrap and
    socket interface by its own rules, which on hosts with several networks (docker bridges,
    a management network) can be one the other nodes cannot reach. Ray's node address is the
    one the other nodes reach this node by, so its interface is the right one for both
    (``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``). A user's own value of either is kept;
    an address on no local interface (NAT) changes nothing.
    """
    unset = [key for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not os.environ.get(key)]
    if not unset:
        return
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == node_ip for address in addresses):
            for key in unset:
                os.environ[key] = name
            logger.debug("%s: %s (%s), this node's Ray address", ", ".join(unset), name, node_ip)
            return
    logger.debug("no local interface holds %s: gloo and NCCL pick their own", node_ip)
