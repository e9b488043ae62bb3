"""Draws Ferrite's icons (a ferrite toroid with a copper winding) as PNGs into assets/icons,
and the macOS app icon (icon.icns: the same drawing at 16 to 512 pixels), with the standard
library only. Run once; the files are committed.

    python3 scripts/make-icons.py
"""

import math
import struct
import zlib
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "assets" / "icons"


def png_bytes(size, pixel):
    rows = b"".join(b"\0" + b"".join(bytes(pixel(x, y, size)) for x in range(size)) for y in range(size))
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0))
    return data + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def png(path, size, pixel):
    path.write_bytes(png_bytes(size, pixel))


# The icns element types that hold a PNG, by pixel size (16x16 to 512x512).
ICNS_TYPES = {16: b"icp4", 32: b"icp5", 64: b"icp6", 128: b"ic07", 256: b"ic08", 512: b"ic09"}


def icns(path, pixel):
    """Apple's icon container: a header, then one (type, length, PNG) element per size."""
    elements = b"".join(kind + struct.pack(">I", 8 + len(data)) + data
                        for kind, data in ((kind, png_bytes(size, pixel)) for size, kind in ICNS_TYPES.items()))
    path.write_bytes(b"icns" + struct.pack(">I", 8 + len(elements)) + elements)


def coverage(x, y, size, inside):
    """Fraction of a pixel inside a shape, 4x4 supersampled (smooth edges)."""
    hits = sum(inside((x + (i + 0.5) / 4) / size - 0.5, (y + (j + 0.5) / 4) / size - 0.5) for i in range(4) for j in range(4))
    return hits / 16


def ring(u, v):
    return 0.19 <= math.hypot(u, v) <= 0.44


def winding(u, v):
    # Copper turns on the ring's right-hand side.
    a = math.atan2(v, u)
    return ring(u, v) and abs(a) < 0.9 and math.sin(a * 14) > -0.2


def app_icon(x, y, size):
    c_ring, c_copper = (58, 63, 71), (200, 116, 44)
    w = coverage(x, y, size, winding)
    r = coverage(x, y, size, ring)
    if r == 0:
        return (0, 0, 0, 0)
    col = [round(c_copper[i] * w / r + c_ring[i] * (1 - w / r)) for i in range(3)]
    return (*col, round(255 * r))


def tray_icon(x, y, size):
    # Black with alpha: a template image on macOS, tinted by the menu bar.
    return (0, 0, 0, round(255 * coverage(x, y, size, ring)))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for size in (32, 128, 256):
        png(OUT / (f"{size}x{size}.png" if size != 256 else "icon.png"), size, app_icon)
    png(OUT / "tray.png", 32, tray_icon)
    icns(OUT / "icon.icns", app_icon)
    print("wrote", ", ".join(sorted(p.name for p in OUT.glob("icon.*")) + sorted(p.name for p in OUT.glob("*x*.png"))))
