"""Execution: the Executor interface, the process pool and Ray executors, the worker that runs one
prompt (environment, agent loop, record), the task handed to it, the dispatch loop that hands
tasks out and commits what comes back (dispatch.py), and the cost budget.

May import runner.input and runner.storage (a worker builds the record it returns; the dispatch
commits through the store it is given and reads the committed records' outcomes).
"""
