"""Training checkpoints read as they are: DCP directories, sweeps, watch mode, refusals.

A "training run" of the bundled tiny Llama saves three steps, each with its own weights (the
trained weights plus seeded noise, less at later steps), each saved another way:

* ``step-100`` by FSDP2 over two gloo ranks in Ray actors (``get_model_state_dict`` +
  ``dcp.save``: two shard files, every tensor split between them);
* ``step-200`` by one process (``dcp.save`` with ``no_dist``);
* ``step-300`` by FSDP2 over two ranks as accelerate's ``SHARDED_STATE_DICT`` writes it:
  ``pytorch_model_fsdp_0/`` holding ``{"model": state_dict}``.

The reference for each is lm-eval's own ``hf`` backend on the same weights merged into a
safetensors copy with DCP's own ``dcp_to_torch_save`` (in the test only: rayeval never writes a
merged copy). The slow tests evaluate the three steps in one engine per layout (G=1, G=2 FSDP,
G=2 TP: the ranks swap weights between steps) against those references; a CLI sweep against
three separate ``rayeval run`` evaluations (bit-identical); a watch that picks up a checkpoint
written while it runs and leaves alone one still being written; and the refusals, before any
rank starts.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint_run import merge, save_one_process, save_sharded
from tests.helpers import (
    HfSpread,
    assert_same_results,
    evaluate,
    half_precision_parity,
    hf_reference,
    hf_spread,
    read_outputs,
)

STEPS = {"step-100": 0.3, "step-200": 0.1, "step-300": 0.0}  # noise scale per step
RUN = {"num_fewshot": 1, "limit": 4, "bootstrap_iters": 0}
TASKS = ["demo_mc", "demo_cloze", "demo_rolling", "demo_gen_short"]


@pytest.fixture(scope="module")
def run_dir(demo: Any, ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The training run's checkpoint folder: three steps, each saved its own way."""
    root = tmp_path_factory.mktemp("run")
    (scale_100, scale_200, scale_300) = STEPS.values()
    save_sharded(demo.model_dir, root / "step-100", scale_100, seed=100, accelerate=False)
    save_one_process(demo.model_dir, root / "step-200", scale_200, seed=200)
    save_sharded(demo.model_dir, root / "step-300", scale_300, seed=300, accelerate=True)
    return root


class References(dict):  # type: ignore[type-arg]
    """lm-eval hf on each step's weights merged to safetensors, float32 by step name; other
    dtypes by (step, dtype), at several batch sizes (:class:`HfSpread`); computed on first use."""

    def __init__(self, run_dir: Path, demo: Any, task_manager: Any, merged: Path) -> None:
        super().__init__()
        self._args = (run_dir, demo, task_manager, merged)

    def __missing__(self, key: str | tuple[str, str]) -> dict[str, Any] | HfSpread:
        run_dir, demo, task_manager, merged = self._args
        step, dtype = key if isinstance(key, tuple) else (key, "float32")
        model = merged / step
        if not model.exists():
            merge(run_dir / step, demo.model_dir, model)
        if dtype == "float32":
            self[key] = hf_reference(model, task_manager, TASKS, dtype, **RUN)
        else:
            self[key] = hf_spread(model, task_manager, TASKS, dtype, **RUN)
        return self[key]


@pytest.fixture(scope="module")
def references(
    demo: Any, run_dir: Path, task_manager: Any, tmp_path_factory: pytest.TempPathFactory
) -> References:
    return References(run_dir, demo, task_manager, tmp_path_factory.mktemp("merged"))


