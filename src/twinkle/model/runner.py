"""The forward side of a ``TransformersModel``: rows encoded and checked, collated into a batch,
run through the model (under autocast, each row on the adapter it asks for), and turned into
logits, router logits, losses and a backward.

``TransformersModel`` runs its single-adapter passes here, and the mixed pass
(``twinkle.model.mixed_pass``) runs several adapters' rows through the same methods: both see
one ``ModelRunner``, not each other.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.utils.generic import is_flash_attention_requested

from twinkle.data_format import InputFeature, ModelOutput
from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.loss import Loss, LossOutput
from twinkle.metric import ExpertLoad, Metric
from twinkle.model import packed_recurrence, router
from twinkle.model.base import Inputs
from twinkle.model.layout import ModelParallel
from twinkle.model.loading import Precision
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.adapter import RowAssignment
from twinkle.model.output import layer as output_layer
from twinkle.model.passes import (
    accumulate,
    carried,
    check_finite,
    check_trainable,
    chunks,
    label_logps,
    loss_sums,
    record_call,
    with_logps,
)
from twinkle.model.train_group import FULL, Batch, Outputs, Pending, TrainGroup
from twinkle.processor import InputProcessor
from twinkle.template import Template, VisionTemplate
from twinkle.wire import FEATURE_FIELDS

#: Row fields that hold one value per token, as ``input_ids`` does (the wire checks the same).
ALIGNED_FIELDS = (*(field for field in FEATURE_FIELDS if field != 'input_ids'), 'mm_token_type_ids')
#: Batch fields a vision-language model's forward takes besides the tokens (``InputProcessor``'s).
IMAGE_INPUTS = ('pixel_values', 'image_grid_thw', 'mm_token_type_ids')
#: The collation ``forward_backward`` uses on a model that packs (``ModelRunner.padding_free``).
PACKED = InputProcessor(padding_free=True)


def packs_by_default(config: PretrainedConfig) -> bool:
    """Whether the model's rows are best packed (``padding_free``'s default): under a flash
    attention kernel, which transformers gives each packed sequence's bounds from the restarting
    ``position_ids`` (a packed row then costs what its tokens cost). Not under ``sdpa`` or
    ``eager``: there a packed row is attended with a block-diagonal mask over all its tokens, and
    packing ran x0.64-x1.06 of padding (``benchmarks/sft_speed.py``, docs/benchmarks.md)."""
    return is_flash_attention_requested(config)


class ModelRunner:
    """Runs a model's adapters' rows: what a forward, its loss and its backward need.

    ``groups`` is the model's own table of adapters (``TransformersModel.groups``, the same
    dict): the first forward prepares every adapter's weights over the mesh, not only the ones it runs.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        model_id: str | None,
        groups: Mapping[str, TrainGroup],
        parallel: ModelParallel,
        *,
        device: torch.device,
        mixed_precision: Precision,
        model_router: router.Router | None,
    ):
        self.model = model
        self.model_id = model_id
        self.groups = groups
        self.parallel = parallel
        self.device = device
        self.mixed_precision: Precision = mixed_precision
        #: A mixture of experts' router (None for a dense model): its load-balancing loss joins
        #: the training loss with ``router.aux_loss_coef``, and the experts' load is a metric.
        self.router = model_router
        self._template: Template | None = None
        self._mode: bool | None = None  # the train/eval mode prepare last set on every module
        #: Whether training passes whose losses read only the labels' logprobs run the output
        #: layer fused, in chunks of tokens, without the logits (``output_layer``; the model's
        #: ``fused_output`` switch).
        self.fused_output = False
        #: Whether ``forward_backward`` packs the rows of an adapter without a processor of its own
        #: into one padding-free row (the model's ``padding_free`` switch): no compute on padding.
        self.padding_free = False

    # ---- rows ---------------------------------------------------------------------------------
    def template_for(self, group: TrainGroup) -> Template:
        """The template that encodes the group's trajectories: its own, else the model's (from ``model_id``)."""
        if group.spec.template is not None:
            return group.spec.template
        if self._template is None:
            if self.model_id is None:
                raise StateError('this model was built from a config: call set_template(...) first')
            # A vision-language model's rows may hold images: its template runs the image processor.
            vision = getattr(self.model.config, 'vision_config', None) is not None
            self._template = VisionTemplate(self.model_id) if vision else Template(self.model_id)
        return self._template

    def features(self, group: TrainGroup, inputs: Inputs) -> list[InputFeature]:
        """``inputs`` as encoded rows (trajectories through the group's template), each checked
        against the model's vocabulary and its per-token fields against its ``input_ids``."""
        rows = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        if not rows:
            raise DataError('inputs is empty: pass at least one row')
        if all('input_ids' in row for row in rows):
            features = cast(list[InputFeature], rows)  # every row is encoded
        else:
            features = self.template_for(group).batch_encode(rows)
            if not features:
                raise DataError('every input row was dropped by the template (truncation_strategy="delete")')
        self._check_tokens(features)
        return features

    def _check_tokens(self, features: Sequence[InputFeature]) -> None:
        embeddings = self.model.get_input_embeddings()
        vocab = (
            embeddings.num_embeddings if isinstance(embeddings, torch.nn.Embedding) else self.model.config.vocab_size
        )
        for index, feature in enumerate(features):
            ids = feature['input_ids']
            if len(ids) == 0:
                raise DataError(f'input row {index} has no tokens')
            for key in ALIGNED_FIELDS:
                values = cast(Sequence[int] | None, feature.get(key))
                if values is not None and len(values) != len(ids):
                    raise DataError(
                        f'input row {index}: {key} has {len(values)} values; '
                        f'it must be as long as input_ids ({len(ids)})'
                    )
            low, high = min(ids), max(ids)
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise DataError(f'input row {index} has token id {bad}, outside the vocabulary [0, {vocab})')

    def processor(self, group: TrainGroup, packs: bool = False) -> InputProcessor:
        """The group's processor; the rows packed into one row instead when the pass ``packs``
        (``forward_backward``, whose caller reads only the loss), the switch ``padding_free`` is
        on and no processor was set for the group (``AdapterSpec.processor_set``)."""
        if packs and self.padding_free and not group.spec.processor_set:
            return PACKED
        return group.spec.processor

    def collate(self, group: TrainGroup, rows: Sequence[InputFeature], packs: bool = False) -> Batch:
        """The rows as one batch on the model's device, by the group's processor and pad token."""
        pad = self.template_for(group).pad_token_id
        batch = self.processor(group, packs)(rows, pad)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    # ---- the forward ----------------------------------------------------------------------------
    def prepare(self, training: bool) -> None:
        """Before a forward: the weights ready over the mesh (the first forward syncs, then shards)
        and every module in training or evaluation mode."""
        self.parallel.prepare(self.model, self.groups.values())
        if self._mode is not training:
            # Every module, not the top one alone: new LoRA modules start in train mode while the
            # model around them is still in from_pretrained's eval mode (no dropout).
            self.model.train(training)
            self._mode = training

    def forget_mode(self) -> None:
        """Set the mode again at the next forward: modules were added (new LoRA layers start in train mode)."""
        self._mode = None

    def run(
        self,
        group: TrainGroup,
        rows: Sequence[InputFeature],
        training: bool,
        lora: bool = True,
        fused: output_layer.FusedReads | None = None,
        packs: bool = False,
    ) -> tuple[Batch, Outputs]:
        """The group's rows through the model (``lora=False``: the base model alone; ``fused``: see
        ``outputs``; ``packs``: see ``processor``)."""
        self.parallel.check_trainable(training and group.name == FULL)
        self.prepare(training)
        batch = self.collate(group, rows, packs)
        multi_lora.assign_rows(self.model, group.name if lora and group.name != FULL else None)
        head = group.spec.value_head if lora else None
        outputs = self.outputs(batch, hidden_state=head is not None, fused=fused)
        if head is not None:
            outputs['values'] = head(outputs.pop('hidden_state'))
        return batch, outputs

    def fused_reads(self, losses: Sequence[Loss], metrics: Sequence[Metric] = ()) -> output_layer.FusedReads | None:
        """What a training pass of these losses, feeding these metrics, computes on the fused
        output layer, or None where it needs the logits: the switch is off, a loss or a metric
        reads the logits, or the head cannot run fused (``output_layer.fusable``). Under Ulysses
        each rank scores its slice of the sequence and the ranks gather ``[rows, positions]``
        values, not logits."""
        reads = {loss.reads for loss in losses}
        if not self.fused_output or 'logits' in reads or any(metric.reads_logits() for metric in metrics):
            return None
        if not output_layer.fusable(self.model):
            return None
        return 'logps+entropy' if 'logps+entropy' in reads else 'logps'

    def outputs(
        self,
        batch: Batch,
        router_logits: bool = True,
        hidden_state: bool = False,
        fused: output_layer.FusedReads | None = None,
    ) -> Outputs:
        """The batch's ``logits`` and, on a mixture of experts, its ``router_logits`` per row
        ([layers, rows, positions, experts]), through the adapters the rows are assigned to;
        with ``hidden_state``, the last hidden state too (``[rows, positions, hidden]``, for a value head).

        ``fused``: no logits; the labels' ``logps``, ``hits`` and, for ``'logps+entropy'``, ``entropy``
        (``[rows, positions]``) from the fused output layer (``output_layer.head_outputs``). The model
        then projects no position (``logits_to_keep`` empty) and hands back its last hidden states."""
        model_inputs: dict[str, object] = {
            k: batch[k] for k in ('input_ids', 'attention_mask', 'position_ids') if k in batch
        }
        sequence = self.parallel.sequence  # Ulysses: this rank runs its slice of the sequence
        if 'pixel_values' in batch:
            if sequence is not None:
                raise ConfigurationError(
                    'rows with images cannot be split over a Ulysses sequence group (ulysses_size > 1)'
                )
            _tower_rows(self.model)
            model_inputs |= {k: batch[k] for k in IMAGE_INPUTS}
            model_inputs['position_ids'] = mrope_positions(self.model, batch)
        elif sequence is not None:
            model_inputs = sequence.split(batch, self.model.config)
        extra: dict[str, object] = {'output_hidden_states': True} if hidden_state or fused else {}
        if fused:
            extra['logits_to_keep'] = torch.empty(0, dtype=torch.long, device=self.device)
        model_inputs |= packed_recurrence.model_kwargs(self.model, batch)
        with self._autocast(), router.replay_routing(self.model, batch.get('routed_experts')):
            if self.router is None or not router_logits:
                out = self.model(**model_inputs, **extra, use_cache=False)
                outputs = {}
            else:
                out = self.model(**model_inputs, **extra, use_cache=False, output_router_logits=True)
                outputs = {'router_logits': router.per_row(out.router_logits, len(batch['input_ids']))}
            if fused:
                labels = batch['labels'] if sequence is None else sequence.local_labels(batch['labels'])
                outputs |= output_layer.head_outputs(self.model, out.hidden_states[-1], labels, fused)
            else:
                outputs['logits'] = out.logits
        if hidden_state:
            outputs['hidden_state'] = out.hidden_states[-1]
        if sequence is not None:  # the whole sequence's, as one process has them
            outputs = {key: sequence.gather(value, batch['input_ids'].shape[1]) for key, value in outputs.items()}
        return outputs

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.mixed_precision == 'bf16':
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def checkpointing(self) -> bool:
        """Whether the model recomputes layers in the backward (transformers' gradient checkpointing;
        ``is_activation_checkpointing`` from transformers 5, ``is_gradient_checkpointing`` before)."""
        if hasattr(type(self.model), 'is_activation_checkpointing'):
            return bool(self.model.is_activation_checkpointing)
        return bool(getattr(self.model, 'is_gradient_checkpointing', False))

    # ---- one adapter's passes -------------------------------------------------------------------
    def forward(
        self, group: TrainGroup, features: list[InputFeature], training: bool, lora: bool = True
    ) -> ModelOutput:
        """A forward of the rows left pending on the group (``Pending``) for ``calculate_loss``
        and, when ``training``, ``backward``; its logits and label logprobs."""
        batch, outputs = self.run(group, features, training, lora)
        group.pending.forward = Pending(batch, outputs, training, rows=len(features), carried=carried(features))
        return with_logps(outputs['logits'], batch, outputs.get('values'))

    def calculate_loss(self, group: TrainGroup, loss_inputs: dict[str, object]) -> float:
        """The loss of the group's pending forward, fed to its metrics: its mean over the items
        it counts, over every rank (the pending forward keeps it for ``backward``)."""
        pending = group.pending.forward
        if pending is None:
            raise StateError(f'calculate_loss() needs a forward()/forward_only() first (adapter {group.name!r})')
        loss_inputs = {**pending.carried, **loss_inputs}
        pending.loss = self.loss(group, pending.batch, pending.outputs, pending.training, loss_inputs)
        sums = torch.stack([pending.loss.loss.detach().float(), pending.loss.num_items.float()])
        total, items = self.parallel.sum_(sums)
        return float(total / items.clamp(min=1))

    def backward_pending(self, group: TrainGroup) -> None:
        """The backward of the group's pending training forward and its loss: one micro step."""
        pending = group.pending.forward
        if pending is None or pending.loss is None or not pending.training:
            raise StateError(f'backward() needs forward() then calculate_loss() first (adapter {group.name!r})')
        check_finite(group, pending.loss, self.parallel.sum_)
        self.backward(group, pending.loss)
        group.window.count_backward(pending.rows)
        group.pending.forward = None

    def forward_backward(
        self,
        group: TrainGroup,
        features: list[InputFeature],
        micro_batch_size: int | None,
        loss_inputs: dict[str, object],
    ) -> ModelOutput:
        """Forward, loss and backward of the rows, in chunks of ``micro_batch_size`` (one micro
        step either way); a NaN or infinite loss raises ``DataError`` before its backward."""
        started, sums = time.perf_counter(), []
        self.parallel.check_trainable(group.name == FULL)
        self.prepare(training=True)  # the mode (LoRA dropout) and the shards fused_reads looks at
        fused = self.fused_reads([group.spec.loss], group.spec.train_metrics)
        for rows, chunk_inputs in chunks(features, micro_batch_size, loss_inputs):
            batch, outputs = self.run(group, rows, training=True, fused=fused, packs=True)
            loss = self.loss_value(group, batch, outputs, chunk_inputs)
            check_finite(group, loss, self.parallel.sum_)  # before the metrics and the gradients see it
            if self.parallel.row_share:  # a Ulysses group counts its metrics and rows once
                accumulate(group, batch, outputs, loss, training=True)
            self.backward(group, loss)
            sums.append(loss_sums(loss, batch, len(rows)) * self.parallel.row_share)
        call_sums = self.parallel.sum_(torch.stack(sums).sum(0)).tolist()
        return record_call(group, features, call_sums, time.perf_counter() - started, self.parallel.row_share)

    # ---- losses and the backward ----------------------------------------------------------------
    def loss(
        self, group: TrainGroup, batch: Batch, outputs: Outputs, training: bool, loss_inputs: dict[str, object]
    ) -> LossOutput:
        """``loss_value``, fed to the group's training (or evaluation) metrics."""
        loss = self.loss_value(group, batch, outputs, loss_inputs)
        if self.parallel.row_share:  # a Ulysses group counts its metrics once
            accumulate(group, batch, outputs, loss, training)
        return loss

    def loss_value(
        self, group: TrainGroup, batch: Batch, outputs: Outputs, loss_inputs: dict[str, object]
    ) -> LossOutput:
        """The group's loss of a forward's ``outputs`` (the reference logprobs computed first
        where the loss needs them and none were given), with the router's loss on a mixture of experts."""
        if group.spec.loss.needs_reference and 'ref_logps' not in loss_inputs and group.name != FULL:
            outputs['ref_logps'] = self._reference_logps(batch)
        loss = self._router_loss(batch, outputs, group.spec.loss(batch, outputs, **loss_inputs))
        return self.parallel.own_share(loss)

    def backward(self, group: TrainGroup, loss: LossOutput) -> None:
        """The loss's backward, its items added to what the group's step divides by."""
        check_trainable(group, loss)
        torch.autograd.backward(loss.loss)
        group.pending.add_items(loss.num_items)

    def _reference_logps(self, batch: Batch) -> torch.Tensor:
        """Label-token logprobs under the base model with every adapter switched off: the KL
        reference of GRPO and DPO, at the cost of one forward pass and no extra weights."""
        # The base model, then back to the rows the training forward used: gradient
        # checkpointing recomputes those layers during backward.
        # The fused layer here needs only the switch and the head (no loss reads the logits).
        fused: output_layer.FusedReads | None = 'logps' if self.fused_reads([]) else None
        with torch.no_grad(), multi_lora.row_adapters(self.model, None):
            outputs = self.outputs(batch, router_logits=False, fused=fused)
        return outputs['logps'] if fused else label_logps(outputs['logits'], batch['labels'])

    def _router_loss(self, batch: Batch, outputs: Outputs, loss: LossOutput) -> LossOutput:
        """The experts' load into ``outputs`` for the metrics and, where the loss trains (its
        router logits carry gradients: not ``forward_only``), the router's load-balancing loss of
        these rows added to ``loss``, x its items: the step divides by them, so the optimizer sees
        the mean loss plus coef x aux, as transformers adds it. A summed loss (no items: Tinker's)
        gets coef x aux per real token, what that sum of per-token losses would get."""
        if self.router is None or 'router_logits' not in outputs:
            return loss
        logits, mask = outputs['router_logits'], batch.get('attention_mask')
        outputs['expert_tokens'] = router.expert_tokens(self.router, logits.detach(), mask)
        if not logits.requires_grad or not self.router.aux_loss_coef:
            return loss
        aux = router.aux_loss(self.router, logits, mask)
        outputs['router_aux_loss'] = aux.detach()
        tokens = mask.sum() if mask is not None else torch.tensor(batch['input_ids'].numel())
        items = torch.where(loss.num_items > 0, loss.num_items.detach(), tokens.to(loss.num_items.device))
        return LossOutput(loss.loss + self.router.aux_loss_coef * aux * items, loss.num_items, loss.metrics)

    def router_metrics(self) -> list[Metric]:
        """The metrics a group adds on a mixture of experts (the experts' load); none otherwise."""
        return [] if self.router is None else [ExpertLoad()]


