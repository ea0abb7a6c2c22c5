"""Which prompts each GRPO step trains on."""

from refiner_core.data.schedule import step_prompt_ids


def test_step_prompts_never_repeat_within_a_step_and_cover_each_epoch():
    ids = [f"p{i:02d}" for i in range(28)]
    for per_step in (1, 4, 5, 13, 28):
        steps_per_epoch = -(-28 // per_step)
        seen = []
        for step in range(3 * steps_per_epoch):
            chosen = step_prompt_ids(ids, step, per_step, seed=7)
            assert len(chosen) == per_step and len(set(chosen)) == per_step, (per_step, step, chosen)
            assert step_prompt_ids(ids, step, per_step, seed=7) == chosen  # a pure function of the step
            seen.append(chosen)
        first_epoch = {p for chosen in seen[:steps_per_epoch] for p in chosen}
        assert first_epoch == set(ids)
    assert step_prompt_ids(ids, 0, 4, seed=7) != step_prompt_ids(ids, 0, 4, seed=8)
