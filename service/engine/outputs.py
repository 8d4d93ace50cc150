"""Where lm-eval's output files go: a local directory, or any fsspec URL (``s3://``, ``gs://``...).

lm-eval's ``EvaluationTracker`` writes with local path I/O only: given ``s3://bucket/run`` it would
quietly create a local folder named ``s3:``. An :class:`OutputTarget` therefore hands the tracker
a local path — the output path itself when it is local, a staging directory when it is a URL — and
:meth:`OutputTarget.publish` copies the staged files to the URL afterwards, keeping lm-eval's
layout (``<model>/results_<ts>.json``, ``<model>/samples_<task>_<ts>.jsonl``; or, for an output
path ending in ``.json``, the files beside it).

A URL needs the fsspec implementation of its scheme (``pip install 'rayeval[s3]'`` for ``s3://``);
:class:`OutputTarget` checks that when it is created, before any evaluation work is done.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from rayeval.actors.errors import ConfigError, RayEvalError

logger = logging.getLogger(__name__)


def is_url(output_path: str) -> bool:
    """True for ``scheme://...`` output paths (``file://`` included), False for plain paths."""
    return "://" in output_path


class OutputTarget:
    """The ``--output_path`` of one evaluation, staged locally when it is a URL.

    Use as a context manager around the evaluation: give :attr:`local_path` to lm-eval's
    ``EvaluationTracker(output_path=...)``, call :meth:`publish` after the tracker saved its files.
    Leaving the context removes the staging directory unless publishing failed (then the files are
    kept, and the error names where they are).

    Args:
        output_path: A local path or an fsspec URL.

    Raises:
        ConfigError: if the URL's scheme is unknown or its fsspec package is not installed.
    """

    def __init__(self, output_path: str) -> None:
        self.output_path = output_path
        #: Give this to lm-eval's EvaluationTracker as its output_path.
        self.local_path = output_path
        self._staging: Path | None = None
        self._keep_staging = False
        self._local_root = Path(output_path)
        self._remote_root = ""
        if not is_url(output_path):
            return
        self._fs, self._root = _filesystem(output_path)
        self._staging = Path(tempfile.mkdtemp(prefix="rayeval-output-"))
        name = PurePosixPath(self._root).name
        if name.endswith(".json"):  # lm-eval writes <stem>_<ts>.json and samples beside it
            self._local_root = self._staging
            self._remote_root = self._fs._parent(self._root)
            self.local_path = str(self._staging / name)
        else:
            self._local_root = self._staging / "output"
            self._remote_root = self._root
            self.local_path = str(self._local_root)

    @property
    def remote(self) -> bool:
        """True when the files are staged locally and copied to a URL by :meth:`publish`."""
        return self._staging is not None

    def publish(self) -> list[str]:
        """Copy the staged files to the URL (a no-op for local paths).

        Returns:
            The URL of every file copied (empty for a local output path).

        Raises:
            RayEvalError: if a copy fails; the staged files are kept and the message names them.
        """
        if self._staging is None:
            return []
        written = []
        files = sorted(p for p in self._local_root.rglob("*") if p.is_file())
        try:
            for path in files:
                relative = path.relative_to(self._local_root).as_posix()
                destination = f"{self._remote_root.rstrip('/')}/{relative}"
                self._fs.makedirs(self._fs._parent(destination), exist_ok=True)
                self._fs.put_file(str(path), destination)
                written.append(self._fs.unstrip_protocol(destination))
        except Exception as exc:
            self._keep_staging = True
            raise RayEvalError(
                f"the results were written to {self._local_root} but copying them to "
                f"{self.output_path} failed ({type(exc).__name__}: {exc}): check the credentials "
                "and the bucket, then copy that directory by hand."
            ) from exc
        logger.info("copied %d output file(s) to %s", len(written), self.output_path)
        return written

    def close(self) -> None:
        """Remove the staging directory (kept when publishing failed). Safe to call twice."""
        if self._staging is not None and not self._keep_staging:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def __enter__(self) -> OutputTarget:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it; a clear error when unusable."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:
        scheme = url.partition("://")[0]
        extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(scheme)
        hint = f"pip install 'rayeval[{extra}]'" if extra else f"install {exc.name or 'it'}"
        raise ConfigError(
            f"--output_path {url!r} needs the fsspec filesystem for {scheme}://, which is not "
            f"installed: {hint} on the machine that runs the evaluation driver."
        ) from None
    except ValueError as exc:
        raise ConfigError(
            f"--output_path {url!r}: {exc}. Use a local path or a URL such as s3://bucket/dir."
        ) from None
