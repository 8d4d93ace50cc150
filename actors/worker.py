"""One rank: a plain class that Ray turns into an actor where the worker group creates it.

A :class:`ShardWorker` joins its replica's torch process group (gloo on CPU, NCCL on GPU), has the
replica's sharding strategy (:mod:`rayeval.actors.parallel.sharding`) load its part of the model and
set up its collectives, and computes micro-batches: scores (:mod:`rayeval.actors.compute.scoring`)
and generations (:mod:`rayeval.actors.compute.generation`). Every call that involves other ranks (a
forward, ``generate`` with ``synced_gpus``) is issued by all ranks of the replica in the same order,
because the driver sends each step to all of them: under FSDP each rank its own micro-batch, under
tensor parallelism the same micro-batch to every rank.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import transformers

from rayeval.actors.batches import (
    GENERATE_LOGIT_COPIES,
    GenerateGroup,
    GenerateMicroBatch,
    GenerateResult,
    GenerationPiece,
    ModelSpec,
    RankOptions,
    ScoreMicroBatch,
    ScoreResult,
    StepStats,
)
from rayeval.actors.compute.continuous import generate_group
from rayeval.actors.compute.generation import generate
from rayeval.actors.compute.rank_model import RankModel
from rayeval.actors.compute.scoring import Scorer
from rayeval.actors.errors import ModelLoadError
from rayeval.actors.layout import DeviceKind, RankCoord
from rayeval.actors.parallel.sharding import RankContext
from rayeval.actors.parallel.strategies import strategy
from rayeval.actors.placement import cuda_device_index
from rayeval.actors.process import (
    INSTALL_CUDA_TORCH,
    host_memory_share,
    peak_rss_mib,
    pin_socket_interfaces,
)
from rayeval.actors.profiles import ModelShape
from rayeval.actors.protocol import (
    InputTokens,
    LoadReport,
    NodeInfo,
    SwapReport,
    compute,
    compute_many,
)

logger = logging.getLogger(__name__)


class ShardWorker:
    """One rank of one replica.

    Args:
        spec: The model to load.
        coord: This rank's replica, shard rank and global rank.
        options: How the evaluation's ranks run.
    """

    def __init__(self, spec: ModelSpec, coord: RankCoord, options: RankOptions) -> None:
        self._spec = spec
        self._coord = coord
        self._options = options
        self._strategy = strategy(options.strategy)
        self._seed = options.seed
        self._rank: RankModel | None = None
        self._scorer: Scorer | None = None
        #: Tokens fed to the model's input embeddings (see input_token_counts).
        self._fed = {"fed": 0, "real": 0, "calls": 0, "decode_rows": 0}  # InputTokens' fields
        self._real_ids: torch.Tensor | None = None
        self._cuda_index: int | None = None
        if options.device is DeviceKind.CPU:  # host-allocator tuning: a GPU rank's tensors
            self._strategy.prepare_process(options.shard_size)  # live in device memory

    # ----------------------------------------------------------------------------- lifecycle
    def node_info(self) -> NodeInfo:
        """Where this rank runs, for placement checks and logs."""
        import ray

        context = ray.get_runtime_context()
        cuda = self._options.device is DeviceKind.CUDA
        return NodeInfo(
            node_id=context.get_node_id(),
            ip=ray.util.get_node_ip_address(),
            gpu_ids=[str(gpu) for gpu in ray.get_gpu_ids()],
            pid=os.getpid(),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            cuda_device=self._local_cuda_index() if cuda else None,
        )

    def begin_evaluation(self, seed: int) -> int:
        """Start an evaluation on this loaded rank: seed torch as a new rank is seeded.

        A rank kept warm for the next evaluation then samples what a new rank would. A GPU rank
        also gives the previous evaluation's cached blocks back to the device, so that the next
        one starts from the weights alone, as a new rank would (its batch shapes differ).

        Returns:
            This rank's process id (the caller can tell a kept rank from a new one).
        """
        self._seed = seed
        torch.manual_seed(seed)
        if self._options.device is DeviceKind.CUDA and self._rank is not None:
            torch.cuda.empty_cache()
        return os.getpid()

    def reserve_port(self) -> tuple[str, int]:
        """A free TCP port on this node for the replica's rendezvous (called on shard rank 0)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, rendezvous: tuple[str, int]) -> LoadReport:
        """Join the replica's process group at ``rendezvous`` (address, port) and load the model.

        Returns:
            Its load figures.
        """
        started = time.monotonic()
        options = self._options
        torch.manual_seed(self._seed)
        device = self._select_device()
        if options.shard_size > 1:
            self._join_process_group(rendezvous, device)
        model = self._strategy.load(self._spec, device, options.shard_size)
        collectives = self._strategy.collectives(
            RankContext(
                replica=self._coord.replica,
                shard_rank=self._coord.shard_rank,
                shard_size=options.shard_size,
                rendezvous=rendezvous,
                collective_timeout_s=options.collective_timeout_s,
                shared_memory=options.shm_collectives,
                device_type=device.type,
            )
        )
        model.get_input_embeddings().register_forward_pre_hook(self._count_input)
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            self._spec.tokenizer or self._spec.pretrained,
            revision=self._spec.revision,
            trust_remote_code=self._spec.trust_remote_code,
        )
        self._rank = RankModel(
            model, self._spec, device, self._strategy, options.shard_size, tokenizer
        )
        self._scorer = Scorer(self._rank, options.logits_budget_mib * 2**20)
        local_params = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
        )
        return LoadReport(
            seconds=time.monotonic() - started,
            local_parameters=local_params,
            kv_capacity_tokens=self._kv_capacity(model, device),
            strategy=self._strategy.name.value if options.shard_size > 1 else None,
            collectives=collectives,
            peak_rss_mib=peak_rss_mib(),
        )

    def _kv_capacity(self, model: Any, device: torch.device) -> int | None:
        """The KV-cache positions this rank's free memory holds now (after loading, and for
        every generation plan): the GPU's free memory, or on CPU its share of the node's
        available memory (by its CPUs), less the logits (:func:`logits_reserve`)."""
        if device.type == "cuda":  # the caching allocator's free blocks are free for the cache
            free, _ = torch.cuda.mem_get_info(device)
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        else:
            import ray

            mine, node_cpus = 1.0, float(os.cpu_count() or 1)
            context = ray.get_runtime_context() if ray.is_initialized() else None
            if context is not None and context.get_actor_id() is not None:  # else: a CPU's share
                mine = context.get_assigned_resources().get("CPU", mine)
                nodes = [n for n in ray.nodes() if n["NodeID"] == context.get_node_id()]
                node_cpus = nodes[0]["Resources"].get("CPU", node_cpus) if nodes else node_cpus
            free = host_memory_share(mine, node_cpus)
        vocab = self._spec.vocab_size or ModelShape(model.config).vocab_size
        free = max(0, free - logits_reserve(self._options, vocab))
        kv_shards = self._options.shard_size if self._strategy.same_batch else 1
        return ModelShape(model.config).kv_capacity_tokens(free, model.dtype.itemsize, kv_shards)

    def _join_process_group(self, rendezvous: tuple[str, int], device: torch.device) -> None:
        """Join the replica's process group: gloo on CPU ranks, NCCL bound to this rank's GPU
        (``device_id``: its communicator is created at once, on the right device)."""
        options = self._options
        cuda = options.device is DeviceKind.CUDA
        if not cuda or self._coord.replica in options.split_replicas:
            import ray

            pin_socket_interfaces(ray.util.get_node_ip_address())
        dist.init_process_group(
            backend=options.device.backend,
            init_method=f"tcp://{rendezvous[0]}:{rendezvous[1]}",
            rank=self._coord.shard_rank,
            world_size=options.shard_size,
            timeout=timedelta(seconds=options.collective_timeout_s),
            device_id=device if cuda else None,
        )

    def load_checkpoint(self, checkpoint: str) -> SwapReport:
        """Swap in the weights of another checkpoint of the same model, in place: this rank
        reads only the regions it holds (:func:`rayeval.actors.weights.sources.fill`).

        Args:
            checkpoint: A DCP directory or HF weight files, of the loaded model's architecture.

        Returns:
            How long it took and what it wrote.

        Raises:
            ConfigError, ModelLoadError: the checkpoint is unusable or unreadable. The rank's
                weights are then a mix of two checkpoints: the caller must not compute on it.
        """
        from dataclasses import replace

        from rayeval.actors.weights.sources import fill, open_source

        assert self._rank is not None, "setup() loads the model first"
        started = time.monotonic()
        self._strategy.after_forward(self._rank.model)  # every FSDP unit in its shard
        written = fill(self._rank.model, open_source(checkpoint), self._spec.pretrained)
        self._spec = replace(self._spec, checkpoint=checkpoint)
        return SwapReport(time.monotonic() - started, written, peak_rss_mib())

    def load_adapter(self, peft: str) -> SwapReport:
        """Swap in another checkpoint of the loaded LoRA adapter, in place: its matrices are
        overwritten; the base is not touched
        (:func:`rayeval.actors.weights.adapters.load_adapter_weights`).

        Raises:
            ModelLoadError: the adapter does not match the loaded one, or cannot be read.
        """
        from dataclasses import replace

        from rayeval.actors.weights.adapters import load_adapter_weights

        assert self._rank is not None, "setup() loads the model first"
        started = time.monotonic()
        self._strategy.after_forward(self._rank.model)  # every FSDP unit in its shard
        written = load_adapter_weights(self._rank.model, peft)
        self._spec = replace(self._spec, peft=peft)
        return SwapReport(time.monotonic() - started, written, peak_rss_mib())

    def shutdown(self) -> None:
        """Leave the process group and drop the model (the actor is killed afterwards)."""
        self._rank = self._scorer = None
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------------------- compute
    def score(self, batch: ScoreMicroBatch) -> tuple[ScoreResult, StepStats]:
        """Log-likelihood of each target continuation
        (:class:`rayeval.actors.compute.scoring.Scorer`)."""
        assert self._scorer is not None, "setup() loads the model first"
        return self._scorer.score(batch)

    def generate(self, batch: GenerateMicroBatch) -> tuple[GenerateResult, StepStats]:
        """Greedy or sampled continuations, as lm-eval's HF backend calls ``generate``."""
        assert self._rank is not None, "setup() loads the model first"
        return generate(self._rank, batch)

    def compute(self, batch: ScoreMicroBatch | GenerateMicroBatch) -> tuple[Any, StepStats]:
        """One micro-batch, computed as its type says (:func:`rayeval.actors.protocol.compute`)."""
        return compute(self, batch)

    def compute_many(self, batches: bytes) -> bytes:
        """Several pickled micro-batches in one call (:func:`rayeval.actors.protocol.compute_many`;
        :meth:`rayeval.actors.group.Replica.submit_many`)."""
        return compute_many(self, batches)

    def generate_stream(self, group: GenerateGroup) -> Iterator[GenerationPiece]:
        """Continuous batching over a group's requests, streaming each answer as its request
        finishes (:mod:`rayeval.actors.compute.continuous`); a Ray streaming generator."""
        assert self._rank is not None, "setup() loads the model first"
        # Ranks that compute one batch together (TP) make the same decisions from the same
        # logits; ranks that each compute their own (FSDP) agree on every step.
        synced = self._options.shard_size > 1 and not self._strategy.same_batch
        yield from generate_group(self._rank, group, synced, self._options.piece_interval_s)

    def kv_capacity_tokens(self) -> int | None:
        """The KV-cache positions this rank's free memory holds now (read for every generation
        plan: what scoring left allocated, or the caching allocator holds free, counts as it
        is then, not as it was after loading)."""
        if self._rank is None:
            return None
        return self._kv_capacity(self._rank.model, self._rank.device)

    def input_token_counts(self) -> InputTokens:
        """Tokens this rank's model was fed since it loaded, counted at its input embeddings."""
        if self._real_ids is not None:  # summed on the device, read here (no sync per step)
            self._fed["real"] += int(self._real_ids)
            self._real_ids = None
        return InputTokens(**self._fed)

    # ------------------------------------------------------------------------------- helpers
    def _count_input(self, module: Any, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            self._fed["fed"] += args[0].numel()
            real = (args[0] != self._spec.pad_token_id).sum()
            self._real_ids = real if self._real_ids is None else self._real_ids + real
            self._fed["calls"] += 1
            if args[0].dim() == 2 and args[0].shape[1] == 1:
                self._fed["decode_rows"] += args[0].shape[0]

    def _select_device(self) -> torch.device:
        """This rank's device; for CUDA also makes it the current device of the process.

        Raises:
            ModelLoadError: CUDA is asked of a CPU build of torch (naming the install command).
        """
        if self._options.device is DeviceKind.CUDA:
            if not torch.backends.cuda.is_built():
                raise ModelLoadError(
                    f"this rank's torch {torch.__version__} is a CPU build, but the evaluation "
                    "runs on GPUs (--device cuda, or auto on a cluster with GPUs). Install the "
                    f"CUDA build of torch on every GPU node:\n  {INSTALL_CUDA_TORCH}\nor run "
                    "on the CPU with --device cpu."
                )
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


def logits_reserve(options: RankOptions, vocab: int) -> int:
    """Bytes of logits a rank holds besides its KV cache: a scoring micro-batch's head chunk
    (``logits_budget_mib``) or a generation group's float32 logits, processed scores and their
    copy (``generate_rows`` x ``vocab`` x :data:`GENERATE_LOGIT_COPIES`), whichever is more (a
    rank does one at a time). A 256k vocabulary's 64 rows take 200 MB; a 768 one's, 0.6 MB."""
    generating = options.generate_rows * vocab * 4 * GENERATE_LOGIT_COPIES
    return max(options.logits_budget_mib * 2**20, generating)
