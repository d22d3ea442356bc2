"""How much memory does the worst image request the server's limits allow cost its worker, against
the bound the limits give?

A real ``twinkle-server serve`` subprocess on loopback serves ``tiny-qwen3.5-vl`` on the CPU with the
default limits (``twinkle.server.config.Limits``); with one rank the model's worker is the server's
process, which also runs the checks of each request where it is accepted. The worst request those
limits allow, as one native ``forward_backward`` row:

* ``max_images_per_request`` (64) images, each resizing to the processor's ``max_pixels`` (16,384 for
  this model: 16 tokens), the most processed pixels a request can hold;
* two of them as large as ``max_image_pixels_per_request`` lets them be: 7,168 x 7,168
  (``max_image_pixels``, 51.4 M pixels) and 7,168 x 7,026 (the rest of the request's pixels after the
  62 others of 128 x 128), the most decoded at once;
* each an RGBA PNG of one colour: a few hundred kB that decode to PIL's 4 bytes a pixel, and to 4
  more once converted to RGB (an RGB file needs no conversion: half that).

The bound the limits give (``bound_mib``): one full-size image decoded and converted
(``max_image_pixels`` x 8 bytes: images are decoded one at a time and resized at once), plus the
processed images: ``max_images_per_request`` x ``max_pixels`` x 24 bytes of ``pixel_values`` (3
channels x 2 frames of float32 a pixel), held up to three times while the processor builds them
(its patches, their concatenation, the tensor). The model's own activations for the row's tokens come
on top: a control request of the same 64 images at 128 x 128 each (nothing to decode large, the same
tokens and pixels) measures them (``control``).

Each request's figure is the server process's peak resident memory over what it held just before
(Linux's VmHWM, reset through ``/proc/<pid>/clear_refs`` before the request), and its wall time. Each
request runs on a fresh server after a one-image warm-up (memory an earlier request freed and the
allocator kept would hide part of a later one's peak): control and worst, ``--repeats`` times each,
the order alternating; the summary takes medians.

Usage::

    .venv/bin/python benchmarks/image_limits.py     # ~4 min on 2 cores; writes results/image_limits.json
"""

from __future__ import annotations

import base64
import io
import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from machine import describe, settings_from_args
from peft import LoraConfig
from PIL import Image
from server_overhead import ServerProcess

from twinkle import assets
from twinkle.server.config import Limits
from twinkle.server.execution.checks.images import Header, ImageRows
from twinkle_client import TwinkleClient
from twinkle_client.client import PREFIX
from twinkle_client.model import MultiLoraTransformersModel

MIB = 2**20
#: Bytes a pixel of one image decoded (PIL's RGBA: 4) and converted to RGB (PIL's RGB: 4 more).
DECODED_BYTES_PER_PIXEL = 8
#: Bytes of ``pixel_values`` a resized pixel: 3 channels x 2 frames (temporal_patch_size) x float32.
PROCESSED_BYTES_PER_PIXEL = 3 * 2 * 4
#: Copies of the processed pixels the image processor holds at once (patches, concatenated, tensor).
PROCESSED_COPIES = 3


@dataclass
class Settings:
    # The embedded vision-language model served.
    model: str = 'tiny-qwen3.5-vl'
    # 'cpu' or 'cuda', the server's device.
    device: str = 'cpu'
    # Rounds of (control, worst) requests after the warm-up.
    repeats: int = 2
    # Seconds the server may take to answer /healthz.
    startup_timeout_s: float = 300.0


def png(width: int, height: int) -> bytes:
    """An RGBA PNG of one colour: small on the wire, PIL's 4 bytes a pixel decoded."""
    buffer = io.BytesIO()
    Image.new('RGBA', (width, height), (40, 160, 220, 255)).save(buffer, format='PNG')
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return 'data:image/png;base64,' + base64.b64encode(data).decode()


