"""FedBR's pseudo-data by hand (session 43, mutation testing of hetfl.algorithms.pseudo_data): the plan's draws,
each client's means in plan order, the server's assembly and its refusals, word for word."""

from __future__ import annotations

import pytest
import torch

from hetfl.algorithms.pseudo_data import Slot, assemble, draw_plan, plan_means, proxy_means


def test_the_plan_draws_a_group_then_its_indices_from_one_generator():
    """Per slot one ``randint`` over the non-empty groups, then ``size`` indices into that group's samples."""
    sizes = [5, 0, 3]
    plan = draw_plan(sizes, 4, 2, torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(9)
    for slot in plan:
        group = [0, 2][int(torch.randint(0, 2, (1,), generator=gen))]
        assert slot.client == group
        assert torch.equal(slot.indices, torch.randint(0, sizes[group], (2,), generator=gen))
    assert draw_plan(sizes, 0, 2, torch.Generator()) == []


def test_a_plan_without_samples_is_refused():
    with pytest.raises(ValueError) as refused:
        draw_plan([0, 0], 3, 10, torch.Generator())
    assert str(refused.value) == "random sample means need at least one non-empty group of samples"


def test_each_client_averages_its_own_slots_in_plan_order_and_the_server_interleaves_them():
    x0 = torch.tensor([[0.0], [10.0], [20.0]])
    x1 = torch.tensor([[1.0], [3.0]])
    plan = [Slot(1, torch.tensor([0, 1])), Slot(0, torch.tensor([2, 2])), Slot(1, torch.tensor([1, 1])),
            Slot(0, torch.tensor([0, 1]))]
    m0, m1 = plan_means(plan, 0, x0), plan_means(plan, 1, x1)
    assert torch.equal(m0, torch.tensor([[20.0], [5.0]])) and torch.equal(m1, torch.tensor([[2.0], [3.0]]))
    assert torch.equal(assemble(plan, {0: m0, 1: m1}), torch.tensor([[2.0], [20.0], [3.0], [5.0]]))
    none = plan_means(plan, 2, x0)  # a client the plan gives no slot: nothing, in the data's shape
    assert none.shape == (0, 1) and none.dtype == x0.dtype


def test_assembly_refuses_counts_the_plan_does_not_give():
    plan = [Slot(0, torch.tensor([0])), Slot(1, torch.tensor([0])), Slot(1, torch.tensor([0]))]
    means = {0: torch.zeros(1, 2), 1: torch.zeros(2, 2)}
    for wrong, message in (({**means, 1: torch.zeros(1, 2)}, "client 1 sent 1 pseudo samples; the plan assigns 2"),
                           ({1: means[1]}, "client 0 sent 0 pseudo samples; the plan assigns 1"),
                           ({**means, 5: torch.zeros(1, 2)}, "client 5 sent 1 pseudo samples; the plan assigns 0")):
        with pytest.raises(ValueError) as refused:
            assemble(plan, wrong)
        assert str(refused.value) == message
    assert assemble(plan, {**means, 5: torch.zeros(0, 2)}).shape == (3, 2)  # an empty reply of an unplanned client


def test_proxy_means_transform_the_drawn_samples_before_averaging():
    x = torch.arange(6.0).view(6, 1)
    picks = [torch.randint(0, 6, (3,), generator=g) for g in [torch.Generator().manual_seed(4)] for _ in range(2)]
    means = proxy_means(x, 2, 3, torch.Generator().manual_seed(4), transform=lambda t: t * t)
    assert torch.equal(means, torch.stack([(x[p] * x[p]).mean(0) for p in picks]))


def test_a_client_of_one_sample_takes_part():
    """A group is drawn among those holding at least one sample: one sample is enough (its mean is itself)."""
    plan = draw_plan([1, 0, 2], 40, 3, torch.Generator().manual_seed(0))
    assert {slot.client for slot in plan} == {0, 2}
    assert all(slot.indices.tolist() == [0, 0, 0] for slot in plan if slot.client == 0)
    assert draw_plan([1], 2, 2, torch.Generator())[0].client == 0
