"""The driver at many replicas: simulated ranks on a real Ray cluster, bulk tokenisation, parts.

The simulated rank (``tests/support/sim_rank.py``) is the real rank actor's interface with a
modelled step; every answer is a function of its own request, so the tests can say, per request,
whether the driver delivered its answer exactly once and to the right request, whatever the layout
(R = 8, 1, 3), with a plan made in parts (loglikelihood and generation), and with a replica
lost mid-run. The cluster runs in
a subprocess (``tests/sim_driver_cluster.py``): it needs 12 logical CPUs, the session's Ray has 4.
The other tests: lm-eval's own tokenisation against the driver's bulk one, part boundaries, the
dispatcher's call sizes, sampling seeds across parts, and a real model scored and generating in
parts against lm-eval's ``hf``.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    assert_same_results,
    evaluate,
    hf_reference,
    kill_processes_naming,
    stop_process_group,
)

REPO = Path(__file__).resolve().parents[1]
CLUSTER_RUN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def sim_report(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run tests/sim_driver_cluster.py; return what it recorded."""
    out = tmp_path_factory.mktemp("sim-driver")
    report, log = out / "report.json", out / "cluster.log"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))  # short: Ray's socket paths
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(ray_tmp)
    command = [sys.executable, "-m", "tests.sim_driver_cluster", "--report", str(report),
               "--model-dir", str(demo.model_dir), "--work", str(out)]  # fmt: skip
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            process.wait(timeout=CLUSTER_RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_process_group(process)
        finally:
            kill_processes_naming(str(ray_tmp))
            shutil.rmtree(ray_tmp, ignore_errors=True)
    if process.returncode != 0 or not report.exists():
        tail = log.read_text(errors="replace")[-6000:]
        pytest.fail(f"the simulated cluster run failed (exit {process.returncode}):\n{tail}")
    return json.loads(report.read_text())


@pytest.mark.e2e
def test_every_request_gets_its_own_answer_once_in_every_layout(
    sim_report: dict[str, Any],
) -> None:
    expected, runs = sim_report["expected"], sim_report["runs"]
    for name in ("R8", "R1", "R3", "R8-parts"):
        assert runs[name]["loglikelihood"] == expected, f"{name}: an answer went astray"
        figures = runs[name]["stats"]["loglikelihood"]
        # Each micro-batch was computed once: the ranks saw as many calls as the plan has.
        assert runs[name]["calls"] == figures["micro_batches"], name
        assert figures["requests"] == len(expected)
    plans = {runs[name]["stats"]["loglikelihood"]["micro_batches"] for name in ("R8", "R1", "R3")}
    assert len(plans) == 1, f"the plan depends on the layout: {plans}"
    assert runs["R8-parts"]["stats"]["loglikelihood"]["micro_batches"] > plans.pop()


@pytest.mark.e2e
def test_generations_do_not_depend_on_the_layout_or_batching(sim_report: dict[str, Any]) -> None:
    runs = sim_report["runs"]
    reference = runs["R1"]["generate_until"]
    assert len(reference) == 160 and len(set(reference)) > 100
    for name in ("R8", "R3", "R8-static", "R3-static", "R8-lost"):
        assert runs[name]["generate_until"] == reference, name
    assert runs["R8"]["stats"]["generate_until"]["batching"] == "continuous"
    assert runs["R8-static"]["stats"]["generate_until"]["batching"] == "static"
    static = runs["R8-static"]["stats"]["generate_until"]["micro_batches"]
    assert runs["R8-static"]["calls"] == runs["R3-static"]["calls"] == static


@pytest.mark.e2e
def test_generations_in_parts_come_once_and_do_not_depend_on_the_layout(
    sim_report: dict[str, Any],
) -> None:
    runs = sim_report["runs"]
    reference = runs["R1"]["generate_until"]
    for name, batching in (("R8-parts", "continuous"), ("R3-parts", "continuous"),
                           ("R3-parts-static", "static")):  # fmt: skip
        assert runs[name]["generate_until"] == reference, f"{name}: an answer went astray"
        figures = runs[name]["stats"]["generate_until"]
        assert figures["batching"] == batching and figures["requests"] == len(reference)
    groups = {
        runs[name]["stats"]["generate_until"]["micro_batches"] for name in ("R8-parts", "R3-parts")
    }
    # Seven parts of at most 24 requests: a group each (32 requests fit one), not one plan's 5.
    assert groups == {7} != {runs["R8"]["stats"]["generate_until"]["micro_batches"]}
    static = runs["R3-parts-static"]["stats"]["generate_until"]["micro_batches"]
    assert runs["R3-parts-static"]["calls"] == static


@pytest.mark.e2e
def test_a_lost_replicas_work_is_rerun_elsewhere(sim_report: dict[str, Any]) -> None:
    lost = sim_report["runs"]["R8-lost"]
    assert lost["killed"], "no replica was killed"
    assert lost["loglikelihood"] == sim_report["expected"]
    utilisation = lost["stats"]["loglikelihood"]["replica_utilisation"]
    assert len(utilisation) == 8 and sum(1 for u in utilisation.values() if u > 0) >= 7


@pytest.mark.service
def test_bulk_tokenisation_is_lm_evals(demo: Any) -> None:
    """encode_pairs against lm-eval's own TemplateLM.loglikelihood tokenisation."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM

    from rayeval.service.engine.plan.encoder import build_encoder, encode_pairs

    encoder, _ = build_encoder(str(demo.model_dir), {})
    pairs = [
        ("The cat sat on the", " mat"), ("The cat sat on the", " hat"),
        ("Question: 2+2?\nAnswer:", " 4"), ("trailing space ", "word"),
        ("", "Once upon a time"), ("<s>already a bos", " yes"), ("model\n", "yes"),
        ("émigré naïve", " café"), ("a", " b c d e f"), ("   ", "x"),
    ]  # fmt: skip
    captured: list[Any] = []

    def capture(requests: list[Any], **_: Any) -> list[Any]:
        captured.extend(requests)
        return [(0.0, True)] * len(requests)

    encoder._loglikelihood_tokens = capture  # type: ignore[method-assign]
    instances = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=0) for pair in pairs
    ]
    TemplateLM.loglikelihood(encoder, instances)
    encoded = encode_pairs(encoder, pairs)
    assert [(list(c), list(k)) for c, k in encoded.pairs] == [
        (list(c), list(k)) for _, c, k in captured
    ]
    for index, ((context, cont), ctx, _) in enumerate(captured):
        if context.strip():  # engine.checks' merged-boundary test, without a second encoding
            merged = encoder.tok_encode(context + cont)[: len(ctx)] != list(ctx)
            assert encoded.merged[index] == merged, pairs[index]
    assert encoded.pairs[0][0] is encoded.pairs[1][0], "choices of one context share its tokens"


@pytest.mark.service
def test_generation_tokenisation_is_lm_evals(demo: Any) -> None:
    """generate_request against lm-eval's tok_batch_encode of each context alone (its rules for
    a batch of one, left-truncated to max_length - max_gen_toks), and its settings."""
    from rayeval.service.engine.plan.encoder import build_encoder, generate_request

    encoder, _ = build_encoder(str(demo.model_dir), {})
    long_context = " ".join(["word"] * (encoder.max_length + 50))
    requests = [
        ("Question: 2+2?\nAnswer:", {"until": ["\n"], "do_sample": False, "max_gen_toks": 16}),
        ("<s>already a bos", {"until": ["\n"], "do_sample": False, "max_gen_toks": 16}),
        ("émigré naïve", {"until": "END", "max_gen_toks": 7}),
        (long_context, {"until": ["\n"], "max_gen_toks": 40, "max_length": 99}),
        ("Question: 2+2?\nAnswer:", {"max_gen_toks": 16, "do_sample": False, "until": ["\n"]}),
    ]  # fmt: skip
    eos = encoder.tok_decode(encoder.eot_token_id, skip_special_tokens=False)
    ours = [generate_request(encoder, context, kwargs, eos) for context, kwargs in requests]
    for (context, _), request in zip(requests, ours, strict=True):
        budget = encoder.max_length - request.max_gen_toks
        ids, _ = encoder.tok_batch_encode([context], left_truncate_len=budget,
                                          truncation=encoder.truncation)  # fmt: skip
        assert list(request.context) == ids[0].tolist(), context[:30]
    assert [r.max_gen_toks for r in ours] == [16, 16, 7, 40, 16]
    assert ours[2].until == ("END", eos) and ours[3].max_length == 99
    assert len(ours[3].context) == encoder.max_length - 40
    assert ours[0].context == ours[4].context and ours[0].kwargs == ours[4].kwargs


@pytest.mark.unit
def test_parts_keep_a_contexts_requests_together() -> None:
    from rayeval.service.engine.parts.pipeline import part_bounds

    contexts = ["a"] * 3 + ["b"] * 4 + ["c"] + ["d"] * 2
    assert list(part_bounds(contexts, 2)) == [(0, 3), (3, 7), (7, 10)]
    assert list(part_bounds(contexts, 1)) == [(0, 3), (3, 7), (7, 8), (8, 10)]
    assert list(part_bounds(contexts, 100)) == [(0, 10)]
    assert list(part_bounds([], 4)) == []
    # A smaller first part (the driver's own, while tokeniser actors start), then parts of size.
    assert list(part_bounds(contexts, 4, first=1)) == [(0, 3), (3, 7), (7, 10)]
    assert list(part_bounds(contexts, 2, first=5)) == [(0, 3), (3, 7), (7, 10)]
    assert list(part_bounds(["x"] * 3 + list("abcdefg"), 3, first=4)) == [
        (0, 3), (3, 6), (6, 9), (9, 10)
    ]  # fmt: skip


@pytest.mark.unit
def test_calls_grow_once_timed_and_shrink_as_the_queue_drains() -> None:
    from rayeval.service.engine.dispatch.dispatcher import CALL_SECONDS, CallSizer

    sizer = CallSizer()
    assert sizer.size(pending=10_000, calls=16, replica=0) == 1  # first results after one step
    sizer.timed(0.02)
    # Twice the replica's last call at most: 2, 4, 8, 16, then CALL_SECONDS of steps.
    grown = [sizer.size(pending=10_000, calls=16, replica=0) for _ in range(6)]
    assert grown == [2, 4, 8, 16, int(CALL_SECONDS / 0.02), int(CALL_SECONDS / 0.02)]
    assert sizer.size(pending=10_000, calls=16, replica=1) == 2  # each replica its own
    assert sizer.size(pending=64, calls=16, replica=0) == 4  # the queue's share
    assert sizer.size(pending=3, calls=16, replica=0) == 1


@pytest.mark.unit
def test_a_replicas_time_is_split_by_what_it_waited_for() -> None:
    from tests.support.timeline import SHARES, time_shares

    sent = {0: [0.0, 0.0, 1.5], 1: [0.2], 2: [0.0, 0.1]}
    calls = {
        # Ran 0.1 after it was sent; the second was queued; the third sent 0.1 after the second
        # ended, and ran 0.1 later still.
        0: [(0.1, 1.0, 0.8), (1.05, 1.4, 0.3), (1.6, 2.0, 0.4)],
        1: [(0.3, 1.8, 1.5)],  # its first call sent late, then nothing more: a tail of 0.2
        2: [(0.0, 9.0, 9.0)],  # a call lost: sent and ran counts differ, left out
    }
    shares = time_shares(sent, calls)
    assert list(shares) == list(SHARES)
    expected = {"computing": 3.0, "rank_overhead": 0.15, "waiting_for_driver": 0.3,
                "sent_not_running": 0.35, "tail": 0.2}  # fmt: skip
    assert shares == pytest.approx({key: value / 4.0 for key, value in expected.items()})
    assert time_shares({}, {}) == dict.fromkeys(SHARES, 0.0)


@pytest.mark.unit
def test_the_heap_is_frozen_while_request_types_run_and_unfrozen_after_the_last() -> None:
    import gc
    import weakref

    from rayeval.service.engine.dispatch import heap

    def frozen(objects: list[Any]) -> bool:  # in the permanent generation: no pass walks them
        walked = {id(o) for o in gc.get_objects()}  # generations 0-2, not the permanent one
        return not any(id(o) in walked for o in objects)

    # Checked by which objects are frozen, not by gc.get_freeze_count(): other threads of a long
    # test session free frozen objects meanwhile, and the count falls by them.
    gc.unfreeze()
    before = [[i] for i in range(10)]
    heap.settle()  # outside a running request type: nothing is frozen
    assert gc.get_freeze_count() == 0
    with heap.frozen_while_running():
        assert frozen(before)
        held = [[i] for i in range(1000)]  # a part's objects, tracked by the collector
        assert not frozen(held[:1])
        heap.settle()
        assert frozen(held)
        answers = [[i] for i in range(1000)]
        heap.settle(every_s=3600.0)  # the last freeze was under an hour ago: not yet
        assert not frozen(answers[:1])
        heap.settle(every_s=0.0)
        assert frozen(answers)
        with heap.frozen_while_running():  # another request type in the same process
            pass
        assert frozen(before + held + answers)  # still frozen: the first has not ended
    assert gc.get_freeze_count() == 0
    assert not frozen(before[:1]) and not frozen(answers[-1:])
    cycle = _Node()
    cycle.next = cycle
    alive = weakref.ref(cycle)
    with heap.frozen_while_running():
        del cycle
        gc.collect()
        assert alive() is not None  # frozen: no pass walks it
    gc.collect()
    assert alive() is None  # a cycle dropped while frozen is collected once unfrozen


class _Node:
    next: Any = None


@pytest.mark.unit
def test_a_ranks_pieces_wait_for_a_share_of_its_slots_and_the_interval() -> None:
    from rayeval.actors.batches import PIECE_WAIT_S, PIECES_PER_S, piece_due

    assert not piece_due(0, slots=64, since_s=10.0, interval_s=0.0)  # nothing to send
    assert not piece_due(15, slots=64, since_s=0.5, interval_s=0.0)  # under a quarter
    assert piece_due(16, slots=64, since_s=0.0, interval_s=0.0)
    interval = 64 / PIECES_PER_S  # 64 ranks: the driver reads at most PIECES_PER_S a second
    assert not piece_due(64, slots=64, since_s=interval / 2, interval_s=interval)
    assert piece_due(16, slots=64, since_s=interval, interval_s=interval)
    assert piece_due(1, slots=64, since_s=PIECE_WAIT_S, interval_s=interval)  # waited long
    many = 512 / PIECES_PER_S  # 512 ranks: longer than PIECE_WAIT_S, and still kept
    assert not piece_due(1, slots=64, since_s=PIECE_WAIT_S, interval_s=many)
    assert piece_due(1, slots=64, since_s=many, interval_s=many)
    assert piece_due(1, slots=3, since_s=0.0, interval_s=0.0)  # a piece per request


@pytest.mark.unit
def test_the_product_never_reaches_the_simulated_rank() -> None:
    """benchmarks/ is not part of the product; the benchmark-only rank class is set nowhere in
    it but where RayEvalLM hands it to WorkerGroup.create."""
    passed_on = []
    for folder in ("actors", "api", "service"):
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    names = [getattr(node, "module", None) or ""]
                    names += [alias.name for alias in node.names]
                    assert not any(n.split(".")[0] == "benchmarks" for n in names), path
                if isinstance(node, ast.keyword) and node.arg == "rank_class":
                    passed_on.append(path.relative_to(REPO).as_posix())
    assert passed_on == ["service/engine/engine.py"]  # from its tunables, to WorkerGroup.create


@pytest.mark.e2e
def test_scores_planned_in_parts_match_lm_eval_hf(
    demo: Any, task_manager: Any, ray_session: None
) -> None:
    """A real model: loglikelihood requests tokenised and planned in parts of 8 while the
    replicas compute, results as lm-eval's hf backend gives them."""
    from rayeval.service.engine.lm import RayEvalLM
    from rayeval.service.engine.parts.pipeline import Tunables

    run = {"limit": 12, "bootstrap_iters": 0, "num_fewshot": 1}
    tasks = ["demo_mc", "demo_cloze"]
    reference = hf_reference(demo.model_dir, task_manager, tasks, **run)
    started = time.monotonic()
    with RayEvalLM(
        pretrained=str(demo.model_dir),
        num_replicas=2,
        dtype="float32",
        tunables=Tunables(score_part=8),
    ) as lm:
        ours = evaluate(lm, task_manager, tasks, **run)
        figures = lm.engine.stats["loglikelihood"].report()
    assert time.monotonic() - started < 300
    assert figures["requests"] > 8 * 3, "the requests should make several parts"
    assert_same_results(reference, ours)


