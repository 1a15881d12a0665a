"""Output: what a run leaves for people, built from the run view: trajectories.jsonl
(finalize.py), statistics.json (statistics.py), report.html (report.py, spend_view.py), the live
status (status.py: console spend line, forecast, status.json); closing.py runs the end of a run
in that order and prints its last lines.

May import runner.input and runner.storage; report.py never imports finalize.py (finalize uses it).
"""
