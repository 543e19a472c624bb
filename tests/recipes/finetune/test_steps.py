"""The data plan: epochs visit every sample once, steps hold whole samples within the token
budget, and a step splits over processes and micro-batches into balanced groups."""

from hypothesis import given, settings
from hypothesis import strategies as st

from fusion.training.steps import plan_steps, split_step

lengths_st = st.lists(st.integers(1, 50), min_size=1, max_size=40)


@settings(max_examples=30)
@given(lengths=lengths_st, budget=st.integers(50, 200), epochs=st.integers(1, 3))
def test_epochs_visit_every_sample_once_within_the_budget(lengths, budget, epochs):
    plan = plan_steps(lengths, batch_tokens=budget, seed=1, epochs=epochs, steps=0)
    for epoch in range(epochs):
        seen = [i for step in plan if step.epoch == epoch for i in step.samples]
        assert sorted(seen) == list(range(len(lengths)))
    for step in plan:
        assert step.samples and sum(lengths[i] for i in step.samples) <= budget
    again = plan_steps(lengths, batch_tokens=budget, seed=1, epochs=epochs, steps=0)
    assert again == plan
    # --steps N takes the first N steps of the same order, epochs repeating as needed.
    longer = plan_steps(lengths, batch_tokens=budget, seed=1, epochs=1, steps=len(plan) + 3)
    assert longer[: len(plan)] == plan and len(longer) == len(plan) + 3


def test_the_order_depends_on_the_seed_and_epoch():
    lengths = [1] * 20
    first = plan_steps(lengths, batch_tokens=20, seed=0, epochs=2, steps=0)
    other = plan_steps(lengths, batch_tokens=20, seed=1, epochs=2, steps=0)
    assert first[0].samples != first[1].samples and first[0].samples != other[0].samples


@settings(max_examples=30)
@given(lengths=lengths_st, parts=st.integers(1, 6))
def test_split_is_a_balanced_partition(lengths, parts):
    samples = list(range(len(lengths)))[::-1]
    groups = split_step(samples, lengths, parts)
    assert len(groups) == parts
    assert sorted(i for g in groups for i in g) == sorted(samples)
    for group in groups:  # each keeps the step's order
        assert group == [i for i in samples if i in group]
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(lengths)
