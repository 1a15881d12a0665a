"""Sandbox backends. Each is one short module: a pydantic config plus a class (see base.py)."""
