"""The CPU time a process tree has used: the measure of the grader's time limits (issue 41).

A limit in wall-clock seconds fails correct work when the machine is busy (a check that takes 40 s on a
quiet machine takes 120 s beside two other jobs), so the grader counts what the learner's kernel itself
used: the user and system time of the kernel and of every process below it (threads included, and children
already reaped), read from ``/proc``. An infinite loop uses CPU and still runs out; a cell that only waits
is stopped by a wall-clock backstop of :data:`minipaged.checks.WALL_FACTOR` times the limit.
"""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: str) -> tuple[int, int] | None:
    """``(parent pid, CPU ticks of the process and of its reaped children)``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces and parentheses
    # fields[1] is the parent pid; fields[11:15] are utime, stime, cutime and cstime (proc(5), fields 14-17)
    return int(fields[1]), sum(int(x) for x in fields[11:15])


def tree_cpu_seconds(root: int) -> float:
    """The CPU seconds used by process ``root`` and everything below it; 0.0 where ``/proc`` is not there.

    Args:
        root: the pid of the tree's root (the kernel's launcher: ``prlimit``/``bwrap`` in the sandbox).
    """
    if not os.path.isdir("/proc"):
        return 0.0
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(name)
            if stat is not None:
                children.setdefault(stat[0], []).append(int(name))
                ticks[int(name)] = stat[1]
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total / _TICK
