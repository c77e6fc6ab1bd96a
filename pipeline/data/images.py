"""Encoded images (PNG, JPEG) decoded so that a bad one raises at once, in every stage that decodes them.

Pillow, with a limit on pixels: on a corrupted PNG (a bad scanline filter byte) torchvision's
``decode_png`` printed ``libpng error: bad adaptive filter value`` and then crashed the process with
SIGSEGV here, and hung ignoring SIGTERM in the run that found it; Pillow raises. A PNG of a few KB can
claim 30000 x 30000 pixels (a decompression bomb): its size is in the header, and an image over
``MAX_PIXELS`` is refused before any pixel is decoded.
"""

from __future__ import annotations

import io
import warnings

import numpy as np

MAX_PIXELS = 1 << 26  # 8192 x 8192: 256 MiB decoded as RGBA; no training image comes near it


class BadImage(ValueError):
    """Bytes that are not a decodable PNG/JPEG image within the pixel limit; the message says which way."""


def open_image(blob: bytes):
    """The decoded ``PIL.Image`` of ``blob``, or ``BadImage`` saying what is wrong with it."""
    from PIL import Image

    if not blob:
        raise BadImage("value of 0 bytes is empty; expected a PNG or JPEG image")
    try:
        with warnings.catch_warnings():
            # Pillow only warns up to twice its own limit; over ours nothing is decoded.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(blob))
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise BadImage(f"value of {len(blob)} bytes claims {width} x {height} pixels (a decompression bomb?); "
                               f"expected a PNG or JPEG image of at most {MAX_PIXELS:,} pixels")
            image.load()
    except BadImage:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise BadImage(f"value of {len(blob)} bytes is a decompression bomb ({exc}); expected a PNG or JPEG image "
                       f"of at most {MAX_PIXELS:,} pixels") from None
    except Exception as exc:  # Pillow raises many types for a bad file
        raise BadImage(f"value of {len(blob)} bytes is not a decodable image ({type(exc).__name__}: {exc}); "
                       f"expected a PNG or JPEG image") from None
    return image


def decode(blob: bytes) -> np.ndarray:
    """Pixels as ``np.asarray(PIL.Image.open(...))`` gives them: uint8 [H, W] or [H, W, C] for 8-bit images."""
    return np.asarray(open_image(blob))
