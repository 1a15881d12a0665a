"""The committed record: the three kinds of line a batch file holds, defined once.

Every line of a batch file is one of three records:
- `OkRecord`: a trajectory (completed or partial); the lines trajectories.jsonl is made of;
- `DiscardedRecord`: a tombstone (the model never reasoned); kept, never paid for again;
- `FailedRecord`: a failed attempt; retried on resume, never merged.

The worker builds records with these models (so a record that does not fit cannot be made), the
store validates and serialises them through `record_line` (so a line that does not fit cannot be
written), and the run view reads lines with `read_line`, which parses only the fields the view
needs (`LineFields`), not the conversations: a merge of 100,000 rows must not pay for a full
validation of every turn.

The original's fields keep their names and their order (prompt_index first, then conversations or
the outcome fields, then metadata, ...); our additions come after them. Every field has one type in
every row (ids are strings, the seed is an int, lists are lists), so the files of any two runs load
together in Hugging Face `datasets`. Arrow takes a column's type from the first file it reads, so
no field may be null in a whole file or be a list that is empty in every row of it (`list<null>`
cannot take a later file's values), and no field may be a mapping whose keys vary between runs
(a struct of other fields): hence `usage.cost` is always a number with `usage.unpriced_requests`
saying whether it is complete (an unknown price is not a price of 0), `usage.by_model` is a list
of entries naming their model, and the loop's notes and dropped replies are text, one line each.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

import orjson
from pydantic import BaseModel, ConfigDict, Field, SerializationInfo, TypeAdapter, ValidationError, model_serializer

from agent.usage import Usage

# Version of the record schema, in every row (metadata.schema_version) and in statistics.json.
# 1: lines written before the version existed (read as well as they can be); 2: cost null when
# unknown, by_model a mapping, notes and dropped replies lists (read too); 3: these models.
SCHEMA_VERSION = 3


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class ModelUsageRecord(_Model):
    """What one attempt spent on one model (the run's model, and the models tools call)."""

    model: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost: float = 0.0  # the known costs; a lower bound when unpriced_requests > 0
    unpriced_requests: int = 0  # replies whose cost is unknown (none reported, no price given)


class UsageRecord(_Model):
    """`metadata.usage`: what one attempt spent (an agent.usage.Usage), summed over every model
    request of its session (tools' too). Its fields are those of Usage.as_dict()."""

    requests: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    total_tokens: int = 0
    cost: float = 0.0  # the known costs: the attempt's cost when unpriced_requests is 0, else a lower bound
    unpriced_requests: int = 0  # replies whose cost is unknown (none reported, no price given)
    by_model: list[ModelUsageRecord] = Field(default_factory=list)  # sorted by model

    @classmethod
    def of(cls, usage: Usage) -> UsageRecord:
        return cls.model_validate(usage.as_dict())


def note_lines(notes: list[dict]) -> str:
    """`metadata.loop_notes`: one line per message the loop itself sent to the model (the turn-limit
    summary request, the repair note after invalid tool-call JSON), "after turn N: <note>", N being
    the index in `conversations` of the turn it followed. Notes are not conversation turns: a
    conversation holds only what a user said and what the model and its tools produced."""
    return "\n".join(f"after turn {n['after_turn']}: {_one_line(n['note'])}" for n in notes)


def dropped_lines(replies: list[dict]) -> str:
    """`metadata.dropped_replies`: one line per model reply the loop did not keep (retried silently: an
    unknown tool, invalid JSON arguments, thinking without an answer, an empty reply), "call N:
    <reason>", N the 1-based model call, so every model call is accounted for."""
    return "\n".join(f"call {d['call']}: {_one_line(d['reason'])}" for d in replies)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def known_cost(usage: Mapping[str, Any]) -> float | None:
    """The cost of a committed `usage` (or one `by_model` entry), None when it is unknown."""
    return Usage.read(usage).known_cost


class ScoreEntry(_Model):
    """What one scorer made of a sample (`metadata.scores`, one entry per scorer, the primary first).

    Every field has one type in every line: a scorer that failed still has a value (0.0), a
    passed flag (false) and an explanation that names its error."""

    scorer: str  # its name as given to --scorer ("includes", "judge", "path/to/file.py:function")
    value: float = Field(allow_inf_nan=False)
    passed: bool  # value >= --pass_threshold (never for a scorer error)
    explanation: str = ""


class Metadata(_Model):
    # The original's three fields first, then ours.
    batch_num: int = -1  # set by the store when it commits the line
    timestamp: str
    model: str
    row_key: str
    id: str = ""  # the dataset row's id, as text; "" when the row has none
    run_id: str  # the invocation that made this attempt
    attempt: int
    duration_seconds: float
    usage: UsageRecord = Field(default_factory=UsageRecord)
    seed: int  # the run's seed (drawn at random and recorded when --seed is not given)
    sample: int = 0  # 0-based index of this sample of the row (--samples_per_prompt)
    samples: int = 1  # --samples_per_prompt: samples of every row
    sample_seed: int = 0  # the sample's own seed, from the run's seed, the row and the sample
    tools_offered: list[str] = Field(default_factory=list)
    stop_reason: str = ""  # final_answer, turn_limit, why a partial row stopped; "failed" for failures
    toolsets_sampled: list[str] = Field(default_factory=list)  # before tools that cannot run were removed
    loop_notes: str = ""  # note_lines(): "after turn N: <note>" per line, "" when the loop sent none
    dropped_replies: str = ""  # dropped_lines(): "call N: <reason>" per line, "" when none was dropped
    schema_version: int = SCHEMA_VERSION
    # What the run's scorers (--scorer) made of the sample; left out of the line when none ran, so
    # the lines of a run without scorers stay as they were.
    scores: list[ScoreEntry] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_scores(self, handler, info: SerializationInfo):
        data = handler(self)
        if data.get("scores") is None:
            data.pop("scores", None)
        return data


class RescoreRecord(_Model):
    """A line of rescores.jsonl: what `--rescore` made of one committed ok line (named by its row
    key, the invocation that made it and its attempt), and what the judge's requests spent. The
    run view puts these scores in place of the line's own (the last rescore of a line wins);
    the batch files are never rewritten."""

    row_key: str
    run_id: str
    attempt: int
    scores: list[ScoreEntry]
    usage: UsageRecord = Field(default_factory=UsageRecord)
    rescore_id: str  # the --rescore invocation
    timestamp: str


RESCORES_FILE = "rescores.jsonl"


def read_rescores(path: Any) -> tuple[dict[tuple[str, str, int], list[dict]], list[dict]]:
    """rescores.jsonl: (row key, run id, attempt) -> the latest scores, and the usage of every
    line (what rescoring spent). A line that is not a rescore record is skipped."""
    latest: dict[tuple[str, str, int], list[dict]] = {}
    usages: list[dict] = []
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return latest, usages
    with handle:
        for line in handle:
            if not line.endswith(b"\n"):
                break  # an unfinished tail (a crash mid-write) is not a line
            try:
                record = RescoreRecord.model_validate_json(line)
            except ValidationError:
                continue
            data = record.model_dump(mode="json")
            latest[(record.row_key, record.run_id, record.attempt)] = data["scores"]
            usages.append({"row_key": record.row_key, "timestamp": record.timestamp, "usage": Usage.read(data["usage"])})
    return latest, usages


class ToolCounts(_Model):
    count: int = 0
    success: int = 0
    failure: int = 0


class ReasoningStats(_Model):
    total_assistant_turns: int = 0
    turns_with_reasoning: int = 0
    turns_without_reasoning: int = 0


class Turn(_Model):
    from_: str = Field(alias="from")
    value: str

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class OkRecord(_Model):
    prompt_index: int
    conversations: list[Turn]
    metadata: Metadata
    completed: bool
    partial: bool
    api_calls: int
    toolsets_used: list[str]  # toolsets with at least one tool offered to the model
    tool_stats: dict[str, ToolCounts]
    tool_error_counts: dict[str, int]
    reasoning_stats: ReasoningStats


class DiscardedRecord(_Model):
    prompt_index: int
    discarded: Literal["no_reasoning"]
    prompt: str
    metadata: Metadata
    api_calls: int
    toolsets_used: list[str]
    tool_stats: dict[str, ToolCounts]
    tool_error_counts: dict[str, int]
    reasoning_stats: ReasoningStats


class FailedRecord(_Model):
    prompt_index: int
    failed: Literal[True]
    error: str
    error_class: str
    prompt: str
    metadata: Metadata


Record = OkRecord | DiscardedRecord | FailedRecord
OUTCOMES = ("failed", "discarded", "ok")
OUTCOME_RANK = {name: rank for rank, name in enumerate(OUTCOMES)}  # the better outcome wins


def outcome_of(record: dict) -> str:
    """ok, discarded or failed, from the fields that tell the kinds apart."""
    if record.get("failed"):
        return "failed"
    if record.get("discarded"):
        return "discarded"
    return "ok"


_KINDS = {"ok": OkRecord, "discarded": DiscardedRecord, "failed": FailedRecord}


class RecordError(ValueError):
    """A record that does not fit its schema; it is never written."""


def validate_record(record: dict | Record) -> Record:
    """The record as its model (raises RecordError naming the first field at fault)."""
    if isinstance(record, (OkRecord, DiscardedRecord, FailedRecord)):
        return record
    kind = _KINDS[outcome_of(record)]
    try:
        return kind.model_validate(record)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise RecordError(f"a {outcome_of(record)} record does not fit its schema: {where}: {first['msg']}") from None


_TURNS = TypeAdapter(list[Turn])


def read_conversation(value: Any) -> list[dict]:
    """A row's `conversations` checked against the Turn model (each turn a `from` and a `value`
    text), as the row holds them; RecordError naming the first field at fault. A turn's other
    keys (some ShareGPT files carry a `weight`) are left as they are."""
    if not isinstance(value, list):
        raise RecordError(f"conversations: must be a list of turns, not {type(value).__name__}")
    for index, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise RecordError(f"conversations.{index}: a turn must be an object with 'from' and 'value'")
    try:
        _TURNS.validate_python([{k: turn[k] for k in ("from", "value") if k in turn} for turn in value])
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]).replace("from_", "from")
        raise RecordError(f"conversations.{where}: {first['msg']}") from None
    return value


