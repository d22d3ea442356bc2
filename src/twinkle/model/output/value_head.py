"""A value head: the critic of PPO as a second adapter on the policy's own base model.

``add_adapter_to_model('critic', lora, value_head=True)`` gives an adapter a scalar head,
``Linear(hidden, 1)`` on the last hidden state (after the final norm), trained with the adapter
(its parameters join the adapter's, so they share its optimizer and nothing else's) and saved
beside its PEFT files as ``value_head.safetensors``. One base model then serves the policy and
the critic, each row of a forward through its own adapter; a critic costs a LoRA and a head, not
a second model.

The value at position ``t`` is read from the hidden state that predicts label ``t``: the value of
the state in which the completion's token ``t`` is chosen, on the same ``[B, S]`` grid as the
label log-probabilities, so advantages, returns and values line up position for position.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from twinkle.errors import CheckpointError

#: The head's weights beside an adapter's PEFT files.
VALUE_HEAD_WEIGHTS = 'value_head.safetensors'


class ValueHead(torch.nn.Module):
    """``Linear(hidden, 1)``: a hidden state ``[B, S, H]`` to a value ``[B, S]`` (float32).

    It starts at zero, weight and bias: every first value is 0, a constant baseline that the
    critic then learns away from. A random head (OpenRLHF's normal init, std ``1 / (H + 1)``)
    starts with per-token values that are noise, about ``sqrt(H) / (H + 1)`` (0.09 for H = 128),
    the size of a sparse reward's signal, so its first advantages push on random tokens."""

    def __init__(self, hidden_size: int, device: torch.device | None = None):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1, device=device)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        """Values ``[B, S]`` float32; the hidden state (bfloat16 under autocast) is read in the head's dtype."""
        value_BS1: torch.Tensor = self.linear(hidden_BSH.to(self.linear.weight.dtype))
        return value_BS1.squeeze(-1).float()


def new_value_head(model: PreTrainedModel, device: torch.device) -> ValueHead:
    """A fresh head sized for ``model``'s (text) hidden state, on ``device``."""
    config = model.config.get_text_config()
    return ValueHead(int(config.hidden_size), device=device)


def has_saved_head(directory: Path) -> bool:
    """Whether ``directory`` (an adapter checkpoint) holds a value head."""
    return (directory / VALUE_HEAD_WEIGHTS).is_file()


def save_value_head(head: ValueHead, directory: Path) -> None:
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in head.state_dict().items()}
    save_file(state, str(directory / VALUE_HEAD_WEIGHTS))


def load_value_head(head: ValueHead, directory: Path) -> None:
    """The head's weights from ``directory``; ``CheckpointError`` if it holds none or they do not fit."""
    path = directory / VALUE_HEAD_WEIGHTS
    if not path.is_file():
        raise CheckpointError(
            f'{directory} has no {VALUE_HEAD_WEIGHTS}: the adapter has a value head, but the checkpoint was '
            'saved from an adapter without one'
        )
    state = load_file(str(path))
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in state.items()}
    if found != expected:
        raise CheckpointError(f'{path} holds {found}; this value head needs {expected}')
    with torch.no_grad():
        for name, tensor in head.state_dict().items():
            tensor.copy_(state[name])


__all__ = [
    'VALUE_HEAD_WEIGHTS',
    'ValueHead',
    'has_saved_head',
    'load_value_head',
    'new_value_head',
    'save_value_head',
]
