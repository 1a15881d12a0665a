"""A seccomp filter that keeps sandboxed commands from creating unix sockets.

A read-only mount does not stop connect(), so a unix socket that shows inside the sandbox (one
bound in /etc or /opt, possibly by a process of another network namespace that the host's
/proc/net/unix does not list, or bound after the sandbox started) would be reachable. Covering
the sockets we can see is not enough; refusing socket(AF_UNIX) is: a command cannot connect to a
unix socket without one. socketpair() stays allowed (it reaches nothing outside the process
tree), and so does every other address family (the network namespace has only `lo`).

io_uring is refused too: its requests create and connect sockets without the socket() and
connect() system calls a filter sees. Programs of another architecture (32-bit x86 on x86_64)
are killed, since their system call numbers differ and would slip past the filter.

The filter is installed in the child process between fork and exec of `nsenter`, so it holds for
nsenter, setpriv, the command and everything they start; bubblewrap's own --seccomp option would
only reach the sandbox's first process, not the commands that join it with nsenter.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_DENY = 0x00050000 | errno.EACCES  # SECCOMP_RET_ERRNO: the call fails with "Permission denied"
_AF_UNIX = 1
# Classic BPF opcodes: load a 32-bit word of struct seccomp_data, compare, return.
_LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JUMP_EQ, _JUMP_GE, _JUMP_GT = 0x15, 0x35, 0x25  # BPF_JMP | BPF_JEQ/JGE/JGT | BPF_K
_RETURN = 0x06  # BPF_RET | BPF_K
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg0's low word on little endian)
_X32_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers

# machine -> (AUDIT_ARCH_*, socket's number, io_uring's first and last call, has x32)
_ARCHES = {
    "x86_64": (0xC000003E, 41, 425, 427, True),
    "aarch64": (0xC00000B7, 198, 425, 427, False),
}


UNSUPPORTED = (f"--sandbox=bwrap cannot filter unix sockets on this machine ({platform.machine()}): "
               f"it supports {', '.join(_ARCHES)}; use --terminal_env=docker")


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def supported() -> bool:
    return platform.machine() in _ARCHES


def _program(machine: str) -> bytes:
    audit_arch, socket_nr, uring_first, uring_last, has_x32 = _ARCHES[machine]
    # (label, code, k, where to go if true, if false): None goes on to the next instruction.
    steps = [
        ("", _LOAD_WORD, _ARCH, None, None),
        ("", _JUMP_EQ, audit_arch, None, "kill"),
        ("", _LOAD_WORD, _NR, None, None),
        *([("", _JUMP_GE, _X32_BIT, "deny", None)] if has_x32 else []),
        ("", _JUMP_EQ, socket_nr, "socket", None),
        ("", _JUMP_GE, uring_first, None, "allow"),
        ("", _JUMP_GT, uring_last, "allow", "deny"),
        ("socket", _LOAD_WORD, _ARG0, None, None),
        ("", _JUMP_EQ, _AF_UNIX, "deny", "allow"),
        ("allow", _RETURN, _RET_ALLOW, None, None),
        ("deny", _RETURN, _RET_DENY, None, None),
        ("kill", _RETURN, _RET_KILL_PROCESS, None, None),
    ]
    where = {label: i for i, (label, *_rest) in enumerate(steps) if label}

    def skip(i: int, target: str | None) -> int:  # BPF jumps go forward, over this many instructions
        return 0 if target is None else where[target] - i - 1

    return b"".join(struct.pack("=HBBI", code, skip(i, yes), skip(i, no), k)
                    for i, (_label, code, k, yes, no) in enumerate(steps))


class SocketFilter:
    """Built once in the parent (no allocation, import or lookup left for the forked child), then
    `install` is the Popen preexec_fn of every sandboxed command."""

    def __init__(self) -> None:
        self._code = _program(platform.machine())
        self._prog = _Prog(len(self._code) // 8, self._code)
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl
        self._prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        self._pointer = ctypes.cast(ctypes.pointer(self._prog), ctypes.c_void_p)

    def install(self) -> None:
        # no_new_privs first: without it only a process with CAP_SYS_ADMIN may install a filter.
        if self._prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if self._prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, self._pointer, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "seccomp: the sandbox's socket filter could not be installed")