def record_line(record: Record) -> bytes:
    """The committed line of a validated record: its fields in schema order, one JSON line."""
    return record.model_dump_json(by_alias=True).encode() + b"\n"


def as_dict(record: Record) -> dict:
    """The record as plain JSON data (what workers send to the parent)."""
    return record.model_dump(mode="json", by_alias=True)


# --- reading --------------------------------------------------------------------------------


class MetadataView:
    """A committed line's metadata, read without validating it again: each field of `Metadata` as
    an attribute, its default (None for a required field) when the line lacks it or holds another
    type (a line of an older schema, a hand edit). A field added to `Metadata` is readable here
    with no other change; `usage` reads as an agent.usage.Usage."""

    __slots__ = ("_raw", "_usage")

    def __init__(self, raw: dict):
        self._raw = raw
        self._usage: Usage | None = None

    @property
    def usage(self) -> Usage:
        if self._usage is None:
            self._usage = Usage.read(self._raw.get("usage"))
        return self._usage

    def __getattr__(self, name: str) -> Any:
        info = Metadata.model_fields.get(name)
        if info is None:
            raise AttributeError(name)
        value = self._raw.get(name)
        if value is not None and _fits(value, info.annotation):
            return value
        return None if info.is_required() else info.get_default(call_default_factory=True)

    def replace(self, name: str, value: Any) -> None:
        """Put `value` in the line's field `name` (a reader's overlay, such as a later rescore)."""
        if name not in Metadata.model_fields:
            raise AttributeError(name)
        self._raw[name] = value
        if name == "usage":
            self._usage = None

    def present(self) -> dict[str, Any]:
        """The fields the line holds (any type), in schema order: what a reader shows of it."""
        return {name: self._raw[name] for name in Metadata.model_fields if name in self._raw}


