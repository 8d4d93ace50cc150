"""What a run that failed with a plain exception tells its user: the field to change, not a bare
Python exception name.

rayeval's own errors already name the fix. lm-eval, datasets and transformers raise plain
exceptions (``ValueError``, ``ZeroDivisionError``, ...) for setups the service could not foresee at
submission; :func:`explain` turns the ones it recognises into a message naming the request's field
and the fix, and wraps every other one in a sentence saying where it happened. No torch here.
"""

from __future__ import annotations

#: (words in the exception's text, the field it is about, what to do).
KNOWN_FAILURES: tuple[tuple[str, str, str], ...] = (
    (
        "Duplicate task",
        "tasks",
        "a task was named both alone and inside its group (or by two groups): name the group "
        "or its tasks, not both",
    ),
    (
        "chat template",
        "apply_chat_template",
        "the tokenizer cannot apply a chat template: set apply_chat_template false, or name a "
        "tokenizer that has one in model_args.tokenizer",
    ),
    (
        "dtype",
        "model_args.dtype",
        "use auto, float32, bfloat16 or float16",
    ),
    (
        "bootstrap",
        "bootstrap_iters",
        "use 0 to skip standard errors, or 2 or more iterations",
    ),
)


def explain(exc: BaseException) -> str:
    """The message a failed run stores for an exception that is not rayeval's own."""
    kind = type(exc).__name__
    text = " ".join(str(exc).split()) or "no message"
    for words, field, fix in KNOWN_FAILURES:
        if words.lower() in text.lower():
            return f"{field}: {fix} (lm-eval stopped with {kind}: {text})"
    if isinstance(exc, ZeroDivisionError):
        return (
            "bootstrap_iters or limit: lm-eval divided by zero computing a metric or its standard "
            f"error ({kind}: {text}); use bootstrap_iters 0 or at least 2, and enough documents "
            "(limit) for the task's metrics"
        )
    return (
        f"lm-eval stopped while running this evaluation ({kind}: {text}): check the tasks and "
        "options it names; the server's log has the traceback"
    )
