"""Fine-tuned weights over a base: a LoRA adapter (``peft=``) and delta weights (``delta=``).

A real LoRA is trained for a few steps on the demo Llama with the ``peft`` package on the CPU
(:mod:`tests.lora_run`), so that it changes the answers; delta weights are seeded noise saved as
a model folder. The reference is lm-eval's own ``hf`` backend with the same ``peft=``/``delta=``
in the same dtype; rayeval must give its per-sample results at 1x1, 2x1 and 1x2 (FSDP), in
float32 (|delta logprob| <= 1e-4) and bf16 (bit for bit), through the Python LM and (float32,
2x1) the CLI.
Bad adapters are refused before any rank starts; the server holds adapter paths to its model
roots; the response cache keys answers by the adapter's content.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_results, evaluate, read_outputs, run_lm_eval_cli
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
    LAYOUTS,
    ids=[f"{a}-{r}x{g}-{d}" for r, g, d, a in LAYOUTS],
)
def test_adapter_matches_lm_eval_hf(
    replicas: int, shard_size: int, dtype: str, arg: str, demo: Any, lora: Path, delta: Path,
    references: References, task_manager: Any, ray_session: None,
) -> None:  # fmt: skip
    """Every request type per sample as lm-eval's hf backend with the same peft=/delta= (bf16
    bit for bit); at G=2 each rank holds half the base, and the adapter changes the answers."""
    from rayeval.service.engine.lm import RayEvalLM

    path = {"peft": lora, "delta": delta}[arg]
    with RayEvalLM(
        pretrained=str(demo.model_dir), dtype=dtype, num_replicas=replicas,
        shard_size=shard_size, batch_size="auto", max_batch_tokens=256, **{arg: str(path)},
    ) as lm:  # fmt: skip
        ours = evaluate(lm, task_manager, TASKS, **RUN)
        reports = lm.engine.load_reports
        assert lm.engine.shard_strategy.value == "fsdp"
    exact = dtype != "float32"
    assert_same_results(references[(arg, dtype)], ours, exact=exact)
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
    delta, peft under tensor parallelism: a ConfigError naming the arg and the fix, raised while
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
    refused(r"shard_strategy tp does not apply peft= .*: use shard_strategy='fsdp' \(or auto\)",
            peft=str(lora), shard_size=2, shard_strategy="tp")  # fmt: skip
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
    (refused,) = strategy_problems(tp)
    assert "shard_strategy tp does not apply peft=" in refused and "model_args.peft" in refused


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
    ("padded", 1, 2, "float32"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("case", "replicas", "shard_size", "dtype"),
    RESIZED,
    ids=[f"{c}-{r}x{g}-{d}" for c, r, g, d in RESIZED],
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
    assert_same_results(reference(args), ours, exact=dtype != "float32")
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
    """Added tokens whose adapter saved no embeddings (lm-eval gives them random rows), or saved
    embeddings without the tokenizer they were trained with: a ConfigError naming peft= and the
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
