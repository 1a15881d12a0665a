"""Row identity, dataset validation and the configuration fingerprint."""

from __future__ import annotations

from runner.input.config import RunConfig, diff_fingerprints
from runner.input.dataset import iter_rows, scan_dataset
from tests.conftest import write_jsonl
from tools.settings import ToolSettings


def test_row_keys_distinguish_duplicates_and_survive_reordering(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}, {"prompt": "y"}, {"prompt": "x"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "y"}, {"prompt": "x"}, {"prompt": "new"}, {"prompt": "x"}])
    keys_a = [r.key for r in iter_rows(a)]
    keys_b = [r.key for r in iter_rows(b)]
    assert len(set(keys_a)) == 3
    assert set(keys_a) <= set(keys_b)  # reordered and extended: every old row keeps its identity
    assert keys_a[0] != keys_a[2] and keys_a[0].rsplit("-", 1)[0] == keys_a[2].rsplit("-", 1)[0]


def test_content_change_changes_identity(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}, {"prompt": "x", "image": "img:1"}, {"prompt": "x", "cwd": "/w"}])
    keys = [r.key for r in iter_rows(a)]
    assert len(set(keys)) == 3 and all(k.endswith("-0") for k in keys)


def test_image_wins_over_docker_image_and_id_is_kept_as_text(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x", "image": "a:1", "docker_image": "b:1", "id": 7}])
    (row,) = iter_rows(path)
    assert row.image == "a:1" and row.id == "7"
    assert scan_dataset(path).images == {"a:1"}


def test_max_samples_counts_valid_rows(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ['{"prompt": "a"}', "oops", '{"prompt": "b"}', '{"prompt": "c"}'])
    scan = scan_dataset(path, max_samples=2)
    assert scan.rows == 2 and scan.errors == [(2, scan.errors[0][1])]
    assert [r.prompt for r in iter_rows(path, 2)] == ["a", "b"]


def _config(**kw) -> RunConfig:
    return RunConfig(dataset_file="d", run_name="r", batch_size=1, **{"seed": 7, **kw})


def test_fingerprint_changes_with_output_affecting_options_only():
    base = _config()
    assert base.fingerprint() == _config(num_workers=64, verbose=True).fingerprint()
    changed = _config(model="other", max_turns=3)
    assert changed.fingerprint() != base.fingerprint()
    assert diff_fingerprints(base.fingerprint_fields(), changed.fingerprint_fields()) == ["max_turns", "model"]


def test_public_config_has_no_secret():
    config = _config(api_key="sk-secret", tools=ToolSettings(brave_api_key="sk-brave"))
    assert "sk-secret" not in str(config.public_dict()) and "sk-brave" not in str(config.public_dict())
    # The model endpoint's key lives on the RunConfig only: the tools reach the model through ctx.model.
    assert "api_key" not in ToolSettings.model_fields and "base_url" not in ToolSettings.model_fields


def test_a_validated_configuration_is_frozen_and_settles_what_other_options_decide():
    import pytest
    from pydantic import ValidationError

    config = RunConfig(dataset_file="d", run_name="r", batch_size=1, model="mock", base_url="http://x/v1")
    with pytest.raises(ValidationError, match="frozen"):
        config.max_turns = 3
    with pytest.raises(ValidationError, match="frozen"):
        config.tools.terminal_env = "docker"
    assert config.base_url is None and config.tools.run_name == "r" and config.tools.model == "mock"
    assert config.seed_drawn and 0 <= config.seed < 2**31
    chosen = RunConfig(dataset_file="d", run_name="r", batch_size=1, seed=5)
    assert chosen.seed == 5 and not chosen.seed_drawn
