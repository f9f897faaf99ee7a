"""hivemind's two 8-bit codecs, fixed; `patches` registers them as the decoders of their wire types."""

import math

import numpy as np
import torch
from hivemind.compression.quantization import Quantile8BitQuantization, Quantization, Uniform8BitQuantization


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
