"""Counter-based Gaussian noise: element ``i`` of a tensor's noise is a pure function of
(seed, tensor name, i), so any shard of any layout regenerates exactly its own slice.

The generator: a 32-bit key pair from (seed, name) (CRC-32 of the name, mixed with the seed), then
three rounds of MurmurHash3's 32-bit finaliser over (key, counter low word, counter high word, lane)
give two 32-bit words per element; each word becomes a uniform in (0, 1) and Box-Muller (in
float64) makes one standard normal. All integer arithmetic stays inside int64 without overflow
(32-bit products are split into 16-bit halves), so the values are the same on every device and
every tensor shape. reference/perturbation.py writes the same generator again in plain PyTorch.
"""

from __future__ import annotations

import math
import zlib

import torch

_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``(a * c) mod 2**32`` for uint32 values held in int64, without int64 overflow."""
    lo = (a & 0xFFFF) * c
    hi = (((a >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection of uint32), elementwise."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _fmix_int(x: int) -> int:
    """``_fmix32`` of one Python int (the same function, without tensor overhead)."""
    h = x & _M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def tensor_key(seed: int, name: str) -> tuple[int, int]:
    """The two 32-bit words that key the noise of tensor ``name`` under ``seed`` (a non-negative int)."""
    if seed < 0:
        raise ValueError(f"noise seed must be >= 0, got {seed}")
    c = zlib.crc32(name.encode())
    k0 = _fmix_int(c ^ _fmix_int(seed & _M32))
    k1 = _fmix_int(zlib.crc32(name.encode(), 0x9E3779B9) ^ _fmix_int((seed >> 32) ^ 0x7F4A7C15))
    return k0, k1


def _words(k0: torch.Tensor, k1: torch.Tensor, counters: torch.Tensor, lane: int) -> torch.Tensor:
    h = _fmix32((counters & _M32) ^ k0)
    h = _fmix32(h ^ (counters >> 32) ^ k1)
    return _fmix32(h ^ (0x632BE5AB * (lane + 1) & _M32))


def gaussian(k0: torch.Tensor | int, k1: torch.Tensor | int, counters: torch.Tensor) -> torch.Tensor:
    """Standard normals [like counters] (float32) for element indices ``counters`` (int64 >= 0) of
    the tensors keyed ``(k0, k1)`` (ints, or int64 tensors broadcastable to ``counters``)."""
    k0 = torch.as_tensor(k0, dtype=torch.int64, device=counters.device)
    k1 = torch.as_tensor(k1, dtype=torch.int64, device=counters.device)
    u1 = (_words(k0, k1, counters, 0).double() + 0.5) * 2.0**-32
    u2 = (_words(k0, k1, counters, 1).double() + 0.5) * 2.0**-32
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)).float()
