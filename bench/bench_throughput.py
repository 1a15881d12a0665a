#!/usr/bin/env python3
"""Throughput, CPU and memory of the real CLI against the local model server.

    python bench/bench_throughput.py --preset quick      # 16 sessions, 200 ms, 200 prompts (~20 s)
    python bench/bench_throughput.py --preset a          # 64 sessions, 500 ms, 2,000 prompts
    python bench/bench_throughput.py --preset b          # 16 sessions, 200 ms, 1,000 prompts
    python bench/bench_throughput.py --preset c          # 512 sessions, 2 s, 4,000 prompts
    python bench/bench_throughput.py --preset zero       # 16 sessions, ~0 latency, 2,000 prompts
    python bench/bench_throughput.py --all               # presets a and b, one table
    python bench/bench_throughput.py --startup           # `--list_distributions` x10, median

Each prompt is two model turns with one terminal call (`@tool terminal {"command": "echo <i>"}`).
The model server runs as its own subprocess (fixed latency, no request recording), so its CPU is
not counted. What is measured:

- wall: from the runner's own "🚀 Running" line to its exit, and from process start to exit;
- throughput: prompts / dispatch phase ("🚀 Running" line to the "📦 Combining" line), against the
  ideal sessions / (turns x latency); also a steady-state figure from the completion timestamps
  the rows carry (10th to 90th percentile), which leaves out worker start-up and the tail;
- CPU per prompt: os.wait4(pid) rusage of the runner (user+sys). The runner joins its worker
  processes, and a worker waits for its terminal subprocesses, so that rusage covers parent +
  workers + their commands and nothing else (the model server is not a descendant). psutil
  samples of the tree give the parent / workers split (they miss each process's last <0.2 s);
- peak memory: the largest sum of RSS over the runner's process tree, sampled every 0.2 s
  (shared pages of the spawn workers are counted once per process, as RSS does).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psutil  # noqa: E402

from _util import (PY, REPO, ModelServerProcess, cmd_text, env_for_children, finalize_phases, make_tmpdir,  # noqa: E402
                   median, print_table, run_cli, verdict)

PRESETS = {
    "a": {"sessions": 64, "latency": 0.5, "prompts": 2000},
    "b": {"sessions": 16, "latency": 0.2, "prompts": 1000},
    "c": {"sessions": 512, "latency": 2.0, "prompts": 4000},
    "zero": {"sessions": 16, "latency": 0.0, "prompts": 2000},
    "quick": {"sessions": 16, "latency": 0.2, "prompts": 200},
}
TURNS = 2  # model turns per prompt: a tool call, then the final answer
RATIO_TARGET = {"a": 0.95, "b": 0.95, "c": 0.92}  # of the ideal throughput, per preset
CPU_TARGET_MS = 5.0
MEM_TARGET_MB = {"c": 300.0}  # sum of RSS without pre-exec fork children, per preset
ZERO_TARGET = 300.0  # prompts/s at ~0 latency
STARTUP_TARGET_TIMES = 4.0  # x the median of a bare `python -c pass`


def write_dataset(path: Path, prompts: int) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(prompts):
            text = f'@tool terminal {{"command": "echo {i}"}}\nBenchmark prompt #{i}: run the command and report its output.'
            # The target is what the final answer holds (the command's output): --scorer=includes passes.
            handle.write(json.dumps({"prompt": text, "target": str(i), "verify": "test -d ."}) + "\n")


def completion_times(run_dir: Path) -> list[float]:
    stamps = []
    for path in sorted(run_dir.glob("batch_*.jsonl")):
        with open(path, "rb") as handle:
            for line in handle:
                try:
                    stamps.append(datetime.fromisoformat(json.loads(line)["metadata"]["timestamp"]).timestamp())
                except (ValueError, KeyError):
                    pass
    return sorted(stamps)


def steady_rows(stamps: list[float], sessions: int) -> float | None:
    """Rows per second between the end of the first wave and the start of the last: the first
    `sessions` rows finish together after the ramp, the last `sessions` are the tail."""
    if len(stamps) <= 3 * sessions:
        return None
    lo, hi = stamps[sessions - 1], stamps[-sessions - 1]
    return (len(stamps) - 2 * sessions) / (hi - lo) if hi > lo else None


def run_preset(name: str, sessions: int, latency: float, prompts: int, keep: bool, processes: int | None,
               extra: list[str] = ()) -> dict:
    tmp = make_tmpdir(f"bench_tp_{name}_", keep)
    try:
        dataset = tmp / "prompts.jsonl"
        samples = next((int(a.split("=", 1)[1]) for a in extra if a.startswith("--samples_per_prompt=")), 1)
        write_dataset(dataset, prompts // samples)  # `prompts` sessions: prompts / samples rows of `samples` each
        prompts = prompts // samples * samples
        ideal = sessions / (TURNS * latency) if latency > 0 else float("inf")  # ~0 latency: no ideal
        with ModelServerProcess(latency, tmp) as server:
            args = [f"--dataset_file={dataset}", "--run_name=bench", "--batch_size=100", f"--num_workers={sessions}",
                    "--distribution=terminal_only", f"--base_url={server.base_url}", "--model=bench", "--api_key=x",
                    "--keep_no_reasoning", f"--output_dir={tmp / 'out'}"]
            if processes:
                args.append(f"--num_processes={processes}")
            args += extra
            timeout = 120 + 4 * prompts / min(ideal, 50.0)
            print(f"\n▶ preset {name}: {sessions} sessions, {latency * 1000:g} ms latency, {prompts:,} prompts "
                  f"(server {server.base_url}, bounded to {timeout:.0f} s)")
            print(f"  $ cd {tmp} && {cmd_text([PY, str(REPO / 'batch_runner.py'), *args])}")

            def on_line(run, t, line, proc):
                if "🚀 Running" in line and run.sampler:
                    run.sampler.mark("running")
                elif "📦 Combining" in line and run.sampler:
                    run.sampler.mark("combining")

            server_proc = psutil.Process(server.proc.pid)
            server_cpu0 = sum(server_proc.cpu_times()[:2])
            machine0, load0 = psutil.cpu_times(), os.getloadavg()[0]
            run = run_cli(args, cwd=tmp, timeout=timeout, sample=True, stderr_path=tmp / "stderr.log", on_line=on_line)
            machine1, load1 = psutil.cpu_times(), os.getloadavg()[0]
            server_cpu = sum(server_proc.cpu_times()[:2]) - server_cpu0
        busy = lambda t: t.user + t.nice + t.system + t.irq + t.softirq + t.steal  # noqa: E731
        machine_busy_cores = (busy(machine1) - busy(machine0)) / run.wall
        if run.returncode != 0 or run.timed_out:
            print(run.tail(25))
            print((tmp / "stderr.log").read_text(errors="replace")[-3000:])
            raise SystemExit(f"preset {name}: the runner exited with {run.returncode}{' (timed out)' if run.timed_out else ''}")
        t_running, t_combining = run.first("🚀 Running"), run.first("📦 Combining")
        dispatch = t_combining - t_running
        stamps = completion_times(tmp / "out" / "bench")
        steady = None
        if len(stamps) >= 20:
            lo, hi = stamps[len(stamps) // 10], stamps[(len(stamps) * 9) // 10]
            steady = ((len(stamps) * 9) // 10 - len(stamps) // 10) / (hi - lo) if hi > lo else None
        first_result = stamps[0] - (run.started_wall + t_running) if stamps else None
        last_to_combining = (run.started_wall + t_combining) - stamps[-1] if stamps else None
        # The last wave: from the moment the last row was handed out (the row whose end freed its
        # slot, `sessions` rows before the end) to the last row done; ideally one row's length.
        last_wave = stamps[-1] - stamps[-sessions - 1] if len(stamps) > sessions else None
        finalize = finalize_phases(tmp / "out" / "bench", run.started_wall + t_combining, run.started_wall + run.wall)
        sampler = run.sampler
        parent_cpu = sampler.cpu_by_pid.get(sampler.root_pid, 0.0)
        cpu_before = sampler.marked("running") or 0.0
        cpu_dispatch = (sampler.marked("combining") or sampler.cpu_seen()) - cpu_before
        result = {
            "preset": name, "sessions": sessions, "latency": latency, "prompts": prompts,
            "rows": len(stamps),
            "wall_total": run.wall, "wall_from_running": run.wall - t_running, "t_running": t_running,
            "dispatch": dispatch, "tail_after_dispatch": run.wall - t_combining,
            "throughput": prompts / dispatch, "ideal": ideal, "ratio": prompts / dispatch / ideal,
            "steady": steady, "steady_ratio": steady / ideal if steady else None,
            "first_result": first_result, "last_to_combining": last_to_combining, "last_wave": last_wave,
            "steady_rows": steady_rows(stamps, sessions), **finalize,
            "cpu_total": run.rusage_cpu, "cpu_ms_per_prompt": run.rusage_cpu / prompts * 1000,
            "cpu_sampled": sampler.cpu_seen(), "cpu_parent_sampled": parent_cpu,
            "cpu_workers_sampled": sampler.cpu_seen() - parent_cpu,
            "cpu_before_running": cpu_before, "cpu_dispatch_ms_per_prompt": cpu_dispatch / prompts * 1000,
            "peak_rss_mb": sampler.peak_rss / 2**20, "peak_parent_rss_mb": sampler.peak_parent_rss / 2**20,
            "peak_rss_dedup_mb": sampler.peak_rss_dedup / 2**20, "peak_pss_mb": sampler.peak_pss / 2**20,
            "preexec_at_peak": sampler.preexec_at_peak, "max_preexec": sampler.max_preexec,
            "server_cpu": server_cpu, "machine_busy_cores": machine_busy_cores,
            "runner_cores": run.rusage_cpu / run.wall, "load": (load0, load1),
            "peak_procs": sampler.peak_procs, "describe": next((l.split(":", 1)[1].strip() for _, l in run.lines if "🚀 Running" in l), ""),
            "command": cmd_text(run.args),
        }
        print(f"  done: exit {run.returncode}, {result['describe']}, dispatch {dispatch:.2f} s, "
              f"{result['throughput']:.1f} prompts/s (ideal {ideal:.0f}), CPU {run.rusage_cpu:.1f} s")
        return result
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def report(results: list[dict]) -> bool:
    print("\n=== Throughput benchmark (2 model turns + 1 terminal call per prompt) ===")
    headers = ["metric"] + [r["preset"] for r in results]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    rows = [
        ["sessions / latency / prompts"] + [f"{r['sessions']} / {r['latency'] * 1000:g} ms / {r['prompts']:,}" for r in results],
        ["executor"] + [r["describe"] for r in results],
        ["wall total (s)"] + [fmt(r["wall_total"], ".2f") for r in results],
        ["  start -> '🚀 Running' (s)"] + [fmt(r["t_running"], ".2f") for r in results],
        ["  '🚀 Running' -> exit (s)"] + [fmt(r["wall_from_running"], ".2f") for r in results],
        ["  dispatch phase (s)"] + [fmt(r["dispatch"], ".2f") for r in results],
        ["    'Running' -> first row done (s)"] + [fmt(r["first_result"], ".2f") for r in results],
        ["    ideal first row = 2 x latency (s)"] + [fmt(TURNS * r["latency"], ".2f") for r in results],
        ["    last wave: last row handed out -> done (s)"] + [fmt(r["last_wave"], ".2f") for r in results],
        ["    last row done -> '📦 Combining' (s)"] + [fmt(r["last_to_combining"], ".2f") for r in results],
        ["  finalize: '📦 Combining' -> exit (s)"] + [fmt(r["tail_after_dispatch"], ".2f") for r in results],
        ["    merge: -> trajectories.jsonl (s)"] + [fmt(r["merge"], ".2f") for r in results],
        ["    statistics: -> statistics.json (s)"] + [fmt(r["statistics"], ".2f") for r in results],
        ["    report: -> report.html (s)"] + [fmt(r["report"], ".2f") for r in results],
        ["    report.html -> exit (s)"] + [fmt(r["exit"], ".2f") for r in results],
        ["throughput over dispatch (prompts/s)"] + [fmt(r["throughput"], ".1f") for r in results],
        ["ideal = S / (2 x latency)"] + [fmt(r["ideal"], ".1f") for r in results],
        ["ratio of the ideal"] + [fmt(r["ratio"], ".3f") for r in results],
        ["steady state: first to last wave (prompts/s)"] + [fmt(r["steady_rows"], ".1f") for r in results],
        ["steady-state ratio (no ramp, no tail)"] + [fmt(r["steady_rows"] / r["ideal"] if r["steady_rows"] else None, ".3f")
                                                     for r in results],
        ["steady-state p10..p90 (prompts/s)"] + [fmt(r["steady"], ".1f") for r in results],
        ["steady-state p10..p90 ratio"] + [fmt(r["steady_ratio"], ".3f") for r in results],
        ["CPU total, wait4 rusage (s)"] + [fmt(r["cpu_total"], ".2f") for r in results],
        [f"CPU per prompt (ms, target <= {CPU_TARGET_MS:g})"] + [fmt(r["cpu_ms_per_prompt"], ".2f") for r in results],
        ["  sampled: parent / workers (s)"] + [f"{r['cpu_parent_sampled']:.2f} / {r['cpu_workers_sampled']:.2f}" for r in results],
        ["  sampled: before 'Running' (s)"] + [fmt(r["cpu_before_running"], ".2f") for r in results],
        ["  sampled: dispatch CPU/prompt (ms)"] + [fmt(r["cpu_dispatch_ms_per_prompt"], ".2f") for r in results],
        ["peak RSS of runner tree (MB)"] + [fmt(r["peak_rss_mb"], ".0f") for r in results],
        ["  peak RSS of parent (MB)"] + [fmt(r["peak_parent_rss_mb"], ".0f") for r in results],
        ["  without pre-exec fork children (MB)"] + [fmt(r["peak_rss_dedup_mb"], ".0f") for r in results],
        ["  sum of PSS, same (MB)"] + [fmt(r["peak_pss_mb"], ".0f") for r in results],
        ["  pre-exec children at raw peak / max"] + [f"{r['preexec_at_peak']} / {r['max_preexec']}" for r in results],
        ["  max processes in tree"] + [str(r["peak_procs"]) for r in results],
        ["cores used: runner / model server"] + [f"{r['runner_cores']:.2f} / {r['server_cpu'] / r['wall_total']:.2f}" for r in results],
        ["cores busy on the machine (of 2)"] + [fmt(r["machine_busy_cores"], ".2f") for r in results],
        ["load average before / after"] + [f"{r['load'][0]:.1f} / {r['load'][1]:.1f}" for r in results],
    ]
    print_table(headers, rows)
    print("\nTargets:")
    all_ok = True
    for r in results:
        ratio, mem = RATIO_TARGET.get(r["preset"]), MEM_TARGET_MB.get(r["preset"])
        checks = [(f"throughput ratio >= {ratio}", r["ratio"] >= ratio if ratio else None, f"{r['ratio']:.3f}"),
                  (f"CPU per prompt <= {CPU_TARGET_MS:g} ms", r["cpu_ms_per_prompt"] <= CPU_TARGET_MS, f"{r['cpu_ms_per_prompt']:.2f} ms"),
                  (f"peak memory (sum of RSS without pre-exec fork children) <= {mem:g} MB" if mem else "peak memory",
                   r["peak_rss_dedup_mb"] <= mem if mem else None, f"{r['peak_rss_dedup_mb']:.0f} MB"),
                  (f"throughput at ~0 latency >= {ZERO_TARGET:g} prompts/s", r["throughput"] >= ZERO_TARGET
                   if r["preset"] == "zero" else None, f"{r['throughput']:.1f} prompts/s")]
        for label, ok, value in checks:
            if ok is None:
                label += " (not a target for this preset)"
            print(f"  [{verdict(ok)}] preset {r['preset']}: {label}: {value}")
            all_ok &= ok is not False
    print("\nNotes: one run per preset unless --repeat; the machine has 2 shared cores, so throughput and wall")
    print("times move with the load of other users (see 'cores busy' and the load average). The raw RSS sum")
    print("counts a worker's memory once more for every child it has forked but not yet exec'd (they share it);")
    print("the deduplicated and PSS rows leave those out.")
    print("\nCommands run:")
    for r in results:
        print(f"  {r['preset']}: {r['command']}")
    return all_ok


def bench_startup(runs: int) -> bool:
    args = [PY, str(REPO / "batch_runner.py"), "--list_distributions"]
    times, bare = [], []
    for _ in range(runs):  # alternately, so both see the same load of the machine
        start = time.perf_counter()
        subprocess.run(args, cwd=REPO, env=env_for_children(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=True, timeout=60)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        subprocess.run([PY, "-c", "pass"], check=True, timeout=60)  # the interpreter alone, for reference
        bare.append(time.perf_counter() - start)
    med = median(times)
    print("\n=== Start-up: python batch_runner.py --list_distributions ===")
    print_table(["measure", "value"], [
        ["runs", str(runs)],
        ["median (s)", f"{med:.3f}"],
        ["min / max (s)", f"{min(times):.3f} / {max(times):.3f}"],
        ["python -c pass, median (s)", f"{median(bare):.3f}"],
    ])
    limit = STARTUP_TARGET_TIMES * median(bare)
    ok = med < limit
    print(f"  [{verdict(ok)}] median start-up < {STARTUP_TARGET_TIMES:g} x a bare `python -c pass` ({limit:.3f} s): "
          f"{med:.3f} s ({med / median(bare):.1f} x)")
    print(f"  command: {cmd_text(args)}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a, b, c, zero or quick")
    parser.add_argument("--all", action="store_true", help="run presets a and b, one table")
    parser.add_argument("--startup", action="store_true", help="time --list_distributions 10 times")
    parser.add_argument("--sessions", type=int, help="override the preset's sessions")
    parser.add_argument("--latency", type=float, help="override the preset's latency (seconds)")
    parser.add_argument("--prompts", type=int, help="override the preset's prompt count")
    parser.add_argument("--num_processes", type=int, help="pass --num_processes to the runner")
    parser.add_argument("--repeat", type=int, default=1, help="run each preset N times and report the median run")
    parser.add_argument("--keep", action="store_true", help="keep the temp dirs")
    parser.add_argument("--scorer", help="pass --scorer to the runner (each row has a target and a verify command)")
    parser.add_argument("--samples", type=int, default=1, help="samples per prompt (the sessions stay --prompts)")
    opts = parser.parse_args()
    if not (opts.preset or opts.all or opts.startup):
        opts.preset = "quick"
    print(f"$ {cmd_text([PY, *sys.argv])}")
    ok = True
    if opts.startup:
        ok &= bench_startup(10)
    names = ["a", "b"] if opts.all else ([opts.preset] if opts.preset else [])
    results = []
    for name in names:
        p = dict(PRESETS[name])
        for key in ("sessions", "latency", "prompts"):
            if getattr(opts, key) is not None:
                p[key] = getattr(opts, key)
        label = name if p == PRESETS[name] else f"{name}*"  # * = overridden by --sessions/--latency/--prompts
        extra = [f"--scorer={opts.scorer}"] if opts.scorer else []
        if opts.samples > 1:
            extra.append(f"--samples_per_prompt={opts.samples}")
        runs = [run_preset(label, p["sessions"], p["latency"], p["prompts"], opts.keep, opts.num_processes, extra)
                for _ in range(max(1, opts.repeat))]
        runs.sort(key=lambda r: r["throughput"])
        chosen = runs[len(runs) // 2]
        if len(runs) > 1:
            print(f"  preset {name}: throughput over {len(runs)} runs: " + ", ".join(f"{r['throughput']:.1f}" for r in runs)
                  + "; CPU ms/prompt: " + ", ".join(f"{r['cpu_ms_per_prompt']:.2f}" for r in runs)
                  + "; peak MB: " + ", ".join(f"{r['peak_rss_mb']:.0f}" for r in runs) + " (median run reported)")
        results.append(chosen)
    if results:
        ok &= report(results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
