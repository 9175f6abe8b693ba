"""Arrays to and from the wire ``Tensor`` message (raw little-endian bytes)."""

from __future__ import annotations

import math

import numpy as np

from shardps.core import kernels
from shardps.core.errors import InvalidArgument
from shardps.v1 import shardps_pb2 as pb

# numpy has no bfloat16: it travels as uint16 holding the upper half of a float32.
NP_DTYPES: dict[int, np.dtype] = {
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT16: np.dtype("<f2"),
    pb.BFLOAT16: np.dtype("<u2"),
    pb.INT64: np.dtype("<i8"),
}
DTYPE_NAMES: dict[int, str] = {pb.FLOAT32: "float32", pb.FLOAT16: "float16", pb.BFLOAT16: "bfloat16", pb.INT64: "int64"}
WIRE_FLOAT_DTYPES = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16)
MAX_NDIM = 32  # numpy allows 64; no message of this protocol needs more than 2


def dtype_name(dtype: int) -> str:
    """The name of a wire dtype, or its number when unknown."""
    return DTYPE_NAMES.get(dtype, str(dtype))


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), returned as uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = np.isnan(x)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(
        np.uint16
    )
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen uint16 bfloat16 bit patterns to float32."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def wire_elements(array: np.ndarray, dtype: int) -> np.ndarray:
    """``array`` as the C-contiguous elements of wire ``dtype`` (bfloat16: rounded uint16 bit patterns)."""
    if dtype == pb.BFLOAT16:
        return float32_to_bfloat16_bits(array)
    return np.ascontiguousarray(array, dtype=NP_DTYPES[dtype])


def encode(array: np.ndarray, dtype: int = pb.DTYPE_UNSPECIFIED) -> pb.Tensor:
    """Encode ``array`` as a Tensor, converting float data to ``dtype`` if given."""
    array = np.asarray(array)
    if dtype == pb.DTYPE_UNSPECIFIED:
        dtype = pb.INT64 if array.dtype.kind in "iu" else pb.FLOAT32
    return pb.Tensor(dtype=dtype, shape=list(array.shape), data=wire_elements(array, dtype).tobytes())


def decode(t: pb.Tensor, what: str, as_float32: bool = True) -> np.ndarray:
    """Decode a Tensor to numpy (a zero-copy read-only view where possible).

    Float payloads are widened to float32 when ``as_float32``; errors name ``what``.
    """
    return decode_raw(t.dtype, list(t.shape), t.data, what, as_float32)


def decode_raw(dtype: int, shape: list, data: bytes | memoryview, what: str, as_float32: bool = True) -> np.ndarray:
    """Decode (dtype, shape, raw bytes) to numpy, a view of ``data`` where possible."""
    np_dtype = NP_DTYPES.get(dtype)
    if np_dtype is None:
        raise InvalidArgument(f"{what}: unsupported or missing dtype {dtype}")
    if len(shape) > MAX_NDIM:
        raise InvalidArgument(f"{what}: {len(shape)} dimensions, more than {MAX_NDIM}")
    shape_t = tuple(map(int, shape))
    count = 1  # exact (Python ints): a product that overflows int64 must not wrap to a match
    for s in shape_t:
        if s < 0:
            raise InvalidArgument(f"{what}: negative dimension in shape {list(shape_t)}")
        count *= s
    # numpy refuses such shapes even when empty
    if (count or math.prod(s for s in shape_t if s)) * np_dtype.itemsize >= 1 << 62:
        raise InvalidArgument(f"{what}: shape {list(shape_t)} is too large")
    nbytes = len(data) if not isinstance(data, memoryview) else data.nbytes
    if count * np_dtype.itemsize != nbytes:
        raise InvalidArgument(
            f"{what}: {nbytes} bytes do not match shape {list(shape_t)} of {DTYPE_NAMES[dtype]}"
        )
    arr = np.frombuffer(data, dtype=np_dtype).reshape(shape_t)
    if as_float32 and dtype == pb.BFLOAT16:
        return bfloat16_bits_to_float32(arr)
    if as_float32 and dtype == pb.FLOAT16:
        return arr.astype(np.float32)
    return arr


def all_finite(values: np.ndarray) -> bool:
    """Whether ``values`` hold no NaN and no infinity: the compiled kernel for float32 rows (one pass, no temporary
    array), else numpy (``np.isfinite(values).all()``, the reference)."""
    k = kernels.jit() if values.dtype == np.float32 and values.ndim == 2 else None
    if k is not None:
        return bool(k.all_finite(values))
    return bool(np.isfinite(values).all())
