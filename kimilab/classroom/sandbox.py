"""A grading kernel's sandbox: Linux Landlock, so a submission can read only what it needs and write only its own folder.

The grader starts each student kernel through this file, run as a script::

    python -I -S sandbox.py --read DIR... --write DIR... -- python -m ipykernel_launcher -f FILE

It asks the kernel (Linux >= 5.13, Landlock enabled) to restrict this process, then
``exec``\\ s the command, which inherits the restriction and cannot lift it: files
outside the ``--read`` trees (the Python installation, the system, the student
edition) cannot be opened at all, and nothing outside the ``--write`` trees (the
submission's own temporary folder) can be created, changed or removed. The
teacher's repository -- the answer key, ``teacher_answers.md``, the package source --
is in neither list. No privilege is needed; a process cannot ``ptrace`` one outside
its sandbox either.

Where Landlock is missing (another OS, an older kernel), :func:`abi` returns 0 and
the grader says so and falls back to checking the teacher's files after each
notebook (:mod:`kimilab.classroom.grade`). The script imports only the standard
library, so it runs before, and apart from, any of kimilab.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["abi", "restrict", "launcher"]

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same numbers on x86-64 and arm64
_PR_SET_NO_NEW_PRIVS = 38
_RULE_PATH_BENEATH = 1
_READ = 1 << 0 | 1 << 2 | 1 << 3  # execute, read a file, list a directory
_FILE_RIGHTS = 1 << 0 | 1 << 1 | 1 << 2 | 1 << 14  # the rights that apply to a file (not a directory)


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The Landlock ABI version this kernel offers, or 0 where there is none."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        version = _libc().syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return 0
    return max(int(version), 0)


def _handled(version: int) -> int:
    rights = (1 << 13) - 1  # ABI 1: execute ... make a symlink
    if version >= 3:
        rights |= 1 << 14  # truncate
    return rights


def restrict(read: list[str], write: list[str]) -> None:
    """Restrict this process (and what it executes) to reading ``read`` and ``write`` and writing ``write``.

    Paths that do not exist are skipped. Raises OSError if the kernel refuses."""
    version = abi()
    if version < 1:
        raise OSError("Landlock is not available on this system")
    libc = _libc()
    handled = _handled(version)
    attr = ctypes.c_uint64(handled)
    fd = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for paths, rights in ((read, _READ), (write, handled)):
            for path in paths:
                try:
                    parent = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    allowed = rights if os.path.isdir(path) else rights & _FILE_RIGHTS & handled
                    rule = _PathBeneath(allowed, parent)
                    if libc.syscall(_ADD_RULE, fd, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)):
                        raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
                finally:
                    os.close(parent)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_RESTRICT_SELF, fd, ctypes.c_uint32(0)):
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(fd)


def launcher(read: list[str], write: list[str], command: list[str]) -> list[str]:
    """The argv that runs ``command`` inside the sandbox (this file as a script, isolated from kimilab)."""
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__)]
    for flag, paths in (("--read", read), ("--write", write)):
        for path in paths:
            argv += [flag, str(path)]
    return argv + ["--"] + list(command)


def _main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit("sandbox.py: expected --read DIR... --write DIR... -- COMMAND...")
    cut = argv.index("--")
    read, write, flags = [], [], argv[:cut]
    for flag, path in zip(flags[::2], flags[1::2]):
        (read if flag == "--read" else write).append(path)
    command = argv[cut + 1:]
    restrict(read, write)  # an error here ends the launch: the kernel never starts unconfined
    os.execv(command[0], command)


if __name__ == "__main__":
    _main(sys.argv[1:])
