"""Bucket packing for weight sync: exact round trips and size bounds."""

from __future__ import annotations

import pytest
import torch

from raylign.rollout.buckets import ALIGN_BYTES, BufferPool, group_into_buckets, pack_bucket, unpack_bucket
from raylign.rollout.weight_sync import with_tied_lm_head


def _named_tensors():
    generator = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(10, 8, generator=generator)),  # 320 bytes
        ("model.layers.0.input_layernorm.weight", torch.randn(8, generator=generator).to(torch.bfloat16)),  # 16
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(3, generator=generator).to(torch.bfloat16)),  # 6 -> 16
        ("model.layers.0.mlp.up_proj.weight", torch.randn(5, 7, generator=generator)),  # 140 -> 144
        ("scalar", torch.tensor(2.5)),  # 0-dim, 4 -> 16
        ("lm_head.weight", torch.randn(10, 8, generator=generator).T),  # not contiguous
    ]


def test_pack_unpack_round_trips_names_dtypes_shapes_and_values_exactly():
    named = _named_tensors()
    bucket = pack_bucket(named)
    unpacked = unpack_bucket(bucket)
    assert [name for name, _ in unpacked] == [name for name, _ in named]
    for (name, original), (_, restored) in zip(named, unpacked):
        assert restored.dtype == original.dtype, name
        assert restored.shape == original.shape, name
        assert torch.equal(restored, original), name
    assert bucket.buffer.dtype == torch.uint8 and bucket.buffer.dim() == 1


def test_packed_offsets_are_aligned_and_buffer_is_the_aligned_sum():
    bucket = pack_bucket(_named_tensors())
    assert [m.offset for m in bucket.metas] == [0, 320, 336, 352, 496, 512]
    assert all(m.offset % ALIGN_BYTES == 0 for m in bucket.metas)
    assert bucket.buffer.numel() == 512 + 320


def test_every_bucket_packed_without_a_pool_gets_a_new_buffer():
    named = _named_tensors()
    first, second = pack_bucket(named[:2]), pack_bucket(named[:2])
    assert first.buffer.data_ptr() != second.buffer.data_ptr()


def test_a_pool_hands_a_buffer_out_again_only_when_no_tensor_refers_to_it():
    pool = BufferPool(keep=3)
    first = pool.take(100)
    assert first.numel() == 100 and first.dtype == torch.uint8 and pool.allocated == 1
    second = pool.take(50)  # the first is still referred to: new memory
    assert pool.allocated == 2 and second.data_ptr() != first.data_ptr()
    address = first.data_ptr()
    view_of_a_view = first[8:40].view(torch.int16)[2:6]  # what a model loader might keep
    del first
    third = pool.take(80)  # the first buffer is still referred to, through the view
    assert pool.allocated == 3 and third.data_ptr() != address
    del view_of_a_view
    fourth = pool.take(80)  # now nothing refers to it: it is handed out again
    assert pool.allocated == 3 and fourth.data_ptr() == address and fourth.numel() == 80


def test_a_pool_keeps_at_most_keep_buffers_and_new_ones_are_as_large_as_the_largest_asked():
    pool = BufferPool(keep=2)
    held = [pool.take(64), pool.take(32), pool.take(16)]  # three in use at once; the third is not kept
    assert [t.untyped_storage().nbytes() for t in held] == [64, 64, 64]
    addresses = {t.data_ptr() for t in held[:2]}
    held.clear()
    again = [pool.take(64), pool.take(64)]
    assert {t.data_ptr() for t in again} == addresses and pool.allocated == 3


def test_packing_into_a_pool_round_trips_and_reuses_the_buffer():
    named, pool = _named_tensors(), BufferPool()
    first = pack_bucket(named, pool)
    address = first.buffer.data_ptr()
    del first
    second = pack_bucket(named, pool)
    assert second.buffer.data_ptr() == address and pool.allocated == 1
    assert all(torch.equal(got, tensor) for (_, got), (_, tensor) in zip(unpack_bucket(second), named))


def test_buckets_respect_the_bound_and_a_large_tensor_goes_alone():
    sizes_in_floats = [16, 16, 16, 100, 8, 8, 8]  # 64, 64, 64, 400, 32, 32, 32 bytes
    named = [(f"w{i}", torch.zeros(n)) for i, n in enumerate(sizes_in_floats)]
    groups = list(group_into_buckets(iter(named), bucket_bytes=160))
    assert [[name for name, _ in g] for g in groups] == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5", "w6"]]
    for group in groups:
        nbytes = sum(t.numel() * 4 for _, t in group)
        assert nbytes <= 160 or len(group) == 1


def test_grouping_rejects_a_non_tensor_naming_it():
    with pytest.raises(TypeError, match="'w1'"):
        list(group_into_buckets([("w0", torch.zeros(1)), ("w1", [1.0])], 1024))


def test_tied_models_get_the_embedding_as_lm_head_and_no_other_head():
    embed, stale_head, norm = torch.ones(2), torch.zeros(2), torch.full((2,), 3.0)
    stream = [("model.embed_tokens.weight", embed), ("model.norm.weight", norm), ("lm_head.weight", stale_head)]
    out = list(with_tied_lm_head(iter(stream), tie_word_embeddings=True))
    assert [name for name, _ in out] == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    assert out[1][1] is embed


def test_untied_models_pass_through_unchanged():
    stream = [("model.embed_tokens.weight", torch.ones(2)), ("lm_head.weight", torch.zeros(2))]
    assert list(with_tied_lm_head(iter(stream), tie_word_embeddings=False)) == stream
