"""Whether a JPEG that lacks its end marker still holds every scan a complete file needs.

libjpeg decodes a file whose data ran out as if its end marker had been there, and warns
only when a scan stops mid-way. A progressive (or multi-scan) JPEG cut exactly between two
scans therefore decodes without a word, blurred or without colour: the scans that carried
the rest were never read. Walking the markers tells such a file from one that lacks only
its end-of-image marker: a complete progressive file refines every coefficient of every
component down to its last bit (Al = 0), and a complete sequential one has a scan for every
component. Both decode paths (the native transform and simplejpeg/Pillow) ask this module
first, so they accept and refuse the same files.
"""

from __future__ import annotations

__all__ = ["missing_scans"]

_SOI, _EOI, _SOS = 0xD8, 0xD9, 0xDA
# Frame headers: SOF0-SOF15 less DHT (C4), JPG (C8) and DAC (CC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}  # RSTn and TEM carry no length


def missing_scans(data: bytes | memoryview) -> str | None:
    """None when ``data`` ends with its end marker or holds every scan a complete image
    needs; else what is missing, in words. Only the marker structure is read; whether the
    last scan's own data is whole is libjpeg's to say (it warns when a scan stops early)."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    n = len(view)
    if n >= 2 and view[n - 2] == 0xFF and view[n - 1] == _EOI:
        return None
    raw = bytes(view)
    components: list[int] = []
    progressive = False
    # Per component: the successive-approximation bit each coefficient is known down to.
    known: dict[int, list[int]] = {}
    seen: set[int] = set()
    pos = 2
    while pos + 1 < n:
        if raw[pos] != 0xFF:
            return f"unexpected byte 0x{raw[pos]:02x} at offset {pos} where a marker belongs"
        marker = raw[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker == _EOI:
            return None
        if marker in _STANDALONE or marker == _SOI:
            pos += 2
            continue
        if pos + 4 > n:
            break
        length = int.from_bytes(raw[pos + 2 : pos + 4], "big")
        end = pos + 2 + length
        if length < 2 or end > n:
            break  # the file stops inside a header
        segment = raw[pos + 4 : end]
        if marker in _SOF and len(segment) >= 6:
            progressive = marker in _PROGRESSIVE
            count = segment[5]
            components = [segment[6 + 3 * k] for k in range(count) if 6 + 3 * k < len(segment)]
            known = {c: [64] * 64 for c in components}  # 64: never coded
        elif marker == _SOS and len(segment) >= 1:
            count = segment[0]
            ids = [segment[1 + 2 * k] for k in range(count) if 1 + 2 * k < len(segment)]
            tail = 1 + 2 * count
            if tail + 3 > len(segment):
                return "a scan header is cut short"
            ss, se, al = segment[tail], segment[tail + 1], segment[tail + 2] & 0x0F
            for c in ids:
                seen.add(c)
                bits = known.get(c)
                if bits is not None:
                    for k in range(ss, min(se, 63) + 1):
                        bits[k] = min(bits[k], al)
            pos = _after_entropy_data(raw, end)
            continue
        pos = end
    if not components:
        return "the file stops before its frame header"
    if progressive:
        short = [c for c in components if any(b != 0 for b in known[c])]
        if short:
            return (
                f"the file stops after scan data for only part of the image (component(s) "
                f"{short} not refined to the last bit): later scans are missing"
            )
        return None
    unseen = [c for c in components if c not in seen]
    if unseen:
        return f"the file stops before the scans of component(s) {unseen}"
    return None


def _after_entropy_data(raw: bytes, pos: int) -> int:
    """The offset of the marker that ends the entropy-coded data starting at ``pos`` (its
    0xFF bytes are followed by 0x00 stuffing or an RSTn marker), or len(raw)."""
    n = len(raw)
    while True:
        j = raw.find(b"\xff", pos)
        if j < 0 or j + 1 >= n:
            return n
        following = raw[j + 1]
        if following == 0x00 or 0xD0 <= following <= 0xD7 or following == 0xFF:
            pos = j + 1 if following == 0xFF else j + 2
            continue
        return j