def _fits(value: Any, annotation: Any) -> bool:
    if annotation is float:
        return _is_number(value)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin = getattr(annotation, "__origin__", None) or annotation
    return isinstance(value, origin) if isinstance(origin, type) else True


class LineFields:
    """The fields of a committed line that the run view needs, parsed from its JSON.

    Plain attribute access over the parsed dict, with the types checked once here, so the merge
    of a large run does not validate every conversation turn (the models above did that when the
    line was written). Lines written before the schema version existed read with defaults.
    `meta` reads any other metadata field.
    """

    __slots__ = ("raw", "key", "outcome", "prompt_index", "row_id", "run_id", "timestamp", "duration", "meta",
                 "error_class")

    def __init__(self, raw: dict, key: str):
        self.raw = raw
        self.key = key
        self.outcome = outcome_of(raw)
        metadata = raw["metadata"]
        self.meta = MetadataView(metadata)
        self.prompt_index = _int(raw.get("prompt_index"), -1)
        row_id = metadata.get("id")
        self.row_id = "" if row_id is None else str(row_id)
        self.run_id = str(metadata.get("run_id") or "")
        self.timestamp = metadata.get("timestamp") if isinstance(metadata.get("timestamp"), str) else None
        duration = metadata.get("duration_seconds")
        self.duration = float(duration) if _is_number(duration) else None
        self.error_class = str(raw.get("error_class") or "agent") if self.outcome == "failed" else None

    @property
    def usage(self) -> Usage:
        return self.meta.usage

    @property
    def batch_num(self) -> int | None:
        """The batch the store committed the line to (None: a line older than the field)."""
        value = self.raw["metadata"].get("batch_num")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def get(self, name: str, default: Any = None) -> Any:
        return self.raw.get(name, default)


