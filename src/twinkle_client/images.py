"""A row's images as the native API sends them: each image part of its ``messages`` (a local
path, bytes, a PIL image, a data URL) as a base64 data URL of the file's bytes, in the order the
chat template renders them, so the server's image processor sees the file the local template
would. Nothing is fetched: a remote URL is refused here, as the local template refuses it.

>>> image_data_url(b'\\x89PNG\\r\\n\\x1a\\n...', 'row 0, message 0, part 0')[:30]
'data:image/png;base64,iVBORw0K'
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Mapping
from pathlib import Path

from twinkle.data_format.images import ACCEPTED_IMAGES, message_images
from twinkle.errors import DataError

#: The leading bytes of the image files a data URL names by type.
_MAGIC = {
    b'\x89PNG\r\n\x1a\n': 'png',
    b'\xff\xd8\xff': 'jpeg',
    b'GIF8': 'gif',
    b'BM': 'bmp',
    b'RIFF': 'webp',
}


def sent_images(index: int, row: Mapping[str, object]) -> list[str] | None:
    """What row ``index`` sends as its ``images``: a row encoded by ``VisionTemplate`` (it has
    ``pixel_values``) its messages' images, a row the server answered (a sampled sequence's
    ``new_input_feature``) its ``images`` as they came; None for a row without images."""
    if row.get('pixel_values') is not None:
        return row_images(index, row)
    images = row.get('images')
    if isinstance(images, list) and images and all(isinstance(i, str) and i.startswith('data:') for i in images):
        return list(images)
    return None


def row_images(index: int, row: Mapping[str, object]) -> list[str]:
    """The images of encoded row ``index`` (it has ``pixel_values``), from its ``messages``, as data URLs."""
    messages = row.get('messages')
    found = message_images(messages) if isinstance(messages, list) else []
    if not found:
        raise DataError(
            f'row {index} has pixel_values but no messages with its images: the native client sends the image '
            "files, not pixels; keep the row's messages beside its encoding (Dataset.encode keeps them, "
            "or add them: {**template.encode(row), 'messages': row['messages']})"
        )
    return [image_data_url(value, f'row {index}, {where}') for where, value in found]


def image_data_url(value: object, where: str) -> str:
    """``value`` (a path, ``file://`` URL, data URL, bytes, ``{'bytes'|'path': ...}`` or PIL image)
    as a base64 data URL of its file's bytes; ``where`` names it in errors."""
    if isinstance(value, Mapping) and ('bytes' in value or 'path' in value):  # a datasets.Image value
        value = value.get('bytes') or value.get('path')
    if isinstance(value, str) and value[:5].lower() == 'data:':
        if ';base64,' not in value.partition(',')[0] + ',':
            raise DataError(f'{where}: a data URL must be base64 (data:image/png;base64,...)')
        return value
    data = _file_bytes(value, where)
    kind = next((name for magic, name in _MAGIC.items() if data.startswith(magic)), 'unknown')
    return f'data:image/{kind};base64,{base64.b64encode(data).decode("ascii")}'


def _file_bytes(value: object, where: str) -> bytes:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str | os.PathLike):
        text = str(value)
        if text[:8].lower().startswith(('http://', 'https://')):
            raise DataError(
                f'{where}: remote image {text[:80]!r} refused: download it first; accepted: {ACCEPTED_IMAGES}'
            )
        path = Path(text[len('file://') :] if text.lower().startswith('file://') else text)
        if not path.is_file():
            raise DataError(f'{where}: image file {str(path)!r} does not exist; accepted: {ACCEPTED_IMAGES}')
        return path.read_bytes()
    if type(value).__module__.startswith('PIL.'):  # a PIL.Image, saved losslessly
        buffer = io.BytesIO()
        value.save(buffer, format='PNG')  # type: ignore[attr-defined]  # a PIL.Image, read without importing PIL
        return buffer.getvalue()
    raise DataError(f'{where}: an image of type {type(value).__name__} is not accepted; accepted: {ACCEPTED_IMAGES}')
