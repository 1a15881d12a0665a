"""No API key reaches a file or the console, whatever route a command tries (real CLI, real
processes, the local backend with and without bubblewrap)."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid

import pytest

from tests.conftest import read_jsonl, run_cli, write_jsonl

# Every route a command has to a key of the runner. Each greps for the keys' common marker, so the
# output stays small (never truncated) and a leak cannot hide in an omitted middle.
ROUTES = {
    "env": "env | grep abrtest; echo done-env",
    "parent environ": r"tr '\0' '\n' < /proc/$PPID/environ | grep abrtest; echo done-ppid",
    "all environs": r"cat /proc/[0-9]*/environ 2>/dev/null | tr '\0' '\n' | grep abrtest; echo done-environ",
    "all cmdlines": r"cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\0' ' ' | grep -o 'abrtest-[0-9a-f]*'; echo done-cmdline",
    "ps": "ps auxeww | grep -o 'abrtest-[0-9a-f]*'; echo done-ps",
}
KEY_SEEN = re.compile(r"abrtest-[0-9a-f]{32}|\[REDACTED\]")  # a key, or a key found and redacted


def _keys() -> dict[str, str]:
    return {name: f"{prefix}-abrtest-{uuid.uuid4().hex}" for name, prefix in
            (("flag", "sk-or"), ("OPENROUTER_API_KEY", "sk-or"), ("TAVILY_API_KEY", "tvly"), ("FAL_KEY", "fal"))}


def _everything_written(root) -> str:
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file())


def _tool_outputs(row: dict) -> list[str]:
    outputs = []
    for turn in row["conversations"]:
        if turn["from"] == "tool":
            body = json.loads(turn["value"].split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0])
            outputs.append(body["content"].get("output", json.dumps(body["content"])))
    return outputs


def _run(model_server, tmp_path, rows, keys, *extra, env=None):
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    args = [f"--dataset_file={dataset}", "--run_name=s", "--batch_size=10", "--distribution=terminal_only",
            f"--base_url={model_server.base_url}", "--model=m", f"--api_key={keys['flag']}", "--verbose", *extra]
    env = {name: value for name, value in keys.items() if name != "flag"} | (env or {})
    return run_cli(args, tmp_path, env=env)


@pytest.mark.parametrize("sandbox", ["none", "bwrap"])
def test_no_route_gives_a_command_the_keys(model_server, tmp_path, sandbox):
    if sandbox == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    keys = _keys()
    # Under bwrap even a secret-named variable the runner does not know stays out of the sandbox.
    extra_env = {"SOME_SERVICE_TOKEN": f"tok-abrtest-{uuid.uuid4().hex}"} if sandbox == "bwrap" else {}
    rows = [{"prompt": f'@tool terminal {json.dumps({"command": command})}\nTry the {name} route.'}
            for name, command in ROUTES.items()]
    proc = _run(model_server, tmp_path, rows, keys, f"--sandbox={sandbox}", env=extra_env)
    assert proc.returncode == 0, proc.stderr
    trajectories = read_jsonl(tmp_path / "data" / "s" / "trajectories.jsonl")
    assert len(trajectories) == len(ROUTES)
    for row in trajectories:
        (output,) = _tool_outputs(row)
        assert "done-" in output  # the command really ran
        assert not KEY_SEEN.search(output), output  # found nothing (not even a key that was then redacted)
    written = _everything_written(tmp_path / "data")
    console = proc.stdout + proc.stderr
    for secret in [*keys.values(), *extra_env.values()]:
        assert secret not in written and secret not in console


def test_a_key_a_command_finds_anyway_is_redacted_in_records_and_console(model_server, tmp_path):
    keys = _keys()
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "leak.txt").write_text(f"flag={keys['flag']} tavily={keys['TAVILY_API_KEY']}\n")
    rows = [
        {"prompt": '@tool terminal {"command": "cat leak.txt"}\nRead the file.', "cwd": str(workdir)},
        # A provider error that quotes the key: the failed record and the console line both carry it.
        {"prompt": f"@fail 400 1 body=invalid key {keys['flag']}\nFail with the key."},
    ]
    proc = _run(model_server, tmp_path, rows, keys)
    assert proc.returncode in (2, 3), proc.stderr  # the second row failed
    (row,) = read_jsonl(tmp_path / "data" / "s" / "trajectories.jsonl")
    (output,) = _tool_outputs(row)
    assert output.strip() == "flag=[REDACTED] tavily=[REDACTED]"
    written = _everything_written(tmp_path / "data")
    console = proc.stdout + proc.stderr
    assert "invalid key [REDACTED]" in written and "[REDACTED]" in console
    for secret in keys.values():
        assert secret not in written and secret not in console


def test_redaction_covers_the_escaped_forms_and_keeps_the_line_valid_json():
    import orjson

    from runner.input import secrets

    key = 'sk-"odd"\\key-ü-' + uuid.uuid4().hex
    secrets.register(key, "x", None)  # "x" is too short to be a secret: it must never be redacted
    record = {"a": key, "nested": json.dumps({"output": key}), "ascii": json.dumps({"o": key}, ensure_ascii=True),
              "x": "x marks the spot"}
    line = secrets.redact_bytes(orjson.dumps(record))
    back = orjson.loads(line)
    assert back["a"] == "[REDACTED]" and back["x"] == "x marks the spot"
    assert json.loads(back["nested"]) == {"output": "[REDACTED]"} and json.loads(back["ascii"]) == {"o": "[REDACTED]"}
    assert secrets.redact(f"error: {key}!") == "error: [REDACTED]!"


def test_api_key_flag_is_taken_out_of_argv_in_every_spelling():
    from runner.input.secrets import _strip_api_key

    for argv, value in ((["p", "--api_key=sk-1", "--x=1"], "sk-1"), (["p", "--api-key", "sk-2", "--x=1"], "sk-2"),
                        (["p", "--api_key", "--x=1"], ""), (["p", "--x=1"], None)):
        clean, found = _strip_api_key(argv)
        assert clean == ["p", "--x=1"] and found == value


def test_python_api_keeps_the_keys_out_of_the_workers_environment(model_server, tmp_path):
    """BatchRunner(...) used from a script: no re-exec there, yet workers never hold the keys."""
    import subprocess
    import sys

    from tests.conftest import REPO

    keys = _keys()
    rows = [{"prompt": f'@tool terminal {json.dumps({"command": ROUTES["parent environ"]})}\nParent environ.'}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    script = (
        "import os, sys\n"
        "from batch_runner import BatchRunner\n"
        f"code = BatchRunner(dataset_file={str(dataset)!r}, batch_size=5, run_name='s', model='m',\n"
        f"                   base_url={model_server.base_url!r}, distribution='terminal_only').run()\n"
        "assert os.environ['OPENROUTER_API_KEY'], 'the caller keeps its environment'\n"
        "sys.exit(code)\n"
    )
    env = {**{k: v for k, v in os.environ.items() if "API_KEY" not in k}, "PYTHONPATH": str(REPO),
           **{name: value for name, value in keys.items() if name != "flag"}}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    (row,) = read_jsonl(tmp_path / "data" / "s" / "trajectories.jsonl")
    (output,) = _tool_outputs(row)
    assert "done-ppid" in output and not KEY_SEEN.search(output), output


@pytest.mark.parametrize("where", ["env", "flag", "tool"])
def test_a_key_no_http_header_can_carry_is_refused_at_start_without_printing_it(model_server, tmp_path, where):
    """A stray é copied along with a key used to fail every row after 8 retries ("'ascii' codec")."""
    key = "sk-or-v1-caf\u00e9-0123456789"
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Key row."}])
    args = [f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--distribution=terminal_only",
            f"--base_url={model_server.base_url}", "--model=m", "--num_workers=1"]
    env = {}
    if where == "env":
        env["OPENROUTER_API_KEY"] = key
    elif where == "flag":
        args.append(f"--api_key={key}")
    else:
        env["TAVILY_API_KEY"] = key
    proc = run_cli(args, tmp_path, env=env, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    console = proc.stdout + proc.stderr
    assert "not ASCII" in console and "HTTP header" in console
    assert ("TAVILY_API_KEY" if where == "tool" else "API key") in console
    assert key not in console and "caf\u00e9" not in console and "Traceback" not in console
    assert not model_server.requests_for("Key row.")
    assert not (tmp_path / "data" / "r").exists()


def test_a_key_cut_by_the_output_truncation_leaves_no_piece_of_it(model_server, tmp_path):
    """A command prints a key where the head of the kept output ends and another where its tail
    begins: the output is redacted before it is cut, so neither cut copy survives."""
    from tests.conftest import SECRET_KEY

    text = f"'a'*19980 + '{SECRET_KEY}' + 'b'*20000 + '{SECRET_KEY}' + 'c'*29980"
    command = json.dumps({"command": f'python3 -c "print({text})"'})
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"@tool terminal {command}\nPrint it."}])
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=cut", "--batch_size=5", "--distribution=terminal_only",
                    "--keep_no_reasoning", "--model=m", f"--base_url={model_server.base_url}",
                    f"--api_key={SECRET_KEY}"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = read_jsonl(tmp_path / "data" / "cut" / "trajectories.jsonl")
    (output,) = _tool_outputs(row)
    assert "characters omitted" in output and output.count("[REDACTED]") == 2
    written = _everything_written(tmp_path / "data")
    assert SECRET_KEY[:13] not in written and SECRET_KEY[-13:] not in written


def test_long_pieces_of_a_key_are_redacted_short_ones_are_not():
    from runner.input import secrets

    key = "sk-piece-" + uuid.uuid4().hex
    secrets.register(key)
    text = f"head {key[:30]}| tail |{key[-30:]} middle {key[5:35]} short {key[:12]}"
    assert secrets.redact(text) == f"head [REDACTED]| tail |[REDACTED] middle [REDACTED] short {key[:12]}"
    line = secrets.redact_bytes(json.dumps({"out": text}).encode())
    assert json.loads(line)["out"] == secrets.redact(text)
