"""``wide-qwen3``: Qwen3's full vocabulary on two layers of Qwen3-0.6B's width, so benchmarks see the
output layer's real share of a step (the other embedded models' 4,096 outputs hide it).

The folder is built in the session's ``TWINKLE_HOME`` (``tests/conftest.py``), once per cache: its
750 MB of float32 weights are not built twice to compare bytes (the seeded draw is the same code
``tests/assets/test_assets.py`` checks on ``tiny-qwen3``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors import safe_open
from transformers import Qwen3ForCausalLM

from twinkle import assets
from twinkle.assets.models import model_config
from twinkle.model import TransformersModel

VOCAB = 151_936  # Qwen3's embedding rows and head outputs


@pytest.fixture(scope='module')
def wide_path() -> str:
    return assets.tiny_model('wide-qwen3')


def test_config_is_qwen3_0_6b_on_two_layers() -> None:
    config = model_config('wide-qwen3')
    # Qwen3-0.6B's config.json: hidden 1024, MLP 3072, 16 query and 8 key/value heads of 128, tied head.
    shape = (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads)
    assert (*shape, config.head_dim, config.vocab_size) == (1024, 3072, 16, 8, 128, VOCAB)
    assert (config.num_hidden_layers, config.tie_word_embeddings) == (2, True)
    assert 'wide-qwen3' in assets.MODELS


def test_parameter_count_from_config() -> None:
    with torch.device('meta'):  # shapes only, no weights
        model = Qwen3ForCausalLM(model_config('wide-qwen3'))
    # embed (= head, tied) 151936*1024 = 155582464; per layer: q 1024*2048 + k 1024*1024 + v 1024*1024
    # + o 2048*1024 = 6291456, q/k norms 2*128, MLP 3*1024*3072 = 9437184, two RMSNorms 2*1024
    # -> 15730944; 2 layers + final norm.
    assert sum(p.numel() for p in model.parameters()) == 155582464 + 2 * 15730944 + 1024 == 187_045_376


@pytest.mark.slow
def test_folder_holds_one_shared_matrix(wide_path: str) -> None:
    folder = Path(wide_path)
    assert json.loads((folder / 'config.json').read_text())['vocab_size'] == VOCAB
    with safe_open(str(folder / 'model.safetensors'), framework='pt') as weights:
        names = set(weights.keys())
        embedding = weights.get_slice('model.embed_tokens.weight').get_shape()
    assert 'lm_head.weight' not in names  # tied: stored once, under the embedding's name
    assert embedding == [VOCAB, 1024]
    assert len(names) == 1 + 2 * 11 + 1  # embedding, 11 tensors per layer, final norm


def test_loads_and_one_lora_step_gives_the_full_vocabulary_loss(wide_path: str) -> None:
    model = TransformersModel(model_id=wide_path, device='cpu')
    assert model.fused_output  # on by default at a real vocabulary: this step runs the output layer fused
    head = model.model.get_output_embeddings()
    assert head.weight.shape == (VOCAB, 1024)
    assert head.weight.data_ptr() == model.model.get_input_embeddings().weight.data_ptr()  # tied on load
    torch.manual_seed(0)
    model.add_adapter_to_model('a', LoraConfig(r=4, lora_alpha=8, target_modules='all-linear'))
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in (9, 6):
        ids = torch.randint(0, 4000, (length,), generator=generator).tolist()
        rows.append({'input_ids': ids, 'labels': [*ids[1:], -100]})  # next-token targets
    loss = model.forward_backward(inputs=rows, adapter_name='a').loss
    # Random weights predict nearly uniformly: the logits are h . e with |h| = 32 (RMS 1 over 1024)
    # and e ~ normal(0, 0.02), so std 0.64, and the loss is about ln(151936) + 0.64^2 / 2 = 12.1
    # (ln(4096) = 8.3 would mean the head lost its width).
    assert math.isfinite(loss)
    assert abs(loss - (math.log(VOCAB) + 0.64**2 / 2)) < 1.0, loss
    grads = [p.grad for p in model.groups['a'].params]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
