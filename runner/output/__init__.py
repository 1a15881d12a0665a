"""Output: what a run leaves for people, built from the run view: trajectories.jsonl
(finalize.py), statistics.json (statistics.py), report.html (report.py, spend_view.py), the live
status (status.py: console spend line, forecast, status.json).

May import runner.input and runner.storage; report.py never imports finalize.py (finalize uses it).
"""