@pytest.mark.unit
def test_sampling_seeds_and_groups_in_parts_are_those_of_the_whole_part_by_part() -> None:
    """A Seeder that saw the parts before gives a part's sampled requests the seeds the whole
    request type gives them (repeats straddle the cut); a part is grouped as any request set."""
    from rayeval.service.engine.parts.generate import GeneratePart, plan_generate_part
    from rayeval.service.engine.parts.pipeline import even_bounds
    from rayeval.service.engine.plan.generation_planner import (
        GenerateRequest,
        Seeder,
        SlotBudget,
        plan_generate_groups,
        request_seeds,
    )
    from rayeval.service.engine.plan.planner import TokenBudget

    sampled = {"do_sample": True, "temperature": 1.0}
    requests = [
        GenerateRequest((1, 2, 3), 4, ("\n",), kwargs=sampled if i % 3 else {})
        for i in range(5)
    ] + [GenerateRequest((9, 8), 4, ("\n",), kwargs=sampled)] * 4  # fmt: skip
    assert list(even_bounds(len(requests), 4)) == [(0, 4), (4, 8), (8, 9)]
    assert list(even_bounds(10, 4, first=1)) == [(0, 1), (1, 5), (5, 9), (9, 10)]
    assert list(even_bounds(10, 4, first=9)) == list(even_bounds(10, 4))
    seeder, budget = Seeder(7), SlotBudget(slots=1, kv_tokens=64)
    names = [f"doc {i}" for i in range(len(requests))]
    seeds = []
    for start, stop in even_bounds(len(requests), 4):
        part = GeneratePart(start, requests[start:stop], names[start:stop])
        planned = plan_generate_part(part, None, TokenBudget(), budget, seeder)
        alone = plan_generate_groups(part.requests, budget, request_seeds(part.requests, 7))
        assert [len(g.requests) for g in planned.micro_batches] == [
            len(g.requests) for g in alone.groups
        ]
        assert list(planned.computed) == list(range(start, stop))
        by_place = {
            place: index for index, place in zip(planned.computed, planned.places, strict=True)
        }
        for group_index, group in enumerate(planned.micro_batches):
            for position, slot in enumerate(group.requests):
                seeds.append((by_place[(group_index, position)], slot.seed))
    assert [seed for _, seed in sorted(seeds)] == request_seeds(requests, 7)
    assert len({seed for _, seed in seeds if seed is not None}) == 7  # repeats differ


