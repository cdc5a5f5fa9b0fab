"""The sandbox a learner's kernel runs in while the grader grades it (issue 41).

Each kernel runs under bubblewrap (``bwrap``), started by the grader as root, in namespaces of its own:

- **mounts:** a read-only view of ``/usr``, the few ``/etc`` files Python reads, the Python installation, the
  venv and the learner's package copy (:data:`ETC`); a private, empty, writable home and ``/tmp`` (tmpfs);
  the notebook's working directory and the kernel's connection directory, both the learner's own. Nothing
  else: not the repository (so the venv's editable-install finder finds nothing), ``solutions/``, the
  instructor side, the other learners' folders or the gradebook;
- **processes:** a PID namespace of its own, which dies with the grader (no signal to, or ``/proc`` of, the
  grader or a classmate's kernel);
- **network:** none (jupyter_client talks to the kernel over ZeroMQ's ``ipc`` transport, files in the
  connection directory);
- **user:** ``setpriv`` drops the kernel to a uid of its own (:data:`FIRST_UID` and up, one per kernel graded
  at once) with no capabilities, no supplementary groups and ``no_new_privs``. A user namespace would not do:
  as root, bwrap maps its uid inside to root outside, for which the kernel does not enforce ``RLIMIT_NPROC``;
- **limits** (``prlimit``, :class:`Confinement`): CPU seconds, data memory (``RLIMIT_DATA``, which
  ``import torch`` survives, unlike ``RLIMIT_AS``), processes and threads, file size, open files, no core
  files; and the size of the two tmpfs.

The grader keeps a cell's output to :data:`minipaged.checks.__main__.MAX_OUTPUT` characters itself.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from jupyter_client import AsyncKernelManager

from minipaged.checks import TIMEOUT_ENV

FIRST_UID = 1000  # the first kernel graded at once runs as this uid, the next as FIRST_UID + 1, ...
HOME = "/home/learner"
ETC = ("alternatives", "fonts", "group", "host.conf", "hosts", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
       "localtime", "mime.types", "nsswitch.conf", "passwd", "ssl")  # read-only in /etc, those that exist
TOOLS = ("bwrap", "setpriv", "prlimit")  # bubblewrap; util-linux (Debian's essential set) has the other two
PASSED = (TIMEOUT_ENV, "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")  # the only grader settings a kernel sees


class SandboxUnavailable(RuntimeError):
    """The grader cannot build the sandbox here: a tool is missing, or it does not run as root."""


def require() -> dict[str, str]:
    """The sandbox's tools by name, with their paths; raise :class:`SandboxUnavailable` saying what is missing."""
    found = {tool: shutil.which(tool) for tool in TOOLS}
    missing = [tool for tool, path in found.items() if path is None]
    if missing:
        raise SandboxUnavailable(f"{', '.join(missing)} not found: install bubblewrap (apt-get install bubblewrap)"
                                 " to grade in a sandbox, or pass --unsandboxed to run learners' code unconfined")
    if os.geteuid() != 0:
        raise SandboxUnavailable("the sandbox drops each kernel to a uid of its own, which needs root: run the "
                                 "grader as root, or pass --unsandboxed to run learners' code unconfined")
    return found


@dataclass(frozen=True)
class Confinement:
    """The limits of one kernel: CPU seconds (all its threads), bytes of data memory, processes and threads
    of its uid, bytes per file written, open files, and bytes in each of its tmpfs (home and ``/tmp``)."""

    cpu_seconds: int
    memory: int
    processes: int = 256
    file_size: int = 2**30
    open_files: int = 1024
    tmpfs_size: int = 2**30

    @classmethod
    def for_run(cls, notebook_seconds: float, threads: int, jobs: int) -> Confinement:
        """The limits for a run whose notebooks may take ``notebook_seconds`` each, on ``threads`` threads, ``jobs``
        notebooks at once: CPU time for the whole notebook on all its threads (a backstop behind the wall-clock
        limits) and an equal share of the machine's memory."""
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // jobs
        return cls(cpu_seconds=int(notebook_seconds * threads) + 60, memory=memory)

    def prlimit(self) -> list[str]:
        """The ``prlimit`` options that set these limits."""
        return [f"--cpu={self.cpu_seconds}", f"--data={self.memory}", f"--nproc={self.processes}",
                f"--fsize={self.file_size}", f"--nofile={self.open_files}", "--core=0"]


