"""The record readers: a line's metadata and usage read by field, tolerant of older lines."""

from __future__ import annotations

import orjson

from agent.usage import Spend, Usage
from runner.storage.records import read_line


def _line(metadata: dict) -> bytes:
    return orjson.dumps({"prompt_index": 0, "failed": True, "error": "x", "error_class": "agent", "prompt": "p",
                         "metadata": {"row_key": "k", **metadata}}) + b"\n"


def test_metadata_fields_read_by_name_with_defaults_for_missing_or_foreign_values():
    fields = read_line(_line({"model": "m", "attempt": 2, "seed": "not a number", "toolsets_sampled": ["web"]}))
    meta = fields.meta
    assert meta.model == "m" and meta.attempt == 2 and meta.toolsets_sampled == ["web"]
    assert meta.seed is None  # required, of another type: absent, not a crash
    assert meta.tools_offered == [] and meta.stop_reason == ""  # missing: the field's default
    assert meta.present()["seed"] == "not a number"  # what the line holds, for a reader showing it whole
    try:
        meta.no_such_field
    except AttributeError:
        pass
    else:
        raise AssertionError("an undeclared field must not read as something")


def test_usage_of_any_schema_reads_with_one_rule_for_an_unknown_cost():
    schema2 = read_line(_line({"usage": {"requests": 2, "prompt_tokens": 10, "cost": None,
                                         "by_model": {"m": {"requests": 2, "cost": None}}}})).usage
    assert schema2.known_cost is None and schema2.by_model["m"].known_cost is None and schema2.requests == 2
    schema3 = read_line(_line({"usage": {"requests": 1, "cost": 0.25, "unpriced_requests": 0,
                                         "by_model": [{"model": "m", "requests": 1, "cost": 0.25}]}})).usage
    assert schema3.known_cost == 0.25 and schema3.by_model["m"].requests == 1
    total = schema2 + schema3
    assert total.requests == 3 and total.known_cost is None and total.cost == 0.25  # a lower bound
    spend = Spend()
    spend.add(schema2)
    spend.add(schema3)
    assert spend.cost is None and spend.known_cost == 0.25 and (spend.priced, spend.unpriced) == (1, 1)
    assert Usage.read("junk") == Usage()
