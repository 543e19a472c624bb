"""A tiny decoder trained a few steps with AdamW and a schedule, saved as training
checkpoints in this process (the ``trained`` fixture)."""

import pytest
import torch

from fusion.training import TrainState, save_checkpoint
from helpers import VOCAB, build_tiny_decoder


class Trained:
    """Builds the tiny decoder, its AdamW and schedule, and trains it on random tokens drawn
    from the global RNG (so a resumed run matches only if the RNG state comes back)."""

    def build(self, seed: int = 0):
        model = build_tiny_decoder(seed=seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
        return model, optimizer, scheduler

    def step(self, model, optimizer, scheduler) -> float:
        tokens = torch.randint(0, VOCAB, (2, 8))
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def state(self, step: int, scheduler, **kwargs) -> TrainState:
        return TrainState(
            step=step,
            samples_seen=2 * step,
            epoch=0,
            losses=[1.0] * step,
            config={"lr": 1e-2, "nested": {"layers": [2, 2]}},
            world_size=1,
            parallel="none",
            scheduler=scheduler.state_dict(),
            **kwargs,
        )

    def save(self, root, step: int, model, optimizer, scheduler, keep: int = 3):
        state = self.state(step, scheduler)
        return save_checkpoint(root, model, optimizer, state, device=torch.device("cpu"), keep=keep)

    def saved(self, root, step: int = 1, seed: int = 0, keep: int = 3):
        """A model trained ``step`` steps and its checkpoint at ``root``."""
        torch.manual_seed(seed)
        model, optimizer, scheduler = self.build(seed)
        for _ in range(step):
            self.step(model, optimizer, scheduler)
        return model, optimizer, scheduler, self.save(root, step, model, optimizer, scheduler, keep)


@pytest.fixture(scope="session")
def trained() -> Trained:
    return Trained()


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (several spin against each other on a busy
    machine); the thread count is given back to the other tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