@dataclass(frozen=True)
class Sandbox:
    """One kernel's sandbox.

    Args:
        package: the learner's package copy (``PYTHONPATH``), read-only inside.
        work: the notebook's working directory, writable, the learner's own.
        runtime: the kernel's connection file and ``ipc`` sockets, writable.
        uid: the uid (and gid) the kernel runs as; no other kernel running at the same time has it.
        limits: the kernel's :class:`Confinement`.
        cache: the course's checkpoint cache (:func:`minipaged.pretrained.cache_root`), shown read-only and named
            by ``MINIPAGED_CACHE``; None when there is none.
    """

    package: Path
    work: Path
    runtime: Path
    uid: int
    limits: Confinement
    cache: Path | None = None

    def prepare(self) -> None:
        """Give the working and connection directories to the kernel's uid (they are created by the grader)."""
        for folder in (self.work, self.runtime):
            os.chown(folder, self.uid, self.uid)
            folder.chmod(0o700)

    def env(self, threads: int) -> dict[str, str]:
        """The kernel's environment: of the grader's, only the settings :data:`PASSED` names; the package path,
        ``threads`` threads for torch and OpenMP, the private home and ``/tmp``, and the checkpoint cache."""
        env = {name: os.environ[name] for name in PASSED if name in os.environ}
        if self.cache is not None:
            env["MINIPAGED_CACHE"] = str(self.cache)
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": HOME, "TMPDIR": "/tmp", **env,
                "PYTHONPATH": str(self.package), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` (the kernel's command) wrapped: limits, then bubblewrap's namespaces and mounts, then the uid."""
        tools = require()
        mounts = _Mounts()
        for name in ETC:
            mounts.bind(Path("/etc", name), ro=True, must=False)
        for prefix in {Path(sys.base_prefix), Path(sys.prefix), *([self.cache] if self.cache else [])}:
            mounts.bind(prefix.resolve(), ro=True)
        mounts.bind(self.package, ro=True)
        mounts.bind(self.work, ro=False)
        mounts.bind(self.runtime, ro=False)
        return [tools["prlimit"], *self.limits.prlimit(), "--",
                tools["bwrap"], "--die-with-parent", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try", "--hostname", "learner",
                "--unsetenv", "JPY_PARENT_PID",  # the grader's pid, not the kernel's parent's here: --die-with-parent
                *_system(), "--proc", "/proc", "--dev", "/dev",
                *_tmpfs("/tmp", self.limits.tmpfs_size), *_tmpfs(HOME, self.limits.tmpfs_size),
                *_tmpfs("/dev/shm", self.limits.tmpfs_size), *mounts.args, "--chdir", str(self.work), "--",
                tools["setpriv"], f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--no-new-privs",
                "--inh-caps=-all", "--bounding-set=-all", "--", *argv]


def _system() -> list[str]:
    """``/usr`` read-only, and ``/bin``, ``/lib``, ... as the host has them (links into ``/usr``, or read-only)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/", name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


def _tmpfs(path: str, size: int) -> list[str]:
    """An empty tmpfs at ``path`` that anyone in the sandbox may write (there is one user), of ``size`` bytes."""
    return ["--size", str(size), "--perms", "1777", "--tmpfs", path]


class _Mounts:
    """Bind mounts at the host's own paths, each parent made first as ``0755`` (bwrap would make it ``0700``
    where the host's is, as ``/root`` is, and the kernel's uid could not pass it)."""

    MOUNTED = frozenset({"/", "/usr", "/tmp", HOME, "/proc", "/dev"})

    def __init__(self):
        self.args: list[str] = []
        self._made = set(self.MOUNTED)

    def bind(self, path: Path, ro: bool, must: bool = True) -> None:
        """Show ``path`` read-only (``ro``) or writable; a link stays a link (``/etc/localtime``); a missing path
        is skipped unless ``must`` (then bwrap refuses to start); one in ``/usr`` is shown already."""
        if (not path.exists() and not must) or str(path) in self._made or path.is_relative_to("/usr"):
            return
        for parent in reversed(path.parents):
            if str(parent) not in self._made:
                self.args += ["--perms", "0755", "--dir", str(parent)]
                self._made.add(str(parent))
        if path.is_symlink():
            self.args += ["--symlink", os.readlink(path), str(path)]
        else:
            self.args += ["--ro-bind" if ro else "--bind", str(path), str(path)]
        self._made.add(str(path))


class SandboxedKernelManager(AsyncKernelManager):
    """A kernel manager whose kernel runs in :attr:`sandbox`, talking over ``ipc`` sockets in its runtime folder.

    Set :attr:`sandbox` before starting the kernel. The connection file (the key that signs messages) is given to
    the kernel's uid once written: jupyter_client writes it readable by its own user only.
    """

    sandbox: Sandbox | None = None

    def write_connection_file(self, **kwargs) -> None:
        """Write the connection file as jupyter_client does, then hand it to the kernel's uid.

        Args:
            kwargs: passed on to jupyter_client's ``write_connection_file``.
        """
        super().write_connection_file(**kwargs)
        os.chown(self.connection_file, self.sandbox.uid, self.sandbox.uid)

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        """The kernel spec's command, formatted by jupyter_client, inside the sandbox.

        Args:
            extra_arguments: passed on to jupyter_client's ``format_kernel_cmd``.
        """
        return self.sandbox.command(super().format_kernel_cmd(extra_arguments))


def kernel_manager(sandbox: Sandbox) -> SandboxedKernelManager:
    """A manager for a python3 kernel in ``sandbox``, its connection file and sockets in ``sandbox.runtime``.

    Args:
        sandbox: the kernel's sandbox.
    """
    manager = SandboxedKernelManager(kernel_name="python3", transport="ipc", ip=str(sandbox.runtime / "kernel"),
                                     connection_file=str(sandbox.runtime / "kernel.json"))
    manager.sandbox = sandbox
    # A SIGINT to the kernel's process group would reach bwrap, which dies of it and takes the kernel along: the
    # kernel is asked on its control channel instead, and signals itself (one that will not stop is killed).
    manager.kernel_spec.interrupt_mode = "message"
    return manager
