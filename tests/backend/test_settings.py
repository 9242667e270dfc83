"""BackendSettings: slot layout, validation, and the round trip to a worker process."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmproxy.backend.settings import BackendSettings


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
