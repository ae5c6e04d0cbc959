"""A few seeds of the process-level chaos run (tests/chaos.py): SIGKILL of the training process or
of the bridge process at a random step, of the bridge process while it starts, a tracker SDK that
crashes at its import; real MLflow and TensorBoard, then replay."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import AT_THE_START, run_once


@pytest.mark.parametrize("seed", [2, 5, 7])  # 2 kills the training process, 5 and 7 the bridge
def test_sigkill_at_a_random_step_then_replay_loses_nothing(seed: int, tmp_path: Path) -> None:
    result = run_once(seed, tmp_path)
    assert result["logged"] > 0
    assert result["mlflow_missing"] == 0, result
    assert result["mlflow_duplicated"] == 0, result
    assert result["mlflow_wrong"] == 0, result
    assert result["tensorboard_missing"] == 0, result
    if result["victim"] == "training":  # the bridge process ends the run as failed on its own
        assert result["mlflow_status"] == "FAILED", result
    else:  # training finished (exit code 0) without its bridge: the spool's end record, via replay
        assert result["mlflow_status"] == "FINISHED", result


@pytest.mark.parametrize("victim", AT_THE_START)  # issue 19, item 1
def test_the_bridge_process_lost_while_it_starts_then_replay_loses_nothing(victim: str, tmp_path: Path) -> None:
    result = run_once(0, tmp_path, victim)
    assert result["logged"] == 60  # training went on, every step in the file
    assert result["mlflow_missing"] == 0, result
    assert result["mlflow_duplicated"] == 0, result
    assert result["mlflow_wrong"] == 0, result
    assert result["tensorboard_missing"] == 0, result
    assert result["mlflow_status"] == "FINISHED", result  # replay made the run, ended as training ended
