"""Sharding that cuts memory: a rank holds its shard, loads only its shard, and does not grow.

The fast tests check, on meta-device models, which FSDP units the loader makes (tied embeddings
and head are one unit) and how a tied parameter finds its one checkpoint tensor; and that a
vocabulary matrix larger than a decoder block is cut into row-chunk units whose logits are
bit-identical to the uncut model's, the head multiplied chunk by chunk or as one weight (the
Llama below is cut in three at G=2). The slow ones run
real rank actors (:class:`rayeval.actors.worker.ShardWorker` in Ray actors, joined by a real gloo
process
group of G=2) on small models saved to disk:

* a Llama (untied head) and a tied-embedding GPT-2 each hold half of the parameters per rank,
  load without falling back to a full load, and score like the unsharded model in one process;
* a checkpoint split over several safetensors files (``model.safetensors.index.json``) and one
  split over several ``.bin`` files load shard by shard too;
* after 30 scoring steps a rank still holds only its shard (no unit stays unsharded after a
  forward, the root's included), and its private memory (RssAnon) is where 10 steps left it.

The actor here wraps a ShardWorker (composition) only to see what a test needs to: the warnings
the rank logs while it loads, its RssAnon, and its parameters.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rayeval.actors.batches import ModelSpec, ScoreMicroBatch, ScoreRow

G = 2
FULL_LOAD_WARNING = "loaded the whole model"
#: A Llama of ~29 MiB: large enough for a leak or an unsharded unit to show in RssAnon.
LLAMA = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "vocab_size": 8192}


# ------------------------------------------------------------------------- fast: no actors
def _meta_model(config: Any) -> Any:
    import torch
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.unit
def test_tied_head_is_one_unit_with_the_embeddings() -> None:
    import transformers

    from rayeval.actors.parallel.fsdp_units import embedding_units

    gpt2 = _meta_model(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100))
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert embedding_units(gpt2) == [[gpt2.transformer.wte, gpt2.lm_head]]

    llama = _meta_model(_llama_config(vocab_size=100, hidden_size=32, num_hidden_layers=2))
    assert embedding_units(llama) == [[llama.model.embed_tokens], [llama.lm_head]]


@pytest.mark.unit
def test_tied_parameter_maps_to_the_one_checkpoint_tensor() -> None:
    import transformers

    from rayeval.actors.parallel.fsdp_loading import _aliases
    from rayeval.actors.weights.hf_files import Checkpoint as _Checkpoint

    gpt2 = _meta_model(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100))
    aliases = _aliases(gpt2)
    assert aliases["transformer.wte.weight"] == ["transformer.wte.weight", "lm_head.weight"]
    assert "lm_head.weight" not in aliases
    # A checkpoint may store the tied tensor under either name, with or without the prefix.
    for stored in ("transformer.wte.weight", "wte.weight", "lm_head.weight"):
        checkpoint = _Checkpoint({stored: Path("model.safetensors")}, safetensors=True)
        assert checkpoint.key_for(aliases["transformer.wte.weight"], gpt2) == stored


# ------------------------------------------------------------------------ slow: real ranks
class _Rank:
    """One rank for these tests: a ShardWorker per model it loads, and a look at its process.

    The same two actors load one model after another (each load is a new ShardWorker in a new
    process group): starting rank processes is what costs most here.
    """

    def __init__(self, shard_rank: int) -> None:
        self._shard_rank = shard_rank
        self._worker: Any = None

    def prepare(self, spec: ModelSpec) -> None:
        """Drop the previous model and its process group; a new ShardWorker for ``spec``."""
        from rayeval.actors.layout import DeviceKind, RankCoord
        from rayeval.actors.worker import RankOptions, ShardWorker

        if self._worker is not None:
            self._worker.shutdown()
        coord = RankCoord(replica=0, shard_rank=self._shard_rank, global_rank=self._shard_rank)
        self._worker = ShardWorker(
            spec, coord, RankOptions(G, DeviceKind.CPU, collective_timeout_s=120)
        )

    def reserve_port(self) -> tuple[str, int]:
        return self._worker.reserve_port()

    def setup(self, rendezvous: tuple[str, int]) -> dict[str, Any]:
        """Load, recording what the rank logs at WARNING and above while it does."""
        handler = _Recorder()
        logging.getLogger().addHandler(handler)
        try:
            report = self._worker.setup(rendezvous)
        finally:
            logging.getLogger().removeHandler(handler)
        return {"report": report, "warnings": handler.messages, "warned_at": handler.times}

    def local_bytes(self) -> int:
        """Bytes of the parameter tensors this rank holds right now."""
        return sum(
            (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes()
            for p in self._worker._rank.model.parameters()
        )

    def score(self, batch: ScoreMicroBatch) -> Any:
        return self._worker.score(batch)[0]

    def score_many(self, batches: list[ScoreMicroBatch]) -> tuple[int, int]:
        """Score every batch in turn; RssAnon and the parameters' local bytes afterwards."""
        for batch in batches:
            self._worker.score(batch)
        return _rss_anon(), self.local_bytes()


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.times.append(record.created)


