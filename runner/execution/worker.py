"""One prompt, start to finish, and the worker process that runs many of them at once.

A worker process runs an asyncio loop with many concurrent sessions: a session spends nearly all
its time waiting for the model, so an extra session costs a coroutine and a little memory, not a
process. Blocking work (subprocesses, the Docker SDK, file IO) runs in threads via
`asyncio.to_thread`. Workers commit nothing: every outcome goes back to the parent as a record,
and the parent commits it. The one file a worker writes in the run directory is its spend journal
(runner/storage/journal.py), so the requests it sent are recorded even if the parent is killed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable

from agent.loop import LoopConfig, run_conversation
from agent.model_client import CallStats, ModelClient, RetryPolicy, SessionModel, needs_sdk
from agent.trajectory import extract_reasoning_stats, extract_tool_stats, normalise_tool_stats, to_sharegpt
from agent.types import ProviderError
from agent.usage import Usage
from runner.execution.group_signals import CANCEL_SIGNAL, shield
from runner.input.config import RunConfig
from runner.input.secrets import register_config
from tools.environments.base import SandboxError, become_subreaper, kill_orphans
from runner.storage.journal import SpendJournal
from runner.storage.records import FailedRecord, Metadata, OkRecord, UsageRecord, as_dict, dropped_lines, note_lines
from runner.execution.task import Task
from runner.scoring.sample import Sample
from runner.scoring.scorers import ScoringContext, resolve, run_scorers
from tools.registry import ToolContext, tools_for_toolsets
from toolset_distributions import get_distribution, rng_for_row, sample_toolsets_from_distribution
from runner.timestamps import now_iso


class WorkerRuntime:
    """What one worker process shares between its sessions: built once, not per prompt."""

    def __init__(self, config: RunConfig, unavailable: dict[str, str], sessions: int, log=None,
                 run_sessions: int | None = None):
        self.config = config
        self.unavailable = unavailable
        self.log = log or (lambda text: None)
        register_config(config)  # this process redacts too: tool output is cut here, before its commit
        # The run's rate is shared between processes in proportion to their sessions, of
        # `run_sessions` in all (--num_workers, unless a Ray cluster's nodes have more).
        self.rate_share = (config.max_requests_per_minute * sessions / max(sessions, run_sessions or config.num_workers)
                           if config.max_requests_per_minute else None)
        if config.model == "mock":
            from agent.mock_model import MockModelClient

            self.client: Any = MockModelClient()
        else:
            self.client = ModelClient(
                config.base_url,
                config.api_key.get_secret_value() if config.api_key else None,
                max_in_flight=sessions,
                requests_per_minute=self.rate_share,
                policy=RetryPolicy(request_timeout=config.request_timeout),
                prompt_caching=config.prompt_caching,
                stop_after_unpriced=config.max_cost is not None and config.request_prices is None,
            )
        # Set by the worker process: each request's usage goes to the parent as it completes
        # (report_usage(task, CallStats)), and under a budget the parent admits each request.
        self.report_usage: Callable[[Task, CallStats], None] | None = None
        self.admit: Callable[[], Awaitable[bool]] | None = None
        self.scorers = [resolve(name) for name in config.scorer]
        self.judge_client = self._judge_client(sessions) if "judge" in config.scorer else None
        self.loop_config = LoopConfig(
            max_iterations=config.max_turns,
            ephemeral_system_prompt=config.ephemeral_system_prompt,
            prefill_messages=list(config.prefill_messages),
        )

    def _judge_client(self, sessions: int) -> Any:
        """The judge's endpoint: the run's own client when it is the same endpoint (one pace and
        one cap on requests in flight for both), else a client of its own with the run's key."""
        config = self.config
        url = config.judge_base_url or config.base_url
        if url == config.base_url and isinstance(self.client, ModelClient):
            return self.client
        return ModelClient(url, config.api_key.get_secret_value() if config.api_key else None, max_in_flight=sessions,
                           requests_per_minute=self.rate_share,  # its own endpoint, paced as the run's
                           policy=RetryPolicy(request_timeout=config.request_timeout),
                           stop_after_unpriced=config.max_cost is not None and config.request_prices is None)

    @staticmethod
    def needs_sdk(config: RunConfig) -> bool:
        """Does a worker of this run load the OpenAI SDK (an endpoint the plain path cannot serve)?"""
        key = config.api_key.get_secret_value() if config.api_key else None
        urls = [] if config.model == "mock" else [config.base_url]
        if "judge" in config.scorer:
            urls.append(config.judge_base_url or config.base_url)
        return any(needs_sdk(url, key) for url in urls)

    def _share_unpriced(self) -> None:
        """A budget without prices stops at the first reply without a cost, the judge's (on an
        endpoint of its own) as the agent's: after one, neither client sends another request."""
        clients = [c for c in (self.client, self.judge_client) if isinstance(c, ModelClient)]
        if any(c.unpriced_reply for c in clients):
            for c in clients:
                c.unpriced_reply = True

    def row_stats(self, task: Task) -> CallStats:
        """The usage counter of one row's session, reporting to the parent as requests complete."""
        report = self.report_usage
        listener = None if report is None else (lambda stats: report(task, stats))
        return CallStats(prices=self.config.request_prices, listener=listener, admit=self.admit)

    async def close(self) -> None:
        await self.client.close()
        if self.judge_client is not None and self.judge_client is not self.client:
            await self.judge_client.close()

    async def score(self, task: Task, conversation: list[dict], session: SessionModel, env_of) -> list[dict]:
        """metadata.scores of an ok sample. The judge's requests count in the sample's usage;
        `env_of()` gives the sample's environment (started for the command scorer if the
        session had none)."""
        config = self.config
        judge = None
        if self.judge_client is not None:
            judge = SessionModel(self.judge_client, config.judge_model, stats=session.stats)

        def run_command(command: str, timeout: float | None):
            return env_of().execute(command, timeout=timeout if timeout is not None else config.verify_timeout)

        sample = Sample(prompt=task.prompt, conversation=conversation, metadata={"model": config.model,
                        "row_key": task.key, "id": task.id, "attempt": task.attempt, "seed": task.seed},
                        targets=task.targets, verify=task.verify, rubric=task.rubric, row_line=task.line,
                        run_command=run_command)
        context = ScoringContext(judge=judge, rubric=config.judge_rubric, verify_command=config.verify_command,
                                 verify_timeout=config.verify_timeout)
        self._share_unpriced()
        try:
            return await run_scorers(self.scorers, sample, context, config.pass_threshold)
        finally:
            self._share_unpriced()


