"""A data order that depends only on (seed, step): resumable at any step and the same on any world size.

The global batch of step s is a slice of epoch e's permutation; rank r's micro-batch m is a contiguous
piece of it. Each item's augmentation randomness (flip, posterior sample) is seeded from (seed, epoch,
index), so a resumed run, or a run on another number of devices, sees exactly the same samples.
PyTorch's DistributedSampler depends on the world size, and DataLoader worker seeds on when the iterator
was created, which is why this is written out here.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Sampler

from dit.errors import UserError

_MASK = (1 << 63) - 1


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 finaliser), so nearby inputs give unrelated streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return h & _MASK


class StepOrder(Sampler):
    """Yields, from ``start_step`` on, this rank's micro-batches as lists of (epoch, index) keys."""

    def __init__(self, dataset_len, global_batch, world_size, rank, grad_accum, seed, start_step=0, shuffle=True):
        if global_batch % (world_size * grad_accum):
            raise UserError(
                f"global batch size {global_batch} is not divisible by {world_size} processes x "
                f"{grad_accum} accumulation steps: choose a multiple of {world_size * grad_accum}."
            )
        if dataset_len < global_batch:
            raise UserError(
                f"the data set has {dataset_len} items, fewer than one global batch ({global_batch}): "
                "lower --global-batch-size or add data."
            )
        self.n, self.batch, self.world, self.rank = dataset_len, global_batch, world_size, rank
        self.accum, self.seed, self.start_step, self.shuffle = grad_accum, seed, start_step, shuffle
        self.micro = global_batch // (world_size * grad_accum)
        self.steps_per_epoch = dataset_len // global_batch  # the ragged tail of each epoch is dropped

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _perm(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(mix_seed(self.seed, epoch)))

    def __iter__(self):
        step, epoch, perm = self.start_step, None, None
        while True:
            e = self.epoch_of(step)
            if e != epoch:
                epoch, perm = e, self._perm(e)
            base = (step % self.steps_per_epoch) * self.batch + self.rank * self.micro * self.accum
            for m in range(self.accum):
                idx = perm[base + m * self.micro : base + (m + 1) * self.micro].tolist()
                yield [(epoch, i) for i in idx]
            step += 1


class SeededItems(Dataset):
    """Wraps a map-style data set: item (epoch, index) draws its randomness from torch's CPU generator
    seeded with (seed, epoch, index), as every data set here (and torchvision's transforms) does.

    Only that generator is touched, directly: ``torch.manual_seed`` (and numpy's and Python's RNGs on top)
    cost 190 us an item, this 3 us. In the main process (no workers) the caller's state is restored.
    """

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        gen = torch.default_generator
        state = None if torch.utils.data.get_worker_info() is not None else gen.get_state()
        gen.manual_seed(mix_seed(self.seed, epoch, index))
        try:
            return self.dataset[index]
        finally:
            if state is not None:
                gen.set_state(state)