def _rss_anon() -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.fixture(scope="module")
def ranks(ray_session: None) -> Iterator[list[Any]]:
    """G rank actors, shared by this module's slow tests."""
    import ray

    remote = ray.remote(num_cpus=1)(_Rank)
    actors = [remote.remote(shard_rank) for shard_rank in range(G)]
    yield actors
    for actor in actors:
        ray.kill(actor, no_restart=True)


def _load(ranks: list[Any], model_dir: Path) -> list[dict[str, Any]]:
    """Load ``model_dir`` on the ranks, in a new gloo process group; their load reports."""
    import ray
    import transformers

    pad = transformers.AutoTokenizer.from_pretrained(model_dir).pad_token_id
    spec = ModelSpec(pretrained=str(model_dir), dtype="float32", pad_token_id=pad)
    ray.get([rank.prepare.remote(spec) for rank in ranks], timeout=120)
    rendezvous = ranks[0].reserve_port.remote()
    return ray.get([rank.setup.remote(rendezvous) for rank in ranks], timeout=300)


def _llama_config(**overrides: Any) -> Any:
    import transformers

    values = {**LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2, **overrides}
    return transformers.LlamaConfig(tie_word_embeddings=False, **values)


def _save_llama(out: Path, tokenizer_dir: Path, **save_kwargs: Any) -> Any:
    """A random-weight Llama (and the demo tokenizer) in ``out``; returns the model."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = _llama_config(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, **save_kwargs)
    tokenizer.save_pretrained(out)
    return model.eval()


def _batches(count: int, seed: int = 0, vocab: int = 700) -> list[ScoreMicroBatch]:
    """Micro-batches of 8 random rows (12-40 token ids below ``vocab``), each scoring a 1- and a
    3-token target."""
    rng = random.Random(seed)

    def row() -> ScoreRow:
        tokens = tuple(rng.randrange(4, vocab) for _ in range(rng.randrange(12, 40)))
        return ScoreRow(tokens=tokens, targets=(tokens[-1:], tokens[-3:]))

    return [ScoreMicroBatch(rows=tuple(row() for _ in range(8))) for _ in range(count)]


def _assert_holds_its_shard(ranks: list[Any], reports: list[dict[str, Any]], model: Any) -> None:
    import ray

    total = sum(p.numel() for p in model.parameters())  # a tied weight counted once
    total_bytes = total * 4
    local = [loaded["report"].local_parameters for loaded in reports]
    assert sum(local) == total
    assert max(local) <= total / G + 1024
    # What the rank keeps resident for its parameters is its shard, not a full copy.
    for nbytes in ray.get([rank.local_bytes.remote() for rank in ranks], timeout=60):
        assert nbytes <= total_bytes / G * 1.05
    for report in reports:
        assert not [w for w in report["warnings"] if FULL_LOAD_WARNING in w], report["warnings"]


def _assert_scores_like(model: Any, ranks: list[Any]) -> None:
    """Rank 0 scores a micro-batch (rank 1 a dummy, so that their all-gathers pair up) within
    1e-4 of the whole in-process model's log-probabilities."""
    import ray
    import torch

    batch = _batches(1, seed=1, vocab=model.config.vocab_size)[0]
    ours, _ = ray.get(
        [ranks[0].score.remote(batch), ranks[1].score.remote(ScoreMicroBatch())], timeout=120
    )
    with torch.no_grad():
        for row, row_scores in zip(batch.rows, ours, strict=True):
            logprobs = torch.log_softmax(model(torch.tensor([row.tokens])).logits[0], dim=-1)
            for target, (total, _) in zip(row.targets, row_scores, strict=True):
                positions = range(len(row.tokens) - len(target), len(row.tokens))
                expected = sum(
                    float(logprobs[p, t]) for p, t in zip(positions, target, strict=True)
                )
                assert abs(total - expected) <= 1e-4


