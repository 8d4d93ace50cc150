"""A small local code task, ``demo_code``: HumanEval's shape over four problems of our own.

Written apart from the other demo tasks (its own folder: :func:`write_code_task`) because it
runs model-written code to score it: a server takes it only with ``--allow-code-execution``, and
each candidate then runs in the bubblewrap sandbox. Like lm-eval's ``humaneval``, its metric is
``pass@k`` through ``evaluate.load("code_eval")`` (which rayeval answers with the sandboxed
metric), the prediction is the prompt plus the generation, and the reference is the tests plus
``check(entry_point)``.
"""

from __future__ import annotations

import json
from pathlib import Path

CODE_TASK = "demo_code"

#: Problems with their tests and a right answer (for the tests of the task itself).
PROBLEMS = [
    {
        "task_id": "demo/0",
        "prompt": 'def add(a, b):\n    """Return a plus b."""\n',
        "canonical_solution": "    return a + b\n",
        "test": "def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n",
        "entry_point": "add",
    },
    {
        "task_id": "demo/1",
        "prompt": 'def reverse(s):\n    """Return s reversed."""\n',
        "canonical_solution": "    return s[::-1]\n",
        "test": "def check(f):\n    assert f('abc') == 'cba'\n    assert f('') == ''\n",
        "entry_point": "reverse",
    },
    {
        "task_id": "demo/2",
        "prompt": 'def is_even(n):\n    """Whether n is even."""\n',
        "canonical_solution": "    return n % 2 == 0\n",
        "test": "def check(f):\n    assert f(4)\n    assert not f(7)\n",
        "entry_point": "is_even",
    },
    {
        "task_id": "demo/3",
        "prompt": 'def total(xs):\n    """The sum of the list xs."""\n',
        "canonical_solution": "    return sum(xs)\n",
        "test": "def check(f):\n    assert f([1, 2, 3]) == 6\n    assert f([]) == 0\n",
        "entry_point": "total",
    },
]

_YAML = """task: demo_code
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
unsafe_code: true
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{test}}}}\\ncheck({{{{entry_point}}}})"
metric_list:
  - metric: !function demo_code_utils.pass_at_k
    aggregation: mean
    higher_is_better: true
    k: [1]
generation_kwargs:
  until: ["\\ndef", "\\nclass", "\\nif", "\\nprint", "\\n#"]
  max_gen_toks: 32
  do_sample: false
repeats: 1
num_fewshot: 0
filter_list:
  - name: create_test
    filter:
      - function: custom
        filter_fn: !function demo_code_utils.build_predictions
metadata:
  version: 1.0
"""

# lm-eval's humaneval/utils.py, the module-level check run aside: the same metric calls.
_UTILS = """import evaluate as hf_evaluate

compute_ = hf_evaluate.load("code_eval")


def pass_at_k(references, predictions, k=None):
    if isinstance(k, int):
        k = [k]
    return compute_.compute(references=references, predictions=predictions, k=k)[0]


def build_predictions(resps, docs):
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs)]
"""


def write_code_task(out_dir: Path) -> Path:
    """Write ``demo_code.yaml``, its ``demo_code_utils.py`` and its data into ``out_dir``.

    Returns:
        ``out_dir``, to pass as an include path.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "demo_code_test.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    (out_dir / "demo_code.yaml").write_text(_YAML.format(data=data.resolve()), encoding="utf-8")
    (out_dir / "demo_code_utils.py").write_text(_UTILS, encoding="utf-8")
    return out_dir
