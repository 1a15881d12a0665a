"""One runner per run directory, also across containers and hosts that share the disk.

Two layers, because neither is enough alone:

- The kernel lock (`flock` on `.lock`) decides on this machine. The kernel releases it when its
  holder dies, however it dies, so a dead runner never blocks the next one and a PID that was
  reused (PID 1 of a restarted container) is never mistaken for a live run.
- The lock record (JSON in the same file: host, boot id, PID, refresh time) covers other machines:
  flock over NFS or some shared volumes is not reliable, so a record written by another machine
  is honoured while its refresh is younger than LEASE_SECONDS. The holder rewrites the record
  every REFRESH_SECONDS from a background thread while the run lives.

The file is never deleted (deleting a lock file lets two runners lock two different files); the
record is read and written only while the kernel lock is held, so there is no check-then-delete
race. A clean release marks the record released, so the next runner on any host starts at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from datetime import datetime
from pathlib import Path

LEASE_SECONDS = 60.0  # a record of another machine older than this is stale
REFRESH_SECONDS = 5.0  # how often the holder rewrites its record


class RunLockBusy(RuntimeError):
    """Another live runner holds the run directory."""


def machine_id() -> tuple[str, str]:
    """(host name, boot id): the boot id tells two machines apart even when their containers share a
    host name, and tells a container on this kernel (same boot id) from one on another machine."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return socket.gethostname(), boot_id


class RunLock:
    def __init__(self, run_dir: Path, lease: float = LEASE_SECONDS, refresh: float = REFRESH_SECONDS):
        self.path = Path(run_dir) / ".lock"
        self.lease = lease
        self.refresh = refresh
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()
        self._started_at = ""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, log=print) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunLockBusy(self._busy_message(_read_record(fd), "")) from None
            record = _read_record(fd)
            self._check_other_machine(record, log)
        except BaseException:
            os.close(fd)  # closing the descriptor releases the kernel lock too
            raise
        self._fd = fd
        self._started_at = datetime.now().isoformat()
        self._write_record(held=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._keep_fresh, name="abr-run-lock", daemon=True)
        self._thread.start()

    def _check_other_machine(self, record: dict | None, log) -> None:
        """We hold the kernel lock. A record of this machine is then stale whatever its PID says;
        a record of another machine is honoured until its lease runs out."""
        if not record or not record.get("held"):
            return
        host, boot_id = machine_id()
        pid = record.get("pid", "?")
        if record.get("host") == host and record.get("boot_id") == boot_id:
            log(f"ℹ️  Taking over the lock of a runner that is gone (PID {pid}; the kernel lock was free)")
            return
        age = time.time() - float(record.get("refreshed_at") or 0)
        if age < self.lease:
            raise RunLockBusy(self._busy_message(record, f", refreshed {max(age, 0):.0f}s ago"))
        log(
            f"ℹ️  Taking over a stale lock of PID {pid} on host {record.get('host')!r} "
            f"(not refreshed for {age:.0f}s; the lease is {self.lease:g}s)"
        )

    def _busy_message(self, record: dict | None, freshness: str) -> str:
        who = f"PID {record.get('pid')} on host {record.get('host')!r}" if record else "another process"
        return (
            f"{self.path.parent} is in use by another batch_runner ({who}{freshness}); "
            "wait for it to finish or stop it first"
        )

    def _keep_fresh(self) -> None:
        while not self._stop.wait(self.refresh):
            try:
                self._write_record(held=True)
            except OSError:
                pass  # a full disk must not kill the lock; the kernel lock still holds here

    def _write_record(self, held: bool) -> None:
        host, boot_id = machine_id()
        record = {
            "held": held,
            "host": host,
            "boot_id": boot_id,
            "pid": os.getpid(),
            "started_at": self._started_at,
            "refreshed_at": time.time(),
            "lease_seconds": self.lease,
        }
        data = (json.dumps(record) + "\n").encode()
        with self._write_lock:
            if self._fd is None:
                return
            os.pwrite(self._fd, data, 0)
            os.ftruncate(self._fd, len(data))
            os.fsync(self._fd)

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            self._write_record(held=False)  # the next runner, on any host, need not wait for the lease
        except OSError:
            pass
        with self._write_lock:
            os.close(self._fd)  # releases the kernel lock
            self._fd = None


def _read_record(fd: int) -> dict | None:
    """The record in the lock file, or None when there is none (a new or unreadable file)."""
    for _ in range(3):  # another host may be rewriting it this very moment
        data = os.pread(fd, 65536, 0)
        if not data.strip():
            return None
        try:
            record = json.loads(data)
            return record if isinstance(record, dict) else None
        except ValueError:
            time.sleep(0.1)
    return None
