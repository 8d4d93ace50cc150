"""Bubblewrap sandboxes for model-written code: one sandbox per candidate, nothing kept.

:class:`Sandbox` runs a candidate program (code_eval's ``check_program``: the candidate, a
newline, the task's tests) in a fresh ``bwrap`` with no network, its own pid, IPC and UTS
namespaces, a private tmpfs ``/tmp``, read-only ``/usr`` and the interpreter's own prefix and
package folders only (no ``/etc``, no home, no data folders, not the project), a scrubbed
environment, an unprivileged uid, and rlimits on CPU time, address space, processes, file size
and open files. Inside, :mod:`inside` calls the pinned code_eval ``check_correctness``, so a
candidate sees what it would see under lm-eval, plus the walls. The sandbox's pid namespace dies
with its first process, so nothing a candidate starts (a ``setsid`` daemon included) outlives it.

Why a uid per running sandbox: as root, the kernel ignores RLIMIT_NPROC, so a root server drops
each sandbox to a uid of its own (:class:`_UidPool`); a shared uid would let one candidate's fork
bomb use up the process count of the candidates running beside it. A server that is not root
runs bwrap in a user namespace instead (uid 65534 inside), where the count is the namespace's.

Fails closed: :func:`check_available` raises :class:`SandboxUnavailableError`, naming Debian's
``bubblewrap`` package, where ``bwrap`` is missing or cannot make its namespaces.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rayeval.actors.errors import RayEvalError
from rayeval.service.sandbox.code_eval import EXECUTE_PATH

logger = logging.getLogger(__name__)

_INSIDE = Path(__file__).with_name("inside.py")
_READY = "rayeval-sandbox-ready"
_RESULT = "rayeval-sandbox-result "

#: Where the sandbox's own two files appear inside it.
_INSIDE_DIR = "/opt/rayeval-sandbox"

#: First of the uids a root server gives its sandboxes, one each while it runs (no user or
#: file has them: far above any distribution's or subuid range's).
UID_BASE = 2_100_000_000

#: Modules imported before the candidate runs. code_eval forks its candidates from lm-eval's
#: process, which has imported numpy (code_eval.py imports it); under code_eval's guard a fresh
#: ``import numpy`` fails ('NoneType' object is not callable), a preloaded one succeeds.
PRELOAD = ("numpy",)

#: The environment inside: nothing of the server's (no tokens, tracker keys, proxies).
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}

_MISSING = (
    "running model-written code needs Debian's bubblewrap package (the bwrap program): "
    "`make install` installs it as root (apt-get install bubblewrap)"
)


class SandboxUnavailableError(RayEvalError):
    """bubblewrap is missing or cannot make its namespaces: no code runs anywhere else."""


class SandboxError(RayEvalError):
    """A sandbox failed before its candidate started (not the candidate's doing)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one candidate's sandbox may use (each a hard rlimit, but ``tmp_bytes`` and
    ``wall_extra_s``).

    Args:
        cpu_s: CPU seconds of each process (RLIMIT_CPU).
        memory_bytes: Address space of each process (RLIMIT_AS).
        processes: Processes and threads of the sandbox's uid (RLIMIT_NPROC).
        file_bytes: Largest file a process may write (RLIMIT_FSIZE), its output included.
        open_files: Open descriptors per process (RLIMIT_NOFILE).
        tmp_bytes: Size of the private tmpfs ``/tmp``.
        wall_extra_s: Wall time on top of code_eval's own (``timeout + 1``) for the sandbox
            to start and import; past it, the whole sandbox is killed ("timed out").
    """

    cpu_s: int = 30
    memory_bytes: int = 2 * 2**30
    processes: int = 64
    file_bytes: int = 16 * 2**20
    open_files: int = 64
    tmp_bytes: int = 64 * 2**20
    wall_extra_s: float = 10.0

    def __post_init__(self) -> None:
        bad = [name for name, value in asdict(self).items() if value <= 0]
        if bad:
            raise ValueError(f"sandbox limits must be positive: {', '.join(bad)}")


@functools.cache
def bwrap_path() -> str:
    """The ``bwrap`` program, or :class:`SandboxUnavailableError` naming the package."""
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailableError(f"bwrap not found: {_MISSING}")
    return found


@functools.cache
def check_available() -> str:
    """Run one trivial candidate end to end, once per process, and return bwrap's version.

    Raises:
        SandboxUnavailableError: bwrap is missing, or it cannot make its namespaces (user
            namespaces off for a server that is not root, or a seccomp policy forbids them),
            or the interpreter cannot run in it.
    """
    program = bwrap_path()
    try:
        probe = Sandbox(limits=SandboxLimits(wall_extra_s=60.0))._checked("pass", 3.0, 0, 0)
    except (OSError, SandboxError) as exc:
        hint = (
            ""
            if os.getuid() == 0
            else " (are user namespaces off? kernel.unprivileged_userns_clone, "
            "user.max_user_namespaces)"
        )
        raise SandboxUnavailableError(
            f"bwrap could not run a sandbox{hint}: {exc}; {_MISSING}"
        ) from None
    if not probe["passed"]:
        raise SandboxUnavailableError(
            f"a sandbox could not run an empty program ({probe['result']}); {_MISSING}"
        )
    version = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=30)
    return version.stdout.strip()


def _python() -> str:
    """The base interpreter (a venv's ``python`` is a link to it; its pyvenv.cfg stays out)."""
    return os.path.realpath(sys.executable)


def _package_dirs() -> list[str]:
    """The folders Python imports from: the interpreter's prefix and its site-packages, never
    a project folder that happens to be on ``sys.path``."""
    paths = sysconfig.get_paths()
    candidates = {sys.base_prefix, paths["purelib"], paths["platlib"], *site.getsitepackages()}
    found = sorted(os.path.realpath(p) for p in candidates if os.path.isdir(p))
    # Keep outermost folders only: a bind of a prefix covers what lies under it.
    outer: list[str] = []
    for path in found:
        if path == "/usr" or path.startswith("/usr/"):
            continue
        if not any(path.startswith(o.rstrip("/") + "/") for o in outer):
            outer.append(path)
    return outer


def _site_paths() -> list[str]:
    """The site-packages folders the candidate's interpreter adds (a venv's, for one)."""
    paths = sysconfig.get_paths()
    wanted = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    return list(dict.fromkeys(os.path.realpath(p) for p in wanted if os.path.isdir(p)))


def _namespace_args() -> list[str]:
    args = [
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        "--clearenv",
    ]
    if os.getuid() != 0:
        args += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    else:
        # Root inside keeps only what dropping to the sandbox's uid needs.
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    for key, value in _ENV.items():
        args += ["--setenv", key, value]
    return args


def _filesystem_args(tmp_bytes: int = SandboxLimits.tmp_bytes) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    binds = _package_dirs()
    # bwrap makes a bind's missing parents 0700: the sandbox's uid could not pass through them.
    for parent in _parents([*binds, f"{_INSIDE_DIR}/code_eval/execute.py"]):
        args += ["--perms", "0755", "--dir", parent]
    for path in binds:
        args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    args += ["--ro-bind", str(_INSIDE), f"{_INSIDE_DIR}/inside.py"]
    args += ["--ro-bind", str(EXECUTE_PATH), f"{_INSIDE_DIR}/code_eval/execute.py"]
    return [*args, "--chdir", "/tmp"]


def _parents(paths: list[str]) -> list[str]:
    """Every folder above ``paths`` but ``/``, outermost first, each once."""
    found: dict[str, None] = {}
    for path in paths:
        for parent in reversed(Path(path).parents[:-1]):
            found.setdefault(str(parent))
    return list(found)


class _UidPool:
    """A uid per running sandbox, unique across the server's processes (a lock file each)."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._dir = Path(tempfile.gettempdir()) / "rayeval-sandbox-uids"
        self._next = 0
        self._lock = threading.Lock()

    @contextmanager
    def uid(self) -> Iterator[int]:
        self._dir.mkdir(mode=0o700, exist_ok=True)
        for _ in range(self._size):
            with self._lock:
                slot = self._next
                self._next = (self._next + 1) % self._size
            handle = open(self._dir / f"{slot}.lock", "w")  # noqa: SIM115 (held while it runs)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                yield UID_BASE + slot
            finally:
                handle.close()
            return
        raise SandboxError(f"all {self._size} sandbox uids are in use")


_UIDS = _UidPool()


@dataclass(frozen=True)
class Sandbox:
    """Runs code_eval's ``check_correctness`` for one candidate in a fresh bubblewrap sandbox.

    Args:
        limits: What each candidate may use.
        preload: Modules imported before the candidate runs (see :data:`PRELOAD`).
    """

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    preload: tuple[str, ...] = PRELOAD

    def describe(self) -> dict[str, Any]:
        """What results record about the sandbox (see :func:`rayeval.service.sandbox.record`)."""
        return {
            "program": "bubblewrap",
            "version": check_available(),
            "network": "none",
            "uid": "one unprivileged uid per candidate"
            if os.getuid() == 0
            else "65534 in a user namespace",
            "limits": asdict(self.limits),
            "preload": list(self.preload),
        }

    def check_correctness(
        self, check_program: str, timeout: float, task_id: int, completion_id: int
    ) -> dict[str, Any]:
        """code_eval's ``check_correctness``, run in a sandbox: the same dict, the same words.

        Returns:
            ``{"task_id", "passed", "result", "completion_id"}``; a sandbox killed at its wall
            limit gives ``"timed out"`` (what code_eval says of a candidate that never
            answered), one a candidate broke from inside ``"failed: sandbox: ..."``.

        Raises:
            SandboxUnavailableError: bwrap cannot run here.
            SandboxError: the sandbox failed before its candidate started.
        """
        check_available()
        return self._checked(check_program, timeout, task_id, completion_id)

    def _checked(
        self, check_program: str, timeout: float, task_id: int, completion_id: int
    ) -> dict[str, Any]:
        request = {
            "program": check_program,
            "timeout": timeout,
            "task_id": task_id,
            "completion_id": completion_id,
            "limits": {
                k: v
                for k, v in asdict(self.limits).items()
                if k not in ("tmp_bytes", "wall_extra_s")
            },
            "preload": list(self.preload),
            "sys_path": _site_paths(),
        }
        with _UIDS.uid() if os.getuid() == 0 else _no_uid() as uid:
            request["uid"] = request["gid"] = uid
            lines, timed_out, code = self._run(request, timeout + 1 + self.limits.wall_extra_s)
        return _result(lines, timed_out, code, task_id, completion_id)

    def _run(self, request: dict[str, Any], wall_s: float) -> tuple[list[str], bool, int]:
        info_read, info_write = os.pipe()
        argv = [
            bwrap_path(),
            "--info-fd",
            str(info_write),
            *_namespace_args(),
            *_filesystem_args(self.limits.tmp_bytes),
            "--",
            _python(),
            "-I",
            f"{_INSIDE_DIR}/inside.py",
        ]
        # Output goes to a file, where RLIMIT_FSIZE bounds it, not to a pipe the server reads.
        with tempfile.TemporaryFile() as out, os.fdopen(info_read, "rb") as info:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=_ENV,
                    start_new_session=True,
                    pass_fds=(info_write,),
                )
            finally:
                os.close(info_write)
            timed_out = False
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(request).encode())
                proc.stdin.close()
                proc.wait(timeout=wall_s)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                timed_out = True
            finally:
                _kill(proc, info)
            out.seek(0)
            text = out.read(self.limits.file_bytes).decode("utf-8", "replace")
        return text.splitlines(), timed_out, proc.returncode


@contextmanager
def _no_uid() -> Iterator[int]:
    yield 65534


def _kill(proc: subprocess.Popen[bytes], info: Any) -> None:
    """End a sandbox and return once everything in it is gone.

    Killing bwrap alone returns before its pid namespace is torn down (its pid 1 dies of
    --die-with-parent, later); killing pid 1 itself makes the kernel kill and reap every
    process in the namespace before pid 1 is gone, and bwrap exits only after that.
    """
    if proc.poll() is None:
        os.set_blocking(info.fileno(), False)
        try:
            child = json.loads(info.read() or b"{}").get("child-pid")
        except (OSError, ValueError):
            child = None
        for target in ([child] if child else []) + [None]:
            try:
                if target is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    os.kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
    proc.wait()


def _result(
    lines: list[str], timed_out: bool, code: int, task_id: int, completion_id: int
) -> dict[str, Any]:
    """code_eval's result dict from the sandbox's output."""
    answers = [line for line in lines if line.startswith(_RESULT)]
    if answers and not timed_out:
        return json.loads(answers[-1][len(_RESULT) :])
    if _READY not in lines:
        if timed_out:
            outcome = "timed out"
        else:
            raise SandboxError(
                f"the sandbox failed before its candidate started (exit {code}): "
                + " | ".join(lines[-5:])
            )
    elif timed_out:
        outcome = "timed out"
    else:
        outcome = f"failed: sandbox: exited with {code} before answering"
    return {"task_id": task_id, "passed": False, "result": outcome, "completion_id": completion_id}
