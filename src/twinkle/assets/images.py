"""Pictures whose content is known exactly: coloured shapes, counts of shapes, seven-segment digits.

Each row is one picture and one question about it, as a chat (Qwen-VL content parts)::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/train/00000.png"},
                                               {"type": "text", "text": "What colour is the square?"}]},
                  {"role": "assistant", "content": "red"}],
     "task": "colour", "answer": "red"}

Images are 64 x 64 RGB PNG files beside the JSONL files; a row names its image by its path
relative to its JSONL file's folder (``resolve_images`` makes them absolute). Tasks: ``colour``
(one word from ``COLOURS``), ``shape`` (``SHAPES``), ``count`` (a digit, 1 to 4), ``digit`` (0 to 9)
and ``caption`` ("A red square.", "Three blue circles.", "The digit 7 in green."). Shapes are
drawn without anti-aliasing on white, so each picture holds white and exactly one other colour,
and its answer can be read back from the pixels. Scenes are drawn by a seeded ``random.Random``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED = 20261127
SPLIT_SIZES = {'train': 512, 'test': 128}
SIZE = 64
BACKGROUND = (255, 255, 255)
COLOURS: dict[str, tuple[int, int, int]] = {
    'red': (230, 25, 25),
    'green': (20, 160, 40),
    'blue': (30, 60, 230),
    'yellow': (250, 210, 0),
    'purple': (140, 30, 200),
    'orange': (250, 130, 0),
}
SHAPES = ('square', 'circle', 'triangle')
COUNT_WORDS = ('One', 'Two', 'Three', 'Four')
#: Seven-segment digits: which of a (top), b (upper right), c (lower right), d (bottom), e (lower
#: left), f (upper left), g (middle) are lit.
SEGMENTS = ('abcdef', 'bc', 'abdeg', 'abcdg', 'bcfg', 'acdfg', 'acdefg', 'abc', 'abcdefg', 'abcdfg')
#: The questions each kind of scene is asked.
TASKS = {
    'shape': ('colour', 'shape', 'caption'),
    'count': ('count', 'colour', 'caption'),
    'digit': ('digit', 'colour', 'caption'),
}

Box = tuple[int, int, int, int]  # left, top, right, bottom (inclusive)


@dataclass(frozen=True)
class Scene:
    """One picture: ``kind`` 'shape' (one shape), 'count' (1-4 equal shapes) or 'digit'."""

    kind: str
    colour: str
    # The shape of 'shape' and 'count' scenes; the digit of 'digit' scenes.
    shape: str = ''
    digit: int = 0
    # Where each shape (or the digit) is drawn, and the digit's stroke width.
    boxes: tuple[Box, ...] = ()
    stroke: int = 0


def _draw_scene(rng: random.Random) -> Scene:
    kind = rng.choice(tuple(TASKS))
    colour = rng.choice(tuple(COLOURS))
    if kind == 'digit':
        width, height = rng.randint(20, 28), rng.randint(36, 48)
        left, top = rng.randint(4, SIZE - 4 - width), rng.randint(4, SIZE - 4 - height)
        box = (left, top, left + width - 1, top + height - 1)
        return Scene(kind, colour, digit=rng.randrange(10), boxes=(box,), stroke=rng.randint(4, 6))
    shape = rng.choice(SHAPES)
    if kind == 'shape':
        return Scene(kind, colour, shape, boxes=(_square_in(rng, 0, 0, SIZE, 20, 40),))
    cells = sorted(rng.sample(range(4), rng.randint(1, 4)))  # 2 x 2 cells of 32 x 32, at most one shape each
    half = SIZE // 2
    boxes = tuple(_square_in(rng, half * (cell % 2), half * (cell // 2), half, 14, 24) for cell in cells)
    return Scene(kind, colour, shape, boxes=boxes)


def _square_in(rng: random.Random, left: int, top: int, extent: int, smallest: int, largest: int) -> Box:
    """A square box of side ``smallest..largest`` inside the given cell, 3 pixels from its edges."""
    side = rng.randint(smallest, largest)
    x, y = rng.randint(left + 3, left + extent - 3 - side), rng.randint(top + 3, top + extent - 3 - side)
    return (x, y, x + side - 1, y + side - 1)


def question(scene: Scene, task: str) -> tuple[str, str]:
    """The question of ``task`` about ``scene`` and its answer."""
    if task == 'colour':
        if scene.kind == 'digit':
            return f'What colour is the digit {scene.digit}?', scene.colour
        if len(scene.boxes) > 1:
            return f'What colour are the {scene.shape}s?', scene.colour
        return f'What colour is the {scene.shape}?', scene.colour
    if task == 'shape':
        return 'What shape is in the picture?', scene.shape
    if task == 'count':
        return f'How many {scene.shape}s are there?', str(len(scene.boxes))
    if task == 'digit':
        return 'What digit is shown?', str(scene.digit)
    if scene.kind == 'digit':
        caption = f'The digit {scene.digit} in {scene.colour}.'
    elif scene.kind == 'count' and len(scene.boxes) > 1:
        caption = f'{COUNT_WORDS[len(scene.boxes) - 1]} {scene.colour} {scene.shape}s.'
    else:
        caption = f'A {scene.colour} {scene.shape}.'
    return 'Describe the picture.', caption


def scenes(split: str) -> list[tuple[Scene, str]]:
    """Every scene of ``split`` with the task it is asked, in row order (train then test drawn
    from one stream, so the splits differ)."""
    rng = random.Random(SEED)
    drawn: dict[str, list[tuple[Scene, str]]] = {}
    for name, size in SPLIT_SIZES.items():
        drawn[name] = []
        for _ in range(size):
            scene = _draw_scene(rng)
            drawn[name].append((scene, rng.choice(TASKS[scene.kind])))
    return drawn[split]


def image_path(split: str, index: int) -> str:
    """Row ``index``'s image, relative to the split's JSONL folder."""
    return f'images/{split}/{index:05d}.png'


def rows(split: str) -> list[dict[str, Any]]:
    """The rows of ``split`` (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for index, (scene, task) in enumerate(scenes(split)):
        text, answer = question(scene, task)
        user = [{'type': 'image', 'image': image_path(split, index)}, {'type': 'text', 'text': text}]
        messages = [{'role': 'user', 'content': user}, {'role': 'assistant', 'content': answer}]
        out.append({'messages': messages, 'task': task, 'answer': answer})
    return out


def splits() -> dict[str, list[dict[str, Any]]]:
    """Every split's rows by name."""
    return {split: rows(split) for split in SPLIT_SIZES}


def render(scene: Scene) -> Any:
    """``scene`` as a 64 x 64 RGB ``PIL.Image`` (no anti-aliasing: two colours exactly)."""
    from PIL import Image, ImageDraw

    image = Image.new('RGB', (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    fill = COLOURS[scene.colour]
    if scene.kind == 'digit':
        for segment in SEGMENTS[scene.digit]:
            draw.rectangle(_segment(scene.boxes[0], scene.stroke, segment), fill=fill)
        return image
    for left, top, right, bottom in scene.boxes:
        if scene.shape == 'square':
            draw.rectangle((left, top, right, bottom), fill=fill)
        elif scene.shape == 'circle':
            draw.ellipse((left, top, right, bottom), fill=fill)
        else:
            draw.polygon([(left, bottom), (right, bottom), ((left + right) // 2, top)], fill=fill)
    return image


def _segment(box: Box, stroke: int, segment: str) -> Box:
    """The rectangle of one seven-segment ``segment`` in ``box``."""
    left, top, right, bottom = box
    middle = (top + bottom) // 2
    bar = top + (bottom - top + 1 - stroke) // 2  # the middle bar's top row
    return {
        'a': (left, top, right, top + stroke - 1),
        'd': (left, bottom - stroke + 1, right, bottom),
        'g': (left, bar, right, bar + stroke - 1),
        'f': (left, top, left + stroke - 1, middle),
        'e': (left, middle, left + stroke - 1, bottom),
        'b': (right - stroke + 1, top, right, middle),
        'c': (right - stroke + 1, middle, right, bottom),
    }[segment]


def write_images(folder: Path) -> None:
    """Every split's PNG files under ``folder`` (``image_path``), fixed compression settings."""
    for split in SPLIT_SIZES:
        (folder / 'images' / split).mkdir(parents=True)
        for index, (scene, _) in enumerate(scenes(split)):
            render(scene).save(folder / image_path(split, index), format='PNG', compress_level=9, optimize=False)


def resolve_images(jsonl: str | Path) -> list[dict[str, Any]]:
    """The rows of an image dataset's JSONL file with each image part's path made absolute.

    >>> from twinkle.assets import dataset
    >>> row = resolve_images(dataset('shapes', 'test'))[0]
    >>> Path(row['messages'][0]['content'][0]['image']).is_file()
    True
    """
    jsonl = Path(jsonl)
    out = []
    for line in jsonl.read_text(encoding='utf-8').splitlines():
        row = json.loads(line)
        for message in row['messages']:
            for part in message['content'] if isinstance(message['content'], list) else []:
                if part.get('type') == 'image' and isinstance(part.get('image'), str):
                    part['image'] = str(jsonl.parent / part['image'])
        out.append(row)
    return out
