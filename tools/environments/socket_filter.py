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
nsenter, setpriv, the command and everything they start (bubblewrap's own --seccomp option only
reaches the sandbox's first process, not the commands that join it with nsenter). That first
process gets it too, through --seccomp: a command of a runner that is not root runs as the same
user and could otherwise make it call socket() for it. ptrace, process_vm_readv/writev and
pidfd_getfd are refused to commands as well, so they cannot reach into another process at all.
A unix socketpair() is allowed as a stream or seqpacket pair (connected for good to its twin), not
as a datagram pair, whose sockets could sendto() or connect() any socket path.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct
from typing import NamedTuple

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_DENY = 0x00050000 | errno.EACCES  # SECCOMP_RET_ERRNO: the call fails with "Permission denied"
_AF_UNIX = 1
_STREAM, _SEQPACKET = 1, 5  # unix socket types a pair may have: connected for good, never re-aimed
_TYPE_MASK = 0xF  # the type's bits, without SOCK_NONBLOCK and SOCK_CLOEXEC
# Classic BPF opcodes: load a 32-bit word of struct seccomp_data, compare, mask, return.
_LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JUMP_EQ, _JUMP_GE, _JUMP_GT = 0x15, 0x35, 0x25  # BPF_JMP | BPF_JEQ/JGE/JGT | BPF_K
_AND = 0x54  # BPF_ALU | BPF_AND | BPF_K
_RETURN = 0x06  # BPF_RET | BPF_K
_NR, _ARCH, _ARG0, _ARG1 = 0, 4, 16, 24  # offsets in struct seccomp_data (low words, little endian)
_X32_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers


class _Numbers(NamedTuple):
    audit_arch: int
    socket: int
    socketpair: int
    # Calls that reach into another process of the sandbox (the one that keeps it alive runs as the
    # same user): its memory, its registers, its file descriptors.
    other_process: tuple[int, ...]
    io_uring: tuple[int, int]  # the first and last of its calls
    has_x32: bool


_ARCHES = {  # ptrace, process_vm_readv, process_vm_writev, pidfd_getfd
    "x86_64": _Numbers(0xC000003E, 41, 53, (101, 310, 311, 438), (425, 427), True),
    "aarch64": _Numbers(0xC00000B7, 198, 199, (117, 270, 271, 438), (425, 427), False),
}


UNSUPPORTED = (f"--sandbox=bwrap cannot filter unix sockets on this machine ({platform.machine()}): "
               f"it supports {', '.join(_ARCHES)}; use --terminal_env=docker")


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def supported() -> bool:
    return platform.machine() in _ARCHES


def _program(machine: str) -> bytes:
    nr = _ARCHES[machine]
    # (label, code, k, where to go if true, if false): None goes on to the next instruction.
    steps = [
        ("", _LOAD_WORD, _ARCH, None, None),
        ("", _JUMP_EQ, nr.audit_arch, None, "kill"),
        ("", _LOAD_WORD, _NR, None, None),
        *([("", _JUMP_GE, _X32_BIT, "deny", None)] if nr.has_x32 else []),
        ("", _JUMP_EQ, nr.socket, "socket", None),
        ("", _JUMP_EQ, nr.socketpair, "pair", None),
        *(("", _JUMP_EQ, number, "deny", None) for number in nr.other_process),
        ("", _JUMP_GE, nr.io_uring[0], None, "allow"),
        ("", _JUMP_GT, nr.io_uring[1], "allow", "deny"),
        # socket(AF_UNIX, ...): refused.
        ("socket", _LOAD_WORD, _ARG0, None, None),
        ("", _JUMP_EQ, _AF_UNIX, "deny", "allow"),
        # socketpair(AF_UNIX, ...): a stream or seqpacket pair only; a datagram socket of a pair
        # could still sendto() any socket path, or connect() to one.
        ("pair", _LOAD_WORD, _ARG0, None, None),
        ("", _JUMP_EQ, _AF_UNIX, None, "allow"),
        ("", _LOAD_WORD, _ARG1, None, None),
        ("", _AND, _TYPE_MASK, None, None),
        ("", _JUMP_EQ, _STREAM, "allow", None),
        ("", _JUMP_EQ, _SEQPACKET, "allow", "deny"),
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

    @property
    def program(self) -> bytes:
        """The filter as bubblewrap's --seccomp reads it (struct sock_filter, one after another)."""
        return self._code

    def install(self) -> None:
        # no_new_privs first: without it only a process with CAP_SYS_ADMIN may install a filter.
        if self._prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if self._prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, self._pointer, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "seccomp: the sandbox's socket filter could not be installed")