GEN_TASKS = ["demo_gen_short", "demo_gen_long"]  # 35 requests, two stop settings
GEN_RUN = {"num_fewshot": 1, "bootstrap_iters": 0}


def _generate(demo: Any, task_manager: Any, replicas: int, **kwargs: Any) -> tuple[Any, Any]:
    """One evaluation of GEN_TASKS with three slots (groups of 12); results and figures."""
    from rayeval.service.engine.lm import RayEvalLM

    run = {**GEN_RUN, **kwargs.pop("run", {})}
    with RayEvalLM(
        pretrained=str(demo.model_dir),
        num_replicas=replicas,
        dtype="float32",
        batch_size=3,
        **kwargs,
    ) as lm:
        results = evaluate(lm, task_manager, GEN_TASKS, **run)
        return results, lm.engine.stats["generate_until"].report()


@pytest.mark.e2e
def test_generations_planned_in_parts_match_lm_eval_hf(
    demo: Any,
    task_manager: Any,
    ray_session: None,
    tmp_path: Path,
) -> None:
    """A real model: generate_until requests tokenised and planned in parts of 8 (a part's
    requests cross from one task's stop strings to the other's) while the replicas compute,
    answers as lm-eval's hf backend gives them; a second engine on the same response cache
    computes none of them and answers the same."""
    from rayeval.service.engine.parts.pipeline import Tunables

    reference = hf_reference(demo.model_dir, task_manager, GEN_TASKS, **GEN_RUN)
    cache, in_parts = str(tmp_path / "cache"), Tunables(generate_part=8)
    ours, figures = _generate(demo, task_manager, 2, use_cache=cache, tunables=in_parts)
    again, rerun = _generate(demo, task_manager, 2, use_cache=cache, tunables=in_parts)
    assert figures["batching"] == "continuous" and figures["requests"] == 35
    assert figures["micro_batches"] >= 5, "35 requests in parts of 8 make at least 5 groups"
    assert_same_results(reference, ours)
    assert rerun["cached"] == 35 and rerun["micro_batches"] == 0
    assert_same_results(ours, again, exact=True)


@pytest.mark.e2e
def test_sampled_generations_in_parts_are_those_of_the_whole(
    demo: Any, task_manager: Any, ray_session: None
) -> None:
    """Each sampled request's generator is seeded as in one plan of the whole request type: the
    same answers in parts of 8 on two replicas as whole on one."""
    from rayeval.service.engine.parts.pipeline import Tunables

    sampled = {"gen_kwargs": "do_sample=True,temperature=1.0,top_k=20"}
    whole, figures = _generate(demo, task_manager, 1, run=sampled)
    eights = Tunables(generate_part=8)
    parts, in_parts = _generate(demo, task_manager, 2, run=sampled, tunables=eights)
    assert figures["micro_batches"] < in_parts["micro_batches"], "no parts were made"
    assert_same_results(whole, parts, exact=True)
    answers = [s["resps"][0][0] for s in parts["samples"]["demo_gen_long"]]
    assert len(set(answers)) > 1, "every request drew the same answer"
