"""The preallocated KV cache holds exactly what a DynamicCache would, without copying on every pass."""

import torch
from transformers import DynamicCache

from backbones.kv_cache import PreallocatedLayer, preallocated_cache


def test_appends_and_crops_like_a_dynamic_cache():
    preallocated, dynamic = preallocated_cache(num_layers=2, capacity=10), DynamicCache()
    for step, length in enumerate((3, 1, 2)):
        keys, values = torch.randn(2, 4, length, 8), torch.randn(2, 4, length, 8)
        for layer in range(2):
            got, expected = preallocated.update(keys, values, layer), dynamic.update(keys, values, layer)
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), step
    preallocated.crop(-2)
    dynamic.crop(-2)
    assert preallocated.get_seq_length() == dynamic.get_seq_length() == 4
    keys = torch.randn(2, 4, 1, 8)
    assert torch.equal(preallocated.update(keys, keys, 0)[0], dynamic.update(keys, keys, 0)[0])


def test_writes_in_place_and_refuses_to_overflow():
    layer = PreallocatedLayer(capacity=4)
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    buffer = layer._key_buffer
    layer.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    assert layer._key_buffer is buffer and layer.keys.data_ptr() == buffer.data_ptr()  # no new allocation
    try:
        layer.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    except ValueError as error:
        assert "holds 4 positions" in str(error)
    else:
        raise AssertionError("overflow was not refused")
