"""What a killed run leaves behind, and removing it.

A run killed with SIGKILL (or a worker killed under it) cannot clean up after itself: the merge's
temp file stays in the run directory, per-prompt working directories stay in the temp directory,
commands it started keep running (they run in sessions of their own, so the kill of the runner's
process group does not reach them) and containers keep running. The parent removes a dead
worker's leftovers as soon as it sees the death; the next start of the same run, holding the run
lock, removes whatever the killed invocation left (it is named in config.json by its run id).
"""

from __future__ import annotations

from pathlib import Path

from runner.storage.runfiles import read_config


def remove_runner_temp_files(run_dir: Path) -> list[str]:
    """Delete the runner's own half-written temp files in the run directory (never anything else):
    `.<output>_<random>.tmp`, written before an output is renamed into place (runner.storage.store)."""
    from runner.storage.store import own_files

    removed = []
    for path in own_files(run_dir):
        if path.name.startswith(".") and path.name.endswith(".tmp") and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def clean_run_leftovers(run_dir: Path, log=print) -> None:
    """At the start of a run, under its lock: remove what the previous invocation left behind.

    The lock says no other runner works on this run directory, so the previous invocation (named
    in config.json) is dead, and so is everything it left: its temp files in the run directory, its
    commands and, unless it kept them on purpose (--keep_workdirs), its working directories (kept
    sandbox workdirs are cleared of setuid and setgid bits). Containers of dead owners are reaped
    before any image is prepared (tools.environments.images).
    """
    try:
        removed = remove_runner_temp_files(run_dir)
    except OSError as err:  # best effort: never a reason not to run
        removed = []
        log(f"⚠️  Could not remove the temp files a killed run left in {run_dir}: {err}")
    if removed:
        log(f"🧹 Removed {len(removed)} temp file(s) a killed run left in {run_dir}: {', '.join(sorted(removed))}")
    saved = read_config(run_dir)
    if saved is None or not saved.run_id:
        return
    run_id = saved.run_id
    tools = saved.setting("tools")
    tools = tools if isinstance(tools, dict) else {}
    from tools.environments.local import kill_task_processes, remove_workdirs, task_workdirs
    from tools.environments.tree import clear_set_id_bits

    killed = kill_task_processes(lambda task: task.startswith(f"{run_id}-"))
    workdirs = 0 if tools.get("keep_workdirs") else remove_workdirs(tools.get("workdir_root"), f"{run_id}-p")
    if tools.get("keep_workdirs") and tools.get("sandbox") == "bwrap":  # kept, but nothing setuid stays
        for folder in task_workdirs(tools.get("workdir_root"), f"{run_id}-p"):
            clear_set_id_bits(folder)
    if killed or workdirs:
        log(f"🧹 Cleaned up after the previous, killed invocation of this run ({run_id}): "
            f"{killed} process(es) stopped, {workdirs} working directory(ies) removed")


def clean_task_leftovers(settings, task_ids: list[str] | None, log=print) -> None:
    """After a worker died: stop its sessions' commands, remove their working directories and
    the containers it owned (it could not do it itself). task_ids None: at the end of a run whose
    workers had to be killed, what any session of the run left (every session has ended). Runs in
    a thread of the parent."""
    try:
        from tools.environments import backend_class

        backend = backend_class(settings.terminal_env)
        if task_ids is None:
            backend.clean_run_leftovers(settings, log=log)
        else:
            backend.clean_task_leftovers(settings, task_ids, log=log)
    except Exception as err:  # best effort: the next start of the run cleans up again
        log(f"⚠️  Could not clean up after {'a dead worker' if task_ids is not None else 'the stopped workers'}: "
            f"{type(err).__name__}: {err}")