def _metadata(task: Task, config: RunConfig, started: float | None, session: SessionModel | None,
              **extra: Any) -> Metadata:
    stats = session.stats if session else None
    return Metadata(
        timestamp=now_iso(),
        model=config.model,
        row_key=task.key,
        id=task.id,
        run_id=config.tools.run_id,
        attempt=task.attempt,
        duration_seconds=round(time.monotonic() - started, 3) if started is not None else 0.0,
        seed=task.seed,
        sample=task.sample,
        samples=task.samples,
        sample_seed=task.sample_seed,
        **{"usage": UsageRecord.of(stats) if stats else UsageRecord(), **extra},
    )


def _message(err: Exception) -> str:
    """An error's text; an exception raised without one is still named (a failure line is never empty)."""
    return str(err).strip() or type(err).__name__


def failed_record(task: Task, config: RunConfig, error: str, error_class: str, *,
                  started: float | None = None, session: SessionModel | None = None,
                  usage: Usage | None = None, **metadata: Any) -> dict:
    """The record of a failed attempt: never merged into trajectories.jsonl, retried on resume.
    `usage`: what the attempt spent, when its session is not at hand (the parent's record of a row
    whose worker died, from the usage the worker reported)."""
    if usage is not None:
        metadata["usage"] = UsageRecord.of(usage)
    return as_dict(FailedRecord(
        prompt_index=task.index,
        failed=True,
        error=error,
        error_class=error_class,
        prompt=task.prompt,
        metadata=_metadata(task, config, started, session, stop_reason="failed", **metadata),
    ))


async def _cleanup(ctx: ToolContext | None, env: Any) -> None:
    if ctx is not None:
        for fn in reversed(ctx.cleanups):
            try:
                value = fn()
                if asyncio.iscoroutine(value):
                    await value
            except Exception:
                pass
    if env is not None:
        quick = getattr(env, "quick_cleanup", None)
        try:
            if quick is not None and quick():  # a few system calls: no thread hand-off
                return
        except Exception:
            pass
        # A second cancel (the runner's death is seen on the pipe and by the death signal) must
        # not abandon the cleanup: a cleanup cancelled before its thread started never runs.
        removal = asyncio.ensure_future(asyncio.to_thread(env.cleanup))
        while True:
            try:
                await asyncio.shield(removal)
                break
            except asyncio.CancelledError:
                if removal.done():
                    raise
            except Exception:
                break


