"""The run's plan line counts in the run's one unit of steps (each world's steps as taken), and after a resume on
another number of ranks says which steps were whose and where the run ends, as the progress lines, the step
metrics and the heartbeats count."""

from pipeline.train.epoch import plan_line


def test_a_fresh_run_and_a_resume_on_the_same_ranks():
    assert plan_line(steps_per_epoch=234, epochs=2, total_steps=468, world_size=2, resumed=None) == (
        "234 steps/epoch x 2 epochs = 468 steps")
    resumed = {"step": 300, "epoch": 1, "in_epoch": 66, "world_size": 2}
    assert plan_line(steps_per_epoch=234, epochs=2, total_steps=468, world_size=2, resumed=resumed) == (
        "234 steps/epoch x 2 epochs = 468 steps; resumed from step 300 (epoch 2), 168 to go")


def test_a_resume_on_fewer_ranks_states_the_offset_and_the_end_in_the_same_unit():
    # 42 steps of 2 ranks are 84 of 1 rank's 468 per epoch: 384 to go, the run ends at step 426, not 468.
    resumed = {"step": 42, "epoch": 0, "in_epoch": 84, "world_size": 2}
    line = plan_line(steps_per_epoch=468, epochs=1, total_steps=426, world_size=1, resumed=resumed)
    assert line == ("468 steps/epoch x 1 epochs on 1 rank(s); resumed from step 42, steps taken by 2 rank(s) (epoch 1, "
                    "at this world's step 84 of it): 384 steps of 1 rank(s) to go, so the run ends at step 426")
    assert "= 426" not in line  # no product of this world's steps/epoch that the total is not
