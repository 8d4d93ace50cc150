"""The engine under stress: uneven work, impossible layouts, lost replicas, another architecture."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_results, evaluate, hf_reference


def _generate_requests() -> list[Any]:
    """Five generate_until requests whose generations have very different lengths."""
    from lm_eval.api.instance import Instance

    specs = [
        ("The cat sat on the", {"until": ["\n"], "max_gen_toks": 1, "do_sample": False}),
        ("Once upon a time", {"until": [], "max_gen_toks": 90, "do_sample": False}),
        ("Q: What is two plus two?\nA:", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
        ("The colour of the sky is", {"until": ["zzzz"], "max_gen_toks": 60, "do_sample": False}),
        ("Red, green and", {"until": ["."], "max_gen_toks": 3, "do_sample": False}),
    ]
    return [
        Instance(request_type="generate_until", doc={}, arguments=(ctx, kwargs), idx=i)
        for i, (ctx, kwargs) in enumerate(specs)
    ]


def _loglikelihood_requests() -> list[Any]:
    from lm_eval.api.instance import Instance

    pairs = [
        ("The cat", " sat"),
        ("", "Once upon a time"),
        ("Two plus two is", " four"),
        ("The sky is", " blue and the grass is green"),
        ("A", " B"),
    ]
    return [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(pairs)
    ]


@pytest.mark.e2e
def test_uneven_work_over_2x2_finishes_and_matches(demo: Any, ray_session: None) -> None:
    """5 requests over 4 ranks (dummy micro-batches) with generations from 1 to 90 tokens."""
    from lm_eval.models.huggingface import HFLM

    from rayeval.service.engine.lm import RayEvalLM

    reference = HFLM(pretrained=str(demo.model_dir), device="cpu", dtype="float32", batch_size=1)
    expected_text = reference.generate_until(_generate_requests())
    expected_ll = reference.loglikelihood(_loglikelihood_requests())

    frozen: list[tuple[str, int]] = []  # per progress report: the heap out of full GC passes?
    started = time.monotonic()
    with RayEvalLM(
        pretrained=str(demo.model_dir),
        num_replicas=2,
        shard_size=2,
        shard_strategy="fsdp",  # each rank its own micro-batch: dummies fill the last steps
        batch_size=1,
        on_progress=lambda p: frozen.append((p.phase, gc.get_freeze_count())),
    ) as lm:
        text = lm.generate_until(_generate_requests())
        ll = lm.loglikelihood(_loglikelihood_requests())
    assert time.monotonic() - started < 240, "uneven work took far too long (a rank waited?)"
    assert {phase for phase, _ in frozen} == {"generate_until", "loglikelihood"}
    assert all(count > 0 for _, count in frozen), frozen
    assert gc.get_freeze_count() == 0

    assert text == expected_text
    assert len({len(t) for t in text}) > 2, f"generation lengths should differ: {text}"
    for (ref_lp, ref_greedy), (lp, greedy) in zip(expected_ll, ll, strict=True):
        assert abs(ref_lp - lp) <= 1e-4 and ref_greedy == greedy


@pytest.mark.unit
def test_a_missing_local_model_is_a_missing_folder(tmp_path: Path) -> None:
    """A path that does not exist is not explained as a malformed hub repo id."""
    from rayeval.actors.errors import ConfigError
    from rayeval.service.engine.lm import RayEvalLM

    for given, folder in (
        ("./no/such/model", "./no/such/model"),
        (str(tmp_path / "missing"), str(tmp_path / "missing")),
        ("~/no-such-model-here", str(Path("~/no-such-model-here").expanduser())),
    ):
        with pytest.raises(ConfigError) as caught:
            RayEvalLM(pretrained=given)
        message = str(caught.value)
        assert message.startswith(f"no such folder: {folder!r} (pretrained={given})"), message
        assert "repo" not in message.lower(), message


@pytest.mark.service
def test_impossible_layout_fails_fast(demo: Any, ray_session: None) -> None:
    import ray

    from rayeval.actors.errors import ConfigError, LayoutError
    from rayeval.service.engine.lm import RayEvalLM

    started = time.monotonic()
    with pytest.raises(LayoutError, match=r"4 in the cluster\. Lower num_replicas= / shard_size="):
        RayEvalLM(pretrained=str(demo.model_dir), num_replicas=3, shard_size=2)
    with pytest.raises(ConfigError, match=r"num_replicas: .* greater than or equal to 1, got 0"):
        RayEvalLM(pretrained=str(demo.model_dir), num_replicas=0, shard_size=1)
    with pytest.raises(ConfigError, match=r"shard_size: .* greater than or equal to 1, got -2"):
        RayEvalLM(pretrained=str(demo.model_dir), num_replicas=1, shard_size=-2)
    assert time.monotonic() - started < 30
    assert not _live_placement_groups(ray)


@pytest.mark.service
def test_busy_cluster_times_out_with_requested_vs_available(demo: Any, ray_session: None) -> None:
    """A layout that fits the cluster but not its free resources fails after the timeout."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from rayeval.actors.errors import ResourcesUnavailableError
    from rayeval.actors.layout import Timeouts
    from rayeval.service.engine.lm import RayEvalLM

    blocker = placement_group([{"CPU": 1.0}] * 3)
    ray.get(blocker.ready(), timeout=30)
    try:
        started = time.monotonic()
        with pytest.raises(
            ResourcesUnavailableError, match=r"needs \{'CPU': 2\.0\} but only \{'CPU': 1\.0\}"
        ):
            RayEvalLM(
                pretrained=str(demo.model_dir),
                num_replicas=2,
                timeouts=Timeouts(placement_s=2.0),
            )
        assert time.monotonic() - started < 30
    finally:
        remove_placement_group(blocker)
    assert not _live_placement_groups(ray, wait_s=30)


