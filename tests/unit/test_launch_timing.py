"""The async-scheduling launch deadline: as late as the predicted device time allows, never guessed."""
from splitserve.engine.launch_timing import LaunchTimer, step_shape


def test_step_shapes_group_similar_steps():
    assert step_shape(17, True) == step_shape(32, True) == (True, 32)
    assert step_shape(33, True) == (True, 64)
    assert step_shape(1, True) == (True, 1) and step_shape(1050, False) == (False, 2048)
    assert step_shape(1024, True) != step_shape(1024, False)


def test_deadline_is_the_expected_end_less_launch_time_and_margin():
    t = LaunchTimer(margin_s=0.001, smoothing=0.5)
    shape = step_shape(24, True)
    assert t.deadline(10.0, shape) is None  # nothing known: launch at once
    t.observe_device(shape, 0.008)
    assert t.deadline(10.0, shape) is None  # no launch measured yet
    t.observe_launch(0.002)
    assert abs(t.deadline(10.0, shape) - (10.0 + 0.008 - 0.002 - 0.001)) < 1e-12
    t.observe_device(shape, 0.010)  # smoothed towards the new time
    assert abs(t.deadline(10.0, shape) - (10.0 + 0.009 - 0.003)) < 1e-12
    assert t.deadline(10.0, step_shape(24, False)) is None  # another shape is its own


def test_launch_time_rises_at_once_and_decays_slowly():
    t = LaunchTimer(margin_s=0.0, smoothing=0.25)
    shape = step_shape(8, True)
    t.observe_device(shape, 0.02)
    t.observe_launch(0.001)
    t.observe_launch(0.004)
    assert abs(t.deadline(0.0, shape) - (0.02 - 0.004)) < 1e-12
    t.observe_launch(0.0)
    assert abs(t.deadline(0.0, shape) - (0.02 - 0.003)) < 1e-12


def test_short_steps_launch_at_once():
    t = LaunchTimer(min_step_s=0.003)
    shape = step_shape(2, True)
    t.observe_device(shape, 0.002)
    t.observe_launch(0.0005)
    assert t.deadline(5.0, shape) is None
