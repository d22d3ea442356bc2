"""Optimizers and learning-rate schedulers by name.

Every ``torch.optim`` optimizer and ``torch.optim.lr_scheduler`` scheduler is registered under
its class name, plus the warmup schedules the reference release offers. Keyword arguments are
checked against the constructor, so a typo fails with the accepted names instead of a bare
``TypeError`` deep inside torch; a value the class refuses (``lr=-1``, ``lr='fast'``) is a
``ConfigurationError`` naming the argument, its value and what is accepted.
``check_optimizer_args`` / ``check_scheduler_args`` run the same checks over a one-number
parameter, touching no model: a server calls them before it queues ``set_optimizer``.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from twinkle.errors import ConfigurationError
from twinkle.registry import Registry

T = TypeVar('T')
OPTIMIZERS: Registry[Optimizer] = Registry('optimizer')
SCHEDULERS: Registry[LRScheduler] = Registry('lr scheduler')

for _name, _cls in vars(torch.optim).items():
    if isinstance(_cls, type) and issubclass(_cls, Optimizer) and _cls is not Optimizer and not _name.startswith('_'):
        OPTIMIZERS.register(_cls, name=_name)
for _name, _cls in vars(torch.optim.lr_scheduler).items():
    if isinstance(_cls, type) and issubclass(_cls, LRScheduler) and not _name.startswith('_'):
        SCHEDULERS.register(_cls, name=_name)


class WarmupScheduler(LambdaLR, ABC):
    """Linear warmup over ``num_warmup_steps``, then ``decay(progress)`` (from 1 at the end of
    the warmup to 0 at ``num_training_steps``) scaled into ``[min_lr_ratio, 1]`` of the base rate.
    A subclass says how it decays; the two registered ones share this one schedule."""

    def __init__(
        self,
        optimizer: Optimizer,
        num_warmup_steps: int = 0,
        num_training_steps: int = 1000,
        min_lr_ratio: float = 0.0,
        last_epoch: int = -1,
    ):
        _check_steps(num_warmup_steps, num_training_steps)

        def factor(step: int) -> float:
            if step < num_warmup_steps:
                return (step + 1) / (num_warmup_steps + 1)
            progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
            return min_lr_ratio + (1.0 - min_lr_ratio) * self.decay(progress)

        super().__init__(optimizer, factor, last_epoch)

    @abstractmethod
    def decay(self, progress: float) -> float:
        """The share of the way from the base rate down to ``min_lr_ratio`` of it left at
        ``progress`` (0 at the end of the warmup, 1 at ``num_training_steps``): 1 falling to 0."""


@SCHEDULERS.register
class CosineWarmupScheduler(WarmupScheduler):
    """Linear warmup over ``num_warmup_steps``, then a cosine decay to ``min_lr_ratio`` of the
    base rate at ``num_training_steps`` (``num_cycles=0.5`` is one half cosine)."""

    def __init__(
        self,
        optimizer: Optimizer,
        num_warmup_steps: int = 0,
        num_training_steps: int = 1000,
        num_cycles: float = 0.5,
        min_lr_ratio: float = 0.0,
        last_epoch: int = -1,
    ):
        self.num_cycles = num_cycles  # before the base steps to the first rate, which decays by it
        super().__init__(optimizer, num_warmup_steps, num_training_steps, min_lr_ratio, last_epoch)

    def decay(self, progress: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * self.num_cycles * 2.0 * progress))


@SCHEDULERS.register
class LinearWarmupScheduler(WarmupScheduler):
    """Linear warmup over ``num_warmup_steps``, then a linear decay to ``min_lr_ratio`` of the
    base rate at ``num_training_steps``."""

    def decay(self, progress: float) -> float:
        return 1.0 - progress


def _check_steps(num_warmup_steps: int, num_training_steps: int) -> None:
    if num_warmup_steps < 0 or num_training_steps <= 0:
        raise ConfigurationError(
            f'need num_warmup_steps >= 0 and num_training_steps > 0; '
            f'got num_warmup_steps={num_warmup_steps}, num_training_steps={num_training_steps}'
        )


def check_kwargs(kind: str, cls: Callable[..., Any], kwargs: dict[str, Any], skip: Iterable[str]) -> None:
    """Fail with the accepted argument names if ``kwargs`` has one ``cls`` does not take."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [name for name in params if name not in skip]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigurationError(f'{kind} {cls.__name__} does not take {unknown}. Accepted arguments are: {accepted}')


