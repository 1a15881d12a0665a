"""Training-ready exports of a run: `messages` (chat messages with structured tool calls) and `dpo`
(preference pairs of scored samples), with a dataset card, in data/<run>/export/.

Both read the kept trajectories from the run view, as the merge does (the same rows, in the same
order as trajectories.jsonl), each line checked against the record model. A committed record
holds the conversation as ShareGPT turns only, written by agent/trajectory.py in a fixed shape:
reasoning in one leading `<think>` block, each call a `<tool_call>` block of JSON, each result a
`<tool_response>` block of JSON naming its `tool_call_id`, and the offered tools' schemas as JSON
in the system turn. That shape is turned back into structured messages here; the row's id,
sample and scores come from its metadata.

Every line has the same fields with one type each (a score is a float, `tools` a JSON string), so
the exports of any two runs load together in Hugging Face `datasets`: every assistant message has
`reasoning_content` and a user message has not, so `datasets` reads the messages as JSON values
(whatever the tool arguments hold) instead of a struct inferred from the first file.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator

from runner.storage import runfiles
from runner.storage.atomic import atomic_write_bytes
from runner.storage.records import OkRecord, RecordError, validate_record
from runner.storage.scores import is_scorer_error

FORMATS = ("messages", "dpo")
EXPORT_DIR = "export"

_THINK = re.compile(r"<think>\n?(.*?)\n?</think>\n?", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)


class ExportError(ValueError):
    """An export that cannot be made (one clear line for the user)."""


def parse_formats(value: Any) -> list[str]:
    """`--export=messages,dpo` as a list of formats; ValueError naming an unknown one."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    formats = [str(item).strip() for item in items if str(item).strip()]
    if not formats:
        raise ValueError(f"--export is empty; choose from {', '.join(FORMATS)}")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"--export: unknown format {unknown[0]!r}; choose from {', '.join(FORMATS)}")
    return list(dict.fromkeys(formats))


# --- one trajectory as chat messages ---------------------------------------------------------


@dataclass
class Sample:
    """One kept trajectory, converted."""

    prompt_index: int
    id: str
    sample: int
    score: float
    passed: bool
    scorer: str
    scored: bool  # a scorer ran on it (metadata.scores)
    score_failed: bool  # its primary scorer failed (raised, timed out, gave no grade): its score says nothing
    messages: list[dict]
    tools: str  # the offered functions' schemas, as a JSON string
    metadata: dict


def offered_tools(system_turn: str) -> list[dict]:
    """The functions the sample was offered, as OpenAI tool schemas, from the system turn."""
    match = _TOOLS.search(system_turn)
    listing = json.loads(match.group(1)) if match else []
    return [{"type": "function", "function": {"name": spec["name"], "description": spec.get("description", ""),
                                              "parameters": spec.get("parameters", {})}} for spec in listing]


def _assistant(value: str, answered: int) -> dict:
    """A gpt turn as an assistant message. Its calls are its last `answered` `<tool_call>` blocks:
    the writer puts the calls after the text, and the next turn holds one result per call. Any
    other block is text the model wrote itself (a call it only described), kept in `content`."""
    reasoning = [part.strip() for part in _THINK.findall(value)]
    text = _THINK.sub("", value)
    blocks = list(_TOOL_CALL.finditer(text))[-answered:] if answered else []
    calls = [_call(block.group(1)) for block in blocks]
    if blocks and None not in calls:
        text = text[:blocks[0].start()]
    else:
        calls = []
    message = {"role": "assistant", "content": text.strip(),
               "reasoning_content": "\n\n".join(part for part in reasoning if part)}
    if calls:
        message["tool_calls"] = calls
    return message


def _call(block: str) -> dict | None:
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments")
    return {"id": "", "type": "function",
            "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, dict) else {}}}


def _tool_results(value: str) -> list[dict]:
    results = []
    for block in _TOOL_RESPONSE.findall(value):
        body = json.loads(block)
        content = body.get("content")
        results.append({"role": "tool", "tool_call_id": str(body.get("tool_call_id") or ""),
                        "name": str(body.get("name") or ""),
                        "content": content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)})
    return results


def _pair_ids(calls: list[dict], results: list[dict], turn: int) -> None:
    """Give each call the id its result names (the results say which call they answer); a call
    with no result (the session ended first) or a result without an id gets one made up."""
    unanswered = list(calls)
    for result in results:
        call = next((c for c in unanswered if c["function"]["name"] == result["name"]), None)
        if call is None:
            continue
        unanswered.remove(call)
        if not result["tool_call_id"]:
            result["tool_call_id"] = f"call_{turn}_{calls.index(call)}"
        call["id"] = result["tool_call_id"]
    for call in unanswered:
        call["id"] = f"call_{turn}_{calls.index(call)}"


