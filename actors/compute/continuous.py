"""Continuous batching on a rank: a row leaves as soon as it stops, the next request takes its slot.

lm-eval's HF backend (and ``generate``) decodes a static batch until its longest row is done;
every row that stopped earlier is still computed at every step. Here a :class:`GenerateGroup`'s
requests flow through ``slots`` rows instead: each step admits the next requests while slots
and the KV-cache budget allow (their prompts prefilled together, left-padded, as ``generate``
prefills a batch), decodes one token for every live row, and drops the rows that stopped, their
answers streamed back at once (:class:`GenerationPiece`). The rows' KV caches live in one
transformers ``DynamicCache``, left-padded to a common length and masked, as ``generate`` holds a
left-padded batch; columns no live row uses any more are trimmed.

A row stops exactly where lm-eval's answer is settled: on an EOS token (``generate`` pads the row
from there), after ``max_gen_toks`` tokens, or once one of its stop strings appears in its
decoded text (lm-eval cuts its answer at the first stop string: what follows never reaches the
answer; any of several EOS ids stops it, as ``generate``'s). Every step applies ``generate``'s own
logits processors to the float32 logits (the model's generation config included: its
``generation_config.json`` settings), then takes the argmax (greedy) or draws from the request's
own generator (sampling), so a sampled answer is the same whatever rows share its steps.
Processors that read the scores alone run over all rows at once; those that read the input ids
(repetition penalty, n-gram bans, a least number of new tokens) run row by row on that row's own
tokens, its context plus what it generated (:mod:`rayeval.actors.compute.logits_setup` says which
ids each reads, and why that gives ``generate``'s scores).

The ranks of a replica that each compute their own group (FSDP) step together: before every
step they agree, with one small all-reduce, on whether anyone admits or decodes, and a rank with
nothing of its own runs a dummy forward, so every rank issues the same collectives. Ranks that
compute one group together (tensor parallelism) see the same logits and so make the same
decisions without agreeing. Which requests a group holds, the slots and
the budget come from the driver's plan, so a request's steps never depend on the layout or on
timing (unless a rank's memory holds less than the plan's budget: then the driver lowers it and
warns). :func:`unsupported` says when this engine cannot give ``generate``'s tokens (beams,
processors it does not reproduce, other cache kinds): the driver then uses the static path and
records why (the phase's ``batching`` figure, and the log).
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rayeval.actors.batches import (
    GenerateGroup,
    GenerationPiece,
    SlotRequest,
    piece_due,
)
from rayeval.actors.compute.logits_setup import GENERATED, SCORES, sampling_setup
from rayeval.actors.compute.rank_model import RankModel


def unsupported(model: Any, kwargs: dict[str, Any]) -> str | None:
    """Why a group with these generation settings cannot run here, or None when it can."""
    setup = sampling_setup(model, kwargs)
    if isinstance(setup, str):
        return setup
    layers = DynamicCache(config=model.config).layers
    if any(type(layer) is not DynamicLayer for layer in layers):
        return "the model's KV cache is not a plain dynamic cache (sliding windows?)"
    if not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        return "transformers' dynamic cache layers no longer hold keys and values"
    return None


@dataclass
class _Row:
    """One request in a slot."""

    position: int
    request: SlotRequest
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    #: Its context then generated tokens, room for all (only where a processor reads ids).
    history: torch.Tensor | None = None

    def ids(self, reads: str) -> torch.Tensor:
        """The ids a processor reads (``TOKENS`` or ``GENERATED``: :mod:`.logits_setup`), as a
        1-row batch."""
        assert self.history is not None
        start = len(self.request.context) if reads == GENERATED else 0
        return self.history[None, start : len(self.request.context) + len(self.generated)]

    @property
    def next_position(self) -> int:
        """Position id of the row's next input token (its last generated one)."""
        return len(self.request.context) + len(self.generated) - 1


