"""Tokeniser actors (``service/engine/plan/tokenisers.py``): parts tokenised on real Ray actors are
the parts the driver makes itself, token for token; a failing or disagreeing actor hands the
rest back to the driver; an evaluation in parts with them gives lm-eval hf's results."""

from __future__ import annotations

import logging
from array import array
from dataclasses import replace
from typing import Any

import pytest

from rayeval.service.engine.plan.generation_planner import request_seeds
from tests.helpers import assert_same_results, evaluate, hf_reference
from tests.support.workload import generation_instances, mmlu_instances

pytestmark = pytest.mark.usefixtures("ray_session")


def _encoder(demo: Any, **model_args: Any) -> Any:
    from rayeval.service.engine.plan.encoder import build_encoder

    return build_encoder(str(demo.model_dir), {"dtype": "float32", **model_args})[0]


def _score_tokens(encoder: Any, instances: list[Any]) -> Any:
    from rayeval.service.engine.parts.score import score_tokens
    from rayeval.service.engine.plan.checks import Origins, RequestChecks, RequestReport

    checks = RequestChecks(encoder.tok_encode, True, RequestReport(), None)
    pairs = [instance.args for instance in instances]
    return score_tokens(encoder, pairs, Origins(instances), checks)


def _made(tokens: Any, bounds: list[tuple[int, int]], encoder: Any, workers: int) -> Any:
    from rayeval.service.engine.plan.tokenisers import TokeniserPool, made_parts

    with TokeniserPool(encoder, workers) as pool:
        return list(made_parts(bounds, tokens, pool)), pool.tokenised


@pytest.mark.service
def test_loglikelihood_parts_from_actors_are_the_driver_s_own(demo: Any) -> None:
    """MMLU-shaped pairs in parts of 40 (cut where the context changes), each part in chunks
    over two actors: the same tokens, checks and answers as the driver's, its token ids the
    driver's shared ones, a question's choices sharing one context tuple."""
    from rayeval.service.engine.parts.pipeline import part_bounds
    from rayeval.service.engine.plan.encoder import shared_ids

    encoder = _encoder(demo)
    instances = mmlu_instances(400, seed=5)
    tokens = _score_tokens(encoder, instances)
    bounds = list(part_bounds([i.args[0] for i in instances], 40))
    alone, none = _made(tokens, bounds, encoder, 0)
    actors, tokenised = _made(tokens, bounds, encoder, 2)
    assert none == 0 and tokenised == 400 - (bounds[0][1] - bounds[0][0])
    assert len(alone) == len(actors) == len(bounds)
    ids = shared_ids(encoder)._ids
    for own, theirs in zip(alone, actors, strict=True):
        assert (own.start, own.pairs, own.todo, own.fixed) == (
            theirs.start,
            theirs.pairs,
            theirs.todo,
            theirs.fixed,
        )
        assert all(t is ids[t] for context, _ in theirs.pairs for t in context)
        contexts = {id(context) for context, _ in theirs.pairs}
        assert len(contexts) == len(theirs.pairs) // 4, "a question's choices share a context"


def _plans(parts: list[Any], pool: Any, share: bool, max_length: int) -> list[Any]:
    from rayeval.service.engine.parts.score import plan_part
    from rayeval.service.engine.plan.planner import TokenBudget

    budget = TokenBudget(max_tokens=700)
    plans = [plan_part(part, None, budget, share, max_length, pool) for part in parts]
    return [plan() if callable(plan) else plan for plan in plans]


def _same_plans(ours: list[Any], theirs: list[Any]) -> None:
    """The same micro-batches (as a rank receives them), places and answers."""
    import pickle

    def received(batches: list[Any]) -> list[Any]:
        return [pickle.loads(pickle.dumps(mb)) for mb in batches]

    for own, other in zip(ours, theirs, strict=True):
        assert received(other.micro_batches) == received(own.micro_batches)
        assert list(other.places) == list(own.places)
        assert (other.computed, other.given) == (own.computed, own.given)


