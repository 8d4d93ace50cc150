"""Fine-tuned weights over a base: a LoRA adapter (``peft=``) and delta weights (``delta=``).

A real LoRA is trained for a few steps on the demo Llama with the ``peft`` package on the CPU
(:mod:`tests.lora_run`), so that it changes the answers; delta weights are seeded noise saved as
a model folder. The reference is lm-eval's own ``hf`` backend with the same ``peft=``/``delta=``
in the same dtype; rayeval must give its per-sample results at 1x1, 2x1 and 1x2 (FSDP), in
float32 (|delta logprob| <= 1e-4) and bf16 (within lm-eval hf's own spread between its batch
sizes on this machine: bit for bit where it does not move), through the Python LM and (float32,
2x1) the CLI.
Bad adapters are refused before any rank starts; the server holds adapter paths to its model
roots; the response cache keys answers by the adapter's content. Sweeps over a LoRA run's
checkpoints (CLI ``--checkpoints``, a REST watch, the dashboard's rows) keep the base loaded and
equal lm-eval per adapter; an adapter whose tokenizer is longer (added tokens) or shorter (a
padded vocabulary) than the base's vocabulary is resized as lm-eval resizes it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    HfSpread,
    assert_same_results,
    evaluate,
    half_precision_parity,
    hf_reference,
    hf_spread,
    read_outputs,
    run_lm_eval_cli,
)
from tests.lora_run import corpus_texts, pad_vocabulary, train_lora

RUN = {"num_fewshot": 1, "limit": 4, "bootstrap_iters": 0}
TASKS = ["demo_mc", "demo_cloze", "demo_rolling", "demo_gen_short"]


@pytest.fixture(scope="module")
def lora(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA trained for a few steps on the demo model (seconds on the CPU)."""
    from rayeval.service.demo.make_data import DATA_DIR

    return train_lora(demo.model_dir, tmp_path_factory.mktemp("lora") / "adapter",
                      corpus_texts(DATA_DIR))  # fmt: skip


@pytest.fixture(scope="module")
def lora_later(demo: Any, lora: Path) -> Path:
    """Another checkpoint of the same LoRA run (same config; other matrices)."""
    from rayeval.service.demo.make_data import DATA_DIR

    return train_lora(demo.model_dir, lora.parent / "later", corpus_texts(DATA_DIR), steps=4,
                      seed=1)  # fmt: skip