class ContinuousGenerator:
    """Generates one group's requests on one rank (see the module docstring).

    Args:
        rank: The rank's loaded model.
        group: The group (empty: a dummy that steps with the replica's other ranks).
        synced: Whether the replica's other ranks run groups of their own, to step together with
            (FSDP; tensor-parallel ranks run the same group and decide alike).
        piece_interval_s: Least seconds between two pieces (:func:`piece_due`).
    """

    def __init__(
        self, rank: RankModel, group: GenerateGroup, synced: bool, piece_interval_s: float = 0.0
    ) -> None:
        self._rank = rank
        self._group = group
        self._synced = synced
        self._piece_interval_s = piece_interval_s
        self._pending = deque(range(len(group.requests)))
        self._rows: list[_Row] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=rank.device)
        self._finished: list[tuple[int, tuple[int, ...]]] = []
        self._fed = self._real = 0
        self._busy_s = 0.0
        self._sent = time.monotonic()  # when the last piece went out
        setup = sampling_setup(rank.model, group.kwargs) if group.requests else None
        if isinstance(setup, str):
            raise ValueError(f"this group cannot be generated here: {setup}")
        self._eos = setup.eos if setup else set()
        self._sample = bool(setup and setup.config.do_sample)
        self._processors = setup.processors if setup else ()
        self._history = bool(setup and setup.reads_ids)
        self._lookbacks: dict[tuple[str, ...], int] = {}
        accepted = inspect.signature(rank.model.forward).parameters
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}

    def run(self) -> Iterator[GenerationPiece]:
        """Step until every rank of the replica is done; a piece whenever requests finish."""
        with self._rank.computing():
            while True:
                admit = self._admissible()
                wants = [int(bool(admit)), int(bool(admit) or bool(self._rows))]
                prefill, decode = self._agree(wants)
                if not decode:
                    break
                started = time.monotonic()
                if prefill:
                    self._prefill(admit)
                self._decode()
                self._busy_s += time.monotonic() - started
                if self._piece_due():
                    yield self._piece()
        if self._finished or self._fed:
            yield self._piece()

    # ------------------------------------------------------------------------------ steps
    def _admissible(self) -> list[int]:
        """The next requests in order to prefill together (:meth:`GenerateGroup.admit`)."""
        return self._group.admit([row.position for row in self._rows], self._pending)

    def _agree(self, wants: list[int]) -> tuple[bool, bool]:
        """Whether any rank of the replica prefills, and whether any still works."""
        if self._synced:
            flags = torch.tensor(wants, dtype=torch.int32, device=self._rank.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            wants = [int(v) for v in flags.tolist()]
        return bool(wants[0]), bool(wants[1])

    def _prefill(self, admit: list[int]) -> None:
        """Prefill the admitted requests together (left-padded) and give each its first token."""
        if not admit:
            self._dummy_forward()
            return
        for position in admit:
            self._pending.remove(position)
        rows = [self._new_row(position) for position in admit]
        contexts = [row.request.context for row in rows]
        width = max(len(context) for context in contexts)
        pad = self._rank.spec.pad_token_id
        device = self._rank.device
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, context in enumerate(contexts):
            ids[i, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            mask[i, width - len(context) :] = 1
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = DynamicCache(config=self._rank.model.config)
        logits = self._forward(ids.to(device), mask.to(device), positions.to(device), cache)
        self._count(ids.numel(), int(mask.sum()))  # (a host tensor: no device sync)
        self._join(rows, cache, mask.to(device))
        self._advance(logits, first=len(self._rows) - len(rows))

    def _decode(self) -> None:
        """One token for every live row (a dummy forward when this rank has none)."""
        if not self._rows:
            self._dummy_forward()
            return
        device = self._rank.device
        ids = torch.tensor([[row.generated[-1]] for row in self._rows], device=device)
        positions = torch.tensor([[row.next_position] for row in self._rows], device=device)
        ones = torch.ones((len(self._rows), 1), dtype=torch.long, device=device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        logits = self._forward(ids, self._mask, positions, self._cache)
        self._count(len(self._rows), len(self._rows))
        self._advance(logits, first=0)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """The model's float32 logits at each row's last position, as ``generate`` takes them."""
        model = self._rank.model
        output = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **self._keep_last,
        )
        self._rank.strategy.after_forward(model)
        return output.logits[:, -1].to(copy=True, dtype=torch.float32)

    def _dummy_forward(self) -> None:
        """One padding token through the model, so that this rank's collectives line up."""
        pad = torch.full((1, 1), self._rank.spec.pad_token_id, device=self._rank.device)
        self._rank.model(input_ids=pad, use_cache=False, **self._keep_last)
        self._rank.strategy.after_forward(self._rank.model)
        self._fed += 1

    # --------------------------------------------------------------------------- rows
    def _new_row(self, position: int) -> _Row:
        request = self._group.requests[position]
        generator = None
        if self._sample:
            generator = torch.Generator(device=self._rank.device)
            generator.manual_seed(request.seed if request.seed is not None else 0)
        history = None
        if self._history:
            history = torch.zeros(request.kv_tokens, dtype=torch.long, device=self._rank.device)
            history[: len(request.context)] = torch.tensor(request.context, dtype=torch.long)
        return _Row(position, request, generator=generator, history=history)

    def _advance(self, logits: torch.Tensor, first: int) -> None:
        """Append the next token of the live rows from ``first`` on (``logits``: theirs, in
        order); drop the rows that stopped, keeping their answers."""
        rows = self._rows[first:]
        stopped = set()
        for offset, (row, token) in enumerate(zip(rows, self._choose(rows, logits), strict=True)):
            row.generated.append(token)
            if row.history is not None:
                row.history[len(row.request.context) + len(row.generated) - 1] = token
            if self._stopped(row):
                self._finished.append((row.position, tuple(row.generated)))
                stopped.add(first + offset)
        if stopped:
            self._keep_rows([i for i in range(len(self._rows)) if i not in stopped])

    def _choose(self, rows: Sequence[_Row], logits: torch.Tensor) -> list[int]:
        """Each row's next token after ``generate``'s processors: the argmax (greedy), or a
        draw from its own generator (sampling); read back to the host once for all rows."""
        scores = self._process(rows, logits)
        if not self._sample:
            return [int(t) for t in torch.argmax(scores, dim=-1).tolist()]
        probs = torch.softmax(scores, dim=-1)
        draws = [torch.multinomial(probs[i], 1, generator=r.generator) for i, r in enumerate(rows)]
        return [int(t) for t in torch.cat(draws).tolist()]

    def _process(self, rows: Sequence[_Row], logits: torch.Tensor) -> torch.Tensor:
        """The processors in ``generate``'s order: those that read the scores alone over all
        rows at once, those that read ids row by row, each on its row's own ids."""
        no_ids = torch.zeros((len(rows), 0), dtype=torch.long, device=logits.device)
        for processor, reads in self._processors:
            if reads == SCORES:
                logits = processor(no_ids, logits)
            else:
                logits = torch.cat(
                    [processor(row.ids(reads), logits[i : i + 1]) for i, row in enumerate(rows)]
                )
        return logits

    def _stopped(self, row: _Row) -> bool:
        """EOS, ``max_gen_toks``, or a stop string in the decoded text (lm-eval's answer is
        cut at the first one, so it is settled).

        The decoded text is checked only when a stop string shows in the last few tokens'
        text (a cheap look, as lm-eval's own stopping criteria take): a look that misses one
        only lets the row run on, and lm-eval's cut at the first stop string gives the same
        answer; the row stops only once the whole text, decoded as lm-eval decodes it, has one.
        """
        if row.generated[-1] in self._eos or len(row.generated) >= row.request.max_gen_toks:
            return True
        stops = [stop for stop in row.request.until if stop]
        if not stops:
            return False
        tail = self._quick_decode(row.generated[-self._lookback(stops) :])
        if not any(stop in tail for stop in stops):
            return False
        text = self._rank.tokenizer.decode(row.generated, skip_special_tokens=True)
        return any(stop in text for stop in stops)

    def _lookback(self, stops: list[str]) -> int:
        """Tokens to look back: each stop string's own tokens plus two, as lm-eval looks."""
        key = tuple(stops)
        if key not in self._lookbacks:
            encode = self._rank.tokenizer.encode
            self._lookbacks[key] = max(len(encode(s, add_special_tokens=False)) for s in stops) + 2
        return self._lookbacks[key]

    def _quick_decode(self, tokens: list[int]) -> str:
        """The tokens' text from the fast tokenizer's backend (no cleanup), else decode."""
        backend = getattr(self._rank.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return str(backend.decode(tokens, skip_special_tokens=True))
        return str(self._rank.tokenizer.decode(tokens, skip_special_tokens=True))

    # --------------------------------------------------------------------------- cache
    def _join(self, rows: list[_Row], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add prefilled rows to the live batch: caches and masks left-padded to one length."""
        if self._cache is None or not self._rows:
            self._rows, self._cache, self._mask = list(rows), cache, mask
            return
        width = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(_layers(self._cache), _layers(cache), strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
        self._mask = torch.cat([_left_pad(self._mask, width), _left_pad(mask, width)])
        self._rows += rows

    def _keep_rows(self, keep: list[int]) -> None:
        """Only the rows at ``keep`` stay live; columns no live row uses are trimmed."""
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, self._mask[:0, :0]
            return
        assert self._cache is not None
        index = torch.tensor(keep, device=self._mask.device)
        self._mask = self._mask[index]
        first = int(self._mask.argmax(dim=1).min())  # the earliest column a live row uses
        for layer in _layers(self._cache):
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]
        self._mask = self._mask[:, first:]

    # --------------------------------------------------------------------------- figures
    def _count(self, fed: int, real: int) -> None:
        self._fed += fed
        self._real += real

    def _piece_due(self) -> bool:
        since = time.monotonic() - self._sent
        return piece_due(len(self._finished), self._group.slots, since, self._piece_interval_s)

    def _piece(self) -> GenerationPiece:
        # step_stats counts seconds from `started`: the busy seconds since the last piece.
        stats = self._rank.step_stats(self._real, self._fed, time.monotonic() - self._busy_s)
        piece = GenerationPiece(tuple(self._finished), stats)
        self._finished, self._fed, self._real, self._busy_s = [], 0, 0, 0.0
        self._sent = time.monotonic()
        return piece


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers (plain dynamic layers: :func:`unsupported` checked), whose ``keys``
    and ``values`` tensors are [rows, heads, positions, head dim]."""
    return list(cache.layers)


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``tensor`` with zero columns added on the left of its sequence dimension up to ``width``
    (dim -2 of a cache tensor [rows, heads, seq, dim], dim 1 of a mask [rows, seq])."""
    dim = 1 if tensor.dim() == 2 else -2
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def generate_group(
    rank: RankModel, group: GenerateGroup, synced: bool, piece_interval_s: float = 0.0
) -> Iterator[GenerationPiece]:
    """Stream a group's answers as its requests finish (:class:`ContinuousGenerator`)."""
    yield from ContinuousGenerator(rank, group, synced, piece_interval_s).run()
