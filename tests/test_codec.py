import numpy as np
import pytest
import torch

from shardps.core import codec
from shardps.core.errors import InvalidArgument
from shardps.v1 import shardps_pb2 as pb


def test_roundtrip_float32_and_int64_zero_copy():
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    t = codec.encode(x)
    assert t.dtype == pb.FLOAT32 and list(t.shape) == [5, 3] and len(t.data) == 60
    np.testing.assert_array_equal(codec.decode(t, "x"), x)
    ids = np.array([1, -2, 2**62], dtype=np.int64)
    back = codec.decode(codec.encode(ids), "ids")
    np.testing.assert_array_equal(back, ids)
    assert not back.flags.writeable  # a view on the message bytes, not a copy


def test_float16_matches_torch():
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 100
    got = codec.decode(codec.encode(x, pb.FLOAT16), "x")
    np.testing.assert_array_equal(got, torch.from_numpy(x).half().float().numpy())


def test_bfloat16_rounding_matches_torch():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 1e3, [0.0, -0.0, 1e-40, np.inf, -np.inf]]).astype(np.float32)
    got = codec.decode(codec.encode(x, pb.BFLOAT16), "x")
    want = torch.from_numpy(x).bfloat16().float().numpy()
    np.testing.assert_array_equal(got, want)
    assert np.isnan(codec.decode(codec.encode(np.array([np.nan], np.float32), pb.BFLOAT16), "x")).all()


def test_size_mismatch_and_missing_dtype_are_named():
    t = codec.encode(np.zeros((2, 2), np.float32))
    t.shape[:] = [3, 2]
    with pytest.raises(InvalidArgument, match="grads: 16 bytes do not match shape"):
        codec.decode(t, "grads")
    with pytest.raises(InvalidArgument, match="ids: unsupported or missing dtype"):
        codec.decode(pb.Tensor(shape=[1], data=b"12345678"), "ids")
