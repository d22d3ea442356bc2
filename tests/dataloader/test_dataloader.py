"""twinkle.dataloader: batches, epochs, seeded shuffling, and resuming mid-run.

Rows are ``{'i': k}`` so a batch reads as the list of its ``k``; expected batches are written out
by hand from ``batch_size`` and the row count.
"""

from __future__ import annotations

import itertools
from typing import Any

import datasets as hf
import pytest

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError, DataError

hf.disable_progress_bars()


def rows(n: int) -> list[dict[str, int]]:
    return [{'i': k} for k in range(n)]


def ids(batch: list[dict[str, Any]]) -> list[int]:
    return [row['i'] for row in batch]


def epoch(loader: DataLoader) -> list[list[int]]:
    return [ids(batch) for batch in loader]


def batches(loader: DataLoader, count: int) -> list[list[int]]:
    """The next ``count`` batches, running into later epochs as a training loop does."""
    out: list[list[int]] = []
    while len(out) < count:
        out += [ids(batch) for batch in itertools.islice(iter(loader), count - len(out))]
    return out


# ---------------------------------------------------------------------------------------------
# Batching


def test_batches_in_order_with_a_short_tail() -> None:
    loader = DataLoader(rows(10), batch_size=4)
    assert len(loader) == 3
    assert epoch(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert epoch(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # the next epoch, same order unshuffled


@pytest.mark.parametrize(
    ('kwargs', 'expected'),
    [
        ({'min_batch_size': 3}, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # the tail of 2 is below 3: dropped
        ({'min_batch_size': 2}, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]),  # a tail of 2 is enough
        ({'drop_last': True}, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ],
)
def test_min_batch_size_and_drop_last(kwargs: dict[str, Any], expected: list[list[int]]) -> None:
    loader = DataLoader(rows(10), batch_size=4, **kwargs)
    assert len(loader) == len(expected)
    assert epoch(loader) == expected


def test_a_full_tail_is_never_dropped() -> None:
    loader = DataLoader(rows(8), batch_size=4, drop_last=True)
    assert epoch(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_shuffle_is_seeded_and_changes_across_epochs() -> None:
    first = DataLoader(rows(10), batch_size=5, shuffle=True, data_seed=3)
    second = DataLoader(rows(10), batch_size=5, shuffle=True, data_seed=3)
    epochs_first = [epoch(first) for _ in range(3)]
    assert epochs_first == [epoch(second) for _ in range(3)]
    assert epochs_first[0] != epochs_first[1] != epochs_first[2]
    assert epochs_first[0] != [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    other_seed = DataLoader(rows(10), batch_size=5, shuffle=True, data_seed=4)
    assert epoch(other_seed) != epochs_first[0]


@pytest.mark.parametrize('shuffle', [False, True])
def test_every_row_appears_once_per_epoch(shuffle: bool) -> None:
    loader = DataLoader(rows(11), batch_size=3, shuffle=shuffle)
    for _ in range(4):
        seen = [k for batch in epoch(loader) for k in batch]
        assert sorted(seen) == list(range(11))


def test_with_a_dropped_tail_each_epoch_has_distinct_rows() -> None:
    loader = DataLoader(rows(11), batch_size=3, shuffle=True, drop_last=True)
    dropped = []
    for _ in range(4):
        seen = [k for batch in epoch(loader) for k in batch]
        assert len(seen) == len(set(seen)) == 9  # 3 full batches of 3; 2 rows left out
        dropped.append(sorted(set(range(11)) - set(seen)))
    assert len({tuple(d) for d in dropped}) > 1  # the left-out rows change with the shuffle


# ---------------------------------------------------------------------------------------------
# State and resume


@pytest.mark.parametrize(('n', 'batch_size', 'kwargs'), [(10, 3, {}), (10, 4, {'drop_last': True}), (9, 3, {})])
def test_resume_reproduces_the_uninterrupted_batches(n: int, batch_size: int, kwargs: dict[str, Any]) -> None:
    reference_loader = DataLoader(rows(n), batch_size=batch_size, shuffle=True, data_seed=7, **kwargs)
    per_epoch = len(reference_loader)
    reference = batches(reference_loader, 3 * per_epoch)
    # Resume after every prefix of batches: mid-epoch, exactly on an epoch boundary, and later epochs.
    for done in range(2 * per_epoch + 1):
        consumed = sum(len(batch) for batch in reference[:done])
        resumed = DataLoader(rows(n), batch_size=batch_size, shuffle=True, data_seed=7, **kwargs)
        resumed.skip_consumed_samples(consumed)
        assert resumed.get_state() == {'consumed_train_samples': consumed, 'epoch': done // per_epoch}
        assert batches(resumed, per_epoch) == reference[done : done + per_epoch], done


def test_get_state_then_resume_in_a_new_loader() -> None:
    loader = DataLoader(rows(10), batch_size=3, shuffle=True, data_seed=1)
    iterator = iter(loader)
    for _ in range(len(loader) + 2):  # one epoch (4 batches), then 2 batches into the next
        try:
            next(iterator)
        except StopIteration:
            iterator = iter(loader)
            next(iterator)
    state = loader.get_state()
    assert state == {'consumed_train_samples': 10 + 6, 'epoch': 1}
    rest = batches(loader, 4)
    fresh = DataLoader(rows(10), batch_size=3, shuffle=True, data_seed=1)
    fresh.resume_from_checkpoint(state['consumed_train_samples'])
    assert batches(fresh, 4) == rest


def test_stopping_after_the_last_batch_does_not_lose_an_epoch() -> None:
    # zip() stops pulling after the last batch, so the loader never sees the epoch end; the next
    # epoch must still be a full one (it used to come out empty).
    loader = DataLoader(rows(6), batch_size=3, shuffle=True)
    first = [ids(batch) for _, batch in zip(range(2), loader, strict=False)]
    assert loader.get_state() == {'consumed_train_samples': 6, 'epoch': 1}
    second = epoch(loader)
    assert len(second) == 2 and second != first
    assert sorted(k for batch in second for k in batch) == list(range(6))


def test_set_epoch_starts_that_epoch_from_the_beginning() -> None:
    reference = DataLoader(rows(8), batch_size=4, shuffle=True)
    epochs = [epoch(reference) for _ in range(3)]
    loader = DataLoader(rows(8), batch_size=4, shuffle=True)
    next(iter(loader))
    loader.set_epoch(2)
    assert epoch(loader) == epochs[2]


# ---------------------------------------------------------------------------------------------
# Inputs and errors


@pytest.mark.parametrize('batch_size', [0, -2, 1.5, True, '4'])
def test_bad_batch_size(batch_size: Any) -> None:
    with pytest.raises(ConfigurationError, match='batch_size must be a positive integer'):
        DataLoader(rows(4), batch_size=batch_size)


@pytest.mark.parametrize('min_batch_size', [0, 5])
def test_bad_min_batch_size(min_batch_size: int) -> None:
    with pytest.raises(ConfigurationError, match=r'min_batch_size must be in \[1, batch_size=4\]'):
        DataLoader(rows(8), batch_size=4, min_batch_size=min_batch_size)


def test_empty_dataset() -> None:
    with pytest.raises(DataError, match='empty'):
        DataLoader([], batch_size=2)


def test_fewer_rows_than_min_batch_size() -> None:
    # Every batch would be dropped, so an epoch would be empty and resuming would divide by zero.
    with pytest.raises(DataError, match='3 rows, fewer than min_batch_size=4'):
        DataLoader(rows(3), batch_size=4, drop_last=True)


def test_negative_consumed_samples() -> None:
    with pytest.raises(ConfigurationError):
        DataLoader(rows(3), batch_size=2).skip_consumed_samples(-1)


def test_callable_dataset_is_built_once() -> None:
    calls = []

    def build() -> Dataset:
        calls.append(1)
        return Dataset(DatasetMeta(data=rows(5)))

    loader = DataLoader(build, batch_size=2)
    assert calls == [1]
    assert isinstance(loader.dataset, Dataset)
    assert epoch(loader) == [[0, 1], [2, 3], [4]]


def test_twinkle_and_hf_datasets() -> None:
    dataset = Dataset(DatasetMeta(data=rows(5)))
    assert epoch(DataLoader(dataset, batch_size=3)) == [[0, 1, 2], [3, 4]]
    assert epoch(DataLoader(hf.Dataset.from_list(rows(5)), batch_size=3)) == [[0, 1, 2], [3, 4]]


def test_the_loader_sees_later_transforms_of_its_dataset() -> None:
    dataset = Dataset(DatasetMeta(data=rows(6)))
    loader = DataLoader(dataset, batch_size=2)
    dataset.filter(lambda row: row['i'] % 2 == 0)
    assert len(loader) == 2
    assert epoch(loader) == [[0, 2], [4]]
