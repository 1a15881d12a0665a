"""Storage: the run directory. records.py defines and reads every line a batch file holds;
runfiles.py models and reads the other files (config.json, statistics.json, status.json,
checkpoint.json); store.py is the batch files' only writer; runview.py their only reader (with
spendtally.py, the spend by model and over time); atomic.py writes files privately and atomically;
lock.py keeps one runner per directory; leftovers.py removes what a killed run left; run_dir.py
decides whether an invocation may write there (--resume, --overwrite, the fingerprint) and writes config.json.

May import agent.usage and runner.input; never runner.execution or runner.output.
"""
