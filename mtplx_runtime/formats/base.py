"""The codec contract: how one expert projection's weight matrix becomes bytes and back.

A projection is a 2-D float matrix `[rows, cols] = [out_features, in_features]`. A codec turns it
into named *components* (numpy arrays, each written as one safetensors tensor or one bank
segment) and decodes them back to float32. Every codec has an obviously-correct NumPy decode
(`decode`), which is the definition the fast paths are tested against.

numpy has no bfloat16: BF16 data is carried as its raw uint16 bit pattern everywhere in this
package, and the component spec says which safetensors tag ("BF16" or "U16") it is written with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

Shape2 = tuple[int, int]

# safetensors dtype tag -> numpy dtype (little-endian; BF16 as its raw uint16 bits).
ST_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E4M3": np.dtype(np.uint8),  # raw e4m3 bytes (numpy has no fp8)
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}


class FormatError(ValueError):
    """Bytes or metadata that do not follow a codec's layout."""


@dataclass(frozen=True, slots=True)
class ComponentSpec:
    """One named array of an encoded projection, in the order it is stored."""

    name: str  # e.g. "packed", "weight_scale"
    dtype: np.dtype  # numpy dtype of the array in memory (BF16 -> uint16 bits)
    shape: tuple[int, ...]
    st_dtype: str  # safetensors dtype tag: U8, U16, I32, I64, BF16, F32

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class Codec(ABC):
    """Encode/decode one projection. Subclasses are small and stateless apart from parameters."""

    name: str

    @abstractmethod
    def components(self, shape: Shape2) -> list[ComponentSpec]:
        """Component specs of a `[rows, cols]` projection, in storage order."""

    @abstractmethod
    def encode(self, weight: np.ndarray) -> dict[str, np.ndarray]:
        """float32 `[rows, cols]` -> components (keys and order as `components`)."""

    @abstractmethod
    def decode(self, parts: Mapping[str, np.ndarray], shape: Shape2) -> np.ndarray:
        """Components -> float32 `[rows, cols]`. The reference definition: slow and exact."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def projection_bytes(self, shape: Shape2) -> int:
        return sum(c.nbytes for c in self.components(shape))

    def bits_per_weight(self, shape: Shape2) -> float:
        return 8.0 * self.projection_bytes(shape) / (shape[0] * shape[1])

    def check_parts(self, parts: Mapping[str, np.ndarray], shape: Shape2) -> None:
        """Raise FormatError unless `parts` holds exactly the expected components."""
        specs = self.components(shape)
        missing = [c.name for c in specs if c.name not in parts]
        if missing:
            raise FormatError(f"{self.name}: missing components {missing}")
        for c in specs:
            a = parts[c.name]
            if a.dtype != c.dtype or tuple(a.shape) != c.shape:
                raise FormatError(
                    f"{self.name}: component {c.name} is {a.dtype}{list(a.shape)}, "
                    f"expected {np.dtype(c.dtype)}{list(c.shape)}"
                )


def check_weight(codec: str, weight: np.ndarray, group_elems: int) -> np.ndarray:
    """A 2-D finite float32 `[rows, cols]` with `cols % group_elems == 0`, or FormatError.

    The common entry check of every grouped encoder: a bad shape or NaN would otherwise turn into
    silently wrong bytes.
    """
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise FormatError(f"{codec}: weight must be 2-D [rows, cols], got shape {list(w.shape)}")
    if w.shape[1] % group_elems:
        raise FormatError(
            f"{codec}: cols={w.shape[1]} is not a multiple of the group size {group_elems}"
        )
    if not np.isfinite(w).all():
        raise FormatError(f"{codec}: weight has NaN or Inf values; the encoder needs finite inputs")
    return w


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round-to-nearest-even on the bits (no NaN special case).

    `(u + 0x7FFF + ((u >> 16) & 1)) >> 16` in 32-bit unsigned arithmetic, as the t158 reference
    encoder does (FORMAT.md, t158 scales).
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    one, sixteen = np.uint32(1), np.uint32(16)
    return ((u + np.uint32(0x7FFF) + ((u >> sixteen) & one)) >> sixteen).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exact (`u16 << 16`)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def stored_to_torch(array: np.ndarray, st_dtype: str):
    """A stored tensor (numpy, as `ST_DTYPES` holds it) as a torch tensor of its safetensors
    dtype, sharing memory: BF16 bits -> torch.bfloat16, F8_E4M3 bytes -> torch.float8_e4m3fn,
    every other tag as its numpy dtype. The one place stored bytes become torch values."""
    import torch  # torch is imported only by what computes; codecs and readers stay light

    a = np.ascontiguousarray(array)
    if st_dtype == "BF16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if st_dtype == "F8_E4M3":
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(a)