def row(model_dir: str, rows: ImageRows, files: list[bytes]) -> dict[str, Any]:
    """A row of text around ``files``, each a run of as many image pads as its tokens (the server's
    resize) between the vision start and end tokens, as ``VisionTemplate`` lays them out; trained on
    its text only."""
    config = json.loads((Path(model_dir) / 'config.json').read_text())
    start, pad, end = config['vision_start_token_id'], config['image_token_id'], config['vision_end_token_id']
    ids = [11, 12, 13]
    for data in files:
        height, width = rows.resized('an image', Header(*Image.open(io.BytesIO(data)).size))
        ids += [start, *[pad] * (height * width // rows.factor**2), end, 14]
    ids += [15, 16, 17, 18]
    labels = [-100] * (len(ids) - 4) + ids[-3:] + [-100]
    return {'input_ids': ids, 'labels': labels, 'images': [data_url(f) for f in files]}


def requests(limits: Limits, side: int) -> dict[str, list[bytes]]:
    """The worst request's files and the control's: ``side`` x ``side`` resizes to ``max_pixels``."""
    count, small = limits.max_images_per_request, png(side, side)
    big_side = int(limits.max_image_pixels**0.5)
    rest = limits.max_image_pixels_per_request - big_side**2 - (count - 2) * side * side
    second = png(big_side, min(big_side, rest // big_side))
    return {'control': [small] * count, 'worst': [png(big_side, big_side), second, *[small] * (count - 2)]}


def memory(pid: int) -> dict[str, int]:
    status = Path(f'/proc/{pid}/status').read_text().splitlines()
    return {line.split(':')[0]: int(line.split()[1]) * 1024 for line in status if line.startswith(('VmRSS', 'VmHWM'))}


def measure(model: MultiLoraTransformersModel, pid: int, body: dict[str, Any]) -> dict[str, float]:
    """One forward_backward: the server's peak resident memory over its resident memory before it."""
    Path(f'/proc/{pid}/clear_refs').write_text('5')  # VmHWM := VmRSS now
    before = memory(pid)['VmRSS']
    began = time.perf_counter()
    result = model.client.call(f'{PREFIX}/runs/{model.runs["default"]}/ops/forward_backward', body)
    seconds = time.perf_counter() - began
    after = memory(pid)
    return {
        'peak_over_before_mib': (after['VmHWM'] - before) / MIB,
        'resident_before_mib': before / MIB,
        'seconds': seconds,
        'loss': float(result['loss']),  # type: ignore[index, arg-type]
    }


def on_a_fresh_server(settings: Settings, warm_up: dict[str, Any], body: dict[str, Any]) -> dict[str, float]:
    """``body``'s figures on a server of its own, after ``warm_up``: what an earlier request freed and
    the allocator kept resident would otherwise hide part of its peak."""
    with tempfile.TemporaryDirectory() as workdir:
        server = ServerProcess(settings, Path(workdir))  # type: ignore[arg-type]  # model, device, startup_timeout_s
        key = server.add_key('bench')
        with server as url:
            assert server.process is not None
            model = MultiLoraTransformersModel(settings.model, client=TwinkleClient(url, key))
            model.add_adapter_to_model('default', LoraConfig(r=8, lora_alpha=16, target_modules='all-linear'))
            model.set_optimizer('AdamW', lr=1e-4)
            measure(model, server.process.pid, warm_up)
            return measure(model, server.process.pid, body)


def main() -> None:
    settings, output = settings_from_args(Settings(), __doc__.split('\n')[0], 'benchmarks/results/image_limits.json')
    limits, model_dir = Limits(), assets.tiny_model(settings.model)
    rows = ImageRows.of(model_dir, limits)
    assert rows is not None, f'{settings.model} takes no images'
    side = int(rows.max_pixels**0.5) // rows.factor * rows.factor  # 128: exactly max_pixels, nothing to resize
    files = requests(limits, side)
    bodies = {name: {'inputs': [row(model_dir, rows, f)]} for name, f in files.items()}
    decoded = limits.max_image_pixels * DECODED_BYTES_PER_PIXEL
    processed = limits.max_images_per_request * rows.max_pixels * PROCESSED_BYTES_PER_PIXEL * PROCESSED_COPIES
    warm_up = {'inputs': [row(model_dir, rows, files['control'][:1])]}
    figures: dict[str, list[dict[str, float]]] = {'control': [], 'worst': []}
    for round_ in range(settings.repeats):
        for name in ('control', 'worst') if round_ % 2 == 0 else ('worst', 'control'):
            figures[name].append(on_a_fresh_server(settings, warm_up, bodies[name]))
            print(name, figures[name][-1], flush=True)
    worst = statistics.median(f['peak_over_before_mib'] for f in figures['worst'])
    control = statistics.median(f['peak_over_before_mib'] for f in figures['control'])
    summary = {
        'worst_peak_over_before_mib': worst,
        'control_peak_over_before_mib': control,
        'worst_less_control_mib': worst - control,
        'worst_seconds': statistics.median(f['seconds'] for f in figures['worst']),
        'control_seconds': statistics.median(f['seconds'] for f in figures['control']),
        'decoded_bound_mib': decoded / MIB,
        'bound_mib': (decoded + processed) / MIB,
        'bound_plus_control_mib': (decoded + processed) / MIB + control,
        'within_bound': worst <= (decoded + processed) / MIB + control,
        'worst_body_mib': len(json.dumps(bodies['worst'])) / MIB,
        'worst_decoded_pixels': sum(math.prod(Image.open(io.BytesIO(f)).size) for f in files['worst']),
    }
    result = {
        'benchmark': 'image_limits',
        'settings': asdict(settings),
        'limits': {name: getattr(limits, name) for name in Limits.model_fields if 'image' in name},
        'max_pixels_after_resizing': rows.max_pixels,
        'environment': describe(),
        'runs': figures,
        'figures': summary,
    }
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(result, indent=2) + '\n')
    print(json.dumps(summary, indent=2))


if __name__ == '__main__':
    main()
