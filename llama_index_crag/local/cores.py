"""How many CPU cores this process may use: what the local models' thread counts are read from."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator


def usable_cores() -> int:
    """The CPU cores this process may run on, at least 1: the fewest of the machine's cores, the process's
    affinity (``taskset``'s share) and a container's CPU quota (cgroups, ``docker run --cpus``), as joblib
    counts them. A thread count read from the machine alone overcommits a container by the host's size."""
    from joblib import cpu_count

    return max(int(cpu_count()), 1)


@contextmanager
def torch_on_usable_cores() -> Iterator[None]:
    """Within the block, torch loads with a thread pool of ``usable_cores()`` threads (and the processes
    started in it inherit the count), unless ``OMP_NUM_THREADS`` already says how many or torch has loaded.

    torch sizes its pool from ``OMP_NUM_THREADS`` when it loads, else from the cores OpenMP sees, which
    follow the affinity but not a container's CPU quota: in a 2-CPU container on a 64-core host, 64 threads
    share two cores' time and are throttled. A command line does this for its user; a library leaves the
    choice to the application it runs in, and a torch already loaded was sized by whoever loaded it.
    """
    if os.environ.get("OMP_NUM_THREADS") or "torch" in sys.modules:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(usable_cores())
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