def fallback_toolset(distribution: str, unavailable: dict[str, str]) -> str | None:
    """The distribution's highest-percentage toolset that offers at least one tool in this run
    (ties: the first in the distribution's order); None when none of its toolsets can.

    A row whose draw offers nothing gets it, so no row is run without tools only because its draw
    fell on toolsets this run cannot serve (and toolsets_used is never empty in such a run)."""
    candidates = [(ts, p) for ts, p in get_distribution(distribution)["toolsets"].items()
                  if tools_for_toolsets([ts], unavailable)]
    return max(candidates, key=lambda item: item[1])[0] if candidates else None  # max keeps the first


class _RowSession:
    """What a row's session holds until its end: the tools' context and the environment."""

    def __init__(self) -> None:
        self.ctx: ToolContext | None = None
        self.env: Any = None


async def process_row(task: Task, runtime: WorkerRuntime, deliver: Callable[[dict], None] | None = None) -> dict:
    """Run one dataset row and return the record to commit (ok, discarded or failed).

    `deliver`, when given, gets the record as soon as it is made, before the session's environment
    is removed: the removal (a sweep of the process table, the working directory, a container)
    is then not on the row's way to its commit, and the parent can hand the slot its next row."""
    held = _RowSession()
    try:
        record = await _attempt(task, runtime, held)
        if deliver is not None:
            deliver(record)
        return record
    finally:
        await _cleanup(held.ctx, held.env)


async def _attempt(task: Task, runtime: WorkerRuntime, held: _RowSession) -> dict:
    config = runtime.config
    started = time.monotonic()
    session: SessionModel | None = None
    offered: dict[str, Any] = {}  # what the model was offered, for the record of a failure too
    try:
        toolsets = sample_toolsets_from_distribution(config.distribution, rng_for_row(task.seed, task.key))
        offering = toolsets
        tools = tools_for_toolsets(offering, runtime.unavailable)
        if not tools:  # the draw offers nothing that can run here: as the original does for an empty draw
            fallback = fallback_toolset(config.distribution, runtime.unavailable)
            offering = [fallback] if fallback else []
            tools = tools_for_toolsets(offering, runtime.unavailable)
        # The toolsets the model really got: at least one of their tools was offered.
        offered_toolsets = {spec.toolset for spec in tools}
        toolsets_used = [ts for ts in offering if ts in offered_toolsets]
        offered = {"tools_offered": [spec.name for spec in tools], "toolsets_sampled": list(toolsets)}
        session = SessionModel(runtime.client, config.model, config.max_tokens, config.extra_body(),
                               stats=runtime.row_stats(task), tool_choice=config.tool_choice)
        if any(spec.needs_sandbox for spec in tools):
            from tools.environments import create_environment

            held.env = create_environment(config.tools, task_id=task.task_id, image=task.image, cwd=task.cwd)
            if getattr(held.env, "quick_start", False):
                held.env.start()
            else:
                await asyncio.to_thread(held.env.start)
        held.ctx = ToolContext(env=held.env, settings=config.tools, model=session, task_id=task.task_id)
        runtime.log(f"[P{task.index}] toolsets {toolsets}, {len(tools)} tools")
        result = await asyncio.wait_for(
            run_conversation(task.prompt, model=session, tools=tools, ctx=held.ctx, config=runtime.loop_config),
            config.prompt_timeout,
        )
        raw_stats = extract_tool_stats(result.messages)
        tool_stats, tool_error_counts = normalise_tool_stats(raw_stats)
        reasoning_stats = extract_reasoning_stats(result.messages)
        # Kept whole (and scored) even when the model never reasoned: the no-reasoning filter is
        # applied when the outputs are built (runner/storage/runview.py), so a changed filter
        # needs no new request.
        conversation = to_sharegpt(result.messages, task.prompt, tools)
        scores = None
        if runtime.scorers:  # before the environment is removed: a verify command sees it

            def env_of():
                if held.env is None:  # the session ran no command: the verify command gets a fresh environment
                    from tools.environments import create_environment

                    held.env = create_environment(config.tools, task_id=task.task_id, image=task.image, cwd=task.cwd)
                    held.env.start()
                return held.env

            scores = await runtime.score(task, conversation, session, env_of)
        metadata = _metadata(
            task,
            config,
            started,
            session,
            stop_reason=result.error or ("turn_limit" if result.hit_turn_limit else "final_answer"),
            dropped_replies=dropped_lines(result.dropped_replies),
            loop_notes=note_lines(result.loop_notes),
            scores=scores,
            **offered,
        )
        common = {
            "metadata": metadata,
            "api_calls": result.api_calls,
            "toolsets_used": toolsets_used,
            "tool_stats": tool_stats,
            "tool_error_counts": tool_error_counts,
            "reasoning_stats": reasoning_stats,
        }
        return as_dict(OkRecord(
            prompt_index=task.index,
            conversations=conversation,
            completed=result.completed,
            partial=result.partial,
            **common,
        ))
    except ProviderError as err:
        dropped = dropped_lines(getattr(err, "dropped_replies", []))  # ModelMisbehaved: the replies it sent
        return failed_record(task, config, _message(err), err.error_class, started=started, session=session,
                             dropped_replies=dropped, **offered)
    except SandboxError as err:
        return failed_record(task, config, f"environment: {_message(err)}", "environment", started=started,
                             session=session, **offered)
    except asyncio.TimeoutError:
        error = f"prompt took longer than {config.prompt_timeout:g}s"
        return failed_record(task, config, error, "timeout", started=started, session=session, **offered)
    except Exception as err:  # a bug in our code fails this row only, with its traceback
        detail = "".join(traceback.format_exception_only(type(err), err)).strip()
        runtime.log(f"[P{task.index}] agent error:\n{traceback.format_exc()}")
        return failed_record(task, config, detail, "agent", started=started, session=session, **offered)