def to_messages(turns: list[dict]) -> list[dict]:
    """ShareGPT turns (system, human, then gpt / tool / human) as chat messages. The system turn
    is the ShareGPT format's own text about tool-call tags, not a prompt the model was sent (the
    tools went as the request's `tools`), so it is not a message here: `tools` carries them."""
    messages: list[dict] = []
    last_calls: list[dict] = []
    for turn_no, turn in enumerate(turns):
        kind, value = turn["from"], turn["value"]
        if kind == "human":
            messages.append({"role": "user", "content": value})
        elif kind == "gpt":
            following = turns[turn_no + 1] if turn_no + 1 < len(turns) else None
            answered = len(_TOOL_RESPONSE.findall(following["value"])) if following and following["from"] == "tool" else 0
            message = _assistant(value, answered)
            last_calls = message.get("tool_calls", [])
            _pair_ids(last_calls, [], turn_no)  # ids for now; the next tool turn gives the real ones
            messages.append(message)
        elif kind == "tool":
            results = _tool_results(value)
            _pair_ids(last_calls, results, turn_no - 1)
            messages.extend({k: r[k] for k in ("role", "tool_call_id", "content")} for r in results)
            last_calls = []
    return messages


def to_sample(record: OkRecord) -> Sample:
    turns = [{"from": t.from_, "value": t.value} for t in record.conversations]
    system = next((t["value"] for t in turns if t["from"] == "system"), "")
    meta = record.metadata
    scores = meta.scores or []
    primary = scores[0] if scores else None
    sample = getattr(meta, "sample", None)  # set by runs with several samples per prompt
    return Sample(
        prompt_index=record.prompt_index,
        id=meta.id,
        sample=sample if isinstance(sample, int) else 0,
        score=float(primary.value) if primary else 0.0,
        passed=bool(primary.passed) if primary else False,
        scorer=primary.scorer if primary else "",
        scored=primary is not None,
        score_failed=primary is not None and is_scorer_error(primary.model_dump()),
        messages=to_messages([t for t in turns if t["from"] != "system"]),
        tools=json.dumps(offered_tools(system), ensure_ascii=False),
        metadata={"prompt_index": record.prompt_index, "model": meta.model, "completed": record.completed,
                  "partial": record.partial, "stop_reason": meta.stop_reason},
    )


def messages_line(sample: Sample) -> dict:
    return {"messages": sample.messages, "tools": sample.tools, "id": sample.id, "sample": sample.sample,
            "score": sample.score, "passed": sample.passed, "scorer": sample.scorer, "metadata": sample.metadata}


# --- preference pairs ------------------------------------------------------------------------


def _prompt_length(messages: list[dict]) -> int:
    """The prompt is the system and user messages before the first assistant message."""
    return next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))


def dpo_lines(samples: Iterable[Sample]) -> Iterator[dict]:
    """For each row with two or more scored samples whose primary scores differ: the best sample
    (the first of the best, by sample index) against the worst, in TRL's conversational
    preference format (prompt, chosen, rejected). A sample whose primary scorer failed is in no
    pair: its 0.0 says nothing about its answer."""
    by_row: dict[int, list[Sample]] = {}
    for sample in samples:
        if sample.scored and not sample.score_failed:
            by_row.setdefault(sample.prompt_index, []).append(sample)
    for index in sorted(by_row):
        group = sorted(by_row[index], key=lambda s: s.sample)
        best = max(group, key=lambda s: s.score)
        worst = min(group, key=lambda s: s.score)
        if best.score == worst.score:
            continue
        cut = _prompt_length(best.messages)
        yield {"prompt": best.messages[:cut], "chosen": best.messages[cut:],
               "rejected": worst.messages[_prompt_length(worst.messages):], "tools": best.tools, "id": best.id,
               "score_chosen": best.score, "score_rejected": worst.score}


# --- writing ---------------------------------------------------------------------------------


def kept_samples(lines: Iterable[bytes]) -> Iterator[Sample]:
    """The kept lines (trajectories.jsonl's), each read through the record model."""
    for line in lines:
        try:
            record = validate_record(json.loads(line))
        except (ValueError, RecordError) as err:
            raise ExportError(f"a kept trajectory does not fit the record model: {err}") from None
        if isinstance(record, OkRecord):
            yield to_sample(record)