@pytest.mark.e2e
def test_lost_replica_is_dropped_and_its_work_rerun(
    demo: Any, task_manager: Any, ray_session: None
) -> None:
    """Kill one FSDP rank mid-run: its replica is dropped at once (its peer waits in a
    collective), the replica's batches rerun on the other one (the figures' ``requeued``), and
    results stay exact."""
    import ray

    from rayeval.service.engine.lm import RayEvalLM

    run = {"limit": 8, "bootstrap_iters": 0}
    tasks = ["demo_cloze", "demo_gen_short"]
    reference = hf_reference(demo.model_dir, task_manager, tasks, **run)
    killed: list[str] = []

    def kill_first_replica(progress: Any) -> None:
        if not killed and progress.done > 0:
            name = f"{lm.engine.name}-r0-s1"
            ray.kill(ray.get_actor(name), no_restart=True)
            killed.append(name)

    lm = RayEvalLM(
        pretrained=str(demo.model_dir),
        num_replicas=2,
        shard_size=2,
        batch_size=1,
        on_progress=kill_first_replica,
    )
    with lm:
        ours = evaluate(lm, task_manager, tasks, **run)
        figures = [stats.report() for stats in lm.engine.stats.values()]
    assert killed, "the failure was never injected"
    assert_same_results(reference, ours)
    # What the lost replica had in flight is counted where the figures show it.
    assert sum(f["requeued"] for f in figures) > 0, figures


@pytest.mark.e2e
def test_tied_embeddings_gpt2_sharded(tmp_path: Path, task_manager: Any, ray_session: None) -> None:
    """Another architecture family, with tied input/output embeddings, sharded over 2 ranks."""
    import transformers

    from rayeval.service.demo import build_tiny_model
    from rayeval.service.engine.lm import RayEvalLM

    model_dir = build_tiny_model(tmp_path / "gpt2", arch="gpt2")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == "gpt2"
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    run = {"limit": 5, "bootstrap_iters": 0}
    tasks = ["demo_cloze", "demo_rolling", "demo_gen_short"]
    reference = hf_reference(model_dir, task_manager, tasks, **run)
    with RayEvalLM(
        pretrained=str(model_dir), num_replicas=1, shard_size=2, max_batch_tokens=256
    ) as lm:
        ours = evaluate(lm, task_manager, tasks, **run)
        # Each rank holds only its shard: about half of the (tied, so counted once) parameters.
        local = [report.local_parameters for report in lm.engine.load_reports]
        # GPT-2 has no TP plan: FSDP (its all-gathers on gloo).
        assert [(r.strategy, r.collectives) for r in lm.engine.load_reports] == [
            ("fsdp", "process group")
        ] * 2
        # Each rank reports the KV-cache positions its share of the node's memory holds, after
        # loading and again when asked (for every generation plan).
        held = [report.kv_capacity_tokens for report in lm.engine.load_reports]
        held_now = lm.engine._group.kv_capacity_tokens(timeout_s=60)
    assert_same_results(reference, ours)
    assert all(isinstance(h, int) and h > 100_000 for h in [*held, *held_now])
    assert len(held_now) == 2
    assert sum(local) == model.num_parameters()
    assert max(local) <= model.num_parameters() / 2 + 1024


def _live_placement_groups(ray: Any, wait_s: float = 0.0) -> list[str]:
    """Placement groups not removed; with ``wait_s``, those still not removed after that long
    (Ray's table shows a removal a moment after it is asked for)."""
    deadline = time.monotonic() + wait_s
    while True:
        table = ray.util.placement_group_table()
        live = [pg_id for pg_id, pg in table.items() if pg["state"] not in ("REMOVED",)]
        if not live or time.monotonic() >= deadline:
            return live
        time.sleep(0.1)
