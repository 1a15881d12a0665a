"""The run directory at the start of an invocation: whether this invocation may write there (a
rerun needs --resume or --overwrite; a resume needs the same configuration), and config.json.

Every check refuses with a UsageError before anything is written; only `prepare` under the run
lock removes anything (--overwrite: the runner's own files, never the user's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runner.input.errors import UsageError
from runner.timestamps import now_iso


class RunDirectory:
    def __init__(self, config, *, resume: bool, overwrite: bool, allow_config_change: bool, started_at: str):
        self.config = config
        self.path = Path(config.output_dir) / config.run_name
        self.resume = resume
        self.overwrite = overwrite
        self.allow_config_change = allow_config_change
        self.started_at = started_at

    def refuse_dataset_among_outputs(self) -> None:
        from runner.storage.store import is_own_file_of

        if is_own_file_of(self.path, self.config.dataset_file):
            raise UsageError(
                f"{self.config.dataset_file}: the dataset is one of the files the runner writes in its run "
                f"directory {self.path}; the run would overwrite it. Move or rename it, or choose another --run_name"
            )

    def prepare(self) -> None:
        """Refuse to mix runs by accident: a rerun needs --resume (or --overwrite). Runs under the lock."""
        from runner.storage.journal import journals, settled_journals
        from runner.storage.store import batch_files, own_files

        has_rows = bool(batch_files(self.path))
        if (has_rows or journals(self.path)) and self.overwrite:
            # A killed run's spend journals are its outputs too (even with no row committed yet):
            # removed with the rest, after their workers exited, so this run never records them.
            settled_journals(self.path, self.config.tools.run_id, print)
            # Only what the runner wrote: a dataset or notes the user keeps in the folder stay.
            dataset = Path(self.config.dataset_file).resolve()
            # config.json last: a kill in between leaves rows only with the configuration they were made with
            for path in sorted(own_files(self.path), key=lambda path: path.name == "config.json"):
                if path.resolve() != dataset:
                    path.unlink(missing_ok=True)
            print(f"🗑️  --overwrite: removed the earlier outputs of the runner in {self.path}")
        elif has_rows and not self.resume:
            raise UsageError(
                f"{self.path} already holds rows of an earlier run; use --resume to continue it "
                "or --overwrite to start again from scratch"
            )

    def check_resumed_configuration(self) -> None:
        """A resume continues the run it finds: the same fingerprint (unless --allow_config_change)
        and at least as many samples per prompt as were paid for."""
        from runner.input.config import diff_fingerprints
        from runner.storage.runfiles import read_config

        recorded = read_config(self.path)
        if recorded is None:
            self._refuse_rows_without_configuration()
            return
        saved, current = recorded.fingerprint_fields, self.config.fingerprint_fields()
        changed = diff_fingerprints(saved, current)
        # Each change with its old and new value: "max_turns: 3 -> 5".
        changes = ", ".join(f"{name}: {_shown(saved.get(name))} -> {_shown(current.get(name))}" for name in changed)
        if changed and not self.allow_config_change:
            raise UsageError(
                f"--resume with a different configuration ({changes}; changed since the rows in "
                f"{self.path} were made); pass --allow_config_change to mix them anyway"
            )
        if changed:
            print(f"⚠️  Configuration changed ({changes}); continuing because of --allow_config_change")
        recorded_samples = recorded.setting("samples_per_prompt")
        wanted = self.config.samples_per_prompt
        if isinstance(recorded_samples, int) and wanted < recorded_samples:  # the extra samples are paid for
            raise UsageError(
                f"--samples_per_prompt={wanted} is lower than the {recorded_samples} samples per prompt of the run "
                f"in {self.path} (their samples are already paid for); resume with "
                f"--samples_per_prompt={recorded_samples} or more")

    def _refuse_rows_without_configuration(self) -> None:
        """Rows whose config.json is gone or unreadable cannot be checked against this invocation's
        configuration (nor sampled again with their seed): mixing them takes --allow_config_change."""
        from runner.storage.store import batch_files

        if not batch_files(self.path):
            return
        if not self.allow_config_change:
            raise UsageError(
                f"--resume: {self.path / 'config.json'} is missing or unreadable, so the configuration the rows in "
                f"{self.path} were made with cannot be checked; pass --allow_config_change to continue them with "
                "this invocation's configuration")
        print(f"⚠️  {self.path / 'config.json'} is missing or unreadable; continuing with this invocation's "
              "configuration because of --allow_config_change")

    def write_config(self) -> None:
        """config.json: the configuration, its fingerprint, and this invocation appended to the run's."""
        from runner.storage.runfiles import ConfigFile, Invocation, read_config, write_config

        saved = None if self.overwrite else read_config(self.path)
        created, invocations = (saved.created_at, saved.invocations) if saved is not None else (None, [])
        # Each invocation's start and end: the run's duration is the time spent running, summed.
        run_id = self.config.tools.run_id
        invocations.append(Invocation(run_id=run_id, started_at=self.started_at, ended_at=None))
        write_config(self.path, ConfigFile(
            config=self.config.public_dict(),
            fingerprint=self.config.fingerprint(),
            fingerprint_fields=self.config.fingerprint_fields(),
            run_id=run_id,
            created_at=created or now_iso(),
            updated_at=now_iso(),
            invocations=invocations,
        ))


def _shown(value: Any) -> str:
    """A recorded option's value as a message shows it: text quoted, the rest as JSON."""
    return repr(value) if isinstance(value, str) else json.dumps(value, sort_keys=True)