def _tower_rows(model: torch.nn.Module) -> None:
    """The vision tower runs on image patches, not on batch rows: an adapter on the tower works
    when one adapter takes every row (its layers are given that one name for any patch count),
    but not in a pass that sends rows through several adapters."""
    for path, layer in multi_lora.multi_lora_layers(model).items():
        names = layer.assignment.names if layer.assignment is not None else None
        if not (multi_lora.is_vision_path(path) and layer.adapters and names is not None):
            continue
        if len(set(names)) > 1:
            raise ConfigurationError(
                f'adapters {sorted(layer.adapters)} adapt the vision tower ({path}), so their image rows '
                f"cannot share a pass with other adapters' rows ({sorted(set(map(str, names)))}); run them alone"
            )
        layer.assignment = RowAssignment.from_names(names[0])


def mrope_positions(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The position ids of a batch with images, ``[4, rows, positions]``: the text positions the
    batch carries (which restart at each packed row, so transformers masks attention to each),
    then Qwen's multimodal RoPE positions (temporal, height, width), computed by the model's own
    ``get_rope_index`` for each sequence alone: each padded row, and each row packed into a
    padding-free one, with its own images. A packed row thus gets exactly the positions it gets
    unpacked; transformers, given a packed row whole, would count on from the row before it (the
    same attention, RoPE being relative, but not the same numbers)."""
    get_rope_index: Any = getattr(getattr(model, 'model', model), 'get_rope_index', None)
    if not callable(get_rope_index):
        raise ConfigurationError(
            f'{type(model).__name__} takes no images (no get_rope_index): rows with images need a VLM'
        )
    ids, kinds = batch['input_ids'], batch['mm_token_type_ids']
    text = batch.get('position_ids')
    if text is None:
        text = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    mask = batch.get('attention_mask')
    grids = list(batch['image_grid_thw'])
    out = torch.zeros(3, *ids.shape, dtype=torch.long, device=ids.device)
    used = 0
    for row in range(ids.shape[0]):
        real = mask[row].bool() if mask is not None else torch.ones_like(ids[row], dtype=torch.bool)
        columns = real.nonzero()[:, 0]
        positions = text[row, columns]
        starts = [0, *(torch.nonzero(positions[1:] <= positions[:-1])[:, 0] + 1).tolist(), len(columns)]
        for start, stop in itertools.pairwise(starts):
            cols = columns[start:stop]
            kind = kinds[row, cols]
            images = int((kind[0] == 1) + ((kind[1:] == 1) & (kind[:-1] != 1)).sum())  # runs of image tokens
            if used + images > len(grids):
                raise DataError(f'the batch has {len(grids)} images but more runs of image tokens in its rows')
            grid = torch.stack(grids[used : used + images]) if images else None
            found, _ = get_rope_index(ids[row, cols][None], kind[None], image_grid_thw=grid)
            out[:, row, cols] = found[:, 0]
            used += images
    if used != len(grids):
        raise DataError(f'the batch has {len(grids)} images but {used} runs of image tokens in its rows')
    return torch.cat([text[None], out])


__all__ = ['ALIGNED_FIELDS', 'ModelRunner', 'mrope_positions']
