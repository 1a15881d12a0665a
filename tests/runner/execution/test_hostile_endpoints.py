"""Endpoints that redirect, drip, never end, flood or answer the wrong thing, through the real CLI
against the scripted server: the key stays with the host the user named, a request has one time
limit, a reply one size limit, and a run whose every request fails the same way stops early."""

from __future__ import annotations

import json
import time

from tests.conftest import SECRET_KEY, read_jsonl, run_cli, write_jsonl
from tests.helpers.model_server import ModelServer, Reply, error_body
from tests.runner.execution.test_requests_cli import _batch_lines, _out, _run


def _rows(*prompts: str) -> list[dict]:
    return [{"prompt": p} for p in prompts]


def test_a_redirect_to_another_host_never_carries_the_key(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows("Redirected row."))
    with ModelServer(host="127.0.0.2") as elsewhere, ModelServer(redirect_to=elsewhere.root_url) as named:
        proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--model=m",
                        "--distribution=terminal_only", "--keep_no_reasoning",
                        f"--base_url={named.base_url}", f"--api_key={SECRET_KEY}"], tmp_path)
        reached = elsewhere.probes + elsewhere.requests
    assert reached, proc.stdout + proc.stderr  # the redirects were followed (probe and chat)
    assert {r.path for r in reached} >= {"/v1/models", "/v1/chat/completions"}
    for request in reached:
        assert SECRET_KEY not in json.dumps(request.headers), request.path


def test_request_timeout_bounds_the_whole_request_not_the_gap_between_bytes(tmp_path, model_server, remote_args):
    # One byte every 0.5 s (a reply of hundreds of bytes), and an event stream that never ends: each
    # first attempt is cut at --request_timeout and retried; the second attempt answers.
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows("@drip 0.5 1\nDripping.", "@endless 1\nEndless."))
    started = time.monotonic()
    proc = _run(tmp_path, dataset, remote_args, "--request_timeout=3", "--keep_no_reasoning", "--num_workers=2",
                timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - started < 60
    kept = read_jsonl(_out(tmp_path) / "trajectories.jsonl")
    assert len(kept) == 2 and all(t["metadata"]["usage"]["retries"] == 1 for t in kept)


def test_a_reply_larger_than_the_limit_fails_the_row_with_a_clear_error(tmp_path, model_server, remote_args):
    import resource

    dataset = write_jsonl(tmp_path / "d.jsonl", _rows("@huge 40\nHuge.", "@gzip_bomb 2048\nBomb.", "Fine."))
    proc = _run(tmp_path, dataset, remote_args, "--keep_no_reasoning", "--num_workers=3", timeout=200)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    failed = {r["prompt"].split("\n")[1]: r for r in _batch_lines(tmp_path) if r.get("failed")}
    assert set(failed) == {"Huge.", "Bomb."}
    for record in failed.values():
        assert "reply is larger than the 16 MiB limit of a model reply" in record["error"], record["error"]
        assert record["metadata"]["usage"]["requests"] == 1  # not asked again: it would be as large again
    assert len(read_jsonl(_out(tmp_path) / "trajectories.jsonl")) == 1
    # The 2 GiB the bomb decodes to were never held: no process of the run grew near it.
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < 700 * 1024


def test_an_endpoint_answering_html_everywhere_is_named_before_anything_starts(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows("Row 1.", "Row 2."))
    with ModelServer(html=True) as proxy:
        proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--model=m",
                        f"--base_url={proxy.base_url}", f"--api_key={SECRET_KEY}"], tmp_path)
        chats = proxy.count()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "answers HTML, not an OpenAI-compatible API" in proc.stderr and proxy.base_url in proc.stderr
    assert chats == 0 and not _out(tmp_path).exists()


def test_html_replies_to_every_chat_request_stop_the_run_early(tmp_path, model_server, remote_args):
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(*(f"@html\nRow {i}." for i in range(20))))
    proc = _run(tmp_path, dataset, remote_args, "--num_workers=2", timeout=200)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "answers HTML, not an OpenAI-compatible API" in proc.stderr
    failed = [r for r in _batch_lines(tmp_path) if r.get("failed")]
    assert 3 <= len(failed) <= 3 + 2 and model_server.count() <= 5  # one request each: HTML is not retried


def test_the_same_http_500_to_every_request_stops_the_run_early_and_it_resumes(tmp_path, model_server, remote_args):
    def always_500(body, state):
        return Reply(status=500, body=error_body(500, "boom"), headers={"Retry-After": "0"})

    model_server.policy = always_500
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(*(f"Row {i}." for i in range(20))))
    proc = _run(tmp_path, dataset, remote_args, "--num_workers=2", "--keep_no_reasoning", timeout=200)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "HTTP 500 to every request" in proc.stderr
    failed = [r for r in _batch_lines(tmp_path) if r.get("failed")]
    assert 3 <= len(failed) <= 3 + 2 and model_server.count() <= 5 * 8
    stats = json.loads((_out(tmp_path) / "statistics.json").read_text())
    assert stats["outcomes"]["not_run"] >= 15

    model_server.policy = None  # the endpoint is fixed: the resume finishes the run
    proc = _run(tmp_path, dataset, remote_args, "--num_workers=2", "--keep_no_reasoning", "--resume", timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(read_jsonl(_out(tmp_path) / "trajectories.jsonl")) == 20


def test_a_404_for_everything_stops_the_run_early(tmp_path, model_server):
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(*(f"Row {i}." for i in range(20))))
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--model=m", "--num_workers=1",
                    f"--base_url={model_server.root_url}/nowhere", "--api_key=sk-x"], tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "HTTP 404 to every request" in proc.stderr
    assert len(_batch_lines(tmp_path)) == 3


