"""Image parts of messages: which content parts are images, and their values in the order a
chat template renders them. Light on purpose (no PIL, no torch): the template encodes the
images (``twinkle.template.vision``), and the native client sends them (``twinkle.wire``).

>>> part = {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,iVBO'}}
>>> message_images([{'role': 'user', 'content': [part, {'type': 'text', 'text': 'What is it?'}]}])
[('message 0, part 0', 'data:image/png;base64,iVBO')]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.errors import DataError

#: What an image part may hold, for error messages.
ACCEPTED_IMAGES = (
    "{'type': 'image', 'image': <a local path, bytes or a PIL.Image>} or "
    "{'type': 'image_url', 'image_url': {'url': 'data:image/...;base64,...'}} (a data URL or a local path)"
)


def is_image_part(part: object) -> bool:
    """Whether a content part is an image (what the VLM chat templates render as one)."""
    if not isinstance(part, Mapping):
        return False
    return part.get('type') in ('image', 'image_url') or 'image' in part or 'image_url' in part


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any message's content holds an image part."""
    return any(isinstance(m.get('content'), list) and any(is_image_part(p) for p in m['content']) for m in messages)


def image_value(part: Mapping[str, Any], where: str) -> Any:
    """What an image part holds: its ``image``, or its ``image_url``'s url."""
    if 'image' in part and part['image'] is not None:
        return part['image']
    url = part.get('image_url')
    if isinstance(url, Mapping):
        url = url.get('url')
    if url is None:
        raise DataError(f'{where} is an image part with no image; accepted: {ACCEPTED_IMAGES}')
    return url


def message_images(messages: Sequence[Any]) -> list[tuple[str, Any]]:
    """Each image part's value, named by where it is, in the order the template renders them
    (message by message, part by part)."""
    found: list[tuple[str, Any]] = []
    for m_index, message in enumerate(messages):
        content = message.get('content') if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for p_index, part in enumerate(content):
            if is_image_part(part):
                where = f'message {m_index}, part {p_index}'
                found.append((where, image_value(part, where)))
    return found
