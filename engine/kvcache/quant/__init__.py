"""Shared math for the compressed KV caches: seeded rotations, Lloyd-Max scalar codebooks, bit packing.

Everything here is vectorised over all leading axes (batch, heads, tokens) and acts on the last axis
(head_dim); arithmetic is float32.
"""

from engine.kvcache.quant.bitpack import MLX_AFFINE_BITS, PACKABLE_BITS, pack_bits, packed_length, unpack_bits
from engine.kvcache.quant.codebooks import (
    DISTRIBUTIONS,
    MAX_CODEBOOK_BITS,
    decode_scalar,
    encode_scalar,
    lloyd_max_codebook,
    lloyd_max_distortion,
)
from engine.kvcache.quant.rotation import (
    Rotation,
    hadamard_supported,
    make_rotation,
    random_orthogonal,
    random_signs,
)

__all__ = [
    "DISTRIBUTIONS",
    "MAX_CODEBOOK_BITS",
    "MLX_AFFINE_BITS",
    "PACKABLE_BITS",
    "Rotation",
    "decode_scalar",
    "encode_scalar",
    "hadamard_supported",
    "lloyd_max_codebook",
    "lloyd_max_distortion",
    "make_rotation",
    "pack_bits",
    "packed_length",
    "random_orthogonal",
    "random_signs",
    "unpack_bits",
]
