"""What the vision-language tests share: the embedded VLMs' classes and one turn's image inputs as Qwen3-VL's
processor gives them (tests/assets/test_vlm_assets.py, tests/model/test_vlm_export.py)."""

from __future__ import annotations

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

VLMS = {'tiny-qwen3.5-vl': 'Qwen3_5ForConditionalGeneration', 'tiny-qwen3-vl': 'Qwen3VLForConditionalGeneration'}


def image_inputs(path: str, picture: Image.Image, question: str) -> dict[str, torch.Tensor]:
    """What Qwen3-VL's processor gives for one user turn holding ``picture`` then ``question``:
    each ``<|image_pad|>`` repeated grid_t * grid_h * grid_w / merge_size**2 times, and
    ``mm_token_type_ids`` 1 on those tokens."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    pixels = AutoImageProcessor.from_pretrained(path)(images=[picture], return_tensors='pt')
    messages = [{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': question}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pads = int(pixels['image_grid_thw'][0].prod()) // 2**2
    ids = tokenizer(text.replace('<|image_pad|>', '<|image_pad|>' * pads), return_tensors='pt')['input_ids']
    mm = (ids == tokenizer.convert_tokens_to_ids('<|image_pad|>')).long()
    return {'input_ids': ids, 'mm_token_type_ids': mm, **pixels}