def _wait_dead(actor: Any, timeout_s: float = 60.0) -> None:
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the actor was not dead within {timeout_s} s")


@pytest.mark.service
def test_parts_planned_by_actors_are_the_driver_s_plans(
    demo: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Each part after the first is planned on an actor, from the actors' own tokens, while the
    next part is made: the same micro-batches, with shared prefixes or without, as planning the
    driver's parts on the driver; actors that died hand the planning back to the driver."""
    import ray

    from rayeval.actors.batches import PickledScoreBatch
    from rayeval.service.engine.parts.pipeline import part_bounds
    from rayeval.service.engine.plan.tokenisers import TokeniserPool, made_parts

    encoder = _encoder(demo)
    instances = mmlu_instances(400, seed=11)
    tokens = _score_tokens(encoder, instances)
    bounds = list(part_bounds([i.args[0] for i in instances], 60))
    alone, _ = _made(tokens, bounds, encoder, 0)
    window = encoder.max_length
    for share in (False, True):
        with TokeniserPool(encoder, 2) as pool:
            theirs = _plans(list(made_parts(bounds, tokens, pool)), pool, share, window)
            assert pool.planned == 400 - bounds[0][1]
        assert all(isinstance(mb, PickledScoreBatch) for p in theirs[1:] for mb in p.micro_batches)
        _same_plans(_plans(alone, None, share, window), theirs)

    caplog.set_level(logging.WARNING, logger="rayeval.service.engine.plan.tokenisers")
    with TokeniserPool(encoder, 2) as pool:
        parts = list(made_parts(bounds, tokens, pool))
        for actor in pool._actors:
            ray.kill(actor, no_restart=True)
        for actor in pool._actors:  # the kill lands asynchronously: wait until it did
            _wait_dead(actor)
        theirs = _plans(parts, pool, True, window)
        assert pool.planned == 0 and not pool.working
    _same_plans(_plans(alone, None, True, window), theirs)
    assert "the driver tokenises, plans and decodes the rest itself" in caplog.text


@pytest.mark.service
def test_generation_parts_from_actors_are_the_driver_s_own(demo: Any) -> None:
    from rayeval.service.engine.parts.generate import Prompts
    from rayeval.service.engine.parts.pipeline import even_bounds

    encoder = _encoder(demo)
    instances = generation_instances(100, seed=6, max_gen_toks=8)
    bounds = list(even_bounds(len(instances), 16))
    alone, _ = _made(Prompts(encoder, instances).tokens(), bounds, encoder, 0)
    actors, tokenised = _made(Prompts(encoder, instances).tokens(), bounds, encoder, 3)
    assert tokenised == 100 - 16
    # An actor's contexts arrive as 32-bit buffers (the driver makes no int per id): the same
    # ids, and the same sampling seeds as the driver's tuples.
    assert all(isinstance(r.context, array) for p in actors[1:] for r in p.requests)
    assert _tuples(alone) == _tuples(actors)
    theirs = [replace(r, kwargs={"do_sample": True}) for p in actors for r in p.requests]
    ours = [replace(r, kwargs={"do_sample": True}) for p in alone for r in p.requests]
    assert request_seeds(theirs, 7) == request_seeds(ours, 7)


def _tuples(parts: list[Any]) -> list[Any]:
    """Made parts with every context as a tuple (an actor's arrive as ``array('i')``)."""
    return [
        (p.start, [replace(r, context=tuple(r.context)) for r in p.requests], p.names)
        for p in parts
    ]


@pytest.mark.service
def test_a_lost_or_disagreeing_actor_hands_the_rest_to_the_driver(
    demo: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An actor killed while parts wait on it, and actors whose encoder adds a BOS token
    (their tokens differ from the driver's): every part is still made, equal to the driver's
    own, the rest by the driver, and the warning says why."""
    import ray

    from rayeval.service.engine.parts.generate import Prompts
    from rayeval.service.engine.parts.pipeline import even_bounds
    from rayeval.service.engine.plan.tokenisers import TokeniserPool, made_parts

    encoder = _encoder(demo)
    instances = generation_instances(80, seed=7, max_gen_toks=8)
    bounds = list(even_bounds(len(instances), 10))
    alone, _ = _made(Prompts(encoder, instances).tokens(), bounds, encoder, 0)
    expected = _tuples(alone)
    caplog.set_level(logging.WARNING, logger="rayeval.service.engine.plan.tokenisers")

    with TokeniserPool(encoder, 2) as pool:
        parts = made_parts(bounds, Prompts(encoder, instances).tokens(), pool)
        made = [next(parts), next(parts)]  # the second part came from the actors
        ray.kill(pool._actors[0], no_restart=True)
        made += list(parts)
        assert 0 < pool.tokenised < 80 - 10 and not pool.working
    assert _tuples(made) == expected
    assert "ActorDiedError" in caplog.text or "RayActorError" in caplog.text

    caplog.clear()
    other = _encoder(demo, add_bos_token=True)
    with TokeniserPool(other, 2) as pool:
        made = list(made_parts(bounds, Prompts(encoder, instances).tokens(), pool))
        assert pool.tokenised == 0
    assert _tuples(made) == expected
    assert "tokenised differently by an actor" in caplog.text


def _answers(encoder: Any, count: int) -> list[tuple[int, ...]]:
    """Generated ids as a model might return them: some run into a stop string."""
    texts = [" 42", " 7 apples\n\nQuestion: and", " none. Question: more", " the end"]
    return [tuple(encoder.tok_encode(texts[i % len(texts)] * (1 + i % 3))) for i in range(count)]


@pytest.mark.service
def test_answers_decoded_by_actors_are_the_driver_s_own(
    demo: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Parts' answers decoded on two actors are the driver's texts (stop strings cut); an actor
    that decodes otherwise (another think_end_token), or actors killed before the last part's
    texts are read, leave the rest to the driver, same texts, and the warning says why."""
    import ray

    from rayeval.service.engine.parts.generate import Prompts
    from rayeval.service.engine.plan.tokenisers import TokeniserPool

    encoder = _encoder(demo)
    instances = generation_instances(40, seed=8, max_gen_toks=8)
    prompts = Prompts(encoder, instances)
    prompts.make(0, len(instances))  # the requests' stop strings
    answers = _answers(encoder, len(instances))
    expected = prompts.decode(list(answers))
    assert any("Question" in a for a in map(encoder.tok_decode, answers))
    assert not any("Question" in text for text in expected)
    caplog.set_level(logging.WARNING, logger="rayeval.service.engine.plan.tokenisers")

    def decode(pool: Any, kill: bool = False) -> tuple[list[str], int]:
        decoding = prompts.decoding(pool)
        for start in range(0, len(instances), 10):  # four parts, finished out of order
            decoding.finished(list(range(start, start + 10))[::-1], list(answers))
        if kill:
            for actor in pool._actors:
                ray.kill(actor, no_restart=True)
        return decoding.texts(list(answers)), decoding.decoded

    with TokeniserPool(encoder, 2) as pool:
        assert decode(pool) == (expected, len(instances))
    with TokeniserPool(_encoder(demo, think_end_token=" Question"), 2) as pool:
        assert decode(pool) == (expected, 0)
    assert "answer was decoded differently" in caplog.text
    caplog.clear()
    with TokeniserPool(encoder, 2) as pool:  # parts read before the kill stay the actors'
        texts, decoded = decode(pool, kill=True)
        assert texts == expected and decoded < len(instances)
    assert "the driver tokenises, plans and decodes the rest itself" in caplog.text


@pytest.mark.e2e
def test_an_evaluation_tokenised_by_actors_matches_lm_eval_hf(demo: Any, task_manager: Any) -> None:
    """Loglikelihood and generation in parts of 8, the parts after the first tokenised by two
    actors: lm-eval hf's results per sample."""
    from rayeval.service.engine.lm import RayEvalLM
    from rayeval.service.engine.parts.pipeline import Tunables

    run = {"limit": 8, "bootstrap_iters": 0, "num_fewshot": 1}
    tasks = ["demo_mc", "demo_gen_short"]
    reference = hf_reference(demo.model_dir, task_manager, tasks, **run)
    with RayEvalLM(
        pretrained=str(demo.model_dir),
        dtype="float32",
        tokenizer_workers=2,
        batch_size=2,
        tunables=Tunables(score_part=8, generate_part=3),
    ) as lm:
        ours = evaluate(lm, task_manager, tasks, **run)
        figures = {phase: stats.report() for phase, stats in lm.engine.stats.items()}
    for phase in ("loglikelihood", "generate_until"):
        assert 0 < figures[phase]["tokenised_by_actors"] < figures[phase]["requests"], phase
    scored, generated = figures["loglikelihood"], figures["generate_until"]
    assert scored["planned_by_actors"] == scored["tokenised_by_actors"]
    assert generated["decoded_by_actors"] == generated["requests"]  # every part's, the first's too
    assert_same_results(reference, ours)


def _needs(encoder: Any, instances: list[Any]) -> list[int]:
    from rayeval.service.engine.plan.encoder import generate_requests

    requests = generate_requests(encoder, [i.args for i in instances], "</s>")
    return [len(r.context) + r.max_gen_toks for r in requests]


@pytest.mark.service
def test_an_unfit_request_is_refused_as_the_planner_would_without_tokenising_all(
    demo: Any,
) -> None:
    """``refuse_unfit`` refuses exactly what planning the parts would (the same request, the
    same message) for budgets around every request's need, and passes every budget at or above
    the largest."""
    from rayeval.actors.errors import ConfigError
    from rayeval.service.engine.parts.generate import Prompts
    from rayeval.service.engine.plan.generation_planner import SlotBudget, check_fits

    encoder = _encoder(demo)
    instances = generation_instances(60, seed=8, max_gen_toks=8, question_words=(2, 60))
    prompts = Prompts(encoder, instances)
    requests = prompts.make(0, len(instances))
    needs = _needs(encoder, instances)
    assert len(set(needs)) > 5 and max(needs) <= encoder.max_length
    for kv_tokens in [*sorted(set(needs))[::3], max(needs) - 1, max(needs), 10_000]:
        budget = SlotBudget(slots=4, kv_tokens=kv_tokens, setting="--kv_cache_tokens")
        planned: str | None = None
        try:
            check_fits(requests.requests, budget, requests.names)
        except ConfigError as exc:
            planned = str(exc)
        try:
            prompts.refuse_unfit(budget)
            early = None
        except ConfigError as exc:
            early = str(exc)
        assert early == planned, kv_tokens
        assert (planned is None) == (kv_tokens >= max(needs))


@pytest.mark.e2e
def test_a_request_unfit_for_the_kv_budget_in_a_later_part_is_refused_before_any_batch(
    demo: Any,
) -> None:
    """In parts of 8, a request of the fourth part needs more KV cache than the budget, which
    fits every request of the first three: refused, naming it, before any group ran."""
    from rayeval.actors.errors import ConfigError
    from rayeval.service.engine.lm import RayEvalLM
    from rayeval.service.engine.parts.pipeline import Tunables

    instances = generation_instances(40, seed=9, max_gen_toks=8, question_words=(2, 25))
    needs = _needs(_encoder(demo), instances)
    instances[30] = generation_instances(1, seed=10, max_gen_toks=8, question_words=(90, 90))[0]
    instances[30].doc_id = 30
    with RayEvalLM(
        pretrained=str(demo.model_dir),
        dtype="float32",
        kv_cache_tokens=max(needs),
        tunables=Tunables(generate_part=8),
    ) as lm:
        with pytest.raises(ConfigError, match=r"doc 30 needs \d+ KV-cache.*--kv_cache_tokens"):
            lm.generate_until(instances, disable_tqdm=True)
        assert lm.engine.input_token_counts().calls == 0
