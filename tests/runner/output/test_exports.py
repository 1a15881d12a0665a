"""--export: training-ready files through the real CLI, and proof that trainers' libraries read them.

`messages` lines carry structured tool calls (arguments as objects), tool results naming their
call, reasoning apart from the text, the tools as a JSON string, and id / sample / score / passed /
scorer with one type each, so two different runs load together in `datasets`; a real tool-aware
chat template renders every line through `transformers`.
"""

from __future__ import annotations

import json
import stat

import pytest

from tests.conftest import SECRET_KEY, read_jsonl, run_cli, write_jsonl

TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def _run(tmp_path, name: str, rows: list[dict], remote_args, *extra: str):
    dataset = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    return run_cli([f"--dataset_file={dataset}", f"--run_name={name}", "--batch_size=2", *remote_args, *extra], tmp_path)


def _terminal_run(tmp_path, remote_args, *extra):
    rows = [
        {"prompt": '@tool terminal {"command": "echo one"}\n@tool terminal {"command": "echo two"}\nRun both.', "id": "t1"},
        {"prompt": '@reasoning native\n@parallel\n@tool terminal {"command": "echo a"}\n@tool terminal {"command": "echo b"}\n'
                   'Both at once.', "id": 7},
        {"prompt": "@reasoning scratchpad\nJust answer.", "id": "t3"},
    ]
    return _run(tmp_path, "a", rows, remote_args, "--distribution=terminal_only", *extra)


def _file_run(tmp_path, remote_args, *extra):
    rows = [
        {"prompt": '@tool write_file {"path": "n.txt", "content": "hello"}\n@tool read_file {"path": "n.txt"}\n'
                   '@answer hello\nWrite then read.', "id": "f1", "target": "hello"},
        {"prompt": "@answer nope\nNo tools.", "id": "f2", "target": "hello"},
    ]
    return _run(tmp_path, "b", rows, remote_args, "--distribution=default", "--scorer=includes", *extra)


def _check_messages_line(line: dict) -> None:
    assert [type(line[k]) for k in ("id", "sample", "score", "passed", "scorer", "tools")] == [str, int, float, bool, str, str]
    tools = json.loads(line["tools"])
    assert tools and all(t["type"] == "function" and isinstance(t["function"]["parameters"], dict) for t in tools)
    offered = {t["function"]["name"] for t in tools}
    messages = line["messages"]
    assert messages[0]["role"] == "user" and all(m["role"] in ("user", "assistant", "tool") for m in messages)
    calls = {}
    for message in messages:
        assert isinstance(message["content"], str)
        assert not any(tag in message["content"] for tag in TAGS), message
        if message["role"] == "assistant":
            assert isinstance(message["reasoning_content"], str)
            for call in message.get("tool_calls", []):
                assert call["type"] == "function" and call["function"]["name"] in offered
                assert isinstance(call["function"]["arguments"], dict)  # an object, not a JSON string
                calls[call["id"]] = call
        if message["role"] == "tool":
            assert message["tool_call_id"] in calls  # every result names a call made before it


