import numpy as np
import pytest

from prime_rl.orchestrator.state import OrchestratorState, load_state, save_state


def test_state_roundtrip_restores_rng_stream(tmp_path):
    rng = np.random.default_rng(7)
    rng.integers(0, 100, size=13)  # advance: the data position
    state = OrchestratorState.capture(step=4, tasks_drawn=13, rng=rng, seed=7)
    save_state(state, tmp_path / "step_4" / "orchestrator")
    expected = rng.integers(0, 1000, size=5)
    loaded = load_state(tmp_path / "step_4" / "orchestrator")
    assert loaded.step == 4 and loaded.tasks_drawn == 13
    np.testing.assert_array_equal(loaded.restore_rng().integers(0, 1000, size=5), expected)


def test_missing_state_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="resume_step"):
        load_state(tmp_path)