@pytest.fixture(scope="module")
def delta(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Delta weights of the demo model's architecture: seeded noise, a model folder."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(39)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.2 * param.std() * torch.randn(param.shape, generator=generator))
    out = tmp_path_factory.mktemp("delta") / "delta"
    model.save_pretrained(out)
    return out


class References(dict):  # type: ignore[type-arg]
    """lm-eval hf by (model arg, dtype): ``("peft", "bfloat16")``, ``("", "float32")`` (the base
    alone); computed on first use."""

    def __init__(self, demo: Any, task_manager: Any, paths: dict[str, Path]) -> None:
        super().__init__()
        self._demo, self._task_manager, self._paths = demo, task_manager, paths

    def __missing__(self, key: tuple[str, str]) -> dict[str, Any]:
        arg, dtype = key
        model_args = {"pretrained": str(self._demo.model_dir), "dtype": dtype}
        if arg:
            model_args["peft" if arg == "later" else arg] = str(self._paths[arg])
        self[key] = evaluate("hf", self._task_manager, TASKS, model_args=model_args,
                             device="cpu", batch_size=4, **RUN)  # fmt: skip
        return self[key]

    def spread(self, arg: str, dtype: str) -> HfSpread:
        """lm-eval hf's answers with ``arg`` at several batch sizes (bf16's reference)."""
        return hf_spread(self._demo.model_dir, self._task_manager, TASKS, dtype,
                         {arg: str(self._paths[arg])}, **RUN)  # fmt: skip

    def assert_matches(self, arg: str, dtype: str, ours: dict[str, Any], what: str) -> None:
        """float32: lm-eval hf's per-sample results within the fidelity tolerance; bf16: within
        lm-eval hf's own spread on this machine (bit for bit where it does not move)."""
        if dtype == "float32":
            assert_same_results(self[(arg, dtype)], ours)
        else:
            self.spread(arg, dtype).assert_holds(ours, what)


@pytest.fixture(scope="module")
def references(
    demo: Any, task_manager: Any, lora: Path, lora_later: Path, delta: Path
) -> References:
    return References(demo, task_manager, {"peft": lora, "later": lora_later, "delta": delta})


# ------------------------------------------------------------------ e2e: parity with lm-eval hf
LAYOUTS = [  # (R, G, dtype, model arg)
    (1, 1, "float32", "peft"),  # 1x2 float32: test_adapter_swaps_in_place
    (2, 1, "bfloat16", "peft"),  # two replicas of one rank: the 1x1 path twice
    (1, 2, "bfloat16", "peft"),
    (1, 2, "float32", "delta"),
    (1, 1, "bfloat16", "delta"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("replicas", "shard_size", "dtype", "arg"),
    half_precision_parity(LAYOUTS, [f"{a}-{r}x{g}-{d}" for r, g, d, a in LAYOUTS]),
)
def test_adapter_matches_lm_eval_hf(
    replicas: int, shard_size: int, dtype: str, arg: str, demo: Any, lora: Path, delta: Path,
    references: References, task_manager: Any, ray_session: None,
) -> None:  # fmt: skip
    """Every request type per sample as lm-eval's hf backend with the same peft=/delta= (bf16
    within its own spread); at G=2 each rank holds half the base, and the adapter changes the
    answers."""
    from rayeval.service.engine.lm import RayEvalLM

    path = {"peft": lora, "delta": delta}[arg]
    with RayEvalLM(
        pretrained=str(demo.model_dir), dtype=dtype, num_replicas=replicas,
        shard_size=shard_size, batch_size="auto", max_batch_tokens=256, **{arg: str(path)},
    ) as lm:  # fmt: skip
        ours = evaluate(lm, task_manager, TASKS, **RUN)
        reports = lm.engine.load_reports
        assert lm.engine.shard_strategy.value == "fsdp"
    references.assert_matches(arg, dtype, ours, f"rayeval {replicas}x{shard_size}")
    if shard_size == 2:  # each rank holds its half of the base (plus a whole, tiny adapter)
        total = sum(r.local_parameters for r in reports)
        assert max(r.local_parameters for r in reports) <= total / 2 * 1.05
    if dtype != "float32":
        return
    base = references[("", "float32")]
    changed = [
        task
        for task in TASKS
        if [s["resps"] for s in base["samples"][task]]
        != [s["resps"] for s in references[(arg, "float32")]["samples"][task]]
    ]  # fmt: skip
    # every task's answers move (a greedy generation too, for the trained LoRA)
    moved = set(TASKS) if arg == "peft" else {"demo_mc", "demo_cloze", "demo_rolling"}
    assert moved <= set(changed), f"the {arg} weights change no answer of {moved - set(changed)}"


@pytest.mark.e2e
def test_adapter_swaps_in_place(
    demo: Any, lora: Path, lora_later: Path, references: References, task_manager: Any,
    ray_session: None, tmp_path: Path,
) -> None:  # fmt: skip
    """At 1x2 FSDP in float32: one engine evaluates a LoRA, then another checkpoint of the same
    run swapped in place (the base stays loaded; only the matrices are rewritten), each equal to
    lm-eval hf with that peft=; an adapter of another config is refused, nothing swapped."""
    from rayeval.actors.errors import ConfigError
    from rayeval.service.engine.lm import RayEvalLM

    other = tmp_path / "other"
    train_lora(demo.model_dir, other, ["a few words"], steps=1, rank=4)
    with RayEvalLM(
        pretrained=str(demo.model_dir), dtype="float32", shard_size=2, peft=str(lora),
        batch_size="auto", max_batch_tokens=256,
    ) as lm:  # fmt: skip
        assert_same_results(
            references[("peft", "float32")], evaluate(lm, task_manager, TASKS, **RUN)
        )
        refusal = r"differs from the loaded adapter .* in lora_alpha, r: only checkpoints"
        with pytest.raises(ConfigError, match=refusal):
            lm.engine.swap_adapter(str(other))
        swap = lm.engine.swap_adapter(str(lora_later))
        assert lm.engine.config.model_args["peft"] == str(lora_later)
        assert_same_results(
            references[("later", "float32")], evaluate(lm, task_manager, TASKS, **RUN)
        )
    print(f"adapter swap at 1x2: {swap}")  # the matrices only: the base is not read again
    assert swap.seconds < 5, swap
    assert references[("later", "float32")]["results"] != references[("peft", "float32")]["results"]


TP_CASES = [  # (model arg, dtype): shard_strategy tp at 1x2
    ("peft", "float32"),  # then another checkpoint of the run, swapped in place
    ("peft", "bfloat16"),
    ("delta", "float32"),
    ("delta", "bfloat16"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("arg", "dtype"), half_precision_parity(TP_CASES, [f"{a}-{d}" for a, d in TP_CASES])
)
def test_adapter_under_tensor_parallelism_matches_lm_eval_hf(
    arg: str, dtype: str, demo: Any, lora: Path, lora_later: Path, delta: Path,
    references: References, task_manager: Any, ray_session: None,
) -> None:  # fmt: skip
    """``shard_strategy="tp"`` at 1x2: each rank holds its half of the base (and of a LoRA's B
    where a layer keeps its output columns), and every request type per sample is lm-eval hf's
    with the same peft=/delta= (bf16 within its own spread); a swapped LoRA checkpoint too."""
    from rayeval.service.engine.lm import RayEvalLM

    path = {"peft": lora, "delta": delta}[arg]
    swap = arg == "peft" and dtype == "float32"
    with RayEvalLM(
        pretrained=str(demo.model_dir), dtype=dtype, shard_size=2, shard_strategy="tp",
        batch_size="auto", max_batch_tokens=256, **{arg: str(path)},
    ) as lm:  # fmt: skip
        ours = evaluate(lm, task_manager, TASKS, **RUN)
        assert lm.engine.shard_strategy.value == "tp"
        held = [r.local_parameters for r in lm.engine.load_reports]
        if swap:
            lm.engine.swap_adapter(str(lora_later))
            swapped = evaluate(lm, task_manager, TASKS, **RUN)
    references.assert_matches(arg, dtype, ours, "rayeval 1x2 tp")
    if swap:
        assert_same_results(references[("later", "float32")], swapped)
    # each rank holds its half of the base, and of the adapter at most the whole
    import math

    import transformers

    from rayeval.actors.weights.adapters import adapter_shapes

    base = transformers.AutoModelForCausalLM.from_pretrained(demo.model_dir).num_parameters()
    adapter = sum(math.prod(s) for s in adapter_shapes(str(lora)).values()) if arg == "peft" else 0
    print(f"parameters per rank under tp with {arg}=: {held} (base {base}, adapter {adapter})")
    assert max(held) <= base / 2 * 1.05 + adapter


@pytest.mark.e2e
def test_cli_peft_two_replicas_writes_what_lm_eval_writes(
    demo: Any, lora: Path, ray_session: None, tmp_path: Path
) -> None:
    """``rayeval run --model_args pretrained=...,peft=...`` at 2x1 writes the per-sample results
    ``lm_eval run`` writes with the same model args."""
    from rayeval.api.cli import main

    common = ["--model", "hf", "--model_args",
              f"pretrained={demo.model_dir},dtype=float32,peft={lora}",
              "--include_path", str(demo.tasks_dir), "--tasks", ",".join(TASKS),
              "--limit", "4", "--num_fewshot", "1", "--seed", "7",
              "--log_samples"]  # fmt: skip
    run_lm_eval_cli(["run", *common, "--device", "cpu", "--batch_size", "4",
                     "--output_path", str(tmp_path / "ref")])  # fmt: skip
    assert (
        main(["run", *common, "--num_replicas", "2", "--output_path", str(tmp_path / "ours")]) == 0
    )
    _, reference, reference_samples = read_outputs(tmp_path / "ref")
    _, results, samples = read_outputs(tmp_path / "ours")
    assert results["config"]["model_args"]["peft"] == str(lora)
    assert_same_results(
        {"results": reference["results"], "samples": reference_samples},
        {"results": results["results"], "samples": samples},
    )


@pytest.fixture(scope="module")
def gpt2_lora(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A GPT-2-style model (Conv1D projections, a tied vocabulary of 769 rows) and a LoRA on
    its attention and MLP layers, as PEFT targets them (``fan_in_fan_out``)."""
    from rayeval.service.demo.make_data import DATA_DIR
    from tests.models import build_model

    root = tmp_path_factory.mktemp("gpt2")
    base = build_model("gpt2", root / "base", demo.model_dir, extra_rows=1)
    adapter = train_lora(base, root / "adapter", corpus_texts(DATA_DIR), steps=4,
                         targets=["c_attn", "c_proj", "c_fc"])  # fmt: skip
    return base, adapter


GPT2_LAYOUTS = [(1, "float32"), (2, "float32"), (2, "bfloat16")]  # (G, dtype); auto: FSDP


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("shard_size", "dtype"),
    half_precision_parity(GPT2_LAYOUTS, [f"1x{g}-{d}" for g, d in GPT2_LAYOUTS]),
)
def test_gpt2_lora_on_conv1d_layers_matches_lm_eval_hf(
    shard_size: int, dtype: str, gpt2_lora: tuple[Path, Path], task_manager: Any,
    ray_session: None,
) -> None:  # fmt: skip
    """A LoRA on GPT-2's Conv1D layers (weights stored in x out) is applied, not refused:
    every request type per sample as lm-eval hf with the same peft= (bf16: within its own
    spread), and the adapter changes the answers."""
    from rayeval.service.engine.lm import RayEvalLM

    base, adapter = gpt2_lora
    with RayEvalLM(
        pretrained=str(base), peft=str(adapter), dtype=dtype, shard_size=shard_size,
        batch_size="auto", max_batch_tokens=256,
    ) as lm:  # fmt: skip
        ours = evaluate(lm, task_manager, TASKS, **RUN)
    if dtype == "float32":
        reference = hf_reference(
            base, task_manager, TASKS, dtype, model_args={"peft": str(adapter)}, **RUN
        )
        assert_same_results(reference, ours)
        plain = hf_reference(base, task_manager, TASKS, dtype, **RUN)
        assert plain["results"] != reference["results"], "the LoRA changes no answer"
    else:
        spread = hf_spread(base, task_manager, TASKS, dtype, {"peft": str(adapter)}, **RUN)
        spread.assert_holds(ours, f"rayeval 1x{shard_size}, GPT-2 LoRA")


# ------------------------------------------------------------------ refusals, before any rank
def _copy_adapter(lora: Path, out: Path, **config: Any) -> Path:
    shutil.copytree(lora, out)
    file = out / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    return out


@pytest.mark.service
def test_bad_adapters_are_refused_before_any_rank_starts(
    demo: Any, lora: Path, delta: Path, tmp_path: Path
) -> None:
    """No adapter config, another adapter type, DoRA, an adapter of another base, peft with
    delta: a ConfigError naming the arg and the fix, raised while
    the engine is built (no Ray is started: no ``ray_session`` here)."""
    import torch
    from safetensors.torch import load_file, save_file

    from rayeval.actors.errors import ConfigError
    from rayeval.service.engine.lm import RayEvalLM

    def refused(match: str, **kwargs: Any) -> None:
        with pytest.raises(ConfigError, match=match):
            RayEvalLM(pretrained=str(demo.model_dir), dtype="float32", **kwargs)

    empty = tmp_path / "empty"
    empty.mkdir()
    refused(r"peft=.*: no adapter_config\.json in it\. Name the folder", peft=str(empty))
    refused(r"peft=.*: no such folder", peft=str(tmp_path / "missing"))
    ia3 = _copy_adapter(lora, tmp_path / "ia3", peft_type="IA3")
    refused(r"peft=.*: a IA3 adapter; the ranks apply LoRA adapters only: merge", peft=str(ia3))
    dora = _copy_adapter(lora, tmp_path / "dora", use_dora=True)
    refused(r"peft=.*: a LoRA adapter with DoRA", peft=str(dora))
    other = _copy_adapter(lora, tmp_path / "other")
    weights = load_file(other / "adapter_model.safetensors")
    key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    weights[key] = torch.zeros(weights[key].shape[0], 96)  # trained on a wider base
    save_file(weights, other / "adapter_model.safetensors")
    refused(r"peft=.*has shape \(8, 96\), but layer .*q_proj of pretrained's model is 64 -> 64",
            peft=str(other))  # fmt: skip
    refused(r"peft with delta: .* give one of them", peft=str(lora), delta=str(delta))
    refused(r"delta=.*: name a model folder of pretrained's architecture", delta=str(lora))


@pytest.mark.service
def test_server_holds_adapters_to_its_model_roots(demo: Any, lora: Path, tmp_path: Path) -> None:
    """REST: ``model_args.peft`` (and ``delta``) under the model roots, like ``pretrained``."""
    from rayeval.service.jobs.validation import ServerPolicy, policy_problems, strategy_problems
    from rayeval.service.vocabulary.config import EvaluationConfig

    def problems(roots: tuple[str, ...], **args: str) -> list[str]:
        config = EvaluationConfig(
            model_args={"pretrained": str(demo.model_dir), **args}, tasks=["demo_mc"]
        )
        return policy_problems(config, ServerPolicy(model_roots=roots))

    roots = (str(demo.model_dir.parent), str(lora.parent))
    assert problems(roots, peft=str(lora)) == []
    (found,) = problems((str(demo.model_dir.parent),), peft=str(lora))
    assert found.startswith("model_args.peft: ") and "--model-root" in found
    (missing,) = problems(roots, peft=str(lora.parent / "nothing"))  # the same answer
    assert missing.startswith("model_args.peft: ") and "is not an adapter folder under" in missing
    (outside,) = problems((str(demo.model_dir.parent),), delta=str(tmp_path))
    assert outside.startswith("model_args.delta: ")
    tp = EvaluationConfig(
        model_args={"pretrained": str(demo.model_dir), "peft": str(lora)}, tasks=["demo_mc"],
        device="cpu",
        parallelism={"shard_size": 2, "shard_strategy": "tp"},
    )  # fmt: skip
    assert strategy_problems(tp) == []  # tensor parallelism applies peft= too


@pytest.mark.unit
def test_cache_keys_answers_by_adapter_content(tmp_path: Path) -> None:
    """Two adapters never share answers; one adapter copied to another path does."""
    from rayeval.service.engine.response_cache import model_fingerprint

    def adapter(name: str, weights: bytes) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
        (folder / "adapter_model.safetensors").write_bytes(weights)
        return folder

    first, copy, other = adapter("a", b"1" * 64), adapter("b", b"1" * 64), adapter("c", b"2" * 64)
    args = {"pretrained": "org/model", "dtype": "float32"}
    base = model_fingerprint(args)
    fingerprints = [model_fingerprint({**args, "peft": str(p)}) for p in (first, copy, other)]
    assert fingerprints[0] == fingerprints[1] != fingerprints[2]
    assert base not in fingerprints


# ------------------------------------------------------------------ adapter sweeps in place
def _adapter_run(lora: Path, lora_later: Path, out: Path) -> Path:
    """A training run's folder as a PEFT trainer leaves it: ``checkpoint-*`` adapters, each with
    a ``trainer_state.json``. The steps are the states' (the names would order them the other
    way), so the sweep must read the state."""
    for name, adapter, step in (("checkpoint-b", lora, 1000), ("checkpoint-a", lora_later, 2000)):
        shutil.copytree(adapter, out / name)
        (out / name / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return out


@pytest.mark.e2e
def test_cli_adapter_sweep_keeps_the_base_and_equals_lm_eval_hf(
    demo: Any, lora: Path, lora_later: Path, ray_session: None, tmp_path: Path
) -> None:
    """``rayeval run --checkpoints RUN/checkpoint-*`` over LoRA checkpoints at 1x2 FSDP: ordered
    by ``trainer_state.json``'s step, each checkpoint's files equal, per sample, what ``lm_eval
    run --model hf`` writes with that ``peft=``; the base is read once (a further checkpoint
    reads only its adapter), and ``sweep.json`` labels each record as an adapter."""
    from rayeval.api.cli import main

    run = _adapter_run(lora, lora_later, tmp_path / "run")
    out = tmp_path / "sweep"
    base = f"pretrained={demo.model_dir},dtype=float32"
    common = ["--model", "hf", "--include_path", str(demo.tasks_dir), "--tasks", ",".join(TASKS),
              "--limit", "4", "--num_fewshot", "1", "--log_samples"]  # fmt: skip
    sweep = ["--output_path", str(out), "--checkpoints", str(run / "checkpoint-*")]
    assert main(["run", *common, "--model_args", base, "--shard_size", "2", *sweep]) == 0
    summary = json.loads((out / "sweep.json").read_text())
    records = summary["checkpoints"]
    assert [(r["label"], r["step"], r["kind"], r["status"]) for r in records] == [
        ("checkpoint-b", 1000, "adapter", "succeeded"),
        ("checkpoint-a", 2000, "adapter", "succeeded"),
    ]
    assert len({r["fingerprint"] for r in records}) == 2
    for record in records:
        reference_out = tmp_path / "ref" / record["label"]
        run_lm_eval_cli(["run", *common, "--model_args", f"{base},peft={record['checkpoint']}",
                         "--device", "cpu", "--batch_size", "4",
                         "--output_path", str(reference_out)])  # fmt: skip
        _, reference, reference_samples = read_outputs(reference_out)
        _, results, samples = read_outputs(out / record["label"])
        assert results["config"]["model_args"]["peft"] == record["checkpoint"]
        assert_same_results(
            {"results": reference["results"], "samples": reference_samples},
            {"results": results["results"], "samples": samples},
        )
    assert records[0]["results"] != records[1]["results"]  # the two adapters answer differently
    first, further = (r["seconds"] for r in records)
    print(f"adapter sweep seconds: first {first}, further {further}")
    # the further checkpoint's swap reads the adapter's matrices, not the base
    assert further["swap"] < 5 and further["read"] < first["read"], (first, further)


@pytest.mark.service
def test_adapter_sweeps_refuse_mixed_or_foreign_checkpoints(
    demo: Any, lora: Path, delta: Path, tmp_path: Path
) -> None:
    """Before any rank starts: ``peft=``/``delta=`` beside ``--checkpoints``, an adapter sweep
    that also names model weights, or an adapter of another LoRA run; ``checkpoint=`` naming an
    adapter says to pass it as ``peft=``. (No Ray is started: no ``ray_session``.)"""
    from rayeval.actors.errors import CheckpointError, ConfigError
    from rayeval.service.engine.lm import RayEvalLM
    from rayeval.service.engine.sweep import run_sweep
    from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions

    def sweep(checkpoints: list[Path], **args: str) -> None:
        config = EvaluationConfig(
            model_args={"pretrained": str(demo.model_dir), "dtype": "float32", **args},
            tasks=["demo_mc"], limit=2,
        )  # fmt: skip
        host = HostOptions(output_path=str(tmp_path / "out"), include_paths=(str(demo.tasks_dir),))
        run_sweep(config, host, checkpoints)

    with pytest.raises(ConfigError, match=r"drop peft= from --model_args and name the adapter"):
        sweep([lora], peft=str(lora))
    with pytest.raises(ConfigError, match=r"delta= over a checkpoint sweep is not supported"):
        sweep([lora], delta=str(delta))
    with pytest.raises(CheckpointError, match=r"is model weights and this sweep's first .* LoRA"):
        sweep([lora, delta])
    other = tmp_path / "other"
    train_lora(demo.model_dir, other, ["a few words"], steps=1, rank=4)
    with pytest.raises(CheckpointError, match=r"differs from the loaded adapter .* lora_alpha, r"):
        sweep([lora, other])
    with pytest.raises(ConfigError, match=r"is a PEFT adapter, not the model's weights: pass it"):
        RayEvalLM(pretrained=str(demo.model_dir), dtype="float32", checkpoint=str(lora))


@pytest.mark.unit
def test_adapter_checkpoint_folders_and_steps(lora: Path, tmp_path: Path) -> None:
    """An adapter folder is a checkpoint; its weights without ``adapter_config.json`` (PEFT writes
    it last) are a save still under way; steps come from ``trainer_state.json``, else the name."""
    from rayeval.actors.weights.checkpoint_dirs import (
        CheckpointFormat,
        by_step,
        candidates,
        inspect_dir,
        step_of_dir,
    )

    run = _adapter_run(lora, lora, tmp_path / "run")
    found = inspect_dir(run / "checkpoint-a")
    assert found is not None and found.format is CheckpointFormat.ADAPTER and found.complete
    assert [step_of_dir(p) for p in (run / "checkpoint-a", run / "checkpoint-b")] == [2000, 1000]
    assert [p.name for p in by_step(list(run.iterdir()))] == ["checkpoint-b", "checkpoint-a"]
    saving = run / "checkpoint-3000"
    saving.mkdir()
    shutil.copy(lora / "adapter_model.safetensors", saving)
    (partial,) = [c for c in candidates(run) if c.path == saving]
    assert not partial.complete and "no adapter_config.json beside it" in partial.problem
    assert step_of_dir(saving) == 3000


@pytest.mark.unit
def test_server_refuses_peft_or_delta_beside_a_sweep(demo: Any, lora: Path) -> None:
    """REST: a sweep names its adapters in ``sweep.checkpoints``; ``model_args.peft`` or
    ``model_args.delta`` beside it is refused with the field."""
    from rayeval.service.jobs.validation import ServerPolicy, expand_sweep
    from rayeval.service.vocabulary.config import EvaluationConfig

    policy = ServerPolicy(model_roots=(str(demo.model_dir.parent), str(lora.parent)))
    for arg in ("peft", "delta"):
        config = EvaluationConfig(
            model_args={"pretrained": str(demo.model_dir), arg: str(lora)}, tasks=["demo_mc"],
            sweep={"checkpoints": [str(lora)]},
        )  # fmt: skip
        _, problems = expand_sweep(config, policy)
        assert any(p.startswith(f"model_args.{arg}: ") for p in problems), problems


@pytest.mark.e2e
def test_rest_watch_over_adapter_checkpoints(
    demo: Any, lora: Path, lora_later: Path, references: References, ray_session: None,
    tmp_path: Path,
) -> None:  # fmt: skip
    """``sweep.watch`` on a folder of LoRA checkpoints over REST: each is evaluated on the base
    loaded once, stored by its ``trainer_state.json`` step and labelled as an adapter, with
    lm-eval hf's metrics for that ``peft=``; ``model_args.peft`` beside a sweep is a 422."""
    from tests.test_service import ServerThread, body, finished, make_settings, submit, wait_for

    run = _adapter_run(lora, lora_later, tmp_path / "run")
    settings = make_settings(tmp_path / "data", demo.tasks_dir)
    roots = [str(demo.model_dir.parent), str(run)]
    server = ServerThread(settings.model_copy(update={"model_roots": roots}))
    server.start()
    args = {"pretrained": str(demo.model_dir), "dtype": "float32"}
    watch = {"watch": str(run), "poll_s": 0.2, "max_checkpoints": 2}
    request = {"tasks": TASKS, **RUN, "parallelism": {"num_replicas": 1, "shard_size": 1}}
    try:
        with server.client() as client:
            with_peft = {**args, "peft": str(run / "checkpoint-a")}
            refused = client.post("/evaluations", json=body(demo, **request, model_args=with_peft,
                                                            sweep=watch))  # fmt: skip
            assert refused.status_code == 422 and "model_args.peft" in refused.text, refused.text
            accepted = submit(client, body(demo, **request, model_args=args, sweep=watch))
            evaluation = wait_for(client, accepted["id"], finished, timeout_s=600)
            sweep = client.get(f"/evaluations/{accepted['id']}/sweep").json()
            served = {
                c["label"]: client.get(c["links"]["results"]).json() for c in sweep["checkpoints"]
            }
        rows, points = _dashboard_sweep(server.url, accepted["id"])
    finally:
        server.stop()
    if rows:  # the dashboard: a curve by step, each row labelled as an adapter
        assert rows == [["checkpoint-b", "adapter", "checkpoint-b (adapter)"],
                        ["checkpoint-a", "adapter", "checkpoint-a (adapter)"]]  # fmt: skip
        assert points == [["checkpoint-b", "1000"], ["checkpoint-a", "2000"]]
    assert evaluation["status"] == "succeeded", evaluation
    assert [(c["label"], c["step"], c["kind"], c["status"]) for c in sweep["checkpoints"]] == [
        ("checkpoint-b", 1000, "adapter", "succeeded"),
        ("checkpoint-a", 2000, "adapter", "succeeded"),
    ]
    for label, key in (("checkpoint-b", "peft"), ("checkpoint-a", "later")):
        ours = served[label]
        assert ours["config"]["model_args"]["peft"] == str((run / label).resolve())
        for task, metrics in references[(key, "float32")]["results"].items():
            for name, value in metrics.items():
                if "," in name and "stderr" not in name:
                    near = pytest.approx(value, rel=1e-5, abs=1e-4)  # perplexity: relative
                    assert ours["results"][task][name] == near, (label, task, name)


def _dashboard_sweep(url: str, evaluation_id: str) -> tuple[list[Any], list[Any]]:
    """What Chromium shows of a finished sweep: its table rows (label, kind, first cell) and the
    ``demo_mc`` accuracy curve's points (label, step); empty without Debian's chromium."""
    from tests.test_service import CHROMIUM, CHROMIUM_ARGS

    if not Path(CHROMIUM).exists():
        return [], []
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(f"{url}/#{evaluation_id}")
            page.locator("#sweep-table tbody tr").nth(1).wait_for(timeout=30_000)
            rows = page.locator("#sweep-table tbody tr").evaluate_all(
                "rows => rows.map(r => [r.dataset.label, r.dataset.kind, r.cells[0].textContent])"
            )
            curve = "#sweep-curves svg.curve[data-task='demo_mc'][data-metric='acc']"
            points = page.locator(f"{curve} circle.point").evaluate_all(
                "points => points.map(p => [p.dataset.label, p.dataset.step])"
            )
        finally:
            browser.close()
    return rows, points


# ------------------------------------------------------------------ a resized vocabulary
#: Tokens the ``grown`` adapter's tokenizer adds: words of the demo tasks' first documents, so
#: that prompts and answers are tokenised into them.
ADDED_TOKENS = ["What", " comes after", " baby", "Once upon a time"]


@pytest.fixture(scope="module")
def grown(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA trained with tokens added to the tokenizer (saved beside it) and the embeddings
    resized for them; PEFT saved the resized embeddings and head with it."""
    from rayeval.service.demo.make_data import DATA_DIR

    return train_lora(demo.model_dir, tmp_path_factory.mktemp("grown") / "adapter",
                      corpus_texts(DATA_DIR), steps=4, added_tokens=ADDED_TOKENS)  # fmt: skip


@pytest.fixture(scope="module")
def padded(demo: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A base with tied embeddings padded 64 rows beyond its tokenizer, and a LoRA of it."""
    from rayeval.service.demo.make_data import DATA_DIR

    root = tmp_path_factory.mktemp("padded")
    base = pad_vocabulary(demo.model_dir, root / "base", rows=832)
    return base, train_lora(base, root / "adapter", corpus_texts(DATA_DIR), steps=4)


def _resized_args(case: str, grown: Path, padded: tuple[Path, Path], demo: Any) -> dict[str, str]:
    if case == "grown":
        return {"pretrained": str(demo.model_dir), "peft": str(grown), "tokenizer": str(grown)}
    return {"pretrained": str(padded[0]), "peft": str(padded[1])}


RESIZED = [  # (case, R, G, dtype)
    ("grown", 1, 1, "float32"),
    ("grown", 1, 2, "float32"),
    ("padded", 1, 2, "bfloat16"),  # within lm-eval hf's spread (bit for bit where it is 0)
]  # bf16 with added tokens is not bit for bit: docs/architecture.md, "Not yet"


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("case", "replicas", "shard_size", "dtype"),
    half_precision_parity(RESIZED, [f"{c}-{r}x{g}-{d}" for c, r, g, d in RESIZED]),
)
def test_resized_vocabulary_matches_lm_eval_hf(
    case: str, replicas: int, shard_size: int, dtype: str, demo: Any, grown: Path,
    padded: tuple[Path, Path], task_manager: Any, ray_session: None,
) -> None:  # fmt: skip
    """A tokenizer of another length than the base's vocabulary, which lm-eval resizes the
    embeddings and head for before applying peft=: grown for added tokens (their rows are the
    ones the adapter saved) or shrunk from a padded vocabulary (tied embeddings, rows cut off).
    Every request type per sample as lm-eval's hf backend, whole and FSDP-sharded (each rank
    reads its rows: vocabulary chunks over the resized row count)."""
    from rayeval.service.engine.lm import RayEvalLM

    def reference(args: dict[str, str]) -> dict[str, Any]:
        return evaluate("hf", task_manager, TASKS, model_args={**args, "dtype": dtype},
                        device="cpu", batch_size=4, **RUN)  # fmt: skip

    args = _resized_args(case, grown, padded, demo)
    swap = case == "grown" and shard_size == 2  # another checkpoint of the run, swapped in place
    with RayEvalLM(
        dtype=dtype, num_replicas=replicas, shard_size=shard_size, batch_size="auto",
        max_batch_tokens=256, **args,
    ) as lm:  # fmt: skip
        ours = evaluate(lm, task_manager, TASKS, **RUN)
        assert lm.engine.shard_strategy.value == "fsdp"
        if swap:  # its saved embeddings and head are rewritten in the rows each rank holds
            from rayeval.service.demo.make_data import DATA_DIR

            later = train_lora(demo.model_dir, grown.parent / "later", corpus_texts(DATA_DIR),
                               steps=2, seed=1, added_tokens=ADDED_TOKENS)  # fmt: skip
            lm.engine.swap_adapter(str(later))
            swapped = evaluate(lm, task_manager, TASKS, **RUN)
    if dtype == "float32":
        assert_same_results(reference(args), ours)
    else:  # lm-eval's own bf16 answers move with its batch size on these tokenizers
        model_dir, extra = args["pretrained"], {k: v for k, v in args.items() if k != "pretrained"}
        spread = hf_spread(model_dir, task_manager, TASKS, dtype, extra, **RUN)
        spread.assert_holds(ours, f"rayeval {replicas}x{shard_size} ({case})")
    if swap:
        assert_same_results(reference({**args, "peft": str(later)}), swapped)
    if case == "grown":  # the prompts are tokenised into added tokens (their rows are read)
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(grown)
        prompts = [s["arguments"][0][0] for s in ours["samples"]["demo_gen_short"]]
        assert max(max(tokenizer(p)["input_ids"]) for p in prompts) >= 768


@pytest.mark.service
def test_resized_vocabulary_refusals_before_any_rank_starts(
    demo: Any, grown: Path, tmp_path: Path
) -> None:
    """Added tokens whose adapter saved no embeddings (lm-eval gives them random rows), saved
    embeddings without the tokenizer they were trained with, or a resized vocabulary under
    tensor parallelism: a ConfigError naming peft= and the
    fix, while the engine is built (no Ray: no ``ray_session`` here)."""
    from safetensors.torch import load_file, save_file

    from rayeval.actors.errors import ConfigError
    from rayeval.service.engine.lm import RayEvalLM

    bare = tmp_path / "bare"
    shutil.copytree(grown, bare)
    weights = load_file(bare / "adapter_model.safetensors")
    for key in ("base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"):
        del weights[key]
    save_file(weights, bare / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=(
        r"peft=.*bare: the tokenizer has 772 tokens, 4 more than pretrained's model \(768\), "
        r"and the adapter saved no model\.embed_tokens\.weight or lm_head\.weight .*"
        r"save_embedding_layers=True"
    )):  # fmt: skip
        RayEvalLM(pretrained=str(demo.model_dir), dtype="float32", peft=str(bare),
                  tokenizer=str(bare))  # fmt: skip
    with pytest.raises(ConfigError, match=(
        r"peft=.*: the adapter saved .*(embed_tokens|lm_head)\.weight with 772 rows, but the "
        r"tokenizer has 768 tokens: pass the tokenizer the adapter was trained with in tokenizer="
    )):  # fmt: skip
        RayEvalLM(pretrained=str(demo.model_dir), dtype="float32", peft=str(grown))
    with pytest.raises(ConfigError, match=(
        r"peft=.*: the adapter resizes the vocabulary to the tokenizer, which shard_strategy tp "
        r"does not apply: use .*fsdp"
    )):  # fmt: skip
        RayEvalLM(pretrained=str(demo.model_dir), dtype="float32", peft=str(grown),
                  tokenizer=str(grown), shard_size=2, shard_strategy="tp")  # fmt: skip
    saved = tmp_path / "saved"  # the base's vocabulary, its head saved with the adapter
    shutil.copytree(grown, saved)
    weights = load_file(saved / "adapter_model.safetensors")
    del weights["base_model.model.model.embed_tokens.weight"]
    weights["base_model.model.lm_head.weight"] = weights["base_model.model.lm_head.weight"][:768]
    save_file(weights, saved / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=(
        r"peft=.*saved: the adapter saved the embeddings or head, which shard_strategy tp does "
        r"not apply: use .*fsdp"
    )):  # fmt: skip
        RayEvalLM(pretrained=str(demo.model_dir), dtype="float32", peft=str(saved),
                  shard_size=2, shard_strategy="tp")  # fmt: skip
