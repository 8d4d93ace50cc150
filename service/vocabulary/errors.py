"""The service's own errors: about evaluations as the job service keeps them.

They derive from :class:`rayeval.actors.errors.RayEvalError`, the one base class of every rayeval
error (so a caller catches them all at once, and ``rayeval.api.app`` maps each to its HTTP status),
but they live here because only the service raises them: an unknown evaluation id, an evaluation
in the wrong state for the request, a service not ready yet, a role that forbids the request, an
unknown or taken user name. Like every rayeval error, each is a
plain exception with one string argument whose message names the fix.
"""

from __future__ import annotations

from rayeval.actors.errors import RayEvalError


class EvaluationNotFoundError(RayEvalError):
    """No evaluation (or no output of it) exists under the given id or name."""


def unknown_evaluation(evaluation_id: str) -> EvaluationNotFoundError:
    """The error of an id no evaluation has, or one the caller may not see: the same answer
    for both, so that a request cannot learn which evaluations exist."""
    return EvaluationNotFoundError(
        f"no evaluation with id {evaluation_id!r}: list yours with `rayeval status` "
        "(GET /evaluations)"
    )


class EvaluationStateError(RayEvalError):
    """The evaluation's state forbids this (results before it finished, cancel after it ended)."""


class ServiceNotReadyError(RayEvalError):
    """A transient condition of the service (task index still building): retry shortly."""


class PermissionDeniedError(RayEvalError):
    """The caller's role forbids this (a viewer submitting, a member reading the audit trail)."""


class UserNotFoundError(RayEvalError):
    """No user (or no live key of theirs) exists under the given name or id."""


class UserConflictError(RayEvalError):
    """A user of that name exists already."""
