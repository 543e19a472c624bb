"""The recipes' shared optimizer and learning-rate schedule, and the fixed-size batches'
sample order."""

import math

import pytest
import torch

from fusion.training import EpochSampler, adamw_warmup_cosine, lr_factor, warmup_cosine
from fusion.training.steps import epoch_order


def test_warmup_then_cosine_to_zero():
    assert [lr_factor(s, 4, 12) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 4, 12) == 1.0
    assert lr_factor(8, 4, 12) == pytest.approx(0.5)
    assert lr_factor(12, 4, 12) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(20, 4, 12) == pytest.approx(0.0, abs=1e-12)  # past the end: stays at 0
    assert lr_factor(0, 0, 1) == 1.0 and lr_factor(3, 0, 3) == pytest.approx(0.0, abs=1e-12)


def test_the_scheduler_state_holds_no_function():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = warmup_cosine(optimizer, 2, 10)
    assert scheduler.state_dict()["lr_lambdas"] == [None]  # what checkpoints store and compare
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.1 * lr_factor(s, 2, 10) for s in range(10)])
    assert math.isclose(lrs[1], 0.1)


def test_fixed_size_batches_read_the_token_budget_plans_epoch_order():
    sampler = EpochSampler(10, seed=3)
    assert sampler.indices(10, 10).tolist() == epoch_order(10, seed=3, epoch=1)
    assert sampler.indices(0, 4).dtype == torch.long


def test_the_recipes_optimizer_is_adamw_on_the_schedule():
    parameters = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    optimizer, scheduler = adamw_warmup_cosine(
        parameters, lr=0.5, weight_decay=0.1, warmup=2, total=6
    )
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert group["params"] == parameters and group["betas"] == (0.9, 0.95)
    assert group["fused"] is True  # on the CPU: torch's fused kernel
    assert group["weight_decay"] == 0.1 and group["initial_lr"] == 0.5
    lrs = []
    for _ in range(6):
        lrs.append(group["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.5 * lr_factor(s, 2, 6) for s in range(6)])


def test_parameters_without_a_fused_kernel_get_torch_s_default():
    """A model built on the meta device (to check a checkpoint before materialising it) still
    gets its optimizer; the step kernel is torch's default there."""
    meta = [torch.nn.Parameter(torch.zeros(2, device="meta"))]
    optimizer, _ = adamw_warmup_cosine(iter(meta), lr=0.1, weight_decay=0.0, warmup=1, total=2)
    assert optimizer.param_groups[0]["params"] == meta
    assert optimizer.param_groups[0]["fused"] is None
