"""Runs rows on a Ray cluster: one async actor per node, many sessions per actor.

The driver (the `batch_runner.py` process) stays the only writer of the run directory: actors run
`process_row` and hand records back; `RunStore.commit` writes them. Each alive node gets one actor,
pinned to it (`NodeAffinitySchedulingStrategy`, soft=False), running up to `sessions_per_node`
sessions at once on its asyncio loop with one `WorkerRuntime` (model client, limiter, pacer) built
once. Sandboxes (local work dirs, Docker containers, ...) are created inside the actor, so they live
on the node that runs the session; a node runs at most `sessions_per_node` of them.

Delivery is at-least-once: when an actor or its node dies, the rows it was running are sent again
to a live actor (the store commits a row key once, so a duplicate result is dropped). A row is
given up, as a failed record (retried on `--resume`), only after its worker died under it
`MAX_DELIVERIES` times, or when no actor is left and none can be started. A node that joins the
cluster mid-run gets an actor too.

Spend is known to the driver request by request, as with the process executor: each actor keeps
one `updates()` call of the driver's open and answers it as soon as a row's usage changes (a request
sent, a reply come back), so the driver's watcher (the live status and the budget) sees the rows in
flight; under a budget each request also waits there for the driver's `may_send()`. A row given
up in flight is committed with the usage its actor last reported, and a row sent again after its
worker died carries what the lost delivery spent, so every request sent is counted once.

Workers must be able to import this project. When a node runs on the driver's machine, its actors
get the checkout on PYTHONPATH (`runtime_env={"env_vars": ...}`: nothing is uploaded); on a real
cluster the project must be installed on every node (`pip install .` or
`pip install 'agent-batch-runner[ray]'`), with the same version as the driver.

Ray is imported lazily: the rest of the runner never needs it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.input.config import RunConfig
from runner.execution.executor import SHUTDOWN_WAIT, SpendWatcher
from runner.execution.task import Task
from runner.execution.worker import failed_record
from agent.usage import Usage

RAY_MISSING = "--executor=ray needs Ray: pip install 'agent-batch-runner[ray]' (or pip install ray)"
REPO_ROOT = Path(__file__).resolve().parent.parent


# --- the actor (runs on a worker node) -------------------------------------------------------


class NodeWorker:
    """The body of the per-node Ray actor (wrapped with `ray.remote` by RayExecutor)."""

    def __init__(self, config: RunConfig, unavailable: dict[str, str], sessions: int, run_sessions: int):
        self.config = config
        self.unavailable = unavailable
        self.sessions = sessions
        self.run_sessions = run_sessions  # every node's sessions: this node's share of the request rate
        self.runtime = None  # built on first use, inside the actor's event loop
        self.node_missing: dict[str, str] = {}  # tools the driver offers but this node cannot run
        self.logs: list[str] = []
        self.running: set[asyncio.Task] = set()
        self.images: dict[str, asyncio.Task] = {}  # image -> its preparation on this node, once
        # What the driver has not fetched yet (`updates`): each row's usage so far, by row key, and
        # the requests waiting for its word under a cost budget (ask id -> the answer to come).
        self.usage: dict[str, dict] = {}
        self.asks: dict[int, asyncio.Future] = {}
        self.new_asks: list[int] = []
        self.ask_ids = itertools.count()
        self.changed: asyncio.Event | None = None  # made inside the actor's event loop
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None
        self.closing = False

    def _runtime(self):
        if self.runtime is None:
            from runner.execution.worker import WorkerRuntime
            from tools.registry import unavailable_tools

            # A tool must work on the driver's machine (where the run was checked) and on this node
            # (Chromium, keys and packages may differ between machines): offer it only if both agree.
            self.node_missing = {k: v for k, v in unavailable_tools(self.config.tools).items() if k not in self.unavailable}
            self.runtime = WorkerRuntime(self.config, {**self.unavailable, **self.node_missing}, self.sessions,
                                         self._log, run_sessions=self.run_sessions)
            self.runtime.report_usage = self._report_usage
            if self.config.max_cost is not None:  # the driver, which knows every node's spend, admits each request
                self.runtime.admit = self._ask_driver
        return self.runtime

    def _bind_loop(self) -> None:
        """The actor's event loop (its methods run on it): where usage reports are noted."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
            self.loop_thread = threading.get_ident()
            self.changed = asyncio.Event()

    # --- spend, reported to the driver request by request ------------------------------------

    def _report_usage(self, task, stats) -> None:
        key, usage = task.key, stats.report()  # read now: the session goes on counting
        if threading.get_ident() == self.loop_thread:
            self._note_usage(key, usage)
        else:
            self.loop.call_soon_threadsafe(self._note_usage, key, usage)

    def _note_usage(self, key: str, usage: dict) -> None:
        self.usage[key] = usage
        self.changed.set()

    async def _ask_driver(self) -> bool:
        if self.closing:
            return False
        ask = next(self.ask_ids)
        future = self.loop.create_future()
        self.asks[ask] = future
        self.new_asks.append(ask)
        self.changed.set()
        try:
            return await future
        finally:
            self.asks.pop(ask, None)

    async def updates(self, wait: float) -> dict:
        """What changed since the last call, once something did (or after `wait` seconds): the
        usage so far of each row that spent more, and the asks waiting for an answer."""
        self._bind_loop()
        if not self.usage and not self.new_asks:
            try:
                await asyncio.wait_for(self.changed.wait(), wait)
            except asyncio.TimeoutError:
                pass
        self.changed.clear()
        usage, self.usage = self.usage, {}
        asks, self.new_asks = self.new_asks, []
        return {"usage": usage, "asks": asks}

    async def answer(self, answers: dict[int, bool]) -> None:
        """The driver's word on asks: may each request be sent?"""
        for ask, allowed in answers.items():
            future = self.asks.get(ask)
            if future is not None and not future.done():
                future.set_result(bool(allowed))

    def _refuse_asks(self) -> None:
        for future in self.asks.values():
            if not future.done():
                future.set_result(False)

    def _log(self, text: str) -> None:
        if self.config.verbose:
            self.logs.append(text)

    async def ready(self) -> dict:
        import socket

        import ray

        self._bind_loop()
        self._runtime()
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "host": socket.gethostname(),
                "missing": self.node_missing}

    async def run(self, task: Task) -> dict:
        """Run one row: {"record": the record to commit, "logs": verbose lines since the last call}."""
        from runner.execution.worker import process_row

        self._bind_loop()
        me = asyncio.current_task()
        self.running.add(me)
        try:
            error = await self._image_error(task)
            if error:
                record = failed_record(task, self.config, f"environment: {error}", "environment")
            else:
                record = await process_row(task, self._runtime())
        finally:
            self.running.discard(me)
        logs, self.logs = self.logs, []
        return {"record": record, "logs": logs}

    async def _image_error(self, task: Task) -> str | None:
        """The row's image must be ready on this node: the backend prepares it once per node (docker:
        reaps containers dead runs left here, then checks or pulls it)."""
        image = task.image or self.config.tools.docker_image
        if not image:
            return None  # create_environment explains what is missing, if the backend needs one
        if image not in self.images:
            self.images[image] = asyncio.ensure_future(asyncio.to_thread(self._prepare_image, image))
        return await asyncio.shield(self.images[image])

    def _prepare_image(self, image: str) -> str | None:
        from tools.environments import backend_class

        tools = self.config.tools
        return backend_class(tools.terminal_env).prepare_run(tools, {image}, say=self._log, log=self._log).get(image)

    async def close(self, cancel: bool = False) -> dict:
        """Cancel running sessions if asked (their sandboxes are removed), then close the clients.
        Returns the usage the driver has not fetched yet ({"usage": row key -> usage so far}), the
        last word on what the cancelled sessions spent."""
        if cancel:
            self.closing = True  # no session sends another request
            self._refuse_asks()
            for job in list(self.running):
                job.cancel()
        if self.running:
            await asyncio.gather(*list(self.running), return_exceptions=True)
        self._refuse_asks()
        usage, self.usage = self.usage, {}
        if self.runtime is not None:
            try:
                await self.runtime.close()
            except Exception:
                pass
        if "tools.browser_tools" in sys.modules:
            try:
                await sys.modules["tools.browser_tools"].shutdown_browser()
            except Exception:
                pass
        return {"usage": usage}


