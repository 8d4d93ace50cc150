"""The one exception hierarchy of rayeval.

Every error a user can cause derives from :class:`RayEvalError` and its message says what to do.
The classes are plain exceptions with a single string argument, so they pickle across Ray actors.
The base class lives in the lowest layer (``actors``) so that every layer can raise and catch it
without breaking the one-way import rule (api -> service -> actors). Errors that only the job
service raises (unknown evaluation, wrong state, not ready) are its own:
:mod:`rayeval.service.vocabulary.errors`.
"""


class RayEvalError(Exception):
    """Base class of every rayeval error; the message names the fix."""


class ConfigError(RayEvalError):
    """Bad user input: unknown option, unsupported model argument, malformed value."""


class CheckpointError(ConfigError):
    """A training checkpoint cannot be used: incomplete, unreadable, or not of this model."""


class LayoutError(RayEvalError):
    """The requested parallel layout is impossible (R or G < 1, or larger than the cluster)."""


class ResourcesUnavailableError(LayoutError):
    """The cluster could not provide the layout's resources within the placement timeout."""


class ModelLoadError(RayEvalError):
    """A rank could not load the model (missing path, unsupported checkpoint, out of memory)."""


class EvaluationTimeoutError(RayEvalError):
    """A wait ran past its timeout: no batch finished, or a process group did not form."""


class WorkerLostError(RayEvalError):
    """Every replica was lost (actor died, node lost); the evaluation cannot continue."""


class ResultIntegrityError(RayEvalError):
    """A request id came back missing or more than once (a bug: please report it)."""