# --- the worker process ---------------------------------------------------------------------

HARD_EXIT_AFTER = 3.0  # seconds an orphaned worker may spend removing its sessions' sandboxes


def worker_main(worker_id: int, config: RunConfig, unavailable: dict, sessions: int, conn) -> None:
    """Entry point of a worker process: serve tasks from the parent's pipe until a None arrives.

    `conn` is this worker's own pipe to the parent: tasks (and ("admit", ask, bool) answers) come
    down it; ("result", record), ("log", text), ("usage", [(row key, usage so far), ...]) after
    rows' usage changed (each row's newest, ahead of whatever is sent next), and, under a cost
    budget, ("ask", ask) before each model request go up. End-of-file on it means the parent
    died: the worker then cancels its sessions (which removes their sandboxes) and exits within
    HARD_EXIT_AFTER seconds.
    """
    shield()  # the parent decides how to stop, on Ctrl-C or a SIGTERM sent to the whole group
    _die_with_parent()
    become_subreaper()  # what commands detach (setsid, env -i) stays ours to kill
    try:
        asyncio.run(_serve(worker_id, config, unavailable, sessions, conn))
    finally:
        kill_orphans(everything=True)  # nothing a session started outlives its worker


def _die_with_parent() -> None:
    """Make the fork server exit with the runner, and this worker with the fork server.

    Every forked worker inherits the write end of the fork server's "alive" pipe; the fork server
    exits only when all of them are closed, so as long as a worker holds one, a runner killed with
    SIGKILL leaves the fork server running, and the fork server keeps its workers. Closing our copy
    leaves the runner as its only holder. PR_SET_PDEATHSIG then sends us CANCEL_SIGNAL (SIGTERM is
    ignored) when the fork server (our parent) goes; the pipe to the runner is the main signal,
    this is the second one.
    """
    try:
        from multiprocessing import forkserver

        server = getattr(forkserver, "_forkserver", None)
        fd = getattr(server, "_forkserver_alive_fd", None)  # private, hence guarded
        if fd is not None:
            os.close(fd)
            server._forkserver_alive_fd = None
    except OSError:
        pass
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, CANCEL_SIGNAL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _hard_exit() -> None:
    kill_orphans(everything=True)
    os._exit(0)


def send_message(conn, message: Any) -> None:
    """`conn.send(message)` without multiprocessing's ForkingPickler, which copies the whole
    copyreg dispatch table for every message (it can send sockets and pipes; ours are plain
    values): the bytes are the same pickle, so the other end's `recv()` reads them as before."""
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


USAGE_WAITING = ("usage waiting",)  # an outbox item: only wakes the sender, which sends the usage reports


