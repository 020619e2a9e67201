"""How large an image a decoder agrees to make, checked on the header before any decoding.

A header is a few bytes and may claim any size: a 2.7 kB progressive JPEG claiming
65,500 x 65,500 made the decoder allocate ~21 GB (a progressive JPEG keeps every DCT
coefficient of the full-size image, whatever scale it is decoded at). Every path checks
the full size the header claims (what the coefficient buffers and a full decode allocate,
never less than a DCT-scaled decode) against ``DecodeConfig.max_pixels``, and a JPEG's
claim against the bytes it has: a complete Huffman-coded JPEG spends at least one bit per
8x8 block of its first component (its DC scan), 512 pixels a byte; more than
``JPEG_MAX_PIXELS_PER_BYTE`` is a truncated file or a bomb.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_PIXELS", "JPEG_MAX_PIXELS_PER_BYTE", "oversize"]

# Pillow's DecompressionBombWarning threshold: ~537 MB as RGB, far above any training image.
DEFAULT_MAX_PIXELS = 178_956_970
# 8x the Huffman floor (512), which arithmetic-coded flat images could approach.
JPEG_MAX_PIXELS_PER_BYTE = 4096
# Below this (48 MB as RGB) an image is never refused for the size of its file.
_ALWAYS_ALLOWED_PIXELS = 1 << 24


def oversize(height: int, width: int, nbytes: int, *, max_pixels: int, jpeg: bool) -> str | None:
    """Why an image of ``height`` x ``width`` (from its header) encoded in ``nbytes`` is not
    decoded, or None when it may be."""
    pixels = height * width
    if pixels > max_pixels:
        return (
            f"its header claims {width}x{height} = {pixels:,} pixels, over max_pixels="
            f"{max_pixels:,} (decoding it would take ~{3 * pixels / 2**30:.1f} GiB); if the image "
            "is real, raise DecodeConfig.max_pixels, else remove the file"
        )
    if jpeg and pixels > _ALWAYS_ALLOWED_PIXELS and pixels > JPEG_MAX_PIXELS_PER_BYTE * nbytes:
        return (
            f"its header claims {width}x{height} = {pixels:,} pixels from only {nbytes:,} bytes "
            f"(over {JPEG_MAX_PIXELS_PER_BYTE} pixels a byte; a complete JPEG needs more data): "
            "a truncated file or a decompression bomb, not decoded; re-fetch or remove it"
        )
    return None
