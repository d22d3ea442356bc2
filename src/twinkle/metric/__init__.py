"""Metrics: loss, token accuracy, learning rate, gradient norm, throughput, experts' load, RL
statistics and the staleness of sampled data."""

from twinkle.metric.base import METRICS, Metric
from twinkle.metric.completion import CompletionRewardMetric
from twinkle.metric.experts import ExpertLoad
from twinkle.metric.grpo import GRPOMetric
from twinkle.metric.loss import Accuracy, LossMetric
from twinkle.metric.sinks import (
    SINKS,
    JsonlSink,
    MetricSink,
    MetricWriter,
    TensorBoardSink,
    WandbSink,
    add_sink_arguments,
)
from twinkle.metric.staleness import StalenessMetric
from twinkle.metric.train import TrainMetric

__all__ = [
    'METRICS',
    'SINKS',
    'Accuracy',
    'CompletionRewardMetric',
    'ExpertLoad',
    'GRPOMetric',
    'JsonlSink',
    'LossMetric',
    'Metric',
    'MetricSink',
    'MetricWriter',
    'StalenessMetric',
    'TensorBoardSink',
    'TrainMetric',
    'WandbSink',
    'add_sink_arguments',
]