async def _serve(worker_id: int, config: RunConfig, unavailable: dict, sessions: int, conn) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: queue.SimpleQueue = queue.SimpleQueue()  # sent in order by one thread, off the event loop
    verbose = config.verbose

    def log(text: str) -> None:
        if verbose:
            outbox.put(("log", text))

    runtime = WorkerRuntime(config, unavailable, sessions, log)
    running: set[asyncio.Task] = set()
    asks: dict[int, asyncio.Future] = {}  # requests waiting for the parent's word (the cost budget)
    ask_ids = itertools.count()

    # What this process's sessions spend, also kept where the parent's death cannot take it.
    journal = SpendJournal(Path(config.output_dir).resolve() / config.run_name, config.tools.run_id, config.model)

    # Each row's newest usage not sent yet: the sender sends them all, in one message, before the
    # next item it takes (a result, an ask, a log line), so a row's usage always precedes its result.
    unsent_usage: dict[str, dict] = {}
    usage_lock = threading.Lock()

    def report_usage(task: Task, stats: CallStats) -> None:
        usage = stats.report()
        journal.note(task, usage)  # synchronously: a request is counted there before it is sent
        with usage_lock:
            wake = not unsent_usage
            unsent_usage[task.key] = usage
        if wake:  # one wake-up of the sender per batch, not per request
            outbox.put(USAGE_WAITING)

    async def admit() -> bool:
        """Ask the parent, which knows every worker's spend, whether a request may be sent."""
        ask = next(ask_ids)
        future = loop.create_future()
        asks[ask] = future
        outbox.put(("ask", ask))
        try:
            return await future
        finally:
            asks.pop(ask, None)

    def answer(ask: int, allowed: bool) -> None:
        future = asks.get(ask)
        if future is not None and not future.done():
            future.set_result(allowed)

    runtime.report_usage = report_usage
    if config.max_cost is not None:
        runtime.admit = admit

    stopped: set = set()

    def stop_now() -> None:  # cancel sessions once each; their finally blocks remove sandboxes
        for t in list(running - stopped):
            stopped.add(t)
            t.cancel()
        inbox.put_nowait(None)

    def parent_gone() -> None:  # nobody would commit our results: stop paying for them now
        timer = threading.Timer(HARD_EXIT_AFTER, _hard_exit)
        timer.daemon = True
        timer.start()
        stop_now()

    def call_soon(fn, *args) -> None:  # from a thread; the loop may be closed by now
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def read_tasks() -> None:  # Connection.recv blocks, so it lives in its own thread
        while True:
            try:
                item = conn.recv()
            except (EOFError, OSError):  # the parent's end is closed: it died
                call_soon(parent_gone)
                return
            if isinstance(item, tuple) and item[0] == "admit":  # the parent's answer to an ask
                call_soon(answer, item[1], item[2])
                continue
            call_soon(inbox.put_nowait, item)
            if item is None:
                return

    def send_results() -> None:  # one sender, so messages never interleave on the pipe
        while True:
            item = outbox.get()
            with usage_lock:
                usages = list(unsent_usage.items())
                unsent_usage.clear()
            try:
                if usages:
                    send_message(conn, ("usage", usages))
                if item is None:
                    return
                if item is not USAGE_WAITING:
                    send_message(conn, item)
            except OSError:
                call_soon(parent_gone)
                return

    loop.add_signal_handler(CANCEL_SIGNAL, stop_now)
    # Blocking work (sandbox start, commands, cleanup) runs in threads: two per session (a row's
    # cleanup goes on while the slot's next row starts), so a session never waits for another's
    # thread (the default pool has only CPU count + 4). Threads start only when needed.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=2 * sessions + 4, thread_name_prefix="abr-io"))
    threading.Thread(target=read_tasks, name="abr-tasks", daemon=True).start()
    sender = threading.Thread(target=send_results, name="abr-results", daemon=True)
    sender.start()

    async def handle(task: Task) -> None:
        delivered = False

        def deliver(record: dict) -> None:  # before the session's environment is removed
            nonlocal delivered
            delivered = True
            outbox.put(("result", record))
            journal.finished(task.key)

        try:
            await process_row(task, runtime, deliver)
        except Exception as err:  # never leave the parent waiting for a row that has no answer
            if not delivered:
                deliver(failed_record(task, config, f"worker error: {type(err).__name__}: {err}", "agent"))

    while True:
        task = await inbox.get()
        if task is None:
            break
        job = asyncio.create_task(handle(task))
        running.add(job)
        job.add_done_callback(running.discard)
    if running:
        await asyncio.gather(*running, return_exceptions=True)
    outbox.put(None)
    await asyncio.to_thread(sender.join, 10.0)  # every result reaches the parent before we exit
    await runtime.close()
    if "tools.browser_tools" in sys.modules:  # only if a session used the browser in this process
        await sys.modules["tools.browser_tools"].shutdown_browser()
