"""Tensors through Flower's records (hetfl.flower.codec): every dtype both ways, what a record weighs, and the
digest of a client's samples that a node sends with its replies. (The round trip of every dtype, NaN payloads
and alignment included: tests/flower/test_flower.py::test_tensors_round_trip_bit_exact_in_every_dtype.)"""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason='Flower is not installed: pip install "hetfl[flower]"')

from flwr.app import Array, ArrayRecord

from hetfl.flower import codec
from hetfl.privacy import release_digest


def test_a_numpy_dtype_travels_as_a_standard_npy_array_flower_can_read():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3).t()  # not contiguous
    a = codec.encode_tensor(t)
    assert (a.dtype, a.shape, a.stype) == ("int16", (3, 2), "numpy.ndarray")
    assert np.array_equal(np.load(io.BytesIO(a.data), allow_pickle=False), t.numpy())
    assert np.array_equal(a.numpy(), t.numpy())  # Flower's own reader


def test_a_dtype_numpy_lacks_travels_as_its_raw_bytes_named_by_torch():
    t = torch.tensor([[1.0, -2.5, 3.0], [0.5, 0.0, -0.0]], dtype=torch.bfloat16)
    a = codec.encode_tensor(t)
    assert (a.dtype, a.shape, a.stype) == ("torch.bfloat16", (2, 3), "hetfl.torch")
    assert a.data == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    back = codec.decode_tensor(a)
    assert back.dtype == torch.bfloat16 and back.shape == (2, 3)
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_a_tensor_that_requires_grad_is_sent_as_its_values():
    t = torch.tensor([1.0, 2.0], requires_grad=True)
    back = codec.decode_tensor(codec.encode_tensor(t * 3))
    assert torch.equal(back, torch.tensor([3.0, 6.0])) and not back.requires_grad


def test_decoded_tensors_are_writable_copies_on_the_device_asked_for():
    a = codec.encode_tensor(torch.ones(3))
    back = codec.decode_tensor(a, device="meta")
    assert back.device.type == "meta" and back.shape == (3,)
    cpu = codec.decode_tensor(a)
    cpu += 1  # np.load's array is read-only: a copy
    assert torch.equal(codec.decode_tensor(a), torch.ones(3))
    raw = codec.decode_tensor(codec.encode_tensor(torch.ones(2, dtype=torch.bfloat16)), device="meta")
    assert raw.device.type == "meta" and raw.dtype == torch.bfloat16


def test_an_array_of_another_serialisation_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^array of unknown serialisation 'pickle'$"):
        codec.decode_tensor(Array(dtype="float32", shape=(1,), stype="pickle", data=b"\0\0\0\0"))


def test_records_keep_names_and_an_absent_record_is_empty():
    tensors = {"w": torch.randn(2, 2), "step": torch.tensor(3), "h": torch.ones(1, dtype=torch.bfloat16)}
    record = codec.to_record(tensors)
    assert isinstance(record, ArrayRecord) and list(record) == ["w", "step", "h"]
    back = codec.from_record(record, device="meta")
    assert list(back) == ["w", "step", "h"] and all(t.device.type == "meta" for t in back.values())
    assert codec.from_record(None) == {}


def test_a_records_weight_is_the_bytes_of_its_arrays_data():
    first = codec.to_record({"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.bfloat16)})
    second = codec.to_record({"c": torch.zeros(2, dtype=torch.int64)})
    npy = len(first["a"].data)
    assert npy > 40  # the .npy header travels too
    assert codec.record_nbytes([first, second]) == npy + 6 + len(second["c"].data)
    assert codec.record_nbytes([]) == 0


def fake_data(train_x, train_y, test_x, test_y, client: int = 1):
    """A stand-in for FederatedData with one client's splits at index ``client``."""
    splits = {client: (train_x, train_y)}
    tests = {client: SimpleNamespace(x=test_x, y=test_y)}
    return SimpleNamespace(client_train_split=splits.__getitem__, client_tests=tests)


def test_a_clients_data_digest_covers_its_train_and_test_samples_and_labels():
    parts = [torch.arange(12.0).reshape(3, 4), torch.tensor([0, 1, 1]), torch.ones(2, 4), torch.tensor([1, 0])]
    digest = codec.client_data_digest(fake_data(*parts), 1)
    named = list(zip(("train.x", "train.y", "test.x", "test.y"), parts, strict=True))
    assert digest == release_digest(named)[:32] and len(digest) == 32
    for i in range(4):  # any part changed: another digest
        changed = [p.clone() for p in parts]
        changed[i].view(-1)[0] += 1
        assert codec.client_data_digest(fake_data(*changed), 1) != digest, i
    swapped = [parts[2], parts[3], parts[0], parts[1]]  # train and test exchanged: another digest
    assert codec.client_data_digest(fake_data(*swapped), 1) != digest


def test_an_array_holding_pickled_objects_is_refused_not_unpickled():
    """A node's reply is read by the server: a ``.npy`` of Python objects would run the sender's pickle there."""

    class Payload:
        def __reduce__(self):
            return (print, ("unpickled on the server",))

    buffer = io.BytesIO()
    np.save(buffer, np.array([Payload()], dtype=object), allow_pickle=True)
    a = Array(dtype="object", shape=(1,), stype="numpy.ndarray", data=buffer.getvalue())
    with pytest.raises(ValueError, match="allow_pickle=False"):
        codec.decode_tensor(a)
