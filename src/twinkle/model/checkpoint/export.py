"""Trained weights out, in forms other tools load.

``export_checkpoint(checkpoint, out, merge=True)`` writes a merged Hugging Face model: the base
model with the adapter folded into its weights by peft (``merge_and_unload``), saved as
safetensors with its config and the tokenizer, so that plain transformers loads it as the base's
own class and gives the logits of base plus adapter: ``AutoModelForCausalLM`` for a text model,
``AutoModelForImageTextToText`` for a vision-language one (``Qwen3_5ForConditionalGeneration``,
vision tower included). With ``merge=False`` it writes the peft adapter
(``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer) without twinkle's
training state. Either way the folder appears whole or not at all.

A vision-language base's processor files (``PROCESSOR_FILES``: the image and video processors'
configs, and the chat template if the tokenizer brought none) are copied from the base into
either export, since a checkpoint keeps only the tokenizer's: the exported folder then serves as
the original does (``AutoImageProcessor``, ``AutoProcessor``, the chat template with image parts).
An unmerged export copies them when the base is on this machine (an embedded model, a folder or a
hub cache), and does not download a base for them.

``twinkle export CHECKPOINT [--merge] --out DIR`` runs it from the command line.

``push_to_hub(folder, 'hf://org/name')`` (or ``ms://org/name``) uploads an exported folder with
the hub's own library (``huggingface_hub`` / ``modelscope_hub``), creating the repository if
needed; a hub that cannot be reached is a ``HubUnavailableError`` that says which and why.

``write_tinker_adapter`` writes an adapter as Tinker exports it (what tinker-cookbook's
``build_hf_model`` / ``build_lora_adapter`` read): linear layers as peft names them, and each MoE
expert stack as 3-D tensors per expert (``experts.w1|w2|w3``: gate, down, up), not peft's
``target_parameters`` layout.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from twinkle.errors import CheckpointError, ConfigurationError, HubUnavailableError, TwinkleError, one_of
from twinkle.hub import is_offline, parse_hub_id, resolve_model
from twinkle.model.checkpoint import files as ckpt
from twinkle.model.lora.experts import EXPERT_PARAMETERS, peft_stack_prefix

ADAPTER_CONFIG = 'adapter_config.json'
#: twinkle's own files in a checkpoint: resume state, not weights another tool reads.
TRAINING_FILES = (
    ckpt.TRAINER_STATE,
    ckpt.WEIGHTS_STEP,
    ckpt.OPTIMIZER,
    ckpt.SCHEDULER,
    ckpt.RNG_STATE,
    ckpt.ACCUMULATION,
)
#: A processor's files beside the tokenizer's: what ``AutoProcessor`` and ``AutoImageProcessor`` read.
PROCESSOR_FILES = ('preprocessor_config.json', 'video_preprocessor_config.json', 'processor_config.json')
#: Where a chat template may be kept besides ``tokenizer_config.json`` (transformers 5 writes the first).
CHAT_TEMPLATE_FILES = ('chat_template.jinja', 'chat_template.json')
DTYPES: dict[str, torch.dtype | str] = {
    'auto': 'auto',
    'float32': torch.float32,
    'bfloat16': torch.bfloat16,
    'float16': torch.float16,
}


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    merge: bool = False,
    base_model: str | None = None,
    dtype: str = 'auto',
) -> Path:
    """Write ``checkpoint`` (a folder ``model.save`` wrote) to ``out``; returns ``out``.

    ``merge``: the base model with the adapter merged in, as a full Hugging Face model.
    ``base_model``: the base to merge into (default: the one the adapter names). ``dtype``: the
    merged weights' type (``'auto'``: the base model's own).
    """
    source, destination = Path(checkpoint), Path(out)
    if not source.is_dir():
        raise CheckpointError(f'no checkpoint folder at {str(checkpoint)!r}')
    if dtype not in DTYPES:
        raise one_of('dtype', dtype, list(DTYPES))
    if destination.exists() and any(destination.iterdir()):
        raise ConfigurationError(f'the output folder {str(out)!r} is not empty; give a new or empty folder')
    is_adapter = (source / ADAPTER_CONFIG).is_file()
    if not is_adapter and not (source / 'config.json').is_file():
        raise CheckpointError(
            f'{str(checkpoint)!r} holds neither a peft adapter ({ADAPTER_CONFIG}) '
            'nor a Hugging Face model (config.json)'
        )
    with ckpt.atomic_directory(destination) as staging:
        if is_adapter and merge:
            _merge(source, staging, base_model or _adapter_base(source), DTYPES[dtype])
        else:
            _copy_weights(source, staging)
            base = base_model or (_named_base(source) if is_adapter else None)
            base_dir = _local_base(base) if base else None
            if base_dir is not None:
                _copy_processor_files(base_dir, staging)
    return destination


def _named_base(adapter: Path) -> str | None:
    """The base model the adapter's config names, if any."""
    base = json.loads((adapter / ADAPTER_CONFIG).read_text()).get('base_model_name_or_path')
    return str(base) if base else None


