"""Storage: the run directory. records.py defines every line a batch file holds; store.py is its
only writer; runview.py its only reader; lock.py keeps one runner per directory; leftovers.py
removes what a killed run left.

May import runner.input; never runner.execution or runner.output.
"""
