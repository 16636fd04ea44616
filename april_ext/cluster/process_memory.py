"""Resident memory of a process, which colocated runs measure on each actor's node."""

from __future__ import annotations


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


__all__ = ["rss_bytes"]
