"""Federated data on the training device.

The whole dataset is moved to the device once; each client is a list of
indices into it. Batches are gathered by index, converted to float and
augmented as one batched tensor operation on the device (DESIGN.md property 4:
no DataLoader workers, nothing re-read from disk).

Partitions that transform client data (rotation, concept shift) are applied
here, once: every training sample belongs to exactly one client, so one
transformed copy of the training tensors serves all clients; each client's
personal test split is materialised with its client's transform.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hetfl.algorithms.base import Batch
from hetfl.data.augment import augment_params, crop_starts, gather_crops, pixel_grid, rotate, to_float
from hetfl.data.base import Dataset
from hetfl.data.partition import Partition
from hetfl.params import ConfigError

# share of a CUDA device's free memory that normalised float copies of the training images may take
PREPARED_SHARE = 0.25


@dataclass
class ClientTest:
    x: torch.Tensor  # raw inputs (uint8 images or float features) on the device
    y: torch.Tensor


class FederatedData:
    """A dataset split over clients, held on ``device``."""

    def __init__(self, dataset: Dataset, partition: Partition, device: torch.device, augment: str,
                 prepared: bool | None = None) -> None:
        """``prepared``: gather training batches from normalised floats made once (:meth:`_batch_source`);
        None: where a CUDA device has room for them."""
        self.info = dataset.info
        self.device = device
        self.partition = partition
        self.num_clients = partition.num_clients
        self.augment = self._resolve_augment(augment)
        self.padding = max(1, self.info.input_shape[-1] // 8) if self.info.is_image else 0
        train_x, train_y = dataset.train.x, dataset.train.y  # copied below only if labels are permuted
        test_x, test_y = dataset.test.x, dataset.test.y
        self.client_train = [torch.as_tensor(np.asarray(i), dtype=torch.long) for i in partition.train]
        if partition.rotation is not None:
            train_x = train_x.clone()
            for idx, angle in zip(self.client_train, partition.rotation, strict=True):
                if angle and len(idx):
                    train_x[idx] = rotate(train_x[idx], float(angle))
        if partition.label_perm is not None:
            train_y = train_y.clone()
            for idx, perm in zip(self.client_train, partition.label_perm, strict=True):
                train_y[idx] = torch.as_tensor(np.asarray(perm), dtype=torch.long)[train_y[idx]]
        self.train_x, self.train_y = train_x.to(device), train_y.to(device)
        # the per-channel normalisation on the device, made once (a step then copies nothing from the host)
        self._mean, self._std = (None if v is None else torch.as_tensor(v, dtype=torch.float32).to(device)
                                 for v in (self.info.mean, self.info.std))
        self._batch_source(prepared)
        self._grid = pixel_grid(*self.info.input_shape, device) if self.augment != "none" else None
        # index lists on the CPU too: a step's batch indices of all its clients are assembled
        # there and moved to the device in one copy (not one small copy per client)
        self.client_train_cpu = self.client_train
        self.client_train = [idx.to(device) for idx in self.client_train]
        self.transformed = partition.rotation is not None or partition.label_perm is not None
        if self.transformed:  # the global test set is the union of the transformed client tests
            self.client_tests = [self._client_test(test_x, test_y, c) for c in range(self.num_clients)]
            self.test_x = torch.cat([t.x for t in self.client_tests])
            self.test_y = torch.cat([t.y for t in self.client_tests])
        else:
            self.test_x, self.test_y = test_x.to(device), test_y.to(device)
            self.client_tests = [self._client_view(np.asarray(i)) for i in partition.test]
        self.client_sizes = [len(idx) for idx in self.client_train]
        self.client_test_idx = [torch.as_tensor(np.asarray(i), dtype=torch.long) for i in partition.test]
        self._test_segments: tuple[torch.Tensor, torch.Tensor, np.ndarray] | None = None

    def _batch_source(self, prepared: bool | None) -> None:
        """What training batches are gathered from (``_source``; ``_interior``: its unpadded images).

        With random crops, the training images zero-padded once (``train_x`` is then the view of their
        interior, not a second copy), so that a batch's crops and flips are one gather
        (:func:`~hetfl.data.augment.gather_crops`). ``prepared`` (by default where a CUDA device has room:
        :data:`PREPARED_SHARE` of its free memory): uint8 images normalised to floats once, the padding
        too (a zero pixel, as the per-batch normalisation sees it), so that a batch is its gather alone,
        without the four kernels of the normalisation. The values are the same either way: the
        normalisation is elementwise, the same kernels on each pixel whatever batch it is in."""
        raw = self.train_x
        p = self.padding if self.augment == "crop_flip" else 0
        if prepared is None:
            prepared = raw.dtype == torch.uint8 and self._room_for(raw, p)
        self._prepared = prepared and raw.dtype == torch.uint8
        padded = F.pad(raw, (p, p, p, p)) if p else raw
        self._source = self.prepare(padded) if self._prepared else padded
        self._interior = self._source[..., p:-p, p:-p] if p else self._source
        if p and not self._prepared:
            self.train_x = self._interior  # the padded images' interior: the raw images, not a second copy

    def _room_for(self, raw: torch.Tensor, padding: int) -> bool:
        """Whether normalised float copies of ``raw``'s images, padded by ``padding``, fit in
        :data:`PREPARED_SHARE` of the device's free memory (CUDA; never on a CPU, whose steps are not
        bound by kernel launches)."""
        if self.device.type != "cuda" or raw.dim() != 4:
            return False
        n, c, h, w = raw.shape
        free, _ = torch.cuda.mem_get_info(self.device)
        return 4 * n * c * (h + 2 * padding) * (w + 2 * padding) <= PREPARED_SHARE * free

    def _resolve_augment(self, augment: str) -> str:
        if augment != "auto":
            if augment != "none" and not self.info.is_image:
                raise ConfigError("data.augment", augment, f"needs image data; {self.info.name} has feature vectors")
            return augment
        shape = self.info.input_shape
        rgb = self.info.is_image and shape[0] == 3 and 32 <= shape[-1] <= 96
        return "crop_flip" if rgb else "none"

    def _client_view(self, idx: np.ndarray) -> ClientTest:
        """An untransformed client's test split from the global test set on the device: a view when its
        indices are one ascending run (natural groups: a device's test samples are stored together),
        else a gathered copy; the same values either way, without holding the test set twice."""
        if len(idx) and idx[-1] - idx[0] + 1 == len(idx) and (idx[1:] - idx[:-1] == 1).all():
            a, b = int(idx[0]), int(idx[-1]) + 1
            return ClientTest(self.test_x[a:b], self.test_y[a:b])
        index = torch.as_tensor(idx, dtype=torch.long).to(self.device)
        return ClientTest(self.test_x[index], self.test_y[index])

    def client_test_accuracies(self, correct: torch.Tensor) -> dict[int, float]:
        """Each client's accuracy on its own test split (clients with one), from ``correct``, the global
        model's per-sample correctness on the untransformed global test set: per-client counts by one
        ``index_add_`` over all clients' indices instead of one indexing and ``.item()`` per client.

        The same floats as ``correct[idx].float().mean().item()`` per client: ``torch.mean`` of a float32
        tensor is its sum divided by the count on a CPU (``mean_out``: ``sum(...).div_(n)``) and the sum
        times ``float32(1 / n)`` on CUDA (``MeanOps`` with ``factor = 1 / numel``); sums of 0/1 below
        2^24 are exact, so each is reproduced by one float32 division or multiplication."""
        if self._test_segments is None:
            sizes = np.array([len(i) for i in self.client_test_idx], dtype=np.int64)
            flat = torch.cat(self.client_test_idx) if self.client_test_idx else torch.zeros(0, dtype=torch.long)
            owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.from_numpy(sizes))
            self._test_segments = (flat.to(self.device), owner.to(self.device), sizes)
        flat, owner, sizes = self._test_segments
        counts = torch.zeros(len(sizes), dtype=torch.int64, device=correct.device)
        counts.index_add_(0, owner, correct[flat].long())
        held = np.flatnonzero(sizes)
        n = torch.from_numpy(sizes[held].astype(np.float32)).to(correct.device)
        hits = counts[torch.from_numpy(held).to(correct.device)].float()
        acc = hits / n if correct.device.type == "cpu" else hits * (1 / n)
        return dict(zip(held.tolist(), acc.tolist(), strict=True))

    def _client_test(self, test_x: torch.Tensor, test_y: torch.Tensor, client: int) -> ClientTest:
        idx = torch.as_tensor(np.asarray(self.partition.test[client]), dtype=torch.long)
        x, y = test_x[idx], test_y[idx]
        if self.partition.rotation is not None and self.partition.rotation[client]:
            x = rotate(x, float(self.partition.rotation[client]))
        if self.partition.label_perm is not None:
            y = torch.as_tensor(np.asarray(self.partition.label_perm[client]), dtype=torch.long)[y]
        return ClientTest(x.to(self.device), y.to(self.device))

    # ------------------------------------------------------------------ inputs
    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Raw inputs -> model inputs (uint8 images become normalised floats)."""
        if x.dtype == torch.uint8:
            return to_float(x, self._mean, self._std)  # device tensors: no copy from the host in a step
        return x

    def augment_draws(self, n: int, generator: torch.Generator) -> torch.Tensor | None:
        """The augmentation of ``n`` samples, drawn on the CPU from ``generator``: ``[3, n]`` int64 rows
        (where each crop starts in the padded image, and which way its columns run:
        :func:`~hetfl.data.augment.crop_starts`), or None without augmentation. The draws (and their
        order) are those of :func:`augment_params`."""
        if self.augment == "none":
            return None
        dx, dy, flips = augment_params(n, self.padding, True, generator)
        if self.augment != "crop_flip":  # "flip": the offsets are drawn (same stream) but not used
            dx, dy = torch.zeros_like(dx), torch.zeros_like(dy)
        return crop_starts(dx, dy, flips, self.info.input_shape[-1])

    def stage_augment(self, sizes: Sequence[int], generator: torch.Generator) -> torch.Tensor | None:
        """The augmentation parameters of a stage's batches of ``sizes`` samples, in order: ``[3, samples]``,
        one :meth:`augment_draws` for all of the stage's samples (batch ``j`` takes the next ``sizes[j]``
        columns), or None without augmentation. Both executors draw a stage's augmentation this way, so a
        batch is augmented alike whether it is drawn just before its stage or with the whole round's
        plan; one draw per stage rather than per batch keeps the plan of a round of thousands of batches
        (CCVR's 10 epochs: 7,860) to milliseconds."""
        if not sizes:
            return None
        return self.augment_draws(sum(sizes), generator)

    def batch_at(self, idx: torch.Tensor, augment: torch.Tensor | None) -> Batch:
        """The model inputs and labels of the training samples ``idx`` (global indices on the device, of any
        shape ``S``: inputs ``[*S, ...]``, labels ``[*S]``), augmented with ``augment`` (``[3, *S]`` on the
        device, from :meth:`augment_draws`): device operations only, no host synchronisation. Augmented
        images are cropped and flipped in the gather itself; from prepared images (:meth:`_batch_source`) the
        gather is the whole batch."""
        x = self._interior[idx] if augment is None else gather_crops(self._source, idx, augment,
                                                                     self._grid)  # type: ignore[arg-type]
        return Batch(x if self._prepared else self.prepare(x), self.train_y[idx])

    def global_indices(self, client: int, local_idx: torch.Tensor) -> torch.Tensor:
        """Client ``client``'s samples ``local_idx`` (into its own list) as indices into the training set (CPU)."""
        return self.client_train_cpu[client][local_idx.cpu()]

    def train_batches(
        self,
        client: int,
        schedule: list[torch.Tensor],
        augment_gen: torch.Generator,
    ) -> Iterator[Batch]:
        """The client's batches for ``schedule`` (a stage's indices into its own samples), augmented with
        draws from ``augment_gen`` (:meth:`stage_augment`, the vectorised executor's draws too); one
        copy to the device per batch."""
        every = self.stage_augment([b.shape[0] for b in schedule], augment_gen)
        augments = [None] * len(schedule) if every is None else every.split([b.shape[0] for b in schedule], dim=1)
        for local_idx, augment in zip(schedule, augments, strict=True):
            idx = self.global_indices(client, local_idx)
            if augment is None:
                yield self.batch_at(idx.to(self.device, non_blocking=True), None)
                continue
            on_device = torch.cat([idx.view(1, -1), augment]).to(self.device, non_blocking=True)
            yield self.batch_at(on_device[0], on_device[1:])

    def client_train_split(self, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.client_train[client]
        return self.train_x[idx], self.train_y[idx]
