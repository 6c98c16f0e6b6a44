"""cadence.py: a save that waited for the one in flight is measured, said once, and counted."""

from __future__ import annotations

from finetune.checkpoint.cadence import BEHIND_S, Cadence


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_only_a_save_that_waited_for_the_one_in_flight_is_behind():
    clock = Clock()
    cadence = Cadence(clock)
    assert cadence.started(5, clock.now, in_flight=False) is None  # the first save
    clock.now += 1.0
    since = clock.now
    clock.now += 3.0  # waited 3 s for step 5's writes
    assert cadence.started(10, since, in_flight=False) is None  # nothing was in flight
    since = clock.now + 1.0
    clock.now = since + BEHIND_S / 2
    assert cadence.started(15, since, in_flight=True) is None  # the commit's own collectives


def test_a_save_behind_says_the_writer_time_the_interval_and_the_save_steps_that_keep_up():
    clock = Clock()
    cadence = Cadence(clock)
    cadence.started(5, clock.now, in_flight=False)
    since = clock.now + 1.0  # 5 steps of 0.2 s
    clock.now = since + 2.0  # then 2 s waiting: step 5's writes took 3 s
    behind = cadence.started(10, since, in_flight=True)
    assert (behind.waited, behind.writer_s, behind.interval_s, behind.steps) == (2.0, 3.0, 1.0, 5)
    assert behind.save_steps() == 15  # 3 s of writes / 0.2 s a step
    message = behind.message()
    for text in ("step 10 waited 2.0 s", "step 5's writes", "took 3.0 s", "every 1.0 s (5 steps)"):
        assert text in message, message
    assert "raise --save_steps to 15 or more" in message
    assert behind.event() == {
        "waited_s": 2.0,
        "previous_step": 5,
        "writer_s": 3.0,
        "interval_s": 1.0,
    }
    assert cadence.first() and not cadence.first()


def test_a_writer_only_just_too_slow_suggests_one_step_more():
    clock = Clock()
    cadence = Cadence(clock)
    cadence.started(1, clock.now, in_flight=False)
    since = clock.now + 1.0
    clock.now = since + 0.6
    assert cadence.started(2, since, in_flight=True).save_steps() == 2