def test_one_success_between_failures_keeps_the_run_going(tmp_path, model_server, remote_args):
    prompts = []
    for i in range(4):
        prompts += [f"@fail 500 99 retry_after=0\nBad {i}a.", f"@fail 500 99 retry_after=0\nBad {i}b.", f"Good {i}."]
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(*prompts))
    proc = _run(tmp_path, dataset, remote_args, "--num_workers=1", "--keep_no_reasoning", timeout=200)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # every row ran: failures were never 3 in a row
    assert len(_batch_lines(tmp_path)) == 12


def test_a_refusal_that_echoes_the_key_leaves_it_in_no_file_of_the_run(tmp_path):
    """Some providers quote the key they refused in the error ("Incorrect API key provided: ...").
    The run stops on the 401, and its cause, that error, reaches statistics.json and report.html
    (and the console) with the key redacted, as in the batch files."""

    def refuse(body, state):
        return Reply(status=401, body=error_body(401, f"Incorrect API key provided: Bearer {SECRET_KEY}"))

    dataset = write_jsonl(tmp_path / "d.jsonl", _rows("Row one.", "Row two."))
    with ModelServer(policy=refuse) as server:
        proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--model=m",
                        "--distribution=terminal_only", f"--base_url={server.base_url}", f"--api_key={SECRET_KEY}"],
                       tmp_path)
    assert proc.returncode != 0 and "Incorrect API key provided" in proc.stdout + proc.stderr
    assert SECRET_KEY not in proc.stdout + proc.stderr
    stats = (tmp_path / "data" / "r" / "statistics.json").read_text()
    assert "Incorrect API key provided: Bearer [REDACTED]" in stats
    written = {p.name: p.read_bytes() for p in (tmp_path / "data" / "r").rglob("*") if p.is_file()}
    assert {"statistics.json", "report.html"} <= set(written)
    assert [name for name, data in written.items() if SECRET_KEY.encode() in data] == []


def test_a_query_string_in_the_base_url_stays_on_every_request(tmp_path, model_server):
    """Some gateways want one (`?api-version=...`): the probe and the chat requests keep it after
    their own path, which the SDK itself would put after the query instead."""
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows("Row one."))
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--model=m",
                    "--distribution=terminal_only", f"--base_url={model_server.base_url}?api-version=2",
                    f"--api_key={SECRET_KEY}"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.path for p in model_server.probes] == ["/v1/models?api-version=2"]
    assert {r.path for r in model_server.requests} == {"/v1/chat/completions?api-version=2"}


def test_credentials_in_the_base_url_are_refused_before_anything_is_written(tmp_path, model_server):
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows("Row one."))
    url = model_server.base_url.replace("http://", "http://user:pa55word@")
    for flag in (f"--base_url={url}", f"--judge_base_url={url}"):
        proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--model=m", "--scorer=judge",
                        f"--base_url={model_server.base_url}", flag, f"--api_key={SECRET_KEY}"], tmp_path)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"--{flag[2:].split('=')[0]}: a user name or password in the URL" in proc.stderr
        assert "pa55word" not in proc.stdout + proc.stderr
    assert not (tmp_path / "data").exists() and model_server.count() == 0


def test_the_api_key_in_the_base_url_is_refused_before_anything_is_written(tmp_path, model_server):
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows("Row one."))
    proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--model=m",
                    f"--base_url={model_server.base_url}?key={SECRET_KEY}", f"--api_key={SECRET_KEY}"], tmp_path)
    assert proc.returncode == 1 and "--base_url holds the API key" in proc.stderr, proc.stdout + proc.stderr
    assert SECRET_KEY not in proc.stdout + proc.stderr
    assert not (tmp_path / "data").exists() and model_server.count() == 0


def test_a_redirect_loop_fails_each_row_at_once_and_stops_the_run(tmp_path):
    dataset = write_jsonl(tmp_path / "d.jsonl", _rows(*(f"Row {i}." for i in range(12))))
    with ModelServer() as server:
        server.redirect_to = server.root_url  # every request is sent back to where it came
        proc = run_cli([f"--dataset_file={dataset}", "--run_name=r", "--batch_size=5", "--model=m", "--num_workers=4",
                        "--distribution=terminal_only", f"--base_url={server.base_url}", "--api_key=sk-x"], tmp_path,
                       timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "redirects every request in a loop" in proc.stderr
    lines = _batch_lines(tmp_path)
    assert lines and all(line["error"].startswith("the endpoint's redirects never end") for line in lines)
    assert all(line["metadata"]["usage"]["retries"] == 0 for line in lines) and len(lines) < 12
