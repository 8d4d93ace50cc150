"""code_eval's pass@k with every candidate in a sandbox: what lm-eval's code tasks score with.

:class:`SandboxedCodeEval` answers ``compute(references=..., predictions=..., k=...)`` as the
``evaluate.load("code_eval")`` object does (``_compute`` of upstream's ``code_eval.py``, the same
program text ``candidate + "\\n" + test``, the same ``timeout`` and ``num_workers`` defaults, the
same pass@k estimator), but each ``check_correctness`` runs in a
:class:`rayeval.service.sandbox.bwrap.Sandbox`. It never needs ``HF_ALLOW_CODE_EVAL``: the
operator's setting decides whether code runs at all, and where it runs is not a choice.

:func:`sandboxed_code_eval` puts it where lm-eval's ``humaneval``/``mbpp`` ``utils.py`` look for
it: ``evaluate.load("code_eval")`` returns it (and never reaches the Hub); every other name goes
to ``evaluate.load`` as before.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from typing import Any

import numpy as np

from rayeval.service.sandbox.bwrap import Sandbox, check_available
from rayeval.service.sandbox.code_eval import UPSTREAM, execute_sha256

logger = logging.getLogger(__name__)

#: The metric name lm-eval's code tasks load.
CODE_EVAL = "code_eval"


class SandboxedCodeEval:
    """``evaluate.load("code_eval")``, with candidates run in a sandbox.

    Args:
        sandbox: Where each candidate runs.
    """

    name = CODE_EVAL

    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self.sandbox = sandbox or Sandbox()
        self.execute_sha256 = execute_sha256()
        self.loads = 0  # how many times lm-eval asked for it (a code task was loaded)

    def compute(
        self,
        *,
        predictions: Sequence[Sequence[str]],
        references: Sequence[str],
        k: Sequence[int] = (1, 10, 100),
        num_workers: int = 4,
        timeout: float = 3.0,
    ) -> tuple[dict[str, float], dict[int, list[tuple[int, dict[str, Any]]]]]:
        """pass@k of ``predictions`` against ``references`` (upstream's ``_compute``).

        Args:
            predictions: Candidates per problem.
            references: One test program per problem.
            k: The k of each pass@k (a k larger than a problem's candidates is left out).
            num_workers: Candidates run at once.
            timeout: Seconds per candidate (code_eval's).

        Returns:
            ``({"pass@k": value}, {task_id: [(completion_id, result), ...]})`` as code_eval.

        Raises:
            SandboxUnavailableError: bwrap cannot run here (no candidate runs anywhere else).
        """
        check_available()
        with ThreadPoolExecutor(max_workers=num_workers) as executor:
            futures = []
            completion_id: Counter[int] = Counter()
            results: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
            pairs = zip(predictions, references, strict=False)
            for task_id, (candidates, test_case) in enumerate(pairs):
                for candidate in candidates:
                    test_program = candidate + "\n" + test_case
                    args = (test_program, timeout, task_id, completion_id[task_id])
                    futures.append(executor.submit(self.sandbox.check_correctness, *args))
                    completion_id[task_id] += 1
            for future in as_completed(futures):
                result = future.result()
                results[result["task_id"]].append((result["completion_id"], result))
        total, correct = [], []
        for answers in results.values():
            answers.sort(key=lambda answer: answer[0])
            passed = [bool(r[1]["passed"]) for r in answers]
            total.append(len(passed))
            correct.append(sum(passed))
        totals, corrects = np.array(total), np.array(correct)
        pass_at_k = {
            f"pass@{n}": estimate_pass_at_k(totals, corrects, n).mean()
            for n in k
            if (totals >= n).all()
        }
        return pass_at_k, results


def estimate_pass_at_k(num_samples: Any, num_correct: Any, k: int) -> np.ndarray:
    """Estimates pass@k of each problem (upstream's ``estimate_pass_at_k``, unchanged)."""

    def estimator(n: int, c: int, k: int) -> float:
        """Calculates 1 - comb(n - c, k) / comb(n, k)."""
        if n - c < k:
            return 1.0
        return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))

    if isinstance(num_samples, int):
        num_samples_it = itertools.repeat(num_samples, len(num_correct))
    else:
        assert len(num_samples) == len(num_correct)
        num_samples_it = iter(num_samples)
    pairs = zip(num_samples_it, num_correct, strict=False)
    return np.array([estimator(int(n), int(c), k) for n, c in pairs])


def record(sandbox: Sandbox) -> dict[str, Any]:
    """What results say about where code ran: the sandbox, its limits, the execution module."""
    return {
        **sandbox.describe(),
        "execution_module": UPSTREAM,
        "execution_module_sha256": execute_sha256(),
    }


@contextmanager
def sandboxed_code_eval(sandbox: Sandbox | None = None) -> Iterator[SandboxedCodeEval]:
    """``evaluate.load("code_eval")`` gives the sandboxed metric while the context is open.

    lm-eval's ``humaneval``/``mbpp`` ``utils.py`` call it when their task configs are loaded (a
    first candidate runs then), so the context must be open around lm-eval's task loading as
    well as its scoring.
    """
    import evaluate

    metric = SandboxedCodeEval(sandbox)
    check_available()
    original: Callable[..., Any] = evaluate.load

    def load(path: str, *args: Any, **kwargs: Any) -> Any:
        if path == CODE_EVAL:
            metric.loads += 1
            return metric
        return original(path, *args, **kwargs)

    evaluate.load = load
    try:
        yield metric
    finally:
        evaluate.load = original
