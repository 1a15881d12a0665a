"""What is checked before a run writes anything or calls a model: every row of the dataset (valid
for the backend and the scorers, ids unique), the images the rows need, the model endpoint; and
what the user is warned of (commands run unisolated as root, tools that cannot be offered).

The rules a row must follow are the same at the first scan, at the rescan of the merge and for
every row read again to be dispatched (`read_rows`). Like batch_runner.py, this driver's module
may import every stage.
"""

from __future__ import annotations

import functools
import os
import sys

from runner.console import plural
from runner.input.errors import UsageError


class Preflight:
    def __init__(self, config, log):
        self.config = config
        self.log = log

    # --- the dataset ------------------------------------------------------------------------

    def scan(self):
        """The dataset scanned once: its valid rows counted and keyed; bad lines and duplicate ids
        refused (listed) unless --skip_invalid / --allow_duplicate_ids."""
        from runner.input.dataset import DatasetError, scan_dataset

        config = self.config
        try:
            scan = scan_dataset(config.dataset_file, config.max_samples, **self.row_rules())
        except DatasetError as err:
            raise UsageError(str(err)) from None
        if scan.errors:
            self._report_bad_lines(scan)
        if scan.duplicate_ids and not config.allow_duplicate_ids:
            self._refuse_duplicate_ids(scan)
        if not scan.rows:
            raise UsageError(f"{config.dataset_file}: no valid rows")
        return scan

    def rescan(self, scan):
        """The dataset as it is now: rows appended (or edited) during the run belong to the merge."""
        from runner.input.dataset import DatasetError, scan_dataset

        try:
            if os.stat(scan.path).st_mtime_ns == scan.mtime_ns and os.stat(scan.path).st_size == scan.size:
                return scan
            fresh = scan_dataset(scan.path, self.config.max_samples, **self.row_rules())
        except (OSError, DatasetError) as err:
            self.log(f"⚠️  Could not read the dataset again ({err}); merging against it as it was at the start")
            return scan
        if fresh.rows != scan.rows:
            self.log(f"ℹ️  The dataset changed during the run: {scan.rows:,} -> {fresh.rows:,} rows")
        return fresh

    def read_rows(self, scanned: dict):
        """The dataset's valid rows read again, in order, under the same rules as the scan that
        keyed them (`scanned`: its key_to_index)."""
        from runner.input.dataset import iter_rows

        return iter_rows(self.config.dataset_file, self.config.max_samples, scanned=scanned, **self.row_rules())

    def row_rules(self) -> dict:
        """The backend's and the scorers' rules for a row: a row one of them refuses is an invalid line."""
        from runner.scoring.scorers import row_rule
        from tools.environments import backend_class

        tools = self.config.tools
        backend = backend_class(tools.terminal_env)
        # A row naming no image is invalid when the backend needs one and the run has no default image.
        return {"require_image": backend.rows_need_image and not tools.docker_image,
                "cwd_error": functools.partial(backend.cwd_error, settings=tools),
                "row_error": row_rule(self.config)}

    def _report_bad_lines(self, scan) -> None:
        errors = scan.errors
        shown = errors[:50]
        lines = [f"   {scan.path}:{line_no}: {reason}" for line_no, reason in shown]
        if len(errors) > len(shown):
            lines.append(f"   ... and {len(errors) - len(shown)} more")
        if not self.config.skip_invalid:
            print("\n".join(lines), file=sys.stderr)
            raise UsageError(
                f"{scan.path}: {len(errors)} invalid line(s) (listed above); fix them or pass --skip_invalid to run the valid rows"
            )
        print(f"⚠️  Skipping {len(errors)} invalid line(s) of {scan.path} (--skip_invalid):")
        print("\n".join(lines))

    def _refuse_duplicate_ids(self, scan) -> None:
        """An `id` names one row: two rows with the same one would both reach trajectories.jsonl."""
        duplicates = scan.duplicate_ids
        shown = duplicates[:50]
        lines = [f"   {scan.path}:{line_no}: duplicate id {row_id!r} (first on line {first})"
                 for line_no, row_id, first in shown]
        if len(duplicates) > len(shown):
            lines.append(f"   ... and {len(duplicates) - len(shown)} more")
        print("\n".join(lines), file=sys.stderr)
        raise UsageError(f"{scan.path}: {len(duplicates)} duplicate id(s) (listed above); make each row's id "
                         "unique or pass --allow_duplicate_ids to run them all")

    # --- the environment and the endpoint -----------------------------------------------------

    def prepare_images(self, scan) -> dict[str, str]:
        """The backend's run preparation (docker: check and pull every distinct image once), before
        any model call. Returns image -> why it cannot be used. The run's default image is a flag:
        when rows need it and it cannot be used, the run stops here instead of failing each row."""
        if self.config.executor == "ray":
            return {}  # with Ray, each node prepares the images it needs itself
        from tools.environments import backend_class

        tools = self.config.tools
        images = {image for image in scan.images | {tools.docker_image} if image}
        failed = backend_class(tools.terminal_env).prepare_run(tools, images, say=print, log=self.log)
        why = failed.get(tools.docker_image or "")
        if why and scan.rows_without_image:
            raise UsageError(f"--docker_image={tools.docker_image}: {why} (needed by "
                             f"{plural(scan.rows_without_image, 'row')} that name no image)")
        return failed

    def probe_endpoint(self) -> None:
        """One cheap request before anything is written: an unreachable endpoint or a refused key
        stops here (exit 1), named, instead of failing every row after minutes of retries."""
        from agent.model_client import probe_endpoint

        config = self.config
        key = config.api_key.get_secret_value() if config.api_key else None
        endpoints = [] if config.model == "mock" or not config.base_url else [config.base_url]
        if "judge" in config.scorer and config.judge_base_url and config.judge_base_url not in endpoints:
            endpoints.append(config.judge_base_url)  # the judge's own endpoint (--judge_base_url)
        for endpoint in endpoints:
            problem = probe_endpoint(endpoint, key)
            if problem:
                raise UsageError(f"{problem}; nothing was started")

    def warn_if_not_isolated(self) -> None:
        """The local backend without a sandbox runs the model's commands as our own user: say so
        when that user is root, and name the flags that isolate them."""
        from toolset_distributions import get_distribution
        from tools.registry import tools_for_toolsets

        tools = self.config.tools
        toolsets = list(get_distribution(self.config.distribution)["toolsets"])
        commands = any(spec.needs_sandbox for spec in tools_for_toolsets(toolsets, {}))
        if tools.terminal_env == "local" and not tools.sandbox and commands and os.geteuid() == 0:
            print("⚠️  Running as root with --terminal_env=local and no sandbox: the model's commands run as root "
                  "on this machine, unisolated. Isolate them with --sandbox=bwrap or --terminal_env=docker.")

    def warn_unavailable(self, unavailable: dict[str, str]) -> None:
        """The distribution's tools that cannot be offered in this run, and why."""
        from runner.execution.worker import fallback_toolset
        from toolset_distributions import get_distribution
        from tools.registry import TOOLSETS

        distribution = self.config.distribution
        wanted = {tool for ts in get_distribution(distribution)["toolsets"] for tool in TOOLSETS.get(ts, ())}
        missing = {tool: why for tool, why in unavailable.items() if tool in wanted}
        if missing:
            by_reason: dict[str, list[str]] = {}
            for tool, why in missing.items():
                by_reason.setdefault(why, []).append(tool)
            detail = "; ".join(f"{', '.join(tools)} ({why})" for why, tools in by_reason.items())
            print(f"⚠️  Not offered to the model in this run: {detail}")
        if fallback_toolset(distribution, unavailable) is None:
            print(f"⚠️  No toolset of --distribution={distribution} can offer a tool in this run: "
                  "every row runs without tools (toolsets_used and metadata.tools_offered are empty)")
