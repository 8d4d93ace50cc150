"""One rank: a plain class that Ray turns into an actor where the worker group creates it.

A :class:`ShardWorker` joins its replica's torch process group (gloo on CPU, NCCL on GPU), loads
the model (sharded by the replica's strategy, :mod:`rayeval.actors.sharding`, when the replica has
several ranks) and computes micro-batches. Every call that involves other ranks (a forward,
``generate`` with ``synced_gpus``) is issued by all ranks of the replica in the same order, because
the driver sends each step to all of them: under FSDP each rank its own micro-batch, under tensor
parallelism the same micro-batch to every rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from rayeval.actors import shm_collectives
from rayeval.actors.batches import (
    GenerateMicroBatch,
    GenerateResult,
    ModelSpec,
    ScoreMicroBatch,
    ScoreResult,
    ScoreRow,
    StepStats,
)
from rayeval.actors.errors import ConfigError
from rayeval.actors.layout import DeviceKind, RankCoord
from rayeval.actors.model_loading import load_model, release_unsharded
from rayeval.actors.packing import packed_inputs
from rayeval.actors.placement import cuda_device_index
from rayeval.actors.sharding import ShardStrategy
from rayeval.actors.tensor_parallel import load_tensor_parallel

logger = logging.getLogger(__name__)

#: Below this many rows a CPU matmul rounds differently (see ShardWorker._scored_logits).
_SMALL_GEMM_ROWS = 4
#: Host allocations at least this large are mmapped, so freeing them returns them to the OS.
_MMAP_THRESHOLD_BYTES = 1 << 20


class ShardWorker:
    """One rank of one replica.

    Args:
        spec: The model to load.
        coord: This rank's replica, shard rank and global rank.
        shard_size: Ranks in this replica (G).
        device_kind: CPU or CUDA.
        collective_timeout_s: Timeout of every collective in the replica's process group.
        seed: torch seed, for sampling generations (the same on every rank, so that tensor-
            parallel ranks sample the same tokens).
        strategy: How the replica shards the model when ``shard_size`` > 1 (FSDP or TP).
    """

    def __init__(
        self,
        spec: ModelSpec,
        coord: RankCoord,
        shard_size: int,
        device_kind: DeviceKind,
        collective_timeout_s: float,
        seed: int = 1234,
        strategy: ShardStrategy = ShardStrategy.FSDP,
    ) -> None:
        self._spec = spec
        self._coord = coord
        self._shard_size = shard_size
        self._device_kind = DeviceKind(device_kind)
        self._collective_timeout_s = collective_timeout_s
        self._seed = seed
        self._strategy = ShardStrategy(strategy)
        self._model: Any = None
        self._tokenizer: Any = None
        #: Keyword arguments of every scoring forward, those the model's forward accepts.
        self._score_kwargs: dict[str, Any] = {}
        self._keeps_logits = False
        #: Tokens fed to the model's input embeddings (see input_token_counts).
        self._fed = {"fed": 0, "real": 0, "calls": 0}
        self._cuda_index: int | None = None
        self._torch_device = torch.device("cpu")  # chosen once, in setup()
        if shard_size > 1 and self._strategy is ShardStrategy.FSDP:
            _return_large_frees_to_os()

    # ----------------------------------------------------------------------------- lifecycle
    def node_info(self) -> dict[str, Any]:
        """Where this rank runs, for placement checks and logs.

        Returns:
            ``node_id``, ``ip``, ``gpu_ids`` (as Ray assigned them), ``pid``,
            ``cuda_visible_devices`` (None: unset) and ``cuda_device`` (the local CUDA index this
            rank computes on; None for CPU ranks).
        """
        import ray

        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_device": (
                self._local_cuda_index() if self._device_kind is DeviceKind.CUDA else None
            ),
        }

    def begin_evaluation(self, seed: int) -> int:
        """Start an evaluation on this loaded rank: seed torch as a new rank is seeded.

        A rank kept warm for the next evaluation then samples what a new rank would.

        Returns:
            This rank's process id (the caller can tell a kept rank from a new one).
        """
        self._seed = seed
        torch.manual_seed(seed)
        return os.getpid()

    def reserve_port(self) -> tuple[str, int]:
        """A free TCP port on this node for the replica's rendezvous (called on shard rank 0)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, rendezvous: tuple[str, int]) -> dict[str, Any]:
        """Join the replica's process group at ``rendezvous`` (address, port) and load the model.

        Returns:
            Load figures: seconds, local parameter count, strategy, what sums TP activations
            (``collectives``), peak resident memory (MiB).
        """
        started = time.monotonic()
        torch.manual_seed(self._seed)
        device = self._torch_device = self._select_device()
        mesh = None
        if self._shard_size > 1:
            if self._device_kind is DeviceKind.CPU:
                import ray

                _pin_gloo_interface(ray.util.get_node_ip_address())
            dist.init_process_group(
                backend=self._device_kind.backend,
                init_method=f"tcp://{rendezvous[0]}:{rendezvous[1]}",
                rank=self._coord.shard_rank,
                world_size=self._shard_size,
                timeout=timedelta(seconds=self._collective_timeout_s),
            )
        if self._shard_size > 1 and self._strategy is ShardStrategy.TP:
            self._model = load_tensor_parallel(self._spec, device, self._shard_size)
        else:
            if self._shard_size > 1:
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh(device.type, (self._shard_size,))
            self._model = load_model(self._spec, device, mesh)
        # G > 1: "shared memory" where TP ranks sum their activations through it (their other
        # collectives stay on the process group), else "process group".
        collectives = None
        if self._shard_size > 1:
            collectives = "process group"
            if device.type == "cpu" and self._strategy is ShardStrategy.TP:
                collectives = self._use_shared_memory(rendezvous)
        accepted = inspect.signature(self._model.forward).parameters
        # No KV cache when scoring: nothing reads it, and it holds 2 x layers x hidden floats per
        # token (for a 32-block model more than all other activations of the forward together).
        self._score_kwargs = {"use_cache": False} if "use_cache" in accepted else {}
        self._keeps_logits = "logits_to_keep" in accepted
        self._model.get_input_embeddings().register_forward_pre_hook(self._count_input)
        self._tokenizer = transformers.AutoTokenizer.from_pretrained(
            self._spec.tokenizer or self._spec.pretrained,
            revision=self._spec.revision,
            trust_remote_code=self._spec.trust_remote_code,
        )
        local_params = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel()
            for p in self._model.parameters()
        )
        return {
            "seconds": time.monotonic() - started,
            "local_parameters": local_params,
            "strategy": self._strategy.value if self._shard_size > 1 else None,
            "collectives": collectives,
            "peak_rss_mib": _peak_rss_mib(),
        }

    def _use_shared_memory(self, rendezvous: tuple[str, int]) -> str:
        """The ranks of a TP replica share a node: the all-reduces of their activations go
        through shared memory instead of gloo's sockets (see actors.shm_collectives).

        Returns:
            What carries them: "shared memory", or "process group" where that is unavailable.
        """
        # Every rank takes part, so that all decide alike (a rank's environment could differ).
        ranks: list[Any] = [None] * self._shard_size
        dist.all_gather_object(ranks, shm_collectives.enabled())
        if not all(ranks):
            return "process group"
        shm = shm_collectives.ShmCollectives.create(
            f"{rendezvous[0]}-{rendezvous[1]}-r{self._coord.replica}",
            self._coord.shard_rank,
            self._shard_size,
            self._collective_timeout_s,
        )
        if shm is None:
            return "process group"
        if not shm_collectives.route_tensor_parallel_all_reduces(shm):
            logger.warning("this transformers reduces TP activations otherwise: staying on gloo")
            return "process group"
        return "shared memory"

    def shutdown(self) -> None:
        """Leave the process group and drop the model (the actor is killed afterwards)."""
        self._model = None
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------------------- compute
    def score(self, batch: ScoreMicroBatch) -> tuple[ScoreResult, StepStats]:
        """Log-likelihood of each target continuation, computed only at continuation positions.

        Mirrors lm-eval's HF backend: right padding, log-softmax then gather, ``is_greedy`` when
        every continuation token is the argmax. Plain rows run as lm-eval runs them (no attention
        mask); a micro-batch with a packed row (a token tree, :mod:`rayeval.actors.packing`) runs
        with a 4D attention mask and position ids that give every token exactly its own request's
        view.
        """
        started = time.monotonic()
        rows = batch.rows or ()
        # A dummy micro-batch scores one padding token, so that collectives line up.
        model_rows = rows or (ScoreRow((self._spec.pad_token_id,), ()),)
        width = max(len(row.tokens) for row in model_rows)
        extra: dict[str, torch.Tensor] = {}
        if any(row.parents is not None for row in model_rows):
            inputs, mask, position_ids = packed_inputs(
                model_rows, self._spec.pad_token_id, self._additive_mask_dtype()
            )
            extra = {
                "attention_mask": mask.to(self._torch_device),
                "position_ids": position_ids.to(self._torch_device),
            }
        else:
            inputs = torch.full((len(model_rows), width), self._spec.pad_token_id, dtype=torch.long)
            for i, row in enumerate(model_rows):
                inputs[i, : len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.long)
        # The only logits computed: every position a target token is scored at, row by row.
        wanted = sorted(
            {(i, p) for i, row in enumerate(rows) for ps in row.scored_positions() for p in ps}
        ) or [(0, 0)]
        index = {pick: k for k, pick in enumerate(wanted)}
        logits = self._scored_logits(inputs.to(self._torch_device), wanted, extra)
        results: ScoreResult = []
        for i, row in enumerate(rows):
            row_results = []
            for target, positions in zip(row.targets, row.scored_positions(), strict=True):
                picks = torch.tensor([index[(i, p)] for p in positions], device=logits.device)
                logprobs = F.log_softmax(
                    logits[picks], dim=-1, dtype=_dtype(self._spec.softmax_dtype)
                )
                target_ids = torch.tensor(target, dtype=torch.long, device=logprobs.device)
                is_greedy = bool((logprobs.argmax(dim=-1) == target_ids).all())
                total = float(logprobs.gather(1, target_ids.unsqueeze(-1)).sum())
                row_results.append((total, is_greedy))
            results.append(row_results)
        real = sum(len(row.tokens) for row in rows)
        return results, self._step_stats(real, len(rows) * width, started)

    def input_token_counts(self) -> dict[str, int]:
        """Tokens this rank's model was fed since it loaded, counted at its input embeddings.

        Returns:
            ``fed``: every input position of every forward and ``generate`` step, padding and
            dummy micro-batches included; ``real``: those whose id is not the padding id;
            ``calls``: the embedding's calls.
        """
        return dict(self._fed)

    def generate(self, batch: GenerateMicroBatch) -> tuple[GenerateResult, StepStats]:
        """Greedy or sampled continuations, exactly as lm-eval's HF backend calls ``generate``."""
        from lm_eval.models.utils_hf import stop_sequences_criteria

        started = time.monotonic()
        contexts = [list(c) for c in batch.contexts] or [[self._spec.pad_token_id]]
        max_gen_toks = batch.max_gen_toks if batch.contexts else 1
        until = list(batch.until) if batch.contexts else []
        width = max(len(c) for c in contexts)
        input_ids = torch.full((len(contexts), width), self._spec.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, ctx in enumerate(contexts):  # left padding, as lm-eval's tok_batch_encode
            input_ids[i, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
            attention_mask[i, width - len(ctx) :] = 1
        kwargs = dict(batch.kwargs)
        kwargs["temperature"] = kwargs.get("temperature", 0.0)
        if kwargs["temperature"] == 0.0 and kwargs.get("do_sample") is None:
            kwargs["do_sample"] = False
        if kwargs.get("do_sample") is False and kwargs["temperature"] == 0.0:
            kwargs.pop("temperature")
        device = self._torch_device
        with torch.no_grad(), self._autocast(), _releasing(self._model):
            output = self._model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_length=batch.max_length or width + max_gen_toks,
                stopping_criteria=stop_sequences_criteria(
                    self._tokenizer, until, width, len(contexts)
                ),
                pad_token_id=self._spec.pad_token_id,
                use_cache=True,
                # Ranks of one group stop together, or the slower ones hang at a collective
                # (FSDP ranks generate different rows; TP ranks the same, but a hang is never
                # worth the risk: one scalar all-reduce per step).
                synced_gpus=self._shard_size > 1,
                **kwargs,
            )
        generated = [row[width:] for row in output.tolist()] if batch.contexts else []
        # Prompt tokens plus generated ones (HF pads a sequence once it has finished).
        real = sum(len(c) for c in batch.contexts) + sum(
            sum(1 for token in row if token != self._spec.pad_token_id) for row in generated
        )
        padded = len(generated) * output.shape[1]
        return generated, self._step_stats(real, padded, started)

    # ------------------------------------------------------------------------------- helpers
    def _step_stats(self, real: int, padded: int, started: float) -> StepStats:
        """A micro-batch's figures, with this rank's memory as it stands after it."""
        device_mib = 0.0
        if self._torch_device.type == "cuda":
            device_mib = torch.cuda.memory_allocated(self._torch_device) / 2**20
        return StepStats(
            real, padded, time.monotonic() - started, rss_mib=_rss_mib(), device_mib=device_mib
        )

    def _count_input(self, module: Any, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            self._fed["fed"] += args[0].numel()
            self._fed["real"] += int((args[0] != self._spec.pad_token_id).sum())
            self._fed["calls"] += 1

    def _select_device(self) -> torch.device:
        """This rank's device; for CUDA also makes it the current device of the process."""
        if self._device_kind is DeviceKind.CUDA:
            index = self._local_cuda_index()
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def _local_cuda_index(self) -> int:
        """This rank's GPU among those its process sees (0 when Ray isolates it; see placement)."""
        if self._cuda_index is None:
            import ray

            self._cuda_index = cuda_device_index(
                ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")
            )
        return self._cuda_index

    def _autocast(self) -> Any:
        dtype = _dtype(self._spec.mixed_precision_dtype)
        return torch.autocast(
            device_type=self._torch_device.type, dtype=dtype, enabled=dtype is not None
        )

    def _scored_logits(
        self,
        inputs: torch.Tensor,
        wanted: list[tuple[int, int]],
        extra: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Logits at each ``(row, position)`` of ``wanted``, in that order: shape
        (len(wanted), vocabulary). ``extra``: more forward arguments (mask, position ids).

        The output head runs on those positions only (a forward pre-hook hands it just their
        hidden states), never on every position of every row: logits are batch x positions x
        vocabulary, the largest activation of a forward (DESIGN "Known pitfalls").
        """
        width = inputs.shape[1]
        keep = width - min(position for _, position in wanted)
        rows = torch.tensor([row for row, _ in wanted])
        positions = torch.tensor([position for _, position in wanted])
        count = len(wanted)
        # The head used to run on every row's last `keep` positions, and BLAS rounds a matmul
        # with fewer rows differently (MKL on x86: 1, 2-3 and 4+ rows per matrix are three
        # kernels). With fewer than _SMALL_GEMM_ROWS kept positions the head still runs on them
        # all (at most 3 per row); from there on on the scored positions only, padded to at
        # least _SMALL_GEMM_ROWS rows. Either way every log-prob is bit-identical to before.
        select = keep >= _SMALL_GEMM_ROWS
        padding = max(0, _SMALL_GEMM_ROWS - count) if select else 0
        rows = torch.cat([rows, rows[:1].expand(padding)]).to(inputs.device)
        positions = torch.cat([positions, positions[:1].expand(padding)]).to(inputs.device)
        head = self._model.get_output_embeddings() if select else None
        picked = False

        def pick(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            nonlocal picked
            if picked or not args or not isinstance(args[0], torch.Tensor):
                return None  # called again or another way: leave it, pick afterwards
            hidden = args[0]  # (batch, kept positions, hidden): the last `keep` or all of them
            picked = True
            return (hidden[rows, positions - (width - hidden.shape[1])].unsqueeze(0), *args[1:])

        handle = head.register_forward_pre_hook(pick) if isinstance(head, torch.nn.Module) else None
        try:
            with torch.no_grad(), self._autocast(), _releasing(self._model):
                kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
                logits = self._model(inputs, **self._score_kwargs, **kwargs, **extra).logits
        finally:
            if handle is not None:
                handle.remove()
        if picked:
            return logits[0, :count]
        # A model whose forward does not call its output embeddings module: pick afterwards.
        return logits[rows[:count], positions[:count] - (width - logits.shape[1])]

    def _additive_mask_dtype(self) -> torch.dtype | None:
        """How this model takes a custom 4D mask: boolean (sdpa) or added to the scores (eager).

        Raises:
            ConfigError: an attention implementation that takes no custom mask.
        """
        implementation = getattr(self._model.config, "_attn_implementation", None)
        if implementation == "sdpa":
            return None
        if implementation == "eager":
            return self._model.dtype
        raise ConfigError(
            f"packed rows need sdpa or eager attention, this model runs {implementation!r}: "
            "run with --share_prefixes false, or load it with attn_implementation=sdpa"
        )


@contextlib.contextmanager
def _releasing(model: Any) -> Iterator[None]:
    """Every FSDP unit back to its shard when the block ends, even if it raised."""
    try:
        yield
    finally:
        release_unsharded(model)


def _return_large_frees_to_os() -> None:
    """Make glibc serve every allocation of 1 MiB or more with its own ``mmap`` (FSDP ranks).

    glibc raises its mmap threshold to the size of the largest block freed so far (up to 32 MiB);
    from then on FSDP's all-gather buffers and unsharded parameters come from the heap, are freed
    in another order than they were allocated, and the fragments stay resident: a CPU rank's
    memory grew by about half the model across forwards, and its peak by a third (measured in
    docs/performance.md). A fixed threshold turns that adjustment off, so a freed buffer goes back
    to the OS at once. Not glibc (musl, macOS): nothing to do. Only FSDP ranks of a sharded
    replica need it: elsewhere nothing all-gathers, and every fresh mapping costs page faults
    (a scoring forward on one core ran ~25% slower with it).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3  # from glibc's malloc.h
    libc.mallopt(m_mmap_threshold, _MMAP_THRESHOLD_BYTES)


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _rss_mib() -> float:
    """This process's resident memory now (``VmRSS`` of /proc/self/status; 0.0 without /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _pin_gloo_interface(node_ip: str) -> None:
    """Make gloo listen on the interface that holds this node's Ray address.

    Unless ``GLOO_SOCKET_IFNAME`` says otherwise, gloo listens on the address the host name
    resolves to, which on many hosts is a loopback address (Debian's ``127.0.1.1``, containers'
    ``/etc/hosts``). Ranks on other nodes are then told to connect to that address and are
    refused ("Gloo connectFullMesh failed ... Connection refused"). Ray's node address is the one
    the other nodes reach this node by, so its interface is the right one. A user's own
    ``GLOO_SOCKET_IFNAME`` is kept; an address on no local interface (NAT) changes nothing.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == node_ip for address in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            logger.debug("gloo listens on %s (%s), this node's Ray address", name, node_ip)
            return
    logger.debug("no local interface holds %s: gloo picks its own", node_ip)


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
