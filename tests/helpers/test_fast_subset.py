"""The fast subset (`pytest -m "not slow"`) leaves out every test that starts a process."""

from __future__ import annotations

import types

from tests.conftest import _slow_functions

SOURCE = '''
import subprocess
import pytest
from tests.conftest import run_cli


def _run(tmp_path):
    return run_cli(["--help"], cwd=tmp_path)


@pytest.fixture
def finished_run(tmp_path):
    return _run(tmp_path)


def test_through_a_helper(tmp_path):
    assert _run(tmp_path).returncode == 0


def test_through_a_fixture(finished_run):
    assert finished_run


def test_subprocess_directly():
    subprocess.run(["true"], check=True)


def test_pure_function():
    assert sorted([2, 1]) == [1, 2]
'''


def _module(tmp_path, source: str) -> types.ModuleType:
    path = tmp_path / "test_sample_module.py"
    path.write_text(source)
    module = types.ModuleType("test_sample_module")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def test_process_starting_tests_are_found_through_helpers_and_fixtures(tmp_path):
    slow = _slow_functions(_module(tmp_path, SOURCE))
    assert {"test_through_a_helper", "test_through_a_fixture", "test_subprocess_directly"} <= slow
    assert "test_pure_function" not in slow
