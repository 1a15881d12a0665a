"""The sandbox's seccomp filter, applied to a child process the way the local backend applies it."""

from __future__ import annotations

import errno
import json
import platform
import subprocess
import sys

import pytest

from tools.environments import socket_filter

pytestmark = pytest.mark.skipif(not socket_filter.supported(), reason="no filter for this architecture")

_PROBE = r"""
import ctypes, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    ctypes.set_errno(0)
    result = libc.syscall(nr, *args)
    return "ok" if result >= 0 else errno_name(ctypes.get_errno())
def errno_name(number):
    import errno
    return errno.errorcode.get(number, str(number))
def attempt(make):
    try:
        make().close()
        return "ok"
    except OSError as exc:
        return errno_name(exc.errno)
socket_nr = {"x86_64": 41, "aarch64": 198}[os.uname().machine]
found = {
    "unix": attempt(lambda: socket.socket(socket.AF_UNIX)),
    "unix_datagram": attempt(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)),
    "inet": attempt(lambda: socket.socket(socket.AF_INET)),
    "pair": attempt(lambda: socket.socketpair()[0]),
    "seqpacket_pair": attempt(lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)[0]),
    "datagram_pair": attempt(lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0]),
    "raw_pair": attempt(lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_RAW | socket.SOCK_NONBLOCK)[0]),
    "ptrace": call({"x86_64": 101, "aarch64": 117}[os.uname().machine], 2, 0x7FFFFFFF, 0, 0),  # PEEKDATA, no such pid
    "pidfd_getfd": call(438, 0, 0, 0),
    "io_uring": call(425, 4, ctypes.create_string_buffer(120)),
}
if os.uname().machine == "x86_64":  # the x32 numbering of socket(), which a filter must not miss
    found["x32_socket"] = call(socket_nr | 0x40000000, 1, 1, 0)
print(json.dumps(found))
"""


def _run_filtered(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, preexec_fn=socket_filter.SocketFilter().install, capture_output=True, text=True,
                          timeout=60)


def test_a_filtered_process_cannot_make_a_unix_socket_but_keeps_pairs_and_network_sockets():
    proc = _run_filtered([sys.executable, "-c", _PROBE])
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["unix"] == found["unix_datagram"] == errno.errorcode[errno.EACCES]
    assert found["inet"] == found["pair"] == found["seqpacket_pair"] == "ok"
    assert found["datagram_pair"] == found["raw_pair"] == errno.errorcode[errno.EACCES]
    assert found["ptrace"] == found["pidfd_getfd"] == errno.errorcode[errno.EACCES]
    assert found["io_uring"] == errno.errorcode[errno.EACCES]
    if platform.machine() == "x86_64":
        assert found["x32_socket"] == errno.errorcode[errno.EACCES]


def test_the_filter_holds_for_what_the_command_starts_and_ordinary_commands_run():
    proc = _run_filtered(["sh", "-c", f"echo started; {sys.executable} -c 'import socket; socket.socket(socket.AF_UNIX)'"])
    assert proc.stdout == "started\n"
    assert proc.returncode == 1 and "PermissionError" in proc.stderr


def test_an_unfiltered_process_is_unchanged():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    found = json.loads(proc.stdout)
    assert found["unix"] == found["datagram_pair"] == "ok"
    assert found["ptrace"] == errno.errorcode[errno.ESRCH]
