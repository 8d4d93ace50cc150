"""A real PostgreSQL server for the tests: Debian's binaries, a throw-away cluster, a free port.

``initdb`` and ``pg_ctl`` refuse to run as root, so as root the server runs as the ``postgres``
user Debian's package creates (through ``runuser``), in a temporary directory that user owns.
The cluster trusts local connections (it listens on 127.0.0.1 only) and skips fsync: it holds
test data for minutes. ``make test`` installs the package where ``pg_ctl`` is missing
(``make postgres``); without it the PostgreSQL cases are skipped with that hint.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

#: Parameters of the ``database_url`` fixture (``indirect=True``): each backend, with its tier
#: (a SQLite file is a unit test; a PostgreSQL server makes it a service test).
DATABASES = [
    pytest.param("sqlite", marks=pytest.mark.unit, id="sqlite"),
    pytest.param("postgresql", marks=pytest.mark.service, id="postgresql"),
]


def find_binaries() -> Path | None:
    """The folder holding ``pg_ctl`` and ``initdb`` (PATH first, then Debian's own place)."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(folder) / "pg_ctl").exists() and (Path(folder) / "initdb").exists():
            return Path(folder)
    return None


class PostgresServer:
    """One PostgreSQL cluster in a temporary directory, started and stopped on demand.

    Args:
        binaries: The folder of ``initdb``, ``pg_ctl`` and ``postgres``.
    """

    def __init__(self, binaries: Path) -> None:
        self._bin = binaries
        self._as_root = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="rayeval-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        if self._as_root:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8")

    def url(self, database: str = "postgres") -> str:
        """A SQLAlchemy URL of ``database`` on this server (psycopg 3)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the server and wait until it accepts connections."""
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.root} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-o", options,
            "-w", "-t", str(int(timeout_s)), "start",
        )  # fmt: skip

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the server at once (``fast``: open connections are closed)."""
        self._run(
            "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", str(int(timeout_s)), "stop"
        )

    def create_database(self) -> str:
        """A new empty database; its URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def destroy(self) -> None:
        """Stop the server (if running) and remove its files."""
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def log(self) -> str:
        """The server's log so far (for a failing test's message)."""
        path = self.root / "log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def _run(self, program: str, *args: str) -> None:
        argv = [str(self._bin / program), *args]
        if self._as_root:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=self.root)
        if done.returncode != 0:
            raise subprocess.CalledProcessError(
                done.returncode, argv, done.stdout, done.stderr + "\n" + self.log()
            )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
