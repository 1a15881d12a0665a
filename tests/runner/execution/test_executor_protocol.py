"""Both executors implement runner.execution.executor.Executor, method by method, signature by signature."""

from __future__ import annotations

import inspect

import pytest

from runner.execution.process_pool import ProcessExecutor
from runner.execution.executor import Executor
from runner.execution.ray_pool import RayExecutor

METHODS = [name for name, value in vars(Executor).items() if inspect.isfunction(value) and not name.startswith("_")]


def test_the_protocol_names_what_the_runner_calls():
    assert set(METHODS) == {"describe", "start", "free_slots", "in_flight", "submit", "poll", "watch", "abandoned",
                           "shutdown", "terminate"}
    assert "stop_reason" in Executor.__annotations__


@pytest.mark.parametrize("cls", [ProcessExecutor, RayExecutor])
@pytest.mark.parametrize("name", METHODS)
def test_executor_has_the_protocol_method_with_its_signature(cls, name):
    wanted = inspect.signature(getattr(Executor, name))
    assert name in vars(cls), f"{cls.__name__} has no {name}()"
    assert inspect.signature(getattr(cls, name)) == wanted, f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))}"


@pytest.mark.parametrize("cls", [ProcessExecutor, RayExecutor])
def test_executor_sets_stop_reason(cls):
    """An attribute, not a method: each class must set it in __init__ (the runner reads it)."""
    assert "self.stop_reason" in inspect.getsource(cls.__init__)


def test_a_class_that_differs_is_caught():
    class Sloppy:
        def poll(self, timeout):  # no annotation, no return type
            return []

    assert inspect.signature(Sloppy.poll) != inspect.signature(Executor.poll)