def _adapter_base(adapter: Path) -> str:
    base = _named_base(adapter)
    if not base:
        raise CheckpointError(f'the adapter at {str(adapter)!r} names no base model; pass base_model (--base)')
    return base


def _merge(adapter: Path, staging: Path, base_model: str, dtype: torch.dtype | str) -> None:
    """The base model with ``adapter`` merged by peft, saved with the tokenizer and processor
    files in ``staging``. The base loads as the class its config names (``auto_model_class``): a
    vision-language checkpoint as its conditional-generation class, whose module names the
    adapter's keys (``model.language_model...``) were trained on."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoTokenizer

    from twinkle import assets
    from twinkle.model.loading import auto_model_class

    base_dir = Path(assets.tiny_model(base_model) if base_model in assets.MODELS else resolve_model(base_model))
    base = auto_model_class(AutoConfig.from_pretrained(base_dir)).from_pretrained(base_dir, dtype=dtype)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.save_pretrained(str(staging), safe_serialization=True)
    tokenizer_dir = adapter if _has_tokenizer(adapter) else base_dir
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(staging))
    _copy_processor_files(base_dir, staging)


def _local_base(base_model: str) -> Path | None:
    """The folder of ``base_model`` if it is on this machine (an embedded model, a folder, a hub
    cache), else None: an adapter export reads only its processor files, not worth a download."""
    from twinkle import assets

    if base_model in assets.MODELS:
        return Path(assets.tiny_model(base_model))
    try:
        return Path(resolve_model(base_model, offline=True))
    except TwinkleError:
        return None


def _copy_processor_files(base_dir: Path, staging: Path) -> None:
    """The base's ``PROCESSOR_FILES`` that ``staging`` lacks, and its chat template when the
    tokenizer saved none (the trained one's template, if it has one, is the one to keep)."""
    names = [name for name in PROCESSOR_FILES if not (staging / name).exists()]
    if not any((staging / name).exists() for name in CHAT_TEMPLATE_FILES):
        names += CHAT_TEMPLATE_FILES
    for name in names:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, staging / name)


def _copy_weights(source: Path, staging: Path) -> None:
    """The checkpoint's files less twinkle's training state: an adapter or a full model."""
    for path in source.iterdir():
        if path.name in TRAINING_FILES:
            continue
        if path.is_dir():
            shutil.copytree(path, staging / path.name)
        else:
            shutil.copy2(path, staging / path.name)


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ('tokenizer.json', 'tokenizer_config.json', 'tokenizer.model'))


def write_tinker_adapter(source: Path, out: Path) -> None:
    """The adapter in ``source`` (a peft folder) as Tinker's two files in ``out``:
    ``adapter_model.safetensors`` with each expert stack's pair as 3-D tensors per expert, and
    ``adapter_config.json``. Expert ``e``'s pair of a stack is ``A_e`` (r, in) and ``B_e`` (out, r);
    a fused ``gate_up_proj`` splits into ``w1`` (gate: the first half of its rows) and ``w3``
    (up), which share ``A_e``; ``down_proj`` is ``w2``."""
    config = json.loads((source / ADAPTER_CONFIG).read_text())
    weights = load_file(str(source / ckpt.ADAPTER_WEIGHTS))
    rank = int(config['r'])
    for module, stacks in _expert_modules(config.get('target_parameters') or []).items():
        for stack in stacks:
            key = f'base_model.model.{module}.{peft_stack_prefix(stacks, stack)}'
            lora_a, lora_b = weights.pop(f'{key}lora_A.weight'), weights.pop(f'{key}lora_B.weight')
            experts = lora_a.shape[0] // rank
            per_a = lora_a.view(experts, rank, -1)  # (E, r, in)
            per_b = lora_b.view(lora_b.shape[0], rank, experts).permute(2, 0, 1)  # (E, out, r)
            base = f'base_model.model.{module}'
            if stack == 'gate_up_proj':
                half = per_b.shape[1] // 2
                pairs = {'w1': (per_a, per_b[:, :half]), 'w3': (per_a.clone(), per_b[:, half:])}
            else:
                pairs = {'w2': (per_a, per_b)}
            for name, (a, b) in pairs.items():
                weights[f'{base}.{name}.lora_A.weight'] = a
                weights[f'{base}.{name}.lora_B.weight'] = b
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / ckpt.ADAPTER_WEIGHTS))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))