# ------------------------------------------------------------------ slow: evaluations
LAYOUTS = [
    (1, "fsdp", "float32"),
    (2, "fsdp", "float32"),
    (2, "tp", "float32"),
    (2, "tp", "bfloat16"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("shard_size", "strategy", "dtype"),
    half_precision_parity(LAYOUTS, ["1", "2-fsdp", "2-tp", "2-tp-bf16"]),
)
def test_checkpoints_match_lm_eval_hf_on_merged_weights(
    shard_size: int, strategy: str, dtype: str, demo: Any, run_dir: Path,
    references: References, task_manager: Any,
) -> None:  # fmt: skip
    """Each step read as saved (two FSDP2 shards, one process, accelerate's layout) by one
    engine whose ranks swap weights between steps, at G=1 and G=2 under both strategies; in
    bf16 (weights saved in float32, rounded on load as lm-eval rounds them) within lm-eval hf's
    own spread between batch sizes on this machine (bit for bit where it does not move)."""
    from rayeval.service.engine.lm import RayEvalLM

    steps = list(STEPS)
    with RayEvalLM(
        pretrained=str(demo.model_dir), checkpoint=str(run_dir / steps[0]), dtype=dtype,
        shard_size=shard_size, shard_strategy=strategy, batch_size="auto", max_batch_tokens=256,
    ) as lm:  # fmt: skip
        reports = lm.engine.load_reports
        for step in steps:
            if step != steps[0]:
                swap = lm.engine.swap_checkpoint(str(run_dir / step))
                assert swap.bytes > 0
            assert lm.engine.config.model_args["checkpoint"] == str(run_dir / step)
            ours = evaluate(lm, task_manager, TASKS, **RUN)
            if dtype == "float32":
                assert_same_results(references[step], ours)
            else:
                references[(step, dtype)].assert_holds(ours, f"rayeval 1x{shard_size} {strategy}")
            assert lm.engine.shard_strategy.value == strategy
    total = sum(r.local_parameters for r in reports)
    if shard_size == 2:  # each rank holds (and read) its half, not the whole model
        assert max(r.local_parameters for r in reports) <= total / 2 * 1.05
    assert references["step-100"]["results"] != references["step-300"]["results"]


@pytest.mark.e2e
def test_cli_sweep_equals_separate_evaluations(
    demo: Any, run_dir: Path, tmp_path: Path, capsys: Any
) -> None:
    """``rayeval run --checkpoints 'run/step-*'``: one results file per step, bit-identical to
    a ``rayeval run`` per step with ``checkpoint=``; ``sweep.json`` and ``rayeval results``."""
    from rayeval.api.cli import main

    def argv(model_args: str, out: Path) -> list[str]:
        return ["run", "--model", "hf", "--model_args", model_args,
                "--include_path", str(demo.tasks_dir), "--tasks", ",".join(TASKS),
                "--limit", "4", "--num_fewshot", "1", "--bootstrap_iters", "0", "--seed", "7",
                "--log_samples", "--output_path", str(out)]  # fmt: skip

    base = f"pretrained={demo.model_dir},dtype=float32"
    assert main([*argv(base, tmp_path / "sweep"), "--checkpoints", str(run_dir / "step-*")]) == 0
    printed = capsys.readouterr().out
    assert "step-100: succeeded" in printed and "| demo_mc" in printed
    summary = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [c["label"] for c in summary["checkpoints"]] == list(STEPS)
    assert [c["step"] for c in summary["checkpoints"]] == [100, 200, 300]
    fingerprints = {c["fingerprint"] for c in summary["checkpoints"]}
    assert len(fingerprints) == 3  # each step its own response-cache key
    for step in STEPS:
        assert main(argv(f"{base},checkpoint={run_dir / step}", tmp_path / "one" / step)) == 0
        _, separate, separate_samples = read_outputs(tmp_path / "one" / step)
        _, swept, swept_samples = read_outputs(tmp_path / "sweep" / step)
        assert swept["config"]["model_args"]["checkpoint"] == str((run_dir / step).resolve())
        assert_same_results(
            {"results": separate["results"], "samples": separate_samples},
            {"results": swept["results"], "samples": swept_samples},
            exact=True,
        )
    capsys.readouterr()
    assert main(["results", str(tmp_path / "sweep")]) == 0
    table = capsys.readouterr().out
    assert "| Tasks" in table and "step-300" in table and "exact_match" in table


@pytest.mark.e2e
def test_watch_picks_up_new_checkpoints_and_waits_for_incomplete_ones(
    demo: Any, run_dir: Path, ray_session: None, tmp_path: Path, capsys: Any
) -> None:
    """A watch evaluates the step present at its start, then one saved while it runs, and
    leaves alone a step whose save has no ``.metadata`` yet; a second watch over the same output
    skips both (their results files are there)."""
    from rayeval.api.cli import main
    from rayeval.service.engine.watch import WatchOptions, watch
    from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions

    watched = tmp_path / "run"
    watched.mkdir()
    shutil.copytree(run_dir / "step-100", watched / "step-100")
    config = EvaluationConfig(
        model_args={"pretrained": str(demo.model_dir), "dtype": "float32"},
        tasks=["demo_mc"], limit=4, bootstrap_iters=0,
    )  # fmt: skip
    host = HostOptions(output_path=str(tmp_path / "out"), include_paths=(str(demo.tasks_dir),))
    seen: list[tuple[str, str]] = []

    def on_checkpoint(record: Any) -> None:
        seen.append((record.label, record.status))
        if len(seen) == 1:  # the trainer saves two more while the watch runs
            partial = watched / "step-150"
            partial.mkdir()
            for shard in (run_dir / "step-200").glob("*.distcp"):
                shutil.copy(shard, partial / shard.name)  # no .metadata: still being written
            shutil.copytree(run_dir / "step-200", watched / "step-200")

    done = threading.Event()
    summary: dict[str, Any] = {}

    def run() -> None:
        options = WatchOptions(poll_s=0.2, max_checkpoints=2)
        summary["value"] = watch(watched, config, host, options, on_checkpoint=on_checkpoint)
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert done.wait(timeout=600), "the watch did not stop after two checkpoints"
    assert seen == [("step-100", "succeeded"), ("step-200", "succeeded")]
    assert "step-150" not in {r.label for r in summary["value"].checkpoints}
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["step-100", "step-200", "sweep.json"]

    status = main(["watch", str(watched), "--model", "hf",
                   "--model_args", f"pretrained={demo.model_dir},dtype=float32",
                   "--include_path", str(demo.tasks_dir), "--tasks", "demo_mc", "--limit", "4",
                   "--bootstrap_iters", "0", "--output_path", str(tmp_path / "out"),
                   "--poll_interval", "0.2", "--idle_timeout", "1"])  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert "step-100: skipped" in printed and "step-200: skipped" in printed
    assert "step-150" not in printed


# ------------------------------------------------- small: refusals, keys, directories, requests
@pytest.fixture(scope="module")
def small_checkpoints(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One-process DCP saves of the demo model: good, a key missing, a shape that differs, and
    a half-written one (shards, no .metadata)."""
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers

    root = tmp_path_factory.mktemp("small")
    state = transformers.AutoModelForCausalLM.from_pretrained(
        demo.model_dir, dtype=torch.float32
    ).state_dict()
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    shape = dict(state, **{"model.norm.weight": torch.ones(65)})
    for name, value in {"good": state, "missing": missing, "shape": shape}.items():
        dcp.save(value, checkpoint_id=str(root / name), no_dist=True)
    shutil.copytree(root / "good", root / "half")
    (root / "half" / ".metadata").unlink()
    (root / "empty").mkdir()
    return {name: root / name for name in ("good", "missing", "shape", "half", "empty")}


@pytest.mark.service
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no tensor for parameter model.layers.1.mlp.up_proj.weight"),
        ("shape", "tensor model.norm.weight has shape (65,), the model's config gives (64,)"),
        ("half", "has DCP shard files but no .metadata file: the save is incomplete"),
        ("empty", "is not a checkpoint: expected a torch.distributed.checkpoint directory"),
    ],
)
def test_unusable_checkpoint_is_refused_before_any_rank_starts(
    case: str, message: str, demo: Any, small_checkpoints: dict[str, Path], capsys: Any
) -> None:
    from rayeval.api.cli import main

    common = ["--model", "hf", "--include_path", str(demo.tasks_dir), "--tasks", "demo_mc",
              "--address", "127.0.0.1:1"]  # nothing listens there: refused before Ray  # fmt: skip
    bad = small_checkpoints[case]
    args = f"pretrained={demo.model_dir},checkpoint={bad}"
    assert main(["run", *common, "--model_args", args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    # A sweep is refused as a whole, naming the unusable one, before any rank starts.
    good = small_checkpoints["good"]
    sweep = ["--model_args", f"pretrained={demo.model_dir}", "--checkpoints", f"{good},{bad}"]
    assert main(["run", *common, *sweep]) == 2
    err = capsys.readouterr().err
    assert message in err and str(good) not in err


@pytest.mark.service
def test_fingerprints_follow_the_checkpoint(
    demo: Any, small_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Two checkpoints never share a response-cache or warm-replica key; rewriting a
    checkpoint's files changes its key."""
    from rayeval.service.engine.dispatch.warm import replica_key
    from rayeval.service.engine.response_cache import model_fingerprint
    from rayeval.service.vocabulary.config import EvaluationConfig

    def args(checkpoint: Path) -> dict[str, Any]:
        return {"pretrained": str(demo.model_dir), "checkpoint": str(checkpoint)}

    good, other = small_checkpoints["good"], small_checkpoints["shape"]
    assert model_fingerprint(args(good)) != model_fingerprint(args(other))
    assert model_fingerprint(args(good)) != model_fingerprint({"pretrained": str(demo.model_dir)})
    configs = [EvaluationConfig(model_args=args(c), tasks=["demo_mc"]) for c in (good, other)]
    assert replica_key(configs[0]) != replica_key(configs[1])
    copy = shutil.copytree(good, tmp_path / "copy")
    before = model_fingerprint(args(copy))
    (copy / ".metadata").write_bytes((copy / ".metadata").read_bytes() + b" ")
    assert model_fingerprint(args(copy)) != before


@pytest.mark.service
@pytest.mark.parametrize("stored", ["both", "embeddings", "head"])
def test_tied_head_reads_the_one_tensor_the_checkpoint_has(stored: str, tmp_path: Path) -> None:
    """A tied GPT-2 saved with both names of its one tensor, or either alone, loads whole
    (G = 1, in this process) with the logits of the model that was saved."""
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers

    from rayeval.actors.batches import ModelSpec
    from rayeval.actors.parallel.fsdp_loading import load_model
    from rayeval.service.demo import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "gpt2", arch="gpt2", train_steps=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = dict(model.state_dict())
    drop = {"embeddings": "lm_head.weight", "head": "transformer.wte.weight"}.get(stored)
    state.pop(drop, None)
    dcp.save(state, checkpoint_id=str(tmp_path / "step"), no_dist=True)
    spec = ModelSpec(str(model_dir), dtype="float32", checkpoint=str(tmp_path / "step"))
    loaded = load_model(spec, torch.device("cpu"), None)
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    ids = torch.tensor([[1, 5, 9, 33, 100, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


@pytest.mark.unit
def test_response_cache_remembers_what_was_evaluated(tmp_path: Path) -> None:
    from rayeval.service.engine.response_cache import ResponseCache

    cache = ResponseCache(tmp_path / "cache.sqlite", "model-a")
    cache.mark_evaluated("step-1", "settings")
    assert cache.evaluated("step-1", "settings")
    assert not cache.evaluated("step-1", "other settings")
    assert not cache.evaluated("step-2", "settings")
    cache.close()
    again = ResponseCache(tmp_path / "cache.sqlite", "model-a")
    assert again.evaluated("step-1", "settings")
    again.close()


@pytest.mark.unit
def test_checkpoint_directories_complete_ordered_and_named(tmp_path: Path) -> None:
    from rayeval.actors.weights.checkpoint_dirs import by_step, expand, inspect_dir, labels, step_of

    assert [step_of(n) for n in ("step-1000", "checkpoint-500", "global_step20", "final")] == [
        1000, 500, 20, None,
    ]  # fmt: skip
    for name in ("step-20", "step-3", "step-100", "final"):
        (tmp_path / "run" / name).mkdir(parents=True)
    ordered = [p.name for p in expand(str(tmp_path / "run" / "*"))]
    assert ordered == ["step-3", "step-20", "step-100", "final"]
    assert [p.name for p in by_step(expand(f"{tmp_path}/run/step-100,{tmp_path}/run/step-3"))] == [
        "step-3", "step-100",
    ]  # fmt: skip
    named = labels([tmp_path / "a" / "step-1", tmp_path / "b" / "step-1"])
    assert sorted(named.values()) == ["a__step-1", "b__step-1"]
    # A safetensors file shorter than its header says is still being written.
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "hf"
    model.mkdir()
    save_file({"w": torch.ones(1000)}, str(model / "model.safetensors"))
    assert inspect_dir(model).complete  # type: ignore[union-attr]
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[:-100])
    found = inspect_dir(model)
    assert found is not None and not found.complete and "still being written" in found.problem
    assert inspect_dir(tmp_path / "run" / "final") is None


@pytest.mark.unit
def test_tasks_build_their_requests_once() -> None:
    """A sweep's task manager loads tasks once; a task builds its requests once per arguments
    and gives the same instances back unanswered."""
    from rayeval.service.engine.sweep import TasksOnce

    class _Instance:
        def __init__(self) -> None:
            self.resps: list[Any] = []
            self.filtered_resps: dict[str, Any] = {}

    class _Task:
        def __init__(self) -> None:
            self.builds = 0
            self.instances: list[_Instance] = []

        def build_all_requests(self, **kwargs: Any) -> None:
            self.builds += 1
            self.instances = [_Instance()]

    class _Manager:
        loads = 0

        def load(self, tasks: Any) -> dict[str, Any]:
            self.loads += 1
            return {"tasks": {"t": _Task()}, "groups": {}}

    manager = _Manager()
    once = TasksOnce(manager)
    task = once.load(["t"])["tasks"]["t"]
    assert once.load(["t"])["tasks"]["t"] is task and manager.loads == 1
    task.build_all_requests(limit=4)
    first = task.instances[0]
    first.resps.append("answer")
    first.filtered_resps["none"] = "answer"
    task.build_all_requests(limit=4)
    assert task.builds == 1 and task.instances[0] is first
    assert first.resps == [] and first.filtered_resps == {}
    task.build_all_requests(limit=2)
    assert task.builds == 2


@pytest.mark.unit
def test_the_model_roots_cover_checkpoints(tmp_path: Path) -> None:
    """``model_args.checkpoint`` in a request: a directory under a model root; a missing one and
    one outside the roots get the same answer (no file oracle)."""
    from rayeval.service.jobs.validation import ServerPolicy, policy_problems
    from rayeval.service.vocabulary.config import EvaluationConfig

    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    (root / "run" / "step-1").mkdir(parents=True)
    outside.mkdir()
    policy = ServerPolicy(model_roots=(str(root),))

    def problems(checkpoint: Any) -> list[str]:
        """The policy's answers about the checkpoint, its own value left out."""
        args = {"pretrained": "org/model", "checkpoint": checkpoint}
        config = EvaluationConfig.model_validate({"model_args": args, "tasks": ["demo_mc"]})
        found = policy_problems(config, policy)
        named = f"model_args.checkpoint: {checkpoint!r} "
        return [p.replace(named, "model_args.checkpoint: <path> ") for p in found if named in p]

    assert problems(str(root / "run" / "step-1")) == []
    refused = problems(str(outside))
    assert len(refused) == 1 and "--model-root" in refused[0] and str(root) in refused[0]
    assert problems(str(root / "run" / "step-2")) == refused  # missing: the same answer
    assert problems(str(root / "run" / ".." / ".." / "elsewhere")) == refused
    assert problems(7) == refused and problems("") == refused
    empty = ServerPolicy()
    args = {"pretrained": "org/model", "checkpoint": str(root / "run" / "step-1")}
    config = EvaluationConfig.model_validate({"model_args": args, "tasks": ["demo_mc"]})
    assert any("none configured" in p for p in policy_problems(config, empty))


@pytest.mark.unit
def test_a_sweep_request_is_expanded_under_the_model_roots(tmp_path: Path) -> None:
    """``sweep.checkpoints``: globs become the directories under the roots they match, by step;
    a glob matching only outside the roots answers as one matching nothing; one list or one
    watched directory, never both; poll bounds."""
    from pydantic import ValidationError

    from rayeval.service.jobs.validation import ServerPolicy, expand_sweep, tracking_problems
    from rayeval.service.vocabulary.config import EvaluationConfig

    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    for step in ("step-20", "step-3", "step-100"):
        (root / "run" / step).mkdir(parents=True)
        (outside / step).mkdir(parents=True)
    policy = ServerPolicy(model_roots=(str(root),))

    def expanded(sweep: dict[str, Any]) -> tuple[Any, list[str]]:
        args = {"pretrained": "org/model"}
        data = {"model_args": args, "tasks": ["demo_mc"], "sweep": sweep}
        config, problems = expand_sweep(EvaluationConfig.model_validate(data), policy)
        return config.sweep, problems

    spec, problems = expanded({"checkpoints": [str(root / "run" / "step-*")]})
    assert problems == []
    assert spec.checkpoints == tuple(str((root / "run" / s).resolve())
                                     for s in ("step-3", "step-20", "step-100"))  # fmt: skip
    named = [str(root / "run" / "step-100"), str(root / "run" / "step-3")]
    assert expanded({"checkpoints": named})[0].checkpoints == tuple(named)  # as given
    _, outside_glob = expanded({"checkpoints": [str(outside / "step-*")]})
    _, nothing = expanded({"checkpoints": [str(root / "none-*")]})
    assert len(outside_glob) == 1 and "--model-root" in outside_glob[0]
    assert outside_glob[0].replace(str(outside / "step-*"), "X") == nothing[0].replace(
        str(root / "none-*"), "X"
    )
    _, problems = expanded({"checkpoints": [str(root / "run" / "step-*"), str(outside / "step-3")]})
    assert len(problems) == 1 and "sweep.checkpoints" in problems[0]
    assert expanded({"watch": str(root / "run")})[1] == []
    assert "sweep.watch" in expanded({"watch": str(outside)})[1][0]
    tracked = EvaluationConfig.model_validate(
        {
            "model_args": {"pretrained": "o/m"},
            "tasks": ["t"],
            "tracking": {},
            "sweep": {"watch": "/r"},
        }
    )
    assert "MLflow" in tracking_problems(tracked, ServerPolicy(trackers=("wandb",)))[0]
    assert tracking_problems(tracked, ServerPolicy(trackers=("wandb", "mlflow"))) == []
    for bad in ({}, {"checkpoints": ["a"], "watch": "b"}, {"watch": "b", "poll_s": 0.01},
                {"checkpoints": []}):  # fmt: skip
        with pytest.raises(ValidationError):
            EvaluationConfig.model_validate(
                {"model_args": {"pretrained": "o/m"}, "tasks": ["demo_mc"], "sweep": bad}
            )


@pytest.mark.unit
def test_checkpoint_events_become_stored_checkpoints_and_stream_events() -> None:
    """A runner's checkpoint events are kept in order with the stream's ``checkpoint`` events;
    a watch's waiting events only move the cursor."""
    import time

    from rayeval.service.jobs.following import digest
    from rayeval.service.vocabulary.events import (
        CheckpointEvent,
        CheckpointOutputs,
        EvaluationProgress,
        RunnerCheckpoint,
        RunnerWaiting,
    )

    def checkpoint(seq: int, label: str, status: str) -> RunnerCheckpoint:
        record = {"label": label, "step": seq, "status": status, "checkpoint": f"/r/{label}"}
        outputs = CheckpointOutputs(
            record=record, results_json="{}" if status == "succeeded" else None
        )
        return RunnerCheckpoint(seq=seq, time=time.time(), outputs=outputs)

    events = [checkpoint(1, "step-1", "succeeded"), RunnerWaiting(seq=2, time=time.time()),
              checkpoint(3, "step-2", "refused")]  # fmt: skip
    digested = digest(EvaluationProgress(), events)
    assert digested.cursor == 3 and digested.ended is None and not digested.moved
    assert [c.label for c in digested.checkpoints] == ["step-1", "step-2"]
    assert [(e.label, e.status) for e in digested.events if isinstance(e, CheckpointEvent)] == [
        ("step-1", "succeeded"),
        ("step-2", "refused"),
    ]
    waiting_only = digest(EvaluationProgress(), [RunnerWaiting(seq=4, time=time.time())])
    assert waiting_only.cursor == 4 and waiting_only.events == [] and waiting_only.ended is None


@pytest.mark.e2e
def test_rest_evaluates_a_checkpoint_under_the_model_roots(
    demo: Any, run_dir: Path, tmp_path: Path
) -> None:
    """``POST /evaluations`` with ``model_args.checkpoint``: the ranks (G=2) read the DCP
    checkpoint as saved, and the served results and samples equal what ``lm_eval run --model hf``
    writes for the merged weights; a checkpoint outside the server's model roots is a 422 before
    anything is queued."""
    from rayeval.service.result_files import parse_samples
    from tests.helpers import run_lm_eval_cli
    from tests.test_service import ServerThread, body, finished, make_settings, submit, wait_for

    step = run_dir / "step-200"
    merged = merge(step, demo.model_dir, tmp_path / "merged")
    run_lm_eval_cli(["run", "--model", "hf", "--model_args", f"pretrained={merged},dtype=float32",
                     "--include_path", str(demo.tasks_dir), "--tasks", ",".join(TASKS),
                     "--limit", "4", "--num_fewshot", "1", "--device", "cpu",
                     "--batch_size", "4", "--log_samples",
                     "--output_path", str(tmp_path / "ref")])  # fmt: skip
    _, reference, reference_samples = read_outputs(tmp_path / "ref")

    settings = make_settings(tmp_path / "data", demo.tasks_dir)
    roots = [str(demo.model_dir.parent), str(run_dir)]
    server = ServerThread(settings.model_copy(update={"model_roots": roots}))
    server.start()
    try:
        with server.client() as client:
            args = {"pretrained": str(demo.model_dir), "dtype": "float32"}
            refused = client.post(
                "/evaluations",
                json=body(demo, model_args={**args, "checkpoint": str(tmp_path)}, tasks=TASKS),
            )
            assert refused.status_code == 422 and "model_args.checkpoint" in refused.text
            payload = body(
                demo, model_args={**args, "checkpoint": str(step)}, tasks=TASKS, **RUN,
                parallelism={"num_replicas": 1, "shard_size": 2},
            )  # fmt: skip
            evaluation = wait_for(client, submit(client, payload)["id"], finished, timeout_s=600)
            assert evaluation["status"] == "succeeded", evaluation
            served = f"/evaluations/{evaluation['id']}"
            results = client.get(f"{served}/results").json()
            samples = {
                task: parse_samples(client.get(f"{served}/samples/{task}").text) for task in TASKS
            }
    finally:
        server.stop()
    assert results["config"]["model_args"]["checkpoint"] == str(step.resolve())
    assert results["n-shot"] == reference["n-shot"]

    assert_same_results(
        {"results": _metrics(reference), "samples": reference_samples},
        {"results": _metrics(results), "samples": samples},
    )


def _metrics(outputs: dict[str, Any]) -> dict[str, Any]:
    """A results file's metrics without stderrs (lm-eval's CLI always bootstraps)."""
    return {
        task: {k: v for k, v in values.items() if "stderr" not in k}
        for task, values in outputs["results"].items()
    }


@pytest.fixture(scope="module")
def sweep_server(
    demo: Any, run_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Path]]:
    """A server whose model roots hold the demo model, the run and a directory to watch."""
    from tests.test_service import ServerThread, make_settings

    watched = tmp_path_factory.mktemp("watched")
    settings = make_settings(tmp_path_factory.mktemp("data"), demo.tasks_dir)
    roots = [str(demo.model_dir.parent), str(run_dir), str(watched)]
    server = ServerThread(settings.model_copy(update={"model_roots": roots}))
    server.start()
    try:
        yield server, watched
    finally:
        server.stop()


def _sweep_body(demo: Any, sweep: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    from tests.test_service import body

    args = {"pretrained": str(demo.model_dir), "dtype": "float32"}
    one_rank = {"parallelism": {"num_replicas": 1, "shard_size": 1}}
    return body(demo, **{"model_args": args, "tasks": TASKS, **RUN, **one_rank, "sweep": sweep,
                         **overrides})  # fmt: skip


@pytest.mark.e2e
def test_rest_sweep_matches_lm_eval_hf_per_checkpoint(
    demo: Any, run_dir: Path, references: dict[str, Any], sweep_server: tuple[Any, Path],
    tmp_path: Path, capsys: Any,
) -> None:  # fmt: skip
    """``POST /evaluations`` with ``sweep.checkpoints`` (a glob the server expands under its
    model roots): each checkpoint's results and samples served under ``/checkpoints/{label}/``
    equal lm-eval hf's on its merged weights; ``/sweep`` lists them by step (JSON and table);
    the event stream has one ``checkpoint`` event each. A glob outside the roots, or a sweep
    with ``model_args.checkpoint``, is a 422 before anything is queued."""
    from rayeval.service.result_files import parse_samples
    from tests.test_service import finished, read_events, submit, wait_for

    server, _ = sweep_server
    step_100 = str(run_dir / "step-100")
    with server.client() as client:
        for refused, field in [
            (_sweep_body(demo, {"checkpoints": [str(tmp_path / "step-*")]}), "sweep.checkpoints"),
            (_sweep_body(demo, {"checkpoints": [step_100]}, model_args={
                "pretrained": str(demo.model_dir), "checkpoint": step_100}),
             "model_args.checkpoint"),
            (_sweep_body(demo, {"checkpoints": [step_100], "watch": str(run_dir)}), "sweep"),
        ]:  # fmt: skip
            answer = client.post("/evaluations", json=refused)
            assert answer.status_code == 422 and field in answer.text, answer.text
        accepted = submit(client, _sweep_body(demo, {"checkpoints": [str(run_dir / "step-*")]}))
        served = f"/evaluations/{accepted['id']}"
        evaluation = wait_for(client, accepted["id"], finished, timeout_s=600)
        sweep = client.get(f"{served}/sweep").json()
        text = client.get(f"{served}/sweep", params={"format": "text"}).text
        swept = {
            record["label"]: {
                "results": client.get(record["links"]["results"]).json(),
                "samples": {task: parse_samples(client.get(url).text)
                            for task, url in record["links"]["samples"].items()},
            }
            for record in sweep["checkpoints"]
        }  # fmt: skip
        summary = client.get(f"{served}/results").json()
        compared = client.get("/compare", params={"a": accepted["id"], "b": accepted["id"]})
        missing = client.get(f"{served}/checkpoints/step-999/results")
    events = read_events(server.url, f"{served}/events")
    _assert_remote_results_write_a_sweep(server.url, accepted["id"], swept, tmp_path, capsys)
    assert accepted["kind"] == "sweep"
    resolved = [str((run_dir / step).resolve()) for step in STEPS]
    assert accepted["request"]["sweep"]["checkpoints"] == resolved
    assert evaluation["status"] == "succeeded", evaluation
    assert evaluation["links"]["sweep"] == f"{served}/sweep"
    assert [(c["label"], c["step"], c["status"]) for c in sweep["checkpoints"]] == [
        (step, int(step.split("-")[1]), "succeeded") for step in STEPS
    ]
    assert len({c["fingerprint"] for c in sweep["checkpoints"]}) == 3
    _assert_figures_add_up(evaluation, sweep["checkpoints"])
    for position, step in enumerate(STEPS):
        ours = swept[step]
        assert ours["results"]["config"]["model_args"]["checkpoint"] == resolved[position]
        for task, metrics in references[step]["results"].items():
            for key, value in metrics.items():
                if "," in key and "stderr" not in key:
                    assert ours["results"]["results"][task][key] == pytest.approx(value, abs=1e-4)
        listed = sweep["checkpoints"][position]["results"]["demo_mc"]["acc,none"]
        assert listed == ours["results"]["results"]["demo_mc"]["acc,none"]
    # Per sample, as lm-eval's CLI writes its files: one step, on its merged weights.
    _assert_equals_lm_eval_cli(demo, run_dir / "step-200", swept["step-200"], tmp_path)
    assert "| Tasks" in text and "step-300" in text and "exact_match" in text
    checkpoint_events = [e["data"] for e in events if e["event"] == "checkpoint"]
    assert [e["label"] for e in checkpoint_events] == list(STEPS)
    assert summary["kind"] == "rayeval-sweep" and len(summary["checkpoints"]) == 3
    assert compared.status_code == 422 and "checkpoint sweep" in compared.text
    assert missing.status_code == 404 and "/sweep" in missing.text


def _assert_figures_add_up(evaluation: dict[str, Any], checkpoints: list[dict[str, Any]]) -> None:
    """Each checkpoint has its own figures; the sweep's evaluation reports their sum."""
    phases = {phase for c in checkpoints for phase in c["stats"]}
    assert phases and all(c["stats"][p]["requests"] > 0 for c in checkpoints for p in phases)
    for phase in phases:
        for figure in ("requests", "cached", "recomputed", "micro_batches", "real_tokens"):
            total = sum(c["stats"][phase][figure] for c in checkpoints)
            assert evaluation["stats"][phase][figure] == total, (phase, figure)


@pytest.mark.e2e
def test_rest_watch_evaluates_new_complete_checkpoints(
    demo: Any, run_dir: Path, sweep_server: tuple[Any, Path], small_checkpoints: dict[str, Path]
) -> None:
    """``sweep.watch``: a step that does not fit the model is recorded as refused (with why),
    the step present at the start is evaluated, then one saved while the watch runs; one whose
    save has no ``.metadata`` yet is not; it ends after ``max_checkpoints`` evaluations. A second
    watch of the same run with the same settings skips the evaluated steps (the server's response
    cache knows them) and, cancelled, keeps what it recorded."""
    from tests.test_service import finished, submit, wait_for

    server, watched = sweep_server
    shutil.copytree(small_checkpoints["shape"], watched / "step-50")
    shutil.copytree(run_dir / "step-100", watched / "step-100")
    spec = {"watch": str(watched), "poll_s": 0.2, "max_checkpoints": 2}
    with server.client() as client:
        watching = submit(client, _sweep_body(demo, spec, tasks=["demo_mc"]))
        served = f"/evaluations/{watching['id']}"
        wait_for(client, watching["id"], _checkpoints_at_least(client, 2), timeout_s=600)
        partial = watched / "step-150"
        partial.mkdir()
        for shard in (run_dir / "step-200").glob("*.distcp"):
            shutil.copy(shard, partial / shard.name)  # no .metadata: still being written
        shutil.copytree(run_dir / "step-200", watched / "step-200")
        evaluation = wait_for(client, watching["id"], finished, timeout_s=600)
        sweep = client.get(f"{served}/sweep").json()
        spec = {"watch": str(watched), "poll_s": 0.2}
        again = submit(client, _sweep_body(demo, spec, tasks=["demo_mc"]))
        wait_for(client, again["id"], _checkpoints_at_least(client, 3), timeout_s=300)
        cancelled = client.delete(f"/evaluations/{again['id']}").json()
        kept = client.get(f"/evaluations/{again['id']}/sweep").json()
    assert cancelled["status"] == "cancelled", cancelled
    assert [(c["label"], c["status"]) for c in kept["checkpoints"]] == [
        ("step-50", "refused"),
        ("step-100", "skipped"),
        ("step-200", "skipped"),
    ]
    assert watching["kind"] == "watch"
    assert evaluation["status"] == "succeeded", evaluation
    assert [(c["label"], c["status"]) for c in sweep["checkpoints"]] == [
        ("step-50", "refused"),
        ("step-100", "succeeded"),
        ("step-200", "succeeded"),
    ]
    refusal = sweep["checkpoints"][0]["error"]
    assert "model.norm.weight has shape (65,)" in refusal and "links" not in sweep["checkpoints"][0]


def _assert_equals_lm_eval_cli(
    demo: Any, checkpoint: Path, served: dict[str, Any], tmp_path: Path
) -> None:
    """``served`` (a results file and samples) equals ``lm_eval run --model hf`` on the
    checkpoint's merged weights, per sample."""
    from tests.helpers import run_lm_eval_cli

    merged = merge(checkpoint, demo.model_dir, tmp_path / "merged")
    run_lm_eval_cli(["run", "--model", "hf", "--model_args", f"pretrained={merged},dtype=float32",
                     "--include_path", str(demo.tasks_dir), "--tasks", ",".join(TASKS),
                     "--limit", "4", "--num_fewshot", "1", "--device", "cpu", "--batch_size", "4",
                     "--log_samples", "--output_path", str(tmp_path / "ref")])  # fmt: skip
    _, reference, reference_samples = read_outputs(tmp_path / "ref")
    assert_same_results(
        {"results": _metrics(reference), "samples": reference_samples},
        {"results": _metrics(served["results"]), "samples": served["samples"]},
    )


def _assert_remote_results_write_a_sweep(
    url: str, evaluation_id: str, swept: dict[str, Any], tmp_path: Path, capsys: Any
) -> None:
    """``rayeval results ID --output_path OUT`` prints the sweep's table and writes what
    ``rayeval run --checkpoints`` writes (each checkpoint's files verbatim, ``sweep.json``),
    which ``rayeval results OUT`` reads back."""
    from rayeval.api.cli import main

    capsys.readouterr()
    out = tmp_path / "remote"
    assert main(["results", evaluation_id, "--url", url, "--output_path", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| Tasks" in printed and "step-300" in printed and "sweep.json" in printed
    for step in STEPS:
        _, results, samples = read_outputs(out / step)
        assert results == swept[step]["results"] and samples == swept[step]["samples"]
    assert main(["results", str(out)]) == 0
    assert "step-100" in capsys.readouterr().out


def _checkpoints_at_least(client: Any, count: int) -> Any:
    """A ``wait_for`` condition: the sweep has ``count`` checkpoints (or the evaluation ended)."""

    def done(evaluation: dict[str, Any]) -> bool:
        if evaluation["status"] in ("succeeded", "failed", "cancelled"):
            return True
        sweep = client.get(f"/evaluations/{evaluation['id']}/sweep").json()
        return len(sweep["checkpoints"]) >= count

    return done


@pytest.mark.unit
def test_a_runner_forgets_the_files_it_delivered() -> None:
    """Checkpoint events up to the service's cursor keep their record and lose their files."""
    import time

    from rayeval.service.jobs.runner_actor import _drop_delivered_files
    from rayeval.service.vocabulary.events import CheckpointOutputs, RunnerCheckpoint, RunnerWaiting

    def checkpoint(seq: int) -> RunnerCheckpoint:
        outputs = CheckpointOutputs(record={"label": f"s{seq}", "status": "succeeded"},
                                    results_json="{}", samples={"t": "x"})  # fmt: skip
        return RunnerCheckpoint(seq=seq, time=time.time(), outputs=outputs)

    events: list[Any] = [checkpoint(1), RunnerWaiting(seq=2, time=0.0), checkpoint(3)]
    assert _drop_delivered_files(events, 0, 2) == 2
    assert events[0].outputs.results_json is None and events[0].outputs.samples == {}
    assert events[0].outputs.record["label"] == "s1"
    assert events[2].outputs.results_json == "{}"  # not delivered yet
    assert _drop_delivered_files(events, 2, 9) == 3 and events[2].outputs.samples == {}