# --- the driver side -------------------------------------------------------------------------


@dataclass
class _Actor:
    node_id: str
    handle: Any
    sessions: int
    ready_ref: Any = None  # the pending `ready()` call; None once the actor answered
    in_flight: dict = field(default_factory=dict)  # ObjectRef -> task
    updates_ref: Any = None  # the pending `updates()` call: returns when a row's usage changes

    @property
    def ready(self) -> bool:
        return self.ready_ref is None

    @property
    def short(self) -> str:
        return self.node_id[:8]


class RayExecutor:
    """An Executor (runner/execution/executor.py) on a Ray cluster (see the module docstring)."""

    MAX_RESTARTS = 5  # per node: actors that may die on a node that is still alive
    MAX_DELIVERIES = 3  # times a row is sent to a worker that then dies, before it is failed
    START_TIMEOUT = 120.0  # seconds start() waits for the first actors
    NODE_REFRESH = 5.0  # seconds between looks for joined or departed nodes
    NO_NODE_GRACE = 60.0  # seconds without any actor before the rows in flight are given up
    UPDATES_WAIT = 2.0  # seconds an actor holds an `updates()` call open when nothing changes
    CLOSE_WAIT = 1.5  # seconds a quit at once waits for the actors' last word on what their rows spent

    def __init__(self, config: RunConfig, unavailable: dict[str, str], log=print):
        try:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        except ImportError:
            raise RuntimeError(RAY_MISSING) from None
        self.ray = ray
        self._affinity = NodeAffinitySchedulingStrategy
        self.config = config
        self.unavailable = unavailable
        self.log = log
        self.sessions = config.sessions_per_node or config.num_workers
        self.actors: list[_Actor] = []
        self.backlog: deque[Task] = deque()  # tasks whose worker died, waiting for a free slot
        self.ready_records: list[dict] = []  # records made on the driver, handed out by poll()
        self.deliveries: dict[str, int] = {}  # row key -> times sent to a worker that died
        self.restarts: dict[str, int] = {}  # node id -> actors lost on it
        self.gone_nodes: set[str] = set()  # dead nodes, or nodes whose actors keep dying
        self._owner: dict[Any, _Actor] = {}  # ObjectRef -> the actor running it
        self._last_refresh = 0.0
        self._no_actor_since: float | None = None
        self.last_start_error: str | None = None
        self.stop_reason: str | None = None  # never set: a lost node's rows are re-sent or failed, the run goes on
        self.watcher: SpendWatcher | None = None
        self.usage: dict[str, Usage] = {}  # row key -> its usage so far in the delivery now running
        # row key -> what its earlier deliveries spent before their worker died: the row is sent
        # again, and its record carries this too, so every request sent is counted once
        self.carried: dict[str, Usage] = {}
        self._updates: dict[Any, _Actor] = {}  # pending `updates()` call -> its actor
        self._late: list[dict] = []  # records that finished while the actors stopped
        self._unfinished: list[Task] = []  # rows in flight when the actors stopped
        self._closing: list[Any] = []  # the actors' `close(cancel=True)` calls of a quit at once
        self._closed = False
        self._owns_connection = False
        self._connect()

    # --- connection and nodes ---------------------------------------------------------------

    def _connect(self) -> None:
        ray = self.ray
        address = self.config.ray_address
        _check_reachable(address)  # Ray itself retries an unreachable address for minutes
        try:
            if not ray.is_initialized():  # (a caller that connected already keeps its connection)
                import logging

                self._owns_connection = True

                # Ray installs its own SIGTERM handler here, before the runner installs its own.
                ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING,
                         **({"include_dashboard": False} if address is None else {}))
        except Exception as err:
            where = "a local Ray instance" if address is None else f"the Ray cluster at {address!r}"
            raise RuntimeError(f"cannot connect to {where}: {type(err).__name__}: {err}") from None
        self.local_only = address is None
        try:
            self.driver_ip = ray.util.get_node_ip_address()
        except Exception:
            self.driver_ip = None
        self._actor_cls = ray.remote(NodeWorker)
        self.nodes_at_start = len(self._eligible_nodes())

    def _eligible_nodes(self) -> dict[str, dict]:
        """Alive nodes that accept work (a node started with --num-cpus=0, e.g. the head, does not)."""
        nodes = {}
        for node in self.ray.nodes():
            if node.get("Alive") and (node.get("Resources") or {}).get("CPU", 0) > 0:
                nodes[node["NodeID"]] = node
        return nodes

    def _runtime_env(self, node: dict) -> dict | None:
        """On the driver's machine, actors import the project from this checkout (nothing is uploaded)."""
        if not (self.local_only or node.get("NodeManagerAddress") == self.driver_ip):
            return None  # another machine: the project must be installed there
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        return {"env_vars": {"PYTHONPATH": path}}

    def _create_actor(self, node_id: str, node: dict, nodes: int) -> None:
        options: dict[str, Any] = {
            "scheduling_strategy": self._affinity(node_id=node_id, soft=False),
            # the sessions, plus room for ready(), updates(), answer() and close()
            "max_concurrency": self.sessions + 4,
            "num_cpus": 0,
            "max_restarts": 0,  # a dead actor is replaced by the driver, which knows its rows
            "max_task_retries": 0,
        }
        runtime_env = self._runtime_env(node)
        if runtime_env:
            options["runtime_env"] = runtime_env
        # Each node gets its share of --max_requests_per_minute: its sessions of every node's.
        handle = self._actor_cls.options(**options).remote(self.config, self.unavailable, self.sessions,
                                                           self.sessions * max(1, nodes))
        self.actors.append(_Actor(node_id, handle, self.sessions, ready_ref=handle.ready.remote()))

    # --- the executor interface -------------------------------------------------------------

    def describe(self) -> str:
        nodes = sum(1 for a in self.actors if a.ready) if self.actors else self.nodes_at_start
        from runner.console import plural

        return f"Ray: {plural(nodes, 'node')} x {plural(self.sessions, 'session')}"

    def start(self) -> None:
        nodes = self._eligible_nodes()
        for node_id, node in nodes.items():
            self._create_actor(node_id, node, len(nodes))
        self._last_refresh = time.monotonic()
        deadline = time.monotonic() + self.START_TIMEOUT
        while any(not a.ready for a in self.actors) and time.monotonic() < deadline:
            self._promote(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        if not any(a.ready for a in self.actors):
            if not self.restarts and not self.gone_nodes and not self.actors:
                detail = "no alive node accepts work (every node has 0 CPUs)"
            elif self.last_start_error:
                detail = f"no worker could start ({self.last_start_error}); is agent-batch-runner installed on every node?"
            else:
                detail = f"no worker was ready within {self.START_TIMEOUT:g}s"
            self.shutdown(abandon=True)
            raise RuntimeError(f"Ray: {detail}")
        pending = sum(1 for a in self.actors if not a.ready)
        ready = len(self.actors) - pending
        self.log(f"☁️  Ray: {ready} node(s) ready" + (f", {pending} still starting" if pending else ""))

    def free_slots(self) -> int:
        self._maintain()
        live = [a for a in self.actors if a.ready]
        if not live and not self.ready_records:
            if not self.actors and self._no_actor_since is not None and not self.backlog and (
                time.monotonic() - self._no_actor_since > self.NO_NODE_GRACE
            ):
                raise RuntimeError(
                    "Ray: no node is left to run prompts on (every worker died and none could be started); "
                    "committed rows are safe, run again with --resume"
                )
            time.sleep(0.2)  # nothing can run yet and the runner does not wait in poll(): do not spin
            return 0
        free = sum(a.sessions - len(a.in_flight) for a in live) - len(self.backlog)
        return max(0, free)

    def in_flight(self) -> int:
        return sum(len(a.in_flight) for a in self.actors) + len(self.backlog) + len(self.ready_records)

    def submit(self, task: Task) -> None:
        live = [a for a in self.actors if a.ready and len(a.in_flight) < a.sessions]
        if not live:
            self.backlog.append(task)  # free_slots() said there was room; it went since
            return
        self._send(max(live, key=lambda a: a.sessions - len(a.in_flight)), task)

    def _send(self, actor: _Actor, task: Task) -> None:
        ref = actor.handle.run.remote(task)
        actor.in_flight[ref] = task
        self._owner[ref] = actor
        self._ask_updates(actor)

    def poll(self, timeout: float) -> list[dict]:
        """Records that finished since the last call (waits up to `timeout` for the first). While
        it waits, the actors' reports of each request's usage go to the watcher as they come."""
        ray = self.ray
        self._maintain()
        deadline = time.monotonic() + timeout
        while True:
            refs = list(self._owner)
            waiting = refs + list(self._updates)
            left = 0.0 if self.ready_records else max(0.0, deadline - time.monotonic())
            if not refs:
                self._take_updates(0.0)
                if not self.ready_records:
                    time.sleep(min(left, 0.2))
                break
            ready, _ = ray.wait(waiting, num_returns=1, timeout=left, fetch_local=True)
            if ready:
                ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0, fetch_local=True)
            ready = set(ready)
            self._take_updates(0.0, [ref for ref in self._updates if ref in ready])
            for ref in refs:
                if ref in ready:
                    self._collect(ref)
            if self.ready_records or time.monotonic() >= deadline:
                break
        self._maintain()
        records, self.ready_records = self.ready_records, []
        return records

    # --- spend, request by request ----------------------------------------------------------

    def _ask_updates(self, actor: _Actor) -> None:
        """Keep one `updates()` call open per ready actor: it returns as soon as a row spends."""
        if self._closed or actor.updates_ref is not None or not actor.ready:
            return
        try:
            actor.updates_ref = actor.handle.updates.remote(self.UPDATES_WAIT)
        except Exception:
            return
        self._updates[actor.updates_ref] = actor

    def _take_updates(self, timeout: float, refs: list | None = None) -> None:
        """Hand the answered `updates()` calls' usage to the watcher, answer their asks, and ask again."""
        if refs is None:
            pending = list(self._updates)
            refs = self.ray.wait(pending, num_returns=len(pending), timeout=timeout)[0] if pending else []
        for ref in refs:
            actor = self._updates.pop(ref, None)
            if actor is None:
                continue
            actor.updates_ref = None
            try:
                update = self.ray.get(ref)
            except Exception:
                continue  # the actor died: its rows' own calls say so
            self._note_usage(actor, update.get("usage") or {})
            asks = update.get("asks") or []
            if asks:
                answers = {ask: self.watcher is None or self.watcher.may_send() for ask in asks}
                try:
                    actor.handle.answer.remote(answers)
                except Exception:
                    pass
            if actor in self.actors:
                self._ask_updates(actor)

    def _note_usage(self, actor: _Actor | None, usage: dict[str, dict]) -> None:
        """Usage reported by `actor` (None: any actor) for rows it runs; a row no longer in flight
        there (finished, or sent again elsewhere) is left alone."""
        running = {task.key for a in ([actor] if actor else self.actors) for task in a.in_flight.values()}
        for key, report in usage.items():
            if key not in running:
                continue
            self.usage[key] = Usage.read(report)
            if self.watcher is not None:
                carried = self.carried.get(key)
                if carried is not None:  # what the earlier deliveries spent, with this one's
                    report = {**(carried + self.usage[key]).as_dict(), "pending": report.get("pending") or 0}
                self.watcher.on_usage(key, report)

    def _spent(self, key: str) -> Usage:
        """What the row has spent so far, over every delivery; forgotten from here on."""
        usage = self.usage.pop(key, None) or Usage()
        carried = self.carried.pop(key, None)
        return usage if carried is None else carried + usage

    def _collect(self, ref) -> None:
        ray = self.ray
        actor = self._owner.pop(ref, None)
        if actor is None:
            return  # its actor was given up meanwhile; the row was sent again
        task = actor.in_flight.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            self._lose_actor(actor, err, [task])
        except ray.exceptions.RayTaskError as err:  # our actor code raised: a bug, not a lost node
            detail = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            self.ready_records.append(failed_record(task, self.config, f"Ray worker error: {detail}", "agent"))
        except ray.exceptions.RayError as err:  # the result was lost on the way (object lost, worker crash)
            self._requeue(task, err)
        else:
            for line in result.get("logs") or ():
                self.log(line)
            self.ready_records.append(self._with_carried(task.key, result["record"]))

    def _with_carried(self, key: str, record: dict) -> dict:
        """The record, its usage including what earlier deliveries of the row spent."""
        self.usage.pop(key, None)
        carried = self.carried.pop(key, None)
        if carried is None or not carried.requests:
            return record
        metadata = record.get("metadata") or {}
        usage = carried + Usage.read(metadata.get("usage"))
        return {**record, "metadata": {**metadata, "usage": usage.as_dict()}}

    # --- failures ---------------------------------------------------------------------------

    def _requeue(self, task: Task, err: Exception) -> None:
        key = task.key
        self.deliveries[key] = self.deliveries.get(key, 0) + 1
        spent = self._spent(key)
        if self.deliveries[key] >= self.MAX_DELIVERIES:
            self.ready_records.append(failed_record(
                task, self.config,
                f"the Ray worker running this row died {self.deliveries[key]} times (last: {_reason(err)})", "agent",
                usage=spent,
            ))
        else:
            if spent.requests:
                self.carried[key] = spent
            self.backlog.append(task)

    def _lose_actor(self, actor: _Actor, err: Exception | str, rows: list[dict] | None = None) -> None:
        """A dead (or unreachable) actor: its rows run again elsewhere; its node may get a new one."""
        rows = list(rows or []) + list(actor.in_flight.values())
        for ref in actor.in_flight:
            self._owner.pop(ref, None)
        actor.in_flight.clear()
        self._updates.pop(actor.updates_ref, None)
        actor.updates_ref = None
        if actor in self.actors:
            self.actors.remove(actor)
        try:
            self.ray.kill(actor.handle, no_restart=True)
        except Exception:
            pass
        for task in rows:
            self._requeue(task, err)
        reason = err if isinstance(err, str) else _reason(err, last=not actor.ready)
        try:
            alive = actor.node_id in self._eligible_nodes()
        except Exception:
            alive = False
        if not alive:
            self.gone_nodes.add(actor.node_id)
            state = "the node left the run"
        elif not actor.ready:  # it never started on a live node: trying again will not help
            self.gone_nodes.add(actor.node_id)
            self.last_start_error = reason
            self.log(f"⚠️  Ray worker on node {actor.short} could not start: {reason}")
            return
        else:
            restarts = self.restarts[actor.node_id] = self.restarts.get(actor.node_id, 0) + 1
            if restarts > self.MAX_RESTARTS:
                self.gone_nodes.add(actor.node_id)
                state = f"its worker died {restarts} times: the node leaves the run"
            else:
                state = "a new worker starts there if the node is still alive in a moment"
                # The next look at the nodes (in ~2 s) replaces it, once Ray has had time to
                # notice whether the node itself died.
                self._last_refresh = min(self._last_refresh, time.monotonic() - self.NODE_REFRESH + 2.0)
        rerun = f"; {len(rows)} row(s) in flight there will run again" if rows else ""
        self.log(f"⚠️  Ray worker on node {actor.short} lost ({reason}){rerun}; {state}")

    def _promote(self, timeout: float = 0.0) -> None:
        """Actors whose ready() answered start taking rows; those that failed to start are dropped."""
        pending = {a.ready_ref: a for a in self.actors if not a.ready}
        if not pending:
            return
        done, _ = self.ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
        for ref in done:
            actor = pending[ref]
            try:
                info = self.ray.get(ref)
            except Exception as err:
                self._lose_actor(actor, err)
                continue
            actor.ready_ref = None
            self._ask_updates(actor)
            if info.get("missing"):
                missing = ", ".join(f"{tool} ({why})" for tool, why in sorted(info["missing"].items()))
                self.log(f"⚠️  Ray node {actor.short} ({info['host']}) cannot offer: {missing}")
            if self.config.verbose:
                self.log(f"   Ray worker ready on node {actor.short} ({info['host']}, pid {info['pid']})")

    def _maintain(self) -> None:
        """Promote started actors, notice joined nodes, and hand the backlog to free slots."""
        if self._closed:
            return
        self._promote()
        now = time.monotonic()
        if now - self._last_refresh > self.NODE_REFRESH:
            self._last_refresh = now
            try:
                nodes = self._eligible_nodes()
            except Exception:
                nodes = {}
            if nodes:  # (an empty answer is more likely a failed call than an empty cluster)
                for actor in [a for a in self.actors if a.node_id not in nodes]:
                    self._lose_actor(actor, "its node is no longer alive")
            covered = {a.node_id for a in self.actors}
            for node_id, node in nodes.items():
                if node_id not in covered and node_id not in self.gone_nodes:
                    if node_id not in self.restarts:
                        self.log(f"➕ Ray node {node_id[:8]} joined: starting a worker on it")
                    self._create_actor(node_id, node, len(nodes))
        while self.backlog:
            live = [a for a in self.actors if a.ready and len(a.in_flight) < a.sessions]
            if not live:
                break
            self._send(max(live, key=lambda a: a.sessions - len(a.in_flight)), self.backlog.popleft())
        if self.actors:
            self._no_actor_since = None
        elif self._no_actor_since is None:
            self._no_actor_since = now
            if self.backlog:
                self.log(f"⚠️  Ray: no worker is left; waiting up to {self.NO_NODE_GRACE:g}s for a node to join")
        elif self.backlog and now - self._no_actor_since > self.NO_NODE_GRACE:
            while self.backlog:
                task = self.backlog.popleft()
                self.ready_records.append(failed_record(task, self.config, "no Ray node was left to run this row",
                                                        "agent", usage=self._spent(task.key)))

    # --- stopping ---------------------------------------------------------------------------

    def watch(self, watcher: SpendWatcher) -> None:
        """Each row's usage goes to `watcher` as its actor reports it (every request sent and
        ended), and under a budget each request waits for `watcher.may_send()`."""
        self.watcher = watcher

    def abandoned(self, error: str, error_class: str) -> list[dict]:
        """The records that came in while the actors stopped, and a failed record of each row that
        sent requests and did not finish, with what it spent as its actor last reported (a request
        without its reply counts at an unknown cost). Without `shutdown` first (a quit at once),
        the actors' answers to `terminate` are waited for a moment: their last word on the spend."""
        if not self._closed:
            self._hear_closing(self.CLOSE_WAIT)
            self._unfinished.extend(self._tasks_in_flight())
        records, self._late = self._late, []
        for task in self._unfinished:
            usage = self._spent(task.key)
            if usage.requests:
                records.append(failed_record(task, self.config, error, error_class, usage=usage))
        self._unfinished = []
        return records

    def _tasks_in_flight(self) -> list[Task]:
        tasks = [task for actor in self.actors for task in actor.in_flight.values()]
        tasks += list(self.backlog)  # sent before, to a worker that died: what they spent is carried
        for actor in self.actors:
            actor.in_flight.clear()
        self._owner.clear()
        self.backlog.clear()
        return tasks

    def _hear_closing(self, timeout: float) -> None:
        """The usage in the answers of the actors' `close()` calls that came within `timeout`."""
        if not self._closing:
            return
        try:
            done, _ = self.ray.wait(self._closing, num_returns=len(self._closing), timeout=timeout)
        except Exception:
            return
        self._take_updates(0.0)
        for ref in done:
            try:
                self._note_usage(None, (self.ray.get(ref) or {}).get("usage") or {})
            except Exception:
                pass
        self._closing = [ref for ref in self._closing if ref not in done]

    def shutdown(self, abandon: bool = False, timeout: float | None = None) -> None:
        """Stop the actors (waiting up to `timeout`, default SHUTDOWN_WAIT). abandon=True cancels in-flight
        sessions (their sandboxes are removed); what they spent, and the records that finish
        meanwhile, are kept for `abandoned`."""
        timeout = SHUTDOWN_WAIT if timeout is None else timeout
        if self._closed:
            return
        ray = self.ray
        try:
            for actor in self.actors:
                if actor.ready:
                    try:
                        self._closing.append(actor.handle.close.remote(cancel=abandon))
                    except Exception:
                        pass
            self._hear_closing(max(0.1, timeout))
            self._keep_finished()
        finally:
            self._closed = True
            self._unfinished.extend(self._tasks_in_flight())
            for actor in self.actors:
                try:
                    ray.kill(actor.handle, no_restart=True)
                except Exception:
                    pass
            self.actors.clear()
            self._updates.clear()
            if self._owns_connection:
                try:
                    ray.shutdown()
                except Exception:
                    pass

    def _keep_finished(self) -> None:
        """Rows whose record came back while the actors stopped: kept, to be committed."""
        self._late, self.ready_records = self._late + self.ready_records, []
        refs = list(self._owner)
        if not refs:
            return
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)
        for ref in done:
            actor = self._owner.pop(ref)
            task = actor.in_flight.pop(ref)
            try:
                result = self.ray.get(ref)
            except Exception:  # cancelled, or its actor died: unfinished
                actor.in_flight[ref] = task
                continue
            self._late.append(self._with_carried(task.key, result["record"]))

    def terminate(self) -> None:
        """Signal every actor to cancel its sessions and remove their sandboxes; do not wait."""
        for actor in self.actors:
            if actor.ready:
                try:
                    self._closing.append(actor.handle.close.remote(cancel=True))
                except Exception:
                    pass


def _reason(err: Exception, last: bool = False) -> str:
    """One line of a Ray error (the first, or the last, which names the root cause), shortened."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return (lines[-1] if last else lines[0])[:300]


def _check_reachable(address: str | None, timeout: float = 5.0) -> None:
    """Fail fast, in one line, when a host:port cluster address does not answer."""
    import socket

    if not address or address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError(f"--ray_address={address!r} is not 'auto' or host:port (the head node's GCS address)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise RuntimeError(f"cannot reach the Ray cluster at {address}: {err} (is `ray start --head` running there?)") from None
