"""Execution: the Executor interface, the process pool and Ray executors, the worker that runs one
prompt (environment, agent loop, record), the task handed to it, and the cost budget.

May import runner.input and runner.storage.records (a worker builds the record it returns).
"""