def _write_jsonl(path: Path, lines: Iterable[dict]) -> int:
    """Write atomically (a private temp file renamed over the target); returns the line count."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}_", suffix=".tmp", dir=path.parent)  # mode 0600
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for line in lines:
                handle.write(json.dumps(line, ensure_ascii=False) + "\n")
                count += 1
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count


def export_run(run_dir: Path, kept_lines, formats: list[str], log=print, ok_lines=None) -> dict[str, int]:
    """Write data/<run>/export/<format>.jsonl for each format and the dataset card; returns the
    line count of each. `kept_lines()` yields the kept lines afresh on each call; `ok_lines()` the
    ok lines whatever --keep selected, which `dpo` pairs (a pair needs the worst sample too; the
    kept lines when not given). A format that cannot be made is refused (ExportError) before
    anything is written."""
    samples = list(kept_samples(kept_lines()))
    scored = list(kept_samples(ok_lines())) if ok_lines is not None else samples
    if "dpo" in formats and not any(s.scored for s in scored):
        raise ExportError(f"{run_dir}: --export=dpo needs scored samples (run with --samples_per_prompt=N, N >= 2, "
                          "and --scorer); this run has none")
    out = run_dir / EXPORT_DIR
    counts = {}
    for fmt in formats:
        lines = (messages_line(s) for s in samples) if fmt == "messages" else dpo_lines(scored)
        counts[fmt] = _write_jsonl(out / f"{fmt}.jsonl", lines)
        log(f"   - Export: {EXPORT_DIR}/{fmt}.jsonl ({counts[fmt]:,} lines)")
    atomic_write_bytes(out / "README.md", dataset_card(run_dir, counts, samples).encode())
    return counts


def dataset_card(run_dir: Path, counts: dict[str, int], samples: list[Sample]) -> str:
    """export/README.md: the Hugging Face front matter naming the files, and what the run was.
    Only named settings of config.json go in (it holds no key, and nothing else is copied)."""
    config_file = runfiles.read_config(run_dir) or runfiles.ConfigFile()
    config = config_file.config
    front = ["---", "configs:"]
    for fmt in counts:
        front += [f"- config_name: {fmt}", f"  data_files: {fmt}.jsonl"]
    front += ["tags:", "- agent-batch-runner", "- tool-use", "---", ""]
    body = [
        f"# {run_dir.name}",
        "",
        "Agent trajectories exported by agent-batch-runner.",
        "",
        *[f"- `{fmt}.jsonl`: {n:,} lines" for fmt, n in counts.items()],
        f"- Model: `{config.get('model', '')}`",
        f"- Toolset distribution: `{config.get('distribution', '')}`",
        f"- Scorers: {_scorers_line(config, samples)}",
        f"- Selection: {_selection_line(config)}; `messages`: the kept trajectories (those of "
        "trajectories.jsonl); `dpo`: the best and the worst scored sample of each prompt whose scores differ, "
        "from every ok sample whatever --keep kept",
        f"- Config fingerprint: `{config_file.fingerprint}`",
        f"- Exported: {datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
        "",
    ]
    return "\n".join(front + body)


def _scorers_line(config: dict, samples: list[Sample]) -> str:
    """The run's scorers, the primary first with its pass threshold (the samples' own scorers
    for a run whose config.json names none, e.g. one that was only rescored)."""
    names = [str(name) for name in config.get("scorer") or []] if isinstance(config.get("scorer"), list) else []
    primaries = sorted({s.scorer for s in samples if s.scorer})
    if primaries and primaries != names[:1]:  # rescored: the lines carry the rescore's scores
        return ", ".join(f"`{name}`" for name in primaries) + " (primary, from --rescore)"
    if not names:
        return "none (score 0.0, passed false)"
    threshold = config.get("pass_threshold")
    threshold = threshold if isinstance(threshold, (int, float)) and not isinstance(threshold, bool) else 1.0
    return ", ".join([f"`{names[0]}` (primary; passes at {threshold:g})", *(f"`{name}`" for name in names[1:])])


def _selection_line(config: dict) -> str:
    keep = config.get("keep") if isinstance(config.get("keep"), str) else "all"
    samples = config.get("samples_per_prompt")
    samples = samples if isinstance(samples, int) and not isinstance(samples, bool) and samples > 0 else 1
    line = f"`--keep={keep}` of {samples} sample{'s' if samples != 1 else ''} per prompt"
    stop = config.get("stop_after_passing")
    if isinstance(stop, int) and not isinstance(stop, bool):
        line += f", `--stop_after_passing={stop}`"
    return line