@pytest.mark.service
def test_llama_rank_holds_its_shard_and_memory_stays_flat(
    tmp_path: Path, demo: Any, ranks: list[Any]
) -> None:
    import ray

    model = _save_llama(tmp_path / "llama", demo.model_dir)
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    reports = _load(ranks, tmp_path / "llama")
    _assert_holds_its_shard(ranks, reports, model)
    # Its 8k-row embeddings and head are vocabulary chunks at G = 2: their values as the whole's.
    _assert_scores_like(model, ranks)
    batches = _batches(30)
    after_10 = ray.get([rank.score_many.remote(batches[:10]) for rank in ranks], timeout=600)
    after_30 = ray.get([rank.score_many.remote(batches[10:]) for rank in ranks], timeout=600)
    for (rss_10, _), (rss_30, local_30) in zip(after_10, after_30, strict=True):
        # Every unit, the root's embeddings and head included, went back to its shard...
        assert local_30 <= model_bytes / G * 1.05, (local_30, model_bytes)
        # ...and nothing piles up from step to step (unsharded units, logits, KV caches, FSDP's
        # per-forward bookkeeping, heap fragments). One full unsharded copy of the model is
        # ~29 MiB and kept fragments used to grow by half of it; 8 MiB leaves room for the
        # allocator's own arenas, which moved by up to 3 MiB between runs on a loaded machine.
        assert rss_30 - rss_10 <= 8 * 2**20, (rss_10, rss_30)


@pytest.mark.service
def test_tied_gpt2_loads_its_shard_and_scores_like_the_whole_model(
    tmp_path: Path, ranks: list[Any]
) -> None:
    import torch
    import transformers

    from rayeval.service.demo import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "gpt2", arch="gpt2", train_steps=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    reports = _load(ranks, model_dir)
    _assert_holds_its_shard(ranks, reports, model)
    _assert_scores_like(model, ranks)


def _split_bin(model: Any, out: Path, tokenizer_dir: Path, files: int = 3) -> None:
    """Save ``model`` as several ``.bin`` files and their index (transformers 5 writes none)."""
    import torch
    import transformers

    model.config.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    state = model.state_dict()
    names = list(state)
    weight_map = {}
    for i in range(files):
        part = names[i::files]
        file = f"pytorch_model-{i + 1:05d}-of-{files:05d}.bin"
        torch.save({name: state[name].clone() for name in part}, out / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index))


@pytest.mark.service
@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_multi_file_checkpoint_loads_shard_by_shard(
    tmp_path: Path, demo: Any, ranks: list[Any], kind: str
) -> None:
    model_dir = tmp_path / kind
    if kind == "safetensors":
        model = _save_llama(model_dir, demo.model_dir, max_shard_size="2MB")
        assert (model_dir / "model.safetensors.index.json").is_file()
        assert len(list(model_dir.glob("*.safetensors"))) > 2
    else:
        model = _save_llama(tmp_path / "single", demo.model_dir)
        _split_bin(model, model_dir, demo.model_dir)
    _assert_holds_its_shard(ranks, _load(ranks, model_dir), model)


