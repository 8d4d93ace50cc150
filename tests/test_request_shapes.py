"""Every request lm-eval's hf backend scores, rayeval scores identically; the odd ones are reported.

Two model families are built here with one hand-made byte-level BPE whose merges swallow a chat
template's trailing newline into the choice after it (``l\\n`` + ``no`` is one token), as a
Gemma-3 tokenizer does with ``model\\n``:

- ``gemma``-style: a Llama with a chat template that starts with the BOS token and rejects the
  ``system`` role (lm-eval then folds the system instruction into the first user turn);
- ``qwen``-style: a Qwen2 (tied embeddings) with a template that accepts ``system``.

Under the gemma template, ``no`` and ``maybe`` encode to no continuation token at all (lm-eval
answers ``(0.0, True)``) and ``yes`` to its last letter only; under the qwen template the same
task is clean. Each run is compared per sample with lm-eval's own hf backend, over a sweep of
chat-template options and two layouts per family, plus an empty context, a multiple-input task,
left truncation with ``add_bos_token``, and a shape lm-eval's hf backend crashes on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import assert_same_results, evaluate

pytestmark = pytest.mark.e2e

SPECIALS = ["<s>", "</s>", "<pad>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SPECIALS += ["<|im_start|>", "<|im_end|>"]
# Byte-level spellings: "Ċ" is "\n". "l\n" + a choice merges into one token ("yes" keeps "s").
MERGES = [("l", "Ċ"), ("lĊ", "n"), ("lĊn", "o"), ("lĊ", "m"), ("lĊm", "a"), ("lĊma", "y")]
MERGES += [("lĊmay", "b"), ("lĊmayb", "e"), ("lĊ", "y"), ("lĊy", "e")]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTIONS = [
    ("Is the sky blue?", 0),
    ("Can a fish fly?", 1),
    ("Will it rain tomorrow?", 2),
    ("Is fire hot?", 0),
    ("Do cats bark?", 1),
    ("Is the coin fair?", 2),
    ("Is ice cold?", 0),
    ("Do stones swim?", 1),
]
BASE_RUN = {"limit": 6, "bootstrap_iters": 0}
SWEEP = {
    "chat": {"apply_chat_template": True},
    "chat_multiturn_system": {
        "apply_chat_template": True,
        "fewshot_as_multiturn": True,
        "num_fewshot": 2,
        "system_instruction": "Answer with one word.",
    },
    "plain": {},
}


def _tokenizer(template: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab: dict[str, int] = {}
    for token in [*SPECIALS, *sorted(alphabet), *("".join(pair) for pair in MERGES)]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[4:],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = template
    return tokenizer


def _build(root: Path, family: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tokenizer = _tokenizer(GEMMA_TEMPLATE if family == "gemma" else QWEN_TEMPLATE)
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = (
        LlamaConfig(tie_word_embeddings=False, **common)
        if family == "gemma"
        else Qwen2Config(tie_word_embeddings=True, **common)
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3 if family == "gemma" else 4)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    out = root / family
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _tasks(root: Path) -> Path:
    """Task YAMLs over local JSONL: yes/no/maybe behind " => ", an empty context, multiple
    inputs, and only the two choices that encode to nothing (lm-eval's hf crashes on it)."""
    import yaml

    data = root / "data"
    data.mkdir(parents=True)
    rows = [{"question": q, "answer": a} for q, a in QUESTIONS]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {s: str(data / f"{s}.jsonl") for s in ("train", "test")}},
        "training_split": "train",
        "fewshot_split": "train",
        "test_split": "test",
        "output_type": "multiple_choice",
        "metric_list": [{"metric": "acc"}],
        "metadata": {"version": 1.0},
    }
    tasks = root / "tasks"
    tasks.mkdir()
    configs = {
        "shapes_mc": {
            "doc_to_text": "{{question}}",
            "doc_to_choice": ["yes", "no", "maybe"],
            "doc_to_target": "{{answer}}",
            "target_delimiter": " => ",
        },
        "shapes_empty_context": {
            "doc_to_text": "",
            "doc_to_choice": ["yes", "no", "maybe"],
            "doc_to_target": "{{answer}}",
        },
        "shapes_multi_input": {
            "doc_to_text": "{{answer}}",  # an int: lm-eval's multiple-input form
            "doc_to_choice": "{{[question + ' Yes.', question + ' No.', question + ' Maybe.']}}",
            "doc_to_target": " So it is.",
            "target_delimiter": "",
        },
        "shapes_crash": {
            "doc_to_text": "{{question}}",
            "doc_to_choice": ["no", "maybe"],
            "doc_to_target": "{{answer % 2}}",
        },
    }
    for name, extra in configs.items():
        (tasks / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **dataset, **extra}))
    return tasks


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    root = tmp_path_factory.mktemp("shapes")
    tasks = _tasks(root)
    return {
        "gemma": _build(root, "gemma"),
        "qwen": _build(root, "qwen"),
        "tasks": TaskManager(include_defaults=False, include_path=str(tasks)),
        "tasks_dir": tasks,
    }


def _hf(model_dir: Path, **model_args: Any) -> Any:
    from lm_eval.models.huggingface import HFLM

    return HFLM(
        pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=4, **model_args
    )


def _rayeval(model_dir: Path, layout: tuple[int, int], **model_args: Any) -> Any:
    from rayeval.service.engine.lm import RayEvalLM

    return RayEvalLM(
        pretrained=str(model_dir),
        num_replicas=layout[0],
        shard_size=layout[1],
        dtype="float32",
        max_batch_tokens=512,
        **model_args,
    )