#: What torch accepts for the common hyperparameters, for the errors that name one of them.
ACCEPTED = {
    'lr': 'a number >= 0',
    'eps': 'a number >= 0',
    'weight_decay': 'a number >= 0',
    'momentum': 'a number >= 0',
    'betas': 'two numbers in [0, 1)',
    'num_warmup_steps': 'an integer >= 0',
    'num_training_steps': 'an integer > 0',
    'step_size': 'an integer > 0',
    'gamma': 'a number',
}
#: What a constructor may raise for a value it refuses (an IndexError for betas=[0.9], say).
_REFUSALS = (TypeError, ValueError, IndexError, KeyError, RuntimeError, ConfigurationError)


def build_optimizer(spec: str | type[Optimizer], params: list[Any], kwargs: dict[str, Any]) -> Optimizer:
    """``spec(params, **kwargs)``, checked; Adam and AdamW take torch's fused kernel by default
    (``fused_by_default``)."""
    cls = OPTIMIZERS.get(spec) if isinstance(spec, str) else _subclass(spec, Optimizer, 'optimizer')
    check_kwargs('optimizer', cls, kwargs, skip=('params',))
    return _refused_or('optimizer', cls, kwargs, lambda args: cls(params, **fused_by_default(cls, params, args)))


#: The optimizers whose fused kernel is their default here (torch's own default is another kernel).
FUSED_BY_DEFAULT = (torch.optim.Adam, torch.optim.AdamW)
#: Arguments by which a caller chooses the kernel itself (``differentiable`` has no fused kernel).
_KERNEL_CHOICES = ('foreach', 'fused', 'differentiable')