@pytest.mark.service
def test_a_legacy_bin_loads_whole_one_rank_at_a_time(
    tmp_path: Path, demo: Any, ranks: list[Any]
) -> None:
    """A legacy (pre-zip) ``.bin`` cannot be memory-mapped: each rank loads the whole model and
    shards it, but not at once: the second starts once the first holds only its shard, so a
    node holds one whole copy at a time, not G. It scores like the whole model."""
    import re

    import torch

    model = _save_llama(tmp_path / "single", demo.model_dir)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (legacy / name).write_bytes((tmp_path / "single" / name).read_bytes())
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    torch.save(state, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    reports = _load(ranks, legacy)
    windows = []
    for report in reports:
        [(message, at)] = [
            (m, t)
            for m, t in zip(report["warnings"], report["warned_at"], strict=True)
            if FULL_LOAD_WARNING in m
        ]
        assert "cannot be memory-mapped" in message and "safetensors" in message
        seconds = float(re.search(r"in ([0-9.]+) s", message).group(1))  # type: ignore[union-attr]
        windows.append((at - seconds, at))
    (_, first_done), (second_started, _) = sorted(windows)
    assert second_started >= first_done - 0.05, windows  # (the clocks of one node)
    local = [loaded["report"].local_parameters for loaded in reports]
    assert sum(local) == sum(p.numel() for p in model.parameters())
    _assert_scores_like(model, ranks)


@pytest.mark.unit
def test_large_vocabulary_is_cut_into_units_with_bit_identical_logits() -> None:
    """A vocabulary matrix larger than a decoder block becomes row chunks (each its own FSDP unit
    on a CPU rank), shared by a tied head; the cut model's logits are bit-identical to the
    uncut one's for every shape the worker feeds it (a few last positions of a row are a
    non-contiguous slice: torch multiplies those another way when the weight requires grad)."""
    import copy

    import torch
    import transformers

    from rayeval.actors.parallel.fsdp_units import decoder_blocks
    from rayeval.actors.parallel.vocab_chunks import ChunkedEmbedding, ChunkedHead, split_vocabulary

    torch.manual_seed(0)
    llama = _llama_config(vocab_size=3001, hidden_size=64, num_hidden_layers=2)
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=5000)
    for config, tied in ((llama, False), (gpt2, True)):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        cut = copy.deepcopy(model)
        largest = max(sum(p.numel() for p in b.parameters()) for b in decoder_blocks(cut))
        origins = split_vocabulary(cut, largest)
        embed, head = cut.get_input_embeddings(), cut.get_output_embeddings()
        assert isinstance(embed, ChunkedEmbedding) and isinstance(head, ChunkedHead)
        dim = embed.embedding_dim  # chunks of about a block: its rows rounded up to 64
        assert len(embed.parts) > 1
        assert all(p.weight.numel() <= largest + 64 * dim for p in embed.parts)
        assert (list(embed.parts) == list(head.parts)) is tied
        assert len(origins) == len(embed.parts) * (1 if tied else 2)
        # The head multiplies chunk by chunk only where that was found exact on this CPU (with
        # MKL on an AVX2 CPU it is, for chunks of a multiple of 64 rows); both ways must be.
        exact = head.products_by_chunk_are_exact()
        if torch.backends.mkl.is_available() and torch.backends.cpu.get_cpu_capability() == "AVX2":
            assert exact, "chunked head products differ from whole ones under MKL on AVX2"
        for head.by_chunks in sorted({False, exact}):
            for rows, width, keep in [(1, 5, 1), (3, 7, 2), (2, 9, 3), (5, 4, 4), (4, 30, 30)]:
                ids = torch.randint(0, config.vocab_size, (rows, width))
                with torch.no_grad():
                    expected = model(ids, logits_to_keep=keep, use_cache=False).logits
                    got = cut(ids, logits_to_keep=keep, use_cache=False).logits
                assert torch.equal(expected, got), (config.model_type, head.by_chunks, rows, keep)
        # Under autocast (mixed_precision_dtype) too; the head then multiplies once (the check ran
        # in the parameters' dtype, not in autocast's).
        ids = torch.randint(0, config.vocab_size, (3, 7))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(ids, logits_to_keep=2, use_cache=False).logits
            assert torch.equal(expected, cut(ids, logits_to_keep=2, use_cache=False).logits)
        with pytest.raises(IndexError):
            embed(torch.tensor([[config.vocab_size]]))


@pytest.mark.unit
def test_embedding_subclasses_and_small_vocabularies_stay_whole() -> None:
    import transformers

    from rayeval.actors.parallel.vocab_chunks import split_vocabulary

    gemma = transformers.Gemma3TextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=4000,
    )
    model = _meta_model(gemma)  # a scaled embedding (a subclass) tied to the head: neither cut
    assert split_vocabulary(model, 1000) == {}
    small = _meta_model(_llama_config(vocab_size=100, hidden_size=32, num_hidden_layers=2))
    assert split_vocabulary(small, 10**6) == {}
