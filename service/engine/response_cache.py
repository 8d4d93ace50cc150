"""A durable cache of model answers, keyed by the model and the exact request (``--use_cache``).

lm-eval's own response cache (``--use_cache``) keys an answer by the request strings alone, so a
second model pointed at the same cache gets the first model's answers (lm-eval #2715, #4063); it
gives every repeat of a sampled request one key, ignores generation settings (#3881), and stores
pickles (CVE-2024-35515). This cache keys each answer by

- a fingerprint of the model: ``pretrained`` (a local path made absolute), every model arg
  (revision, dtype, tokenizer, max_length, ``checkpoint``, ...), and for a local model the
  content hash of its config and tokenizer files and the size, modification time and leading
  bytes of each weights file — for a training checkpoint (``checkpoint=``) the content hash of
  its DCP ``.metadata`` and the same of each shard file, so two steps of one run never share
  answers; delta weights (``delta=``) are described as a model is; a LoRA adapter (``peft=``) by
  the content hash of its ``adapter_config.json`` and weight files alone, not its path, so two
  adapters never share answers and one adapter copied elsewhere does; and the installed
  versions of torch, transformers and lm-eval (their kernels and code change answers);
- where the answers were computed (:class:`AnswerSite`), as far as the conformance matrix shows
  it to change them: the device kind (cpu or cuda) for every dtype; the settled sharding
  strategy for every dtype, so tensor parallelism (whose kernels split sums: a bf16 answer
  moves) never shares with FSDP, while one rank, replicas and FSDP at any G (bit-identical to
  one rank in every dtype, DESIGN invariant 2) share; and, for half precision only, the
  kernels' machine (ATen's CPU capability, or the GPU models), since a bf16 answer moves with
  the kernel. float32 answers from another machine of the same kind stay within the fidelity
  bound, so a cluster's shared cache keeps them; its answers under tensor parallelism are
  within the bound too, but are keyed apart all the same: one rule for every dtype, and each
  layout's rerun reproduces its own answers bit for bit; and
- the exact request as the model sees it: token ids (and the window length) for a score, context
  tokens plus every generation setting for a generation. Sampled generations are never cached.

It stores plain JSON in SQLite (one file, ``<use_cache>_rayeval.sqlite``, lm-eval's
``<use_cache>_rank<N>.db`` naming), one transaction per finished step, so an interrupted run keeps
everything computed before the interruption. Answers do not depend on R, G or the batch size,
so a layout reads what any other with the same site wrote. It also records which models
(fingerprints) were evaluated to the end with which settings
(:meth:`ResponseCache.mark_evaluated`), so that a watch over a training run skips the
checkpoints it has already evaluated.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayeval.actors.layout import DeviceKind, ShardStrategy

if TYPE_CHECKING:
    import torch

    from rayeval.service.vocabulary.config import EvaluationConfig

logger = logging.getLogger(__name__)

#: Files that define a local model's config and tokenizer (hashed whole).
_DEFINING_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")
#: A DCP save's metadata (hashed whole: it names every tensor, shape and shard).
_DCP_METADATA = ".metadata"
#: accelerate's FSDP sharded-state-dict folders (their files are described too).
_NESTED_DIR_PREFIX = "pytorch_model_fsdp_"
_HEAD_BYTES = 1 << 20
#: Part of every model fingerprint: raised when rayeval computes some answers differently, so
#: that answers cached before never answer for the new code. 2: generation_config.json applies
#: under every strategy (FSDP at G > 1 ignored it), tensor parallelism splits no sum. 3: scores in
#: bf16 and fp16 never come from packed shared-prefix rows. 4: nor bf16 and fp16 generations from
#: continuous batching.
ANSWERS_VERSION = 4


def cache_file(use_cache: str) -> Path:
    """The SQLite file behind ``--use_cache PREFIX`` (lm-eval's flag takes a path prefix)."""
    return Path(f"{use_cache}_rayeval.sqlite")


def model_fingerprint(model_args: Mapping[str, Any]) -> str:
    """A hash of everything that determines the model's answers (see the module docstring)."""
    args = {key: value for key, value in model_args.items()}
    pretrained = str(args.get("pretrained", ""))
    files: dict[str, Any] = {}
    for key in ("pretrained", "tokenizer", "checkpoint", "delta"):
        value = args.get(key)
        if isinstance(value, str) and Path(value).expanduser().exists():
            local = Path(value).expanduser().resolve()
            args[key] = str(local)
            files[key] = _describe_files(local)
    adapter = args.get("peft")
    if isinstance(adapter, str) and Path(adapter).expanduser().is_dir():
        # by content alone: the same adapter copied elsewhere answers the same
        args["peft"] = "local"
        files["peft"] = _describe_adapter(Path(adapter).expanduser())
    payload = {
        "pretrained": pretrained,
        "model_args": args,
        "files": files,
        "answers_version": ANSWERS_VERSION,
        "versions": {name: _version(name) for name in _ANSWERING_PACKAGES},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


#: The packages whose version changes an answer's bits.
_ANSWERING_PACKAGES = ("torch", "transformers", "lm_eval")


def _version(package: str) -> str | None:
    """The installed version of ``package`` (None: not installed), without importing it."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class AnswerSite:
    """Where answers are computed, as far as it changes their bits (see the module docstring).

    Args:
        device: The ranks' device kind.
        strategy: The settled sharding strategy (FSDP for one rank and for replicas, which
            shard nothing: their answers are FSDP's at any G).
        kernels: For half precision, the machine whose kernels computed them (ATen's CPU
            capability, or the GPU models); None for float32, whose answers every machine of
            the device kind gives within the fidelity bound.
    """

    device: DeviceKind
    strategy: ShardStrategy
    kernels: str | None = None

    def __post_init__(self) -> None:
        if self.strategy is ShardStrategy.AUTO:  # a bug, not a user's setting: name the fix
            raise ValueError(
                "an answer site needs the settled shard strategy, not auto: "
                "take Engine.shard_strategy, which settles it"
            )


#: The dtypes whose answers move with the kernel (keyed by :attr:`AnswerSite.kernels`).
_HALF_PRECISION = ("bfloat16", "float16")


def answer_site(device: DeviceKind, strategy: ShardStrategy, dtype: torch.dtype) -> AnswerSite:
    """The site of answers computed in ``dtype`` by ``strategy`` on ``device`` ranks.

    The kernels are this process's view: ATen's CPU capability here (the ranks of one CPU
    cluster are taken to share the driver's), or every GPU model the Ray cluster reports
    (its ``accelerator_type:`` resources; this process's GPU where it reports none). Must be
    called after Ray is connected.
    """
    if str(dtype).removeprefix("torch.") not in _HALF_PRECISION:
        return AnswerSite(device, strategy)
    return AnswerSite(device, strategy, _kernels(device))


def _kernels(device: DeviceKind) -> str:
    """Which kernels compute on ``device`` ranks (see :func:`answer_site`)."""
    import torch

    if device is DeviceKind.CPU:
        return f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    import ray

    prefix = "accelerator_type:"
    models = sorted(k.removeprefix(prefix) for k in ray.cluster_resources() if k.startswith(prefix))
    if not models and torch.cuda.is_available():
        models = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return "cuda:" + (",".join(models) or "unknown")


def answers_fingerprint(model: str, site: AnswerSite | None) -> str:
    """What an answer is keyed by beside its request: the model's fingerprint
    (:func:`model_fingerprint`) and where the answer was computed (None: not named, for a
    cache that stores no model's answers, as a sweep's)."""
    payload = [model, None if site is None else asdict(site)]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def score_key(context: Sequence[int], continuation: Sequence[int], max_length: int) -> Any:
    """The request part of a score's key (the model sees these tokens, cut to ``max_length``)."""
    return ["score", max_length, list(context), list(continuation)]


def generate_key(context: Sequence[int], settings: Mapping[str, Any]) -> Any | None:
    """The request part of a generation's key, or None for a sampled generation (not cached)."""
    if settings.get("kwargs", {}).get("do_sample"):
        return None
    return ["generate", list(context), dict(settings)]


class Digest(str):
    """A request's key already hashed (:meth:`ResponseCache.digest`): 64 characters to hold
    instead of the request's token lists, for a million requests."""


class ResponseCache:
    """Answers of one model, keyed by request, in a SQLite file.

    Args:
        path: The SQLite file (created with its folder if missing).
        fingerprint: :func:`model_fingerprint` of the model whose answers these are.
        site: Where they are computed (:func:`answer_site`), or a call that says so, made once,
            when the first key is needed (the engine's strategy may be settled only when its
            ranks are placed). None: not named (a sweep's cache records evaluated models only).
    """

    def __init__(
        self,
        path: Path,
        fingerprint: str,
        site: AnswerSite | Callable[[], AnswerSite] | None = None,
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fingerprint = fingerprint
        self._site = site
        #: :func:`answers_fingerprint`, once the site is known (keys are made on a planning
        #: thread and on the driver's: the first one settles it, under ``_site_lock``).
        self._answers: str | None = None
        self._site_lock = threading.Lock()
        self._db = sqlite3.connect(str(path), timeout=60, check_same_thread=False)
        with self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, answer TEXT NOT NULL)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS evaluated "
                "(fingerprint TEXT, settings TEXT, PRIMARY KEY (fingerprint, settings))"
            )
        self.hits = 0
        self.stored = 0
        #: Answers stored that the cache held already: computed twice (by this evaluation, or
        #: by another one that computed them at the same time).
        self.rewritten = 0
        #: Answers not stored because the cache's disk was full (the evaluation went on).
        self.unstored = 0
        #: Parts of a large request type are looked up on a planning thread while the
        #: driver's thread stores finished ones (engine.parts.pipeline).
        self._lock = threading.Lock()

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the model whose answers are read and stored."""
        return self._fingerprint

    @property
    def site(self) -> AnswerSite | None:
        """Where the answers read and stored are computed (settled by this call if it was
        given as a call); None where the cache was given none."""
        self._answers_fingerprint()
        return self._site if isinstance(self._site, AnswerSite) else None

    def use_model(self, model_args: Mapping[str, Any]) -> None:
        """Read and store the answers of another model (a sweep's next checkpoint) from now on,
        computed where this one's are."""
        with self._site_lock:
            self._fingerprint = model_fingerprint(model_args)
            self._answers = None

    def mark_evaluated(self, fingerprint: str, settings: str) -> None:
        """Record that the model of ``fingerprint`` was evaluated to the end with ``settings``
        (a digest of the evaluation's other options)."""
        with self._unless_full(0), self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO evaluated VALUES (?, ?)", (fingerprint, settings)
            )

    def evaluated(self, fingerprint: str, settings: str) -> bool:
        """Whether the model of ``fingerprint`` was evaluated to the end with ``settings``."""
        row = self._db.execute(
            "SELECT 1 FROM evaluated WHERE fingerprint = ? AND settings = ?",
            (fingerprint, settings),
        ).fetchone()
        return row is not None

    def get_many(self, requests: Iterable[Any]) -> dict[int, Any]:
        """Cached answers: request position -> answer, for the requests found."""
        keys = {self._key(request): i for i, request in enumerate(requests) if request is not None}
        found: dict[int, Any] = {}
        items = list(keys.items())
        for start in range(0, len(items), 500):  # SQLite bounds the number of parameters
            chunk = dict(items[start : start + 500])
            marks = ",".join("?" * len(chunk))
            with self._lock:
                rows = self._db.execute(
                    f"SELECT key, answer FROM answers WHERE key IN ({marks})",
                    list(chunk),
                ).fetchall()
            for key, answer in rows:
                found[chunk[key]] = _from_json(json.loads(answer))
        self.hits += len(found)
        return found

    def put_many(self, answers: Iterable[tuple[Any, Any]]) -> None:
        """Store ``(request, answer)`` pairs in one transaction (None requests are skipped)."""
        rows = [
            (self._key(request), json.dumps(answer))
            for request, answer in answers
            if request is not None
        ]
        if not rows:
            return
        with self._lock, self._unless_full(len(rows)):
            with self._db:
                held = self._held([key for key, _ in rows])
                self._db.executemany("INSERT OR REPLACE INTO answers VALUES (?, ?)", rows)
            self.stored += len(rows)
            self.rewritten += held

    def storer(
        self, located: Sequence[tuple[Any, int, tuple[int, ...]]]
    ) -> Callable[[int, Any], None]:
        """A callback that stores a finished micro-batch's answers, in one transaction.

        Args:
            located: Per computed request: its key, its micro-batch, and where its answer is
                inside that micro-batch's result (indices, outermost first).

        Returns:
            ``store(micro_batch, result)``, to call once per finished micro-batch.
        """
        by_micro_batch: dict[int, list[tuple[Any, tuple[int, ...]]]] = {}
        for key, micro_batch, path in located:
            by_micro_batch.setdefault(micro_batch, []).append((key, path))

        def store(micro_batch: int, result: Any) -> None:
            answers = []
            for key, path in by_micro_batch.get(micro_batch, []):
                answer = result
                for part in path:
                    answer = answer[part]
                answers.append((key, answer))
            self.put_many(answers)

        return store

    def piece_storer(
        self, located: Sequence[tuple[Any, int, int]]
    ) -> Callable[[int, Sequence[tuple[int, Any]]], None]:
        """A callback that stores the answers of a continuous-batching group's finished
        requests as they stream back, in one transaction per piece.

        Args:
            located: Per computed request: its key, its group, and its position in the group.

        Returns:
            ``store(group, finished)``, ``finished`` being (position, token ids) pairs.
        """
        key_at = {(group, position): key for key, group, position in located}

        def store(group: int, finished: Sequence[tuple[int, Any]]) -> None:
            self.put_many(
                (key_at[(group, position)], list(tokens)) for position, tokens in finished
            )

        return store

    def _held(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` the cache holds (the caller holds the lock)."""
        held = 0
        for start in range(0, len(keys), 500):  # SQLite bounds the number of parameters
            chunk = keys[start : start + 500]
            marks = ",".join("?" * len(chunk))
            (count,) = self._db.execute(
                f"SELECT count(*) FROM answers WHERE key IN ({marks})", chunk
            ).fetchone()
            held += int(count)
        return held

    def digest(self, request: Any) -> Digest | None:
        """The key of ``request`` as this cache stores it (None stays None); every method
        taking requests takes digests too."""
        return None if request is None else Digest(self._key(request))

    def close(self) -> None:
        """Close the database (answers are committed as they are stored)."""
        self._db.close()

    @contextlib.contextmanager
    def _unless_full(self, count: int) -> Iterator[None]:
        """Skip a write the cache's disk has no room for (``count`` answers): the cache only
        saves work, so a full disk costs recomputing them on a retry, never the evaluation
        (issue 41's soak filled it, and the evaluation failed)."""
        try:
            yield
        except sqlite3.OperationalError as error:
            if not _disk_full(error):
                raise
            with contextlib.suppress(sqlite3.Error):
                self._db.rollback()
            if not self.unstored:
                logger.warning(
                    "response cache %s: not storing answers (%s); the evaluation goes on "
                    "without caching them: free space there for a retry to reuse them",
                    self.path,
                    error,
                )
            self.unstored += count

    def _key(self, request: Any) -> str:
        if isinstance(request, Digest):
            return request
        text = json.dumps([self._answers_fingerprint(), request], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def _answers_fingerprint(self) -> str:
        """:func:`answers_fingerprint` of this model and site (the site settled on first use)."""
        with self._site_lock:
            if self._answers is None:
                if callable(self._site):
                    self._site = self._site()
                self._answers = answers_fingerprint(self._fingerprint, self._site)
            return self._answers


def _disk_full(error: sqlite3.OperationalError) -> bool:
    """Whether SQLite failed for lack of room (full, or a write's I/O error such as ENOSPC)."""
    return error.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR)


def _from_json(answer: Any) -> Any:
    """A stored answer as the engine returns it: a score is a (float, bool) tuple."""
    if isinstance(answer, list) and len(answer) == 2 and isinstance(answer[1], bool):
        return (float(answer[0]), answer[1])
    return answer


def _describe_files(root: Path) -> dict[str, Any]:
    """Content hashes of a local model's defining files; size, mtime and head of its weights."""
    if root.is_file():
        return {root.name: _file_hash(root)}
    described: dict[str, Any] = {}
    for path in sorted(root.iterdir()):
        if path.is_dir() and path.name.startswith(_NESTED_DIR_PREFIX):
            described[path.name] = _describe_files(path)
        elif path.name in (*_DEFINING_FILES, _DCP_METADATA) or path.name.endswith(".index.json"):
            described[path.name] = _file_hash(path)
        elif path.name.endswith(_WEIGHT_SUFFIXES):
            stat = path.stat()
            described[path.name] = [stat.st_size, stat.st_mtime_ns, _file_hash(path, _HEAD_BYTES)]
    return described


def _describe_adapter(folder: Path) -> dict[str, str]:
    """Content hashes of a LoRA adapter's config and weights (adapters are small: read whole)."""
    return {
        path.name: _file_hash(path)
        for path in sorted(folder.iterdir())
        if path.name == "adapter_config.json" or path.name.startswith("adapter_model.")
    }


def _file_hash(path: Path, limit: int | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if limit is not None:
            digest.update(f.read(limit))
        else:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def settings_digest(config: EvaluationConfig) -> str:
    """What, beside the weights, decides an evaluation's answers (for
    :meth:`ResponseCache.mark_evaluated`): the config without the checkpoint (the fingerprint
    has it) and without a sweep's own list or watch."""
    data = config.with_checkpoint(None).to_json()
    data.pop("sweep", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def open_cache(
    use_cache: str | None,
    model_args: Mapping[str, Any] | None,
    site: AnswerSite | Callable[[], AnswerSite] | None = None,
) -> ResponseCache | None:
    """The cache for ``--use_cache PREFIX`` and this model computed at ``site`` (see
    :class:`ResponseCache`; None: no model yet, as for a sweep, which names each checkpoint's
    fingerprint itself), or None without ``use_cache`` or where the cache cannot be opened for
    lack of room (SQLite must create its shared-memory index to read a WAL database: on a full
    disk that is "disk I/O error")."""
    if not use_cache:
        return None
    path = cache_file(os.path.expanduser(use_cache))
    fingerprint = model_fingerprint(model_args) if model_args is not None else ""
    try:
        cache = ResponseCache(path, fingerprint, site)
    except sqlite3.OperationalError as error:
        if not _disk_full(error):
            raise
        logger.warning("response cache %s: cannot open it (%s); evaluating without it", path, error)
        return None
    logger.info(
        "response cache: %s (keyed by model fingerprint, device, strategy and request)", cache.path
    )
    return cache
