"""How many CPU cores this process may use: what the local models' thread counts are read from."""

from __future__ import annotations


def usable_cores() -> int:
    """The CPU cores this process may run on, at least 1: the fewest of the machine's cores, the process's
    affinity (``taskset``'s share) and a container's CPU quota (cgroups, ``docker run --cpus``), as joblib
    counts them. A thread count read from the machine alone overcommits a container by the host's size."""
    from joblib import cpu_count

    return max(int(cpu_count()), 1)
