"""One runner per run directory, also across containers and hosts that share the disk.

Two layers, because neither is enough alone:

- The kernel lock (`flock` on the run directory itself) decides on this machine. The kernel
  releases it when its holder dies, however it dies, so a dead runner never blocks the next one and
  a PID that was reused (PID 1 of a restarted container) is never mistaken for a live run. It is
  taken on the directory, not on a file in it: a file can be deleted (by hand, by a cleanup job),
  and the next runner would lock a new file of the same name while the first still runs.
- The lock record (JSON in `<run>/.lock`: host, boot id, PID, refresh time) covers other machines:
  flock over NFS or some shared volumes is not reliable, so a record written by another machine
  is honoured while its refresh is younger than LEASE_SECONDS. The holder rewrites the record
  every REFRESH_SECONDS from a background thread while the run lives (recreating it if it was
  deleted), each time as a whole (written aside, then renamed), so a reader never sees half of one.

The record is written only while the kernel lock is held. A clean release marks the record
released, so the next runner on any host starts at once. A record that cannot be read (cut, not
JSON, a refresh time that is no number or lies in the future by more than the lease) protects
nothing: it is taken over, with a line saying so.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import threading
import time
from pathlib import Path
from runner.timestamps import now_iso

LEASE_SECONDS = 60.0  # a record of another machine older than this is stale
REFRESH_SECONDS = 5.0  # how often the holder rewrites its record
RECORD_NAME = ".lock"


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


def same_kernel(record: dict) -> bool:
    """Was the record written on this kernel? Then the kernel lock alone decides. The boot id says
    so even when the host name differs (a container re-created on the same machine); without a
    boot id (no /proc), the host name has to do."""
    host, boot_id = machine_id()
    if boot_id:
        return record.get("boot_id") == boot_id
    return not record.get("boot_id") and record.get("host") == host


class RunLock:
    def __init__(self, run_dir: Path, lease: float = LEASE_SECONDS, refresh: float = REFRESH_SECONDS):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RECORD_NAME
        self.lease = lease
        self.refresh = refresh
        self._fd: int | None = None  # the run directory, opened and flock-ed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()
        self._started_at = ""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, log=print) -> None:
        fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                kernel_lock = True
            except BlockingIOError:
                record, _ = read_record(self.path)
                raise RunLockBusy(self._busy_message(record, "")) from None
            except OSError as err:  # NFS emulates flock with POSIX locks, which refuse a read-only fd
                kernel_lock = False
                log(f"ℹ️  {self.run_dir}: no kernel lock on this file system ({err.strerror}); "
                    f"the lock record alone guards the run (its {self.lease:g}s lease)")
            self._check_record(log, kernel_lock)
        except BaseException:
            os.close(fd)  # closing the descriptor releases the kernel lock too
            raise
        self._fd = fd
        self._started_at = now_iso()
        self._write_record(held=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._keep_fresh, name="abr-run-lock", daemon=True)
        self._thread.start()

    def _check_record(self, log, kernel_lock: bool = True) -> None:
        """We hold the kernel lock. A record of this machine is then stale whatever its PID says;
        a record of another machine is honoured until its lease runs out (without a kernel lock,
        a record of this machine too)."""
        record, problem = read_record(self.path)
        if problem:
            log(f"ℹ️  Taking over the lock: its record {self.path} cannot be read ({problem})")
            return
        if not record or record.get("held") is not True:
            return
        pid = record.get("pid", "?")
        if kernel_lock and same_kernel(record):
            log(f"ℹ️  Taking over the lock of a runner that is gone (PID {pid}; the kernel lock was free)")
            return
        refreshed_at = record.get("refreshed_at")
        if isinstance(refreshed_at, bool) or not isinstance(refreshed_at, (int, float)) or not math.isfinite(refreshed_at):
            log(f"ℹ️  Taking over the lock of PID {pid} on host {record.get('host')!r}: "
                f"its refresh time {refreshed_at!r} is not a time")
            return
        # A refresh time in the future (another host's clock runs ahead) counts as old as it is far
        # ahead: a record is never honoured for more than the lease past what its clock claims.
        age = abs(time.time() - refreshed_at)
        if age < self.lease:
            raise RunLockBusy(self._busy_message(record, f", refreshed {age:.0f}s ago"))
        log(
            f"ℹ️  Taking over a stale lock of PID {pid} on host {record.get('host')!r} "
            f"(not refreshed for {age:.0f}s; the lease is {self.lease:g}s)"
        )

    def _busy_message(self, record: dict | None, freshness: str) -> str:
        who = f"PID {record.get('pid')} on host {record.get('host')!r}" if record else "another process"
        return (
            f"{self.run_dir} is in use by another batch_runner ({who}{freshness}); "
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
        tmp = self.run_dir / f"{RECORD_NAME}_{os.getpid()}.tmp"
        with self._write_lock:
            if self._fd is None:
                return
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)  # whole, or not at all: a reader never sees half a record
            except OSError:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise

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


def read_record(path: Path) -> tuple[dict | None, str | None]:
    """(record, None), (None, None) when there is none, or (None, why) when it cannot be read."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as err:
        return None, err.strerror or str(err)
    if not data.strip():
        return None, None
    try:
        record = json.loads(data)
    except ValueError:
        return None, "not complete JSON"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object"
    return record, None