def test_messages_export_with_a_run_and_alone(tmp_path, model_server, remote_args):
    proc = _terminal_run(tmp_path, remote_args, "--export=messages")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "data" / "a"
    path = run / "export" / "messages.jsonl"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = read_jsonl(path)
    kept = read_jsonl(run / "trajectories.jsonl")
    assert [line["id"] for line in lines] == [t["metadata"]["id"] for t in kept] == ["t1", "7", "t3"]
    for line in lines:
        _check_messages_line(line)
        assert (line["sample"], line["score"], line["passed"], line["scorer"]) == (0, 0.0, False, "")  # unscored
    first = lines[0]["messages"]
    calls = [c for m in first if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in calls] == [{"command": "echo one"}, {"command": "echo two"}]
    results = [m for m in first if m["role"] == "tool"]
    assert [r["tool_call_id"] for r in results] == [c["id"] for c in calls] and "one" in results[0]["content"]
    parallel = [m for m in lines[1]["messages"] if m.get("tool_calls")]
    assert len(parallel) == 1 and len(parallel[0]["tool_calls"]) == 2  # one turn, two calls, two results
    assert [m["tool_call_id"] for m in lines[1]["messages"] if m["role"] == "tool"] == [
        c["id"] for c in parallel[0]["tool_calls"]]
    assert any(m["reasoning_content"] for m in lines[1]["messages"] if m["role"] == "assistant")
    assert any(m["reasoning_content"] for m in lines[2]["messages"] if m["role"] == "assistant")  # inline <think>

    card = (run / "export" / "README.md").read_text()
    assert card.startswith("---\nconfigs:\n- config_name: messages\n  data_files: messages.jsonl\n")
    assert "`messages.jsonl`: 3 lines" in card and "terminal_only" in card and SECRET_KEY not in card
    assert stat.S_IMODE((run / "export" / "README.md").stat().st_mode) == 0o600
    assert SECRET_KEY not in path.read_text()

    # Alone with --run_name: nothing runs, the same lines (the card's date aside).
    requests = model_server.count()
    path.unlink()
    proc = run_cli(["--export=messages", "--run_name=a"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert read_jsonl(path) == lines and model_server.count() == requests


def test_an_export_that_cannot_be_made_is_refused(tmp_path, model_server, remote_args):
    proc = run_cli(["--export=messages", "--run_name=nothing"], tmp_path)
    assert proc.returncode == 1 and "holds no run" in proc.stderr, proc.stderr
    proc = run_cli(["--export=parquet", "--run_name=nothing"], tmp_path)
    assert proc.returncode == 1 and "unknown format 'parquet'" in proc.stderr, proc.stderr

    assert _terminal_run(tmp_path, remote_args, "--export=messages").returncode == 0
    before = (tmp_path / "data" / "a" / "export" / "messages.jsonl").read_bytes()
    proc = run_cli(["--export=messages,dpo", "--run_name=a"], tmp_path)  # an unscored run has no pairs
    assert proc.returncode == 1 and "--export=dpo needs scored samples" in proc.stderr, proc.stderr
    assert (tmp_path / "data" / "a" / "export" / "messages.jsonl").read_bytes() == before  # nothing written
    assert not (tmp_path / "data" / "a" / "export" / "dpo.jsonl").exists()
    requests = model_server.count()
    proc = _run(tmp_path, "c", [{"prompt": "x"}], remote_args, "--export=dpo")  # refused before any model call
    assert proc.returncode == 1 and "--export=dpo needs scored samples" in proc.stderr, proc.stderr
    assert model_server.count() == requests


def _two_runs(tmp_path, remote_args) -> list[str]:
    assert _terminal_run(tmp_path, remote_args, "--export=messages").returncode == 0
    proc = _file_run(tmp_path, remote_args, "--export=messages")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [str(tmp_path / "data" / name / "export" / "messages.jsonl") for name in ("a", "b")]


def test_two_runs_load_together_in_datasets_and_render_through_a_chat_template(tmp_path, model_server, remote_args):
    files = _two_runs(tmp_path, remote_args)
    scored = read_jsonl(files[1])
    assert [(line["score"], line["passed"], line["scorer"]) for line in scored] == [(1.0, True, "includes"),
                                                                                 (0.0, False, "includes")]
    for line in scored:
        _check_messages_line(line)
    datasets = pytest.importorskip("datasets")
    for order in (files, files[::-1]):
        loaded = datasets.load_dataset("json", data_files=order, split="train", cache_dir=str(tmp_path / "hf"))
        assert loaded.num_rows == 5
        assert {k: loaded.features[k].dtype for k in ("id", "sample", "score", "passed", "scorer", "tools")} == {
            "id": "string", "sample": "int64", "score": "float64", "passed": "bool", "scorer": "string", "tools": "string"}
        by_id = {row["id"]: row for row in loaded}
        call = next(c for m in by_id["f1"]["messages"] if m["role"] == "assistant" for c in m.get("tool_calls") or [])
        assert call["function"]["arguments"] == {"path": "n.txt", "content": "hello"}
    _render_with_a_chat_template(tmp_path, [json.loads(x) for f in files for x in open(f)])


# A tool-aware chat template in the style of today's open models: tools listed in the system
# block, arguments rendered from the object, tool results in their own turns, reasoning kept apart.
CHAT_TEMPLATE = """\
{%- if tools %}<|system|>Tools:
{% for tool in tools %}{{ tool.function.name }}: {{ tool.function.parameters | tojson }}
{% endfor %}<|end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|assistant|>
{%- if message.reasoning_content %}<reasoning>{{ message.reasoning_content }}</reasoning>{% endif %}
{{- message.content }}
{%- for call in message.tool_calls or [] %}
[call {{ call.id }}] {{ call.function.name }}({{ call.function.arguments | tojson }})
{%- endfor %}<|end|>
{% elif message.role == 'tool' %}<|tool|>[result {{ message.tool_call_id }}] {{ message.content }}<|end|>
{% else %}<|{{ message.role }}|>{{ message.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


def _render_with_a_chat_template(tmp_path, lines: list[dict]) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "<|end|>": 1}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<|end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    for line in lines:
        text = tokenizer.apply_chat_template(line["messages"], tools=json.loads(line["tools"]), tokenize=False)
        for message in line["messages"]:
            assert message["content"][:40] in text
            for call in message.get("tool_calls", []):
                assert f"[call {call['id']}] {call['function']['name']}(" in text
                assert json.dumps(call["function"]["arguments"])[:20] in text.replace("'", '"')
            if message["role"] == "tool":
                assert f"[result {message['tool_call_id']}]" in text
        assert text.count("<|tool|>") == sum(m["role"] == "tool" for m in line["messages"])


def test_dpo_of_a_scored_run_with_one_sample_per_prompt_has_no_pairs(tmp_path, model_server, remote_args):
    assert _file_run(tmp_path, remote_args).returncode == 0
    proc = run_cli(["--export=dpo,messages", "--run_name=b"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    export = tmp_path / "data" / "b" / "export"
    assert (export / "dpo.jsonl").read_text() == "" and len(read_jsonl(export / "messages.jsonl")) == 2
    assert stat.S_IMODE((export / "dpo.jsonl").stat().st_mode) == 0o600
    card = (export / "README.md").read_text()
    assert "- config_name: dpo\n  data_files: dpo.jsonl" in card and "`dpo.jsonl`: 0 lines" in card


def _sample(index: int, sample: int, score: float, answer: str, scored: bool = True):
    from runner.output.export import Sample

    messages = [{"role": "user", "content": f"Question {index}?"},
                {"role": "assistant", "content": answer, "reasoning_content": ""}]
    return Sample(prompt_index=index, id=f"q{index}", sample=sample, score=score, passed=score >= 1.0,
                  scorer="exact" if scored else "", scored=scored, score_failed=False, messages=messages, tools="[]", metadata={})


def test_dpo_pairs_the_best_and_the_worst_sample_of_each_prompt():
    from runner.output.export import dpo_lines

    samples = [_sample(0, 0, 0.0, "Lyon."), _sample(0, 1, 1.0, "Paris."), _sample(0, 2, 1.0, "Paris!"),
               _sample(0, 3, 0.5, "France."),
               _sample(1, 0, 1.0, "Yes."), _sample(1, 1, 1.0, "Yes!"),  # equal scores: no preference
               _sample(2, 0, 0.0, "Alone.")]  # one sample: no pair
    lines = list(dpo_lines(samples))
    assert lines == [{"prompt": [{"role": "user", "content": "Question 0?"}],
                      "chosen": [{"role": "assistant", "content": "Paris.", "reasoning_content": ""}],
                      "rejected": [{"role": "assistant", "content": "Lyon.", "reasoning_content": ""}],
                      "tools": "[]", "id": "q0", "score_chosen": 1.0, "score_rejected": 0.0}]
    assert list(dpo_lines([_sample(3, 0, 0.0, "a", scored=False), _sample(3, 1, 1.0, "b", scored=False)])) == []


@pytest.mark.parametrize("keep", ["best", "passing"])
def test_dpo_pairs_come_from_every_scored_sample_whatever_keep_selected(tmp_path, model_server, remote_args, keep):
    rows = [{"prompt": "@answers right|wrong|right|wrong\nQuestion one.", "target": "right"}]
    proc = _run(tmp_path, "k", rows, remote_args, "--samples_per_prompt=4", "--scorer=includes", f"--keep={keep}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_cli(["--export=dpo", "--run_name=k"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pairs = read_jsonl(tmp_path / "data" / "k" / "export" / "dpo.jsonl")
    assert len(pairs) == 1, proc.stdout
    assert "right" in pairs[0]["chosen"][-1]["content"] and "wrong" in pairs[0]["rejected"][-1]["content"]
    assert (pairs[0]["score_chosen"], pairs[0]["score_rejected"]) == (1.0, 0.0)


def _documented_dpo_features():
    """The `features` docs/exports.md gives for loading dpo files together (its python block)."""
    from tests.conftest import REPO

    page = (REPO / "docs" / "exports.md").read_text(encoding="utf-8")
    code = page.split("## `dpo`", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(code, namespace)
    return namespace["DPO_FEATURES"]


def test_dpo_exports_of_two_runs_load_together_in_datasets_in_both_orders(tmp_path, model_server, remote_args):
    plain = [{"prompt": "@answers right|wrong\nPlain question.", "id": "p1", "target": "right"}]
    tools = [{"prompt": '@tool terminal {"command": "echo hi"}\n@answers right|wrong\nWith a tool.', "id": "q1",
              "target": "right"}]
    for name, rows in (("p", plain), ("q", tools)):
        proc = _run(tmp_path, name, rows, remote_args, "--distribution=terminal_only", "--samples_per_prompt=2",
                    "--scorer=includes", "--export=dpo")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    files = [str(tmp_path / "data" / name / "export" / "dpo.jsonl") for name in ("p", "q")]
    pairs = [read_jsonl(path)[0] for path in files]
    assert [m["role"] for m in pairs[0]["chosen"]] == ["assistant"]
    assert "tool" in [m["role"] for m in pairs[1]["chosen"]]
    datasets = pytest.importorskip("datasets")
    features = _documented_dpo_features()
    for order in (files, files[::-1]):
        loaded = datasets.load_dataset("json", data_files=order, split="train", features=features,
                                       cache_dir=str(tmp_path / "hf"))
        by_id = {row["id"]: row for row in loaded}
        assert set(by_id) == {"p1", "q1"}
        for row, pair in zip((by_id["p1"], by_id["q1"]), pairs):
            assert (row["prompt"], row["chosen"], row["rejected"]) == (pair["prompt"], pair["chosen"], pair["rejected"])
            assert (row["score_chosen"], row["score_rejected"]) == (1.0, 0.0)


def test_a_sample_whose_primary_scorer_failed_is_never_paired(tmp_path, model_server, remote_args):
    # A scorer error says nothing about the answer: it is no rejected (or chosen) sample.
    (tmp_path / "picky.py").write_text(
        "def picky(sample):\n"
        "    if 'broken' in sample.final_answer:\n"
        "        raise RuntimeError('the grader is down')\n"
        "    return 'right' in sample.final_answer\n")
    rows = [{"prompt": "@answers right|broken\nOne.", "id": "a"},
            {"prompt": "@answers right|broken|wrong\nTwo.", "id": "b"}]
    proc = _run(tmp_path, "e", rows, remote_args, "--distribution=terminal_only", "--samples_per_prompt=3",
                "--scorer=picky.py:picky", "--export=dpo", "--num_workers=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pairs = read_jsonl(tmp_path / "data" / "e" / "export" / "dpo.jsonl")
    assert [(p["id"], p["chosen"][-1]["content"], p["rejected"][-1]["content"]) for p in pairs] == [
        ("b", "right", "wrong")]


def test_the_dataset_card_names_every_scorer_and_the_selection(tmp_path, model_server, remote_args):
    rows = [{"prompt": "@answers right|wrong\nQuestion.", "id": "c1", "target": "right"}]
    proc = _run(tmp_path, "card", rows, remote_args, "--distribution=terminal_only", "--samples_per_prompt=2",
                "--scorer=includes,exact", "--pass_threshold=0.5", "--keep=best", "--export=messages,dpo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    card = (tmp_path / "data" / "card" / "export" / "README.md").read_text()
    assert "- Scorers: `includes` (primary; passes at 0.5), `exact`\n" in card, card
    assert "- Selection: `--keep=best` of 2 samples per prompt" in card, card
    assert "`messages.jsonl`: 1 lines" in card and "`dpo.jsonl`: 1 lines" in card
    # An unscored run says so.
    assert _terminal_run(tmp_path, remote_args, "--export=messages").returncode == 0
    card = (tmp_path / "data" / "a" / "export" / "README.md").read_text()
    assert "- Scorers: none (score 0.0, passed false)\n" in card and "- Selection: `--keep=all` of 1 sample per prompt" in card


TEXT_CALLS = {
    # a model that writes a call as text in its answer (a server without a tool-call parser)
    "Text call.": 'I would run:\n<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call>',
    # and one whose text block is no JSON at all
    "Broken call.": "Like this:\n<tool_call>\n{not json\n</tool_call>\nDone.",
}


def _text_call_policy(body, state):
    from tests.helpers.model_server import Reply, chat_completion, first_user_text

    answer = TEXT_CALLS.get(first_user_text(body).splitlines()[-1])
    return None if answer is None else Reply(body=chat_completion(body, answer, None, "Thinking."))


def test_call_text_a_model_wrote_in_its_answer_stays_text(tmp_path):
    from tests.helpers.model_server import ModelServer

    with ModelServer(policy=_text_call_policy) as server:
        rows = [{"prompt": "Text call.", "id": "x"}, {"prompt": "Broken call.", "id": "y"},
                {"prompt": '@tool terminal {"command": "echo real"}\nReal call.', "id": "z"}]
        proc = _run(tmp_path, "t", rows, [f"--base_url={server.base_url}", "--model=m", "--api_key=k"],
                    "--distribution=terminal_only", "--export=messages")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {line["id"]: line["messages"] for line in read_jsonl(tmp_path / "data" / "t" / "export" / "messages.jsonl")}
    assert set(lines) == {"x", "y", "z"}
    for row_id, prompt in (("x", "Text call."), ("y", "Broken call.")):
        answer = lines[row_id][-1]
        assert "tool_calls" not in answer and not any(m["role"] == "tool" for m in lines[row_id])  # no call was made
        assert answer["content"] == TEXT_CALLS[prompt] and answer["reasoning_content"] == "Thinking."
    real = [c for m in lines["z"] if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in real] == [{"command": "echo real"}]
