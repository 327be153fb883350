"""format_duration: the unit people read, and the run records that use it."""
import math
import re

import pytest
from hypothesis import given, strategies as st

from creditrl.tools.diagnose.measure import eta_text
from creditrl.trainer.report import write_summary
from creditrl.utils.durations import format_duration

UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}


@pytest.mark.parametrize("seconds, text", [
    (0, "0.0 s"), (1.3, "1.3 s"), (59.94, "59.9 s"), (59.96, "1.0 min"), (60, "1.0 min"), (252, "4.2 min"),
    (3596, "59.9 min"), (3597, "1.0 h"), (5400, "1.5 h"), (36 * 3600, "36.0 h")])
def test_examples(seconds, text):
    assert format_duration(seconds) == text


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False))
def test_unit_is_the_largest_that_shows_at_least_one(seconds):
    value, unit = re.fullmatch(r"(\d+\.\d) (s|min|h)", format_duration(seconds)).groups()
    shown = float(value)
    # the number is the duration in that unit, to the printed digit
    assert math.isclose(shown, seconds / UNITS[unit], abs_tol=0.05 + 1e-9 * seconds / UNITS[unit])
    # never "60.0 s" or "60.0 min"; a larger unit only once the value reaches its 1.0
    assert unit == "h" or shown < 60
    assert unit == "s" or shown >= 1.0


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, -math.inf, True, "3", None])
def test_bad_input_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"seconds: expected a finite number >= 0, got"):
        format_duration(bad)


def test_short_run_summary_states_seconds(tmp_path):
    """A 1.3 s run's summary.md says 1.3 s, not "0.0 min"; summary.json keeps the seconds."""
    summary = write_summary(tmp_path, title="t", metrics=[], evals=[], wall_time=1.3)
    assert summary["wall_time_s"] == 1.3
    text = (tmp_path / "summary.md").read_text()
    assert "wall time: 1.3 s" in text and "0.0 min" not in text


def test_eta_text():
    state = {"needed": 30, "prompts": 10}
    assert eta_text(state, per_prompt=2.0, left=100.0) == "40.0 s"
    assert eta_text(state, per_prompt=6.0, left=100.0) == "2.0 min (beyond the budget)"
    assert eta_text({"needed": math.inf, "prompts": 10}, 1.0, 1.0) == "unknown (signal not resolved)"