def fused_by_default(cls: Callable[..., object], params: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``fused=True`` for Adam and AdamW over plain floating-point tensors on the
    CPU or a GPU, unless the caller chose a kernel. torch's default kernel runs Adam's update as a
    pass over the tensor per operation (about ten); the fused kernel makes one pass, the same
    arithmetic: the clip and step of 8 LoRA adapters of ``small-qwen3`` took 41.9 against 103.7 ms
    on the CPU (``benchmarks/multi_step.py``). Its rounding may differ from the default's in the last bit.
    Sharded (DTensor) parameters keep torch's default."""
    if cls not in FUSED_BY_DEFAULT or any(name in kwargs for name in _KERNEL_CHOICES):
        return kwargs
    tensors = [p for group in params for p in (group['params'] if isinstance(group, dict) else [group])]
    plain = all(
        type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point() and p.device.type in ('cpu', 'cuda')
        for p in tensors
    )
    return {**kwargs, 'fused': True} if tensors and plain else kwargs


def build_scheduler(spec: str | type[LRScheduler], optimizer: Optimizer, kwargs: dict[str, Any]) -> LRScheduler:
    cls = SCHEDULERS.get(spec) if isinstance(spec, str) else _subclass(spec, LRScheduler, 'lr scheduler')
    check_kwargs('lr scheduler', cls, kwargs, skip=('optimizer',))
    return _refused_or('lr scheduler', cls, kwargs, lambda args: cls(optimizer, **args))


def check_optimizer_args(spec: str, kwargs: dict[str, Any], device: torch.device | str = 'cpu') -> None:
    """``ConfigurationError`` unless ``spec(**kwargs)`` builds and steps over one zero 2x2
    parameter on ``device`` (a matrix, as every optimizer takes: Muon takes nothing else): torch
    checks an optimizer's hyperparameters in ``__init__``, so this is the exact check, touching
    no model."""
    cls = OPTIMIZERS.get(spec)
    check_kwargs('optimizer', cls, kwargs, skip=('params',))

    def build_and_step(args: dict[str, Any]) -> None:
        param = torch.nn.Parameter(torch.zeros(2, 2, device=device))
        optimizer = cls([param], **args)
        param.grad = torch.zeros_like(param)
        optimizer.step()

    _refused_or('optimizer', cls, kwargs, build_and_step)


def check_scheduler_args(spec: str, kwargs: dict[str, Any]) -> None:
    """``ConfigurationError`` unless ``spec(**kwargs)`` builds over a plain SGD optimizer and
    takes two steps (some schedulers read an argument only when they step)."""
    cls = SCHEDULERS.get(spec)
    check_kwargs('lr scheduler', cls, kwargs, skip=('optimizer',))

    def build_and_step(args: dict[str, Any]) -> None:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = cls(optimizer, **args)
        for _ in range(2):
            optimizer.step()
            scheduler.step()

    _refused_or('lr scheduler', cls, kwargs, build_and_step)


def _refused_or(
    kind: str, cls: Callable[..., object], kwargs: dict[str, Any], build: Callable[[dict[str, Any]], T]
) -> T:
    """``build(kwargs)``; what it raises for a refused value becomes a ``ConfigurationError``
    that names the argument, its value and what is accepted."""
    try:
        return build(kwargs)
    except _REFUSALS as error:
        culprit = _culprit(cls, kwargs, build)
        if culprit is None:
            raise ConfigurationError(
                f'{kind} {cls.__name__}({_shown(kwargs)}) is refused ({type(error).__name__}: {error}); '
                f'it accepts what torch documents for {cls.__name__}'
            ) from error
        accepted = ACCEPTED.get(culprit, f'what torch documents for {cls.__name__}')
        raise ConfigurationError(
            f'{kind} {cls.__name__} does not accept {culprit}={kwargs[culprit]!r} '
            f'({type(error).__name__}: {error}); accepted {culprit}: {accepted}'
        ) from error


def _culprit(
    cls: Callable[..., object], kwargs: dict[str, Any], build: Callable[[dict[str, Any]], object]
) -> str | None:
    """The first argument refused beside the required ones alone (those first)."""
    params = inspect.signature(cls).parameters
    required = {n: v for n, v in kwargs.items() if n in params and params[n].default is inspect.Parameter.empty}
    try:
        build(required)
    except _REFUSALS:
        return None  # refused with the required arguments alone: no optional one is to blame
    for name in [*required, *(n for n in kwargs if n not in required)]:
        try:
            build({**required, name: kwargs[name]})
        except _REFUSALS:
            return name
    return None


def _shown(kwargs: dict[str, Any]) -> str:
    return ', '.join(f'{name}={value!r}' for name, value in kwargs.items())


def set_hyperparams(optimizer: Optimizer, values: dict[str, Any]) -> None:
    """Set ``values`` (``lr``, ``betas``, ``eps``, ``weight_decay``; None: unchanged) on every
    parameter group of ``optimizer``, keeping its state. ``weight_decay`` goes only to groups
    holding parameters of 2 or more dimensions: biases and norms keep none (``set_optimizer``)."""
    values = {name: value for name, value in values.items() if value is not None}
    _check_hyperparams(values)
    has = set(optimizer.defaults)
    missing = sorted(set(values) - has)
    if missing:
        raise ConfigurationError(
            f'{type(optimizer).__name__} has no hyperparameters {missing}; its hyperparameters are {sorted(has)}'
        )
    if 'betas' in values:
        values['betas'] = tuple(values['betas'])
    for group in optimizer.param_groups:
        decays = any(param.ndim >= 2 for param in group['params'])
        group.update({k: v for k, v in values.items() if k != 'weight_decay' or decays})


#: The values ``set_hyperparams`` takes (finite numbers only; torch's own bounds, see ``ACCEPTED``).
HYPERPARAMS: dict[str, Callable[[float], bool]] = {
    'lr': lambda value: value >= 0,
    'betas': lambda value: 0 <= value < 1,
    'eps': lambda value: value >= 0,
    'weight_decay': lambda value: value >= 0,
}


def _check_hyperparams(values: dict[str, Any]) -> None:
    betas = values.get('betas')
    if betas is not None and (not isinstance(betas, (tuple, list)) or len(betas) != 2):
        raise ConfigurationError(f'optimizer betas={betas!r} is refused; accepted betas: {ACCEPTED["betas"]}')
    for name, value in values.items():
        for number in value if name == 'betas' else [value]:
            is_number = isinstance(number, (int, float)) and not isinstance(number, bool)
            if not (is_number and math.isfinite(number) and HYPERPARAMS[name](number)):
                raise ConfigurationError(
                    f'optimizer {name}={value!r} is refused; accepted {name}: {ACCEPTED[name]}, finite'
                )


def _subclass(spec: object, base: type[T], kind: str) -> type[T]:
    if isinstance(spec, type) and issubclass(spec, base):
        return spec
    raise ConfigurationError(f'{kind} must be a registered name or a {base.__name__} subclass; got {spec!r}')
