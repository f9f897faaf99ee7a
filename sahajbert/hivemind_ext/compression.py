"""hivemind's two 8-bit codecs, fixed, and a codec of sparse parts (`SparseParts`); `patches` registers them as the
decoders of their wire types."""

import math

import numpy as np
import torch
from hivemind.compression.base import CompressionBase
from hivemind.compression.quantization import Quantile8BitQuantization, Quantization, Uniform8BitQuantization
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2


class _FixedExtract(Quantization):
    """hivemind 1.1.12's 8-bit decoders read their codebook size with `int()` of a one-element numpy array, which
    numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"): every 8-bit part a peer received failed to
    decode, and its all-reduce went on without it. The same layout, read with `[0]`."""

    def extract(self, serialized_tensor) -> torch.Tensor:
        """hivemind 1.1.12's Quantization.extract (hivemind/compression/quantization.py), reading the size with [0]."""
        buffer = serialized_tensor.buffer
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.from_numpy(quantized.astype(np.int64)).reshape(tuple(serialized_tensor.size))
        codebook = torch.from_numpy(codebook.copy()).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


class Uniform8Bit(_FixedExtract, Uniform8BitQuantization):
    """hivemind's uniform 8-bit codec (256 buckets over +-3 sigma around the mean, each decoded as the mean of the
    values in it), same wire format. Encoded without `torch.quantize_per_tensor`, which torch deprecates, and with
    each bucket's mean taken over the values themselves: hivemind's, when allowed to work in place, averaged the
    centered values and decoded them without the mean."""

    def quantize(self, tensor: torch.Tensor, allow_inplace: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Replaces hivemind 1.1.12's Uniform8BitQuantization.quantize (hivemind/compression/quantization.py): the
        same buckets and codebook layout, computed as the class docstring says."""
        assert torch.is_floating_point(tensor)
        values = tensor.detach().to(torch.float32).flatten()
        centered = values - values.mean()
        sigma = centered.norm() / math.sqrt(max(1, centered.numel() - 1))
        scale = max(float(self.RANGE_IN_SIGMAS * sigma / self.n_bins), torch.finfo(torch.float32).tiny)
        buckets = torch.clamp(torch.round(centered / scale) + self.n_bins // 2, 0, self.n_bins - 1).to(torch.uint8)
        sums = torch.zeros(self.n_bins).scatter_add_(0, buckets.long(), values)
        counts = torch.bincount(buckets.long(), minlength=self.n_bins).clamp_min(1)
        return buckets.numpy().astype(self.indices_dtype), (sums / counts).numpy().astype(self.codebook_dtype)


class Quantile8Bit(_FixedExtract, Quantile8BitQuantization):
    pass


# the wire type of `SparseParts`: not one of hivemind's CompressionType values (proto3 enums carry any number);
# `patches` teaches the all-reduce's serialize and deserialize it
SPARSE_WIRE_TYPE = 64
SPARSE_CHUNK = 4096  # values per codebook: each chunk's distinct non-zero values are listed once
PART_RATIO = 1 / 16  # the compression ratio hivemind sizes the parts by (`SparseParts.estimate_compression_ratio`)
# the most values a part may declare: a receiver allocates its part before it checks its shape
MOST_PART_VALUES = 2**22
_DENSE, _SPARSE = 0, 1  # layouts
_HEADER = 6  # int64 values: layout, chunk, non-zeros, bits, gap bytes, chunks with non-zeros


class SparseParts(CompressionBase):
    """A mostly-zero tensor part on the wire: the positions of its non-zeros as gaps, one byte each (a gap of 255 or
    more as that many 255s, then the rest), and each non-zero as a `bits`-bit index into its chunk's list of distinct
    values (fp16). A pseudo-gradient sparsified to a few values per chunk (SparseLoCo: top-k, 2-bit) and rounded to
    fp16 travels exactly, in about 1.25 bytes per non-zero; an averaged part sent back (a handful of sums per chunk)
    in about 2. A part with a chunk of over 256 distinct values goes as fp16, dense.

    `density`: the share of non-zeros expected, which hivemind sizes the parts by (`estimate_compression_ratio`)."""

    compression_type = SPARSE_WIRE_TYPE

    def __init__(self, density: float = 1 / 64):
        self.density = density

    def estimate_compression_ratio(self, info) -> float:
        # hivemind cuts each tensor into parts of 2^19 bytes / (4 x this) values: 2^21 values, whatever the density
        # (peers that cut differently cannot average: their parts' shapes differ), which stay under the stream bound
        # even when they arrive dense (fp16: 4 MiB)
        return PART_RATIO

    def compress(self, tensor: torch.Tensor, info=None, allow_inplace: bool = False):
        values = tensor.detach().to(torch.float16).flatten().numpy()
        buffer = _encode_sparse(values)
        return runtime_pb2.Tensor(
            compression=SPARSE_WIRE_TYPE,
            buffer=buffer,
            size=tensor.shape,
            dtype="float32",
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        values = _decode_sparse(serialized_tensor.buffer, math.prod(shape))
        return torch.from_numpy(values.astype(np.float32)).reshape(shape)


def _encode_sparse(values: np.ndarray) -> bytes:
    positions = np.flatnonzero(values)
    chunks = positions // SPARSE_CHUNK
    nonzero = values[positions]
    # each chunk's distinct values, sorted (NaN last, each its own); a non-zero's code is its rank among them
    order = np.lexsort((nonzero.astype(np.float32), chunks))
    sorted_values, sorted_chunks = nonzero[order], chunks[order]
    new = np.ones(len(order), dtype=bool)
    if len(order):
        new[1:] = (sorted_chunks[1:] != sorted_chunks[:-1]) | ~(sorted_values[1:] == sorted_values[:-1])
    distinct = np.cumsum(new) - 1  # index of each sorted non-zero's value in the codebook
    codebook = sorted_values[new]
    book_chunks, first = np.unique(sorted_chunks[new], return_index=True)
    counts = np.diff(np.append(first, len(codebook)))
    if len(counts) and counts.max() > 256:
        header = np.array([_DENSE, SPARSE_CHUNK, len(values), 16, 0, 0], dtype=np.int64)
        return header.tobytes() + values.astype(np.float16).tobytes()
    codes = np.empty(len(order), dtype=np.int64)
    codes[order] = distinct - first[np.searchsorted(book_chunks, sorted_chunks)]
    bits = max(1, int(np.ceil(np.log2(max(2, int(counts.max()) if len(counts) else 2)))))
    gaps = np.diff(positions, prepend=-1)
    lengths = gaps // 255 + 1
    gap_bytes = np.full(int(lengths.sum()), 255, dtype=np.uint8)
    gap_bytes[np.cumsum(lengths) - 1] = gaps % 255
    packed = np.packbits(((codes[:, None] >> np.arange(bits)) & 1).astype(np.uint8), axis=None, bitorder="little")
    header = np.array([_SPARSE, SPARSE_CHUNK, len(positions), bits, len(gap_bytes), len(counts)], dtype=np.int64)
    return b"".join(
        (
            header.tobytes(),
            gap_bytes.tobytes(),
            (counts - 1).astype(np.uint8).tobytes(),
            codebook.astype(np.float16).tobytes(),
            packed.tobytes(),
        )
    )


def _decode_sparse(buffer: bytes, size: int) -> np.ndarray:
    """The values of a part of `size` values; ValueError, before anything of its size is allocated, for a buffer that
    does not hold one (any sender may write anything there)."""
    if not 0 <= size <= MOST_PART_VALUES or len(buffer) < _HEADER * 8:
        raise ValueError(f"a sparse part of {size} values, in {len(buffer)} bytes, is not one this peer sends")
    layout, chunk, count, bits, gap_length, chunk_count = (
        int(v) for v in np.frombuffer(buffer, dtype=np.int64, count=_HEADER)
    )
    offset = _HEADER * 8
    if layout == _DENSE:
        if len(buffer) - offset < 2 * size:
            raise ValueError("a dense part's buffer is shorter than its values")
        return np.frombuffer(buffer, dtype=np.float16, offset=offset, count=size).copy()
    room = len(buffer) - offset  # bytes after the header
    if (
        layout != _SPARSE
        or chunk != SPARSE_CHUNK
        or not 0 <= count <= size
        or not 1 <= bits <= 8
        or not 0 <= chunk_count <= count
        or not count <= gap_length <= room
        or room - gap_length < chunk_count + count * bits / 8
    ):
        raise ValueError("a sparse part's header does not fit its buffer")
    gap_bytes = np.frombuffer(buffer, dtype=np.uint8, offset=offset, count=gap_length)
    offset += int(gap_length)
    counts = np.frombuffer(buffer, dtype=np.uint8, offset=offset, count=chunk_count).astype(np.int64) + 1
    offset += int(chunk_count)
    if len(buffer) - offset < 2 * int(counts.sum()) + count * bits / 8:
        raise ValueError("a sparse part's codebooks do not fit its buffer")
    codebook = np.frombuffer(buffer, dtype=np.float16, offset=offset, count=int(counts.sum()))
    offset += codebook.nbytes
    packed = np.frombuffer(buffer, dtype=np.uint8, offset=offset)
    bit_values = np.unpackbits(packed, count=count * bits, bitorder="little").reshape(count, bits)
    codes = bit_values.astype(np.int64) @ (1 << np.arange(bits, dtype=np.int64))
    # the sum of a gap's bytes is the gap, so each position is the running sum at its last byte, less one
    positions = np.cumsum(gap_bytes, dtype=np.int64)[gap_bytes < 255] - 1
    if len(positions) != count or (count and (positions[-1] >= size or positions.min() < 0)):
        raise ValueError(f"a sparse part's positions do not fit its {size} values")
    chunks = positions // chunk
    book_chunks = np.unique(chunks)
    if len(book_chunks) != chunk_count:
        raise ValueError("a sparse part's codebooks do not match its chunks")
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    at = starts[np.searchsorted(book_chunks, chunks)] + codes
    if count and (codes >= counts[np.searchsorted(book_chunks, chunks)]).any():
        raise ValueError("a sparse part's code is outside its chunk's codebook")
    values = np.zeros(size, dtype=np.float16)
    values[positions] = codebook[at]
    return values


def serialize_tensor_part(tensor, compression_type=None, info=None, allow_inplace: bool = False, **kwargs):
    """hivemind's `serialize_torch_tensor`, which the all-reduce sends each averaged part back with (in the sender's
    wire type), also for `SparseParts`."""
    if compression_type == SPARSE_WIRE_TYPE:
        return SparseParts().compress(tensor, info, allow_inplace)
    if compression_type is None:
        return serialize_torch_tensor(tensor, info=info, allow_inplace=allow_inplace, **kwargs)
    return serialize_torch_tensor(tensor, compression_type, info, allow_inplace, **kwargs)


def deserialize_tensor_part(serialized_tensor) -> torch.Tensor:
    """hivemind's `deserialize_torch_tensor`, which the all-reduce reads each part and each average with, also for
    `SparseParts`."""
    if serialized_tensor.compression == SPARSE_WIRE_TYPE:
        return SparseParts().extract(serialized_tensor).requires_grad_(serialized_tensor.requires_grad)
    return deserialize_torch_tensor(serialized_tensor)