def fields_of(record: dict) -> LineFields | None:
    """The fields of a record as plain data (what a worker sent, what the store committed)."""
    metadata = record.get("metadata") if isinstance(record, dict) else None
    key = metadata.get("row_key") if isinstance(metadata, dict) else None
    if not isinstance(key, str) or not key:
        return None
    return LineFields(record, key)


def row_key_of(record: dict) -> str | None:
    fields = fields_of(record)
    return fields.key if fields is not None else None


def stamp_batch(record: dict, model: Record, batch_num: int) -> None:
    """The batch a record is committed to, on its model and on its plain form (which the parent
    goes on reading)."""
    model.metadata.batch_num = record["metadata"]["batch_num"] = batch_num


def relocated_line(line: bytes, prompt_index: int, row_id: str, scores: list[dict] | None = None) -> bytes:
    """A committed line with the row's current position and id (the dataset was edited), and its
    latest scores when it was rescored."""
    record = orjson.loads(line)
    record["prompt_index"] = prompt_index
    record["metadata"]["id"] = row_id
    if scores is not None:
        record["metadata"]["scores"] = scores
    return orjson.dumps(record) + b"\n"


def read_line(line: bytes) -> LineFields | None:
    """The fields of one committed line, or None when it is not a record (not JSON, not an
    object, no metadata.row_key): such a line is skipped by every reader and counted."""
    try:
        raw = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return fields_of(raw) if isinstance(raw, dict) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: Any, default: int = 0) -> int:
    return int(value) if _is_number(value) else default