def test_the_tokenizer_reproduces_the_reported_shape(shapes: dict[str, Any]) -> None:
    """Precondition: under the gemma template, no/maybe encode to nothing and yes to "s"."""
    lm = _hf(shapes["gemma"])
    context = lm.apply_chat_template([{"role": "user", "content": "Is fire hot?"}])
    assert context.startswith("<s>") and context.endswith("<start_of_turn>model\n")
    encoded = {choice: lm._encode_pair(context, choice)[1] for choice in ("yes", "no", "maybe")}
    assert encoded["no"] == encoded["maybe"] == []
    assert lm.tok_decode(encoded["yes"]) == "s"


@pytest.mark.parametrize(
    ("family", "layouts"), [("gemma", [(1, 1), (1, 2)]), ("qwen", [(2, 1), (1, 2)])]
)
def test_chat_template_sweep_matches_lm_eval_hf(
    family: str, layouts: list[tuple[int, int]], shapes: dict[str, Any], ray_session: None
) -> None:
    tasks = ["shapes_mc", "shapes_multi_input", "shapes_empty_context"]
    reference = _hf(shapes[family])
    expected = {
        name: evaluate(reference, shapes["tasks"], tasks, **BASE_RUN, **options)
        for name, options in SWEEP.items()
    }
    for layout in layouts:
        with _rayeval(shapes[family], layout) as lm:
            for name, options in SWEEP.items():
                ours = evaluate(lm, shapes["tasks"], tasks, **BASE_RUN, **options)
                assert_same_results(expected[name], ours)
            report = lm.engine.request_report.as_dict()
    # Reported beyond lm-eval: the empty contexts everywhere; the swallowed choices under the
    # gemma template only (the qwen template ends in "t\n", which nothing merges with).
    assert report["shapes_empty_context"]["empty_context"]["count"] > 0
    if family == "gemma":
        mc = report["shapes_mc"]
        assert mc["empty_continuation"]["count"] == 2 * 6 * 2  # no + maybe, 6 docs, 2 chat runs
        assert mc["merged_boundary"]["count"] == 3 * 6 * 2
        assert mc["empty_continuation"]["example"]["continuation"] in ("no", "maybe")
    else:
        assert "shapes_mc" not in report


def test_truncation_and_bos_match_lm_eval_hf(shapes: dict[str, Any], ray_session: None) -> None:
    """Left truncation (contexts longer than max_length) with an explicit BOS token."""
    model_args = {"max_length": 40, "add_bos_token": True}
    run = {**BASE_RUN, "num_fewshot": 3, "apply_chat_template": True}
    tasks = ["shapes_mc", "shapes_multi_input"]
    expected = evaluate(_hf(shapes["qwen"], **model_args), shapes["tasks"], tasks, **run)
    with _rayeval(shapes["qwen"], (1, 1), **model_args) as lm:
        ours = evaluate(lm, shapes["tasks"], tasks, **run)
    assert_same_results(expected, ours)


def test_a_shape_lm_eval_crashes_on_is_refused_naming_task_and_fix(
    shapes: dict[str, Any], ray_session: None
) -> None:
    from rayeval.actors.errors import ConfigError

    run = {**BASE_RUN, "apply_chat_template": True}
    with pytest.raises(AssertionError):  # lm-eval's hf backend: an empty continuation alone
        evaluate(_hf(shapes["gemma"]), shapes["tasks"], ["shapes_crash"], **run)
    with (
        _rayeval(shapes["gemma"], (1, 1)) as lm,
        pytest.raises(ConfigError, match=r"task 'shapes_crash', doc \d+: the continuation"),
    ):
        evaluate(lm, shapes["tasks"], ["shapes_crash"], **run)
    assert not lm.engine.stats, "refused before any batch ran"


def test_flagged_requests_reach_the_results_file_and_the_live_callback(
    shapes: dict[str, Any], ray_session: None, tmp_path: Path
) -> None:
    """What ``rayeval run`` and the service write: a results field, and a warning as it happens."""
    from rayeval.service.engine.runner import run_evaluation
    from rayeval.service.vocabulary.config import EvaluationConfig, HostOptions
    from rayeval.service.vocabulary.events import RequestWarning, TrackerWarning

    config = EvaluationConfig(
        model_args={"pretrained": str(shapes["gemma"]), "dtype": "float32"},
        tasks=("shapes_mc",),
        limit=6,
        apply_chat_template=True,
        bootstrap_iters=0,
    )
    host = HostOptions(output_path=str(tmp_path / "out"), include_paths=(str(shapes["tasks_dir"]),))
    warnings: list[RequestWarning | TrackerWarning] = []
    output = run_evaluation(config, host, on_warning=warnings.append)
    assert output is not None
    (results_file,) = (tmp_path / "out").glob("*/results_*.json")
    written = json.loads(results_file.read_text())["request_warnings"]["shapes_mc"]
    assert written == output.results["request_warnings"]["shapes_mc"]
    assert (
        written["empty_continuation"]["count"] == 12 and written["merged_boundary"]["count"] == 18
    )
    assert [w.task for w in warnings if isinstance(w, RequestWarning)] == ["shapes_mc"]
    assert isinstance(warnings[0], RequestWarning)
    assert warnings[0].counts == {"empty_continuation": 12, "merged_boundary": 18}
