"""A resumed run's data plan checked against its checkpoint's data position."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from fusion.training import TrainingError, check_plan_position, plan_position
from fusion.training.steps import plan_steps

LENGTHS = [3, 5, 2, 4, 6, 1]


def test_the_position_after_each_step():
    plan = plan_steps(LENGTHS, batch_tokens=8, seed=1, epochs=2, steps=0)
    assert plan_position(plan, 0) == (0, 0)
    for step in range(1, len(plan) + 1):
        seen = sum(len(s.samples) for s in plan[:step])
        epoch = plan[step].epoch if step < len(plan) else 2  # after the last: the next epoch
        assert plan_position(plan, step) == (seen, epoch)
    assert plan_position(plan, len(plan))[0] == 2 * len(LENGTHS)


def test_a_checkpoint_off_the_plan_is_refused():
    plan = plan_steps(LENGTHS, batch_tokens=8, seed=1, epochs=2, steps=0)
    path = Path("run/checkpoints/step_00000002")

    def state(step: int, seen: int, epoch: int) -> SimpleNamespace:  # a TrainState's position
        return SimpleNamespace(step=step, samples_seen=seen, epoch=epoch)

    check_plan_position(path, state(2, *plan_position(plan, 2)), plan)  # type: ignore[arg-type]
    seen, epoch = plan_position(plan, 2)
    for bad in (state(2, seen + 1, epoch), state(2, seen, epoch + 1), state(len(plan) + 1, 12, 2)):
        with pytest.raises(TrainingError, match=r"^--resume: run/checkpoints/step_00000002 is at"):
            check_plan_position(path, bad, plan)  # type: ignore[arg-type]
    with pytest.raises(
        TrainingError,
        match=rf"is at step 2 \(samples {seen + 1}, epoch {epoch}\), which the run's data plan "
        rf"of {len(plan)} steps does not have \(expected samples {seen}, epoch {epoch}\): was "
        r"--train-data changed\?$",
    ):
        check_plan_position(path, state(2, seen + 1, epoch), plan, flag="--train-data")  # type: ignore[arg-type]