def _expert_modules(target_parameters: list[str]) -> dict[str, list[str]]:
    """The experts modules of peft's ``target_parameters`` ('<module>.<stack>'), each with its
    stacks in the order peft wraps them."""
    modules: dict[str, list[str]] = defaultdict(list)
    for target in target_parameters:
        module, _, stack = target.rpartition('.')
        if stack not in EXPERT_PARAMETERS:
            raise CheckpointError(f'unknown expert stack {stack!r} in target_parameters; known: {EXPERT_PARAMETERS}')
        modules[module].append(stack)
    return {module: [s for s in EXPERT_PARAMETERS if s in stacks] for module, stacks in modules.items()}


def push_to_hub(folder: str | Path, hub_id: str, *, token: str | None = None, private: bool = True) -> str:
    """Upload ``folder`` (an export) to ``hf://org/name`` or ``ms://org/name``, creating the
    repository (private unless ``private=False``) if it does not exist; returns the hub id.
    The hub's endpoint and token come from the environment unless ``token`` is given, as its
    library reads them (``HF_ENDPOINT``, ``HF_TOKEN``; ``MODELSCOPE_ENDPOINT``, ``MODELSCOPE_API_TOKEN``)."""
    source = Path(folder)
    if not source.is_dir() or not any(source.iterdir()):
        raise CheckpointError(f'nothing to upload: {str(folder)!r} is not a folder with files')
    parsed = parse_hub_id(hub_id)
    if parsed.hub == 'local' or parsed.name.count('/') != 1:
        raise ConfigurationError(f'push_to_hub needs hf://org/name or ms://org/name; got {hub_id!r}')
    hub: Literal['hf', 'ms'] = 'hf' if parsed.hub == 'hf' else 'ms'
    label = {'hf': 'the Hugging Face Hub', 'ms': 'ModelScope'}[hub]
    if is_offline(hub):
        raise HubUnavailableError(f'{label} is turned off here (offline mode): {hub_id!r} was not uploaded')
    try:
        if hub == 'hf':
            _push_hf(source, parsed.name, token, private)
        else:
            _push_ms(source, parsed.name, token, private)
    except (ConnectionError, TimeoutError) as error:  # not OSError: a library's HTTP 401 is one
        raise HubUnavailableError(
            f'{label} could not be reached to upload {hub_id!r}: {type(error.__cause__ or error).__name__}; '
            'check the network '
            f'and {"HF_ENDPOINT" if hub == "hf" else "MODELSCOPE_ENDPOINT"}'
        ) from error
    return hub_id


def _push_hf(source: Path, repo_id: str, token: str | None, private: bool) -> None:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=os.environ.get('HF_ENDPOINT') or None, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(source), commit_message='Upload from twinkle export')
    except Exception as error:
        if _is_transport_error(error):
            raise ConnectionError(str(error)) from error
        raise


#: Base classes of the transport errors of the HTTP clients huggingface_hub has used (httpx, its
#: fork httpx2, requests): the hub was not reached, as opposed to an answer it gave.
_TRANSPORT_ERRORS = ('TransportError', 'ConnectionError', 'Timeout', 'TimeoutException')


def _is_transport_error(error: Exception) -> bool:
    return any(cls.__name__ in _TRANSPORT_ERRORS for cls in type(error).__mro__)


def _push_ms(source: Path, repo_id: str, token: str | None, private: bool) -> None:
    from modelscope_hub import HubApi, HubConfig
    from modelscope_hub.errors import NetworkError

    api = HubApi(HubConfig(), token=token)
    try:
        if not api.repo_exists(repo_id, 'model'):
            api.create_repo(repo_id, 'model', visibility='private' if private else 'public')
        api.upload_folder(repo_id, 'model', source, commit_message='Upload from twinkle export')
    except NetworkError as error:
        raise ConnectionError(str(error)) from error
