"""A ModelScope dataset repository as a read-only fsspec filesystem, streamed, not downloaded.

ModelScope's streaming mode (``MsDataset.load(..., use_streaming=True)``) reads a dataset's
files over HTTP from the hub's per-file URL (``/api/v1/datasets/{org}/{name}/repo?FilePath=``)
as it iterates. This filesystem does the same for ``IterableDataset``: ``modelscope_hub`` lists
the repository's files (sizes included) and builds each file's URL, and fsspec's HTTP file reads
it in ranged requests, one per buffered read. A stream can therefore seek, and so resume mid-file, without downloading.

>>> fs = ModelScopeFileSystem('AI-ModelScope/alpaca-gpt4-data-en')  # doctest: +SKIP
>>> fs.find('AI-ModelScope/alpaca-gpt4-data-en')  # doctest: +SKIP
"""

from __future__ import annotations

import posixpath
from typing import Any

from fsspec.implementations.http import HTTPFileSystem
from fsspec.spec import AbstractFileSystem

from twinkle.errors import AssetNotFoundError, HubUnavailableError


class ModelScopeFileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec ships no types: its classes are Any
    """The files of one ModelScope dataset repository at one revision, under ``org/name/``.

    The hub's endpoint and token are read from the environment when the filesystem is made
    (``MODELSCOPE_ENDPOINT``, ``MODELSCOPE_API_TOKEN`` or a ``modelscope login``), as
    ``modelscope_hub`` reads them.
    """

    protocol = 'ms'
    cachable = False  # one listing per repository and revision, not a shared instance

    def __init__(self, repo_id: str, revision: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        from modelscope_hub import HubApi, HubConfig

        self.repo_id, self.revision = repo_id, revision or 'master'
        self._api = HubApi(HubConfig())
        self._sizes = self._list()
        token = self._api.legacy.token
        headers = {'Authorization': f'Bearer {token}', 'Cookie': f'm_session_id={token}'} if token else {}
        self._http = HTTPFileSystem(headers=headers, skip_instance_cache=True)

    def _list(self) -> dict[str, int]:
        from modelscope_hub.errors import HubError, NetworkError

        try:
            listing = self._api.list_repo_files(self.repo_id, 'dataset', revision=self.revision)
        except NetworkError as error:
            raise HubUnavailableError(
                f'ModelScope could not be reached to list the dataset {self.repo_id!r}: {type(error).__name__}; '
                'check the network and MODELSCOPE_ENDPOINT'
            ) from error
        except HubError as error:
            raise AssetNotFoundError(
                f'the ModelScope dataset {self.repo_id!r} (revision {self.revision!r}) could not be listed: '
                f'{type(error).__name__}'
            ) from error
        return {f'{self.repo_id}/{item.path.lstrip("/")}': item.size for item in listing if not item.is_dir}

    def url(self, path: str) -> str:
        """The hub's download URL of a file of the repository."""
        inner = posixpath.relpath(self._strip_protocol(path), self.repo_id)
        return self._api.legacy.get_download_url(self.repo_id, 'dataset', inner, revision=self.revision)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        """The entries right under ``path`` (folders are the prefixes of file paths)."""
        path = self._strip_protocol(path).rstrip('/')
        if path in self._sizes:
            entries = {path: {'name': path, 'size': self._sizes[path], 'type': 'file'}}
        else:
            entries = {}
            for name, size in self._sizes.items():
                if not name.startswith(path + '/'):
                    continue
                head, _, rest = name[len(path) + 1 :].partition('/')
                child = f'{path}/{head}'
                entries[child] = {'name': child, 'size': 0 if rest else size, 'type': 'directory' if rest else 'file'}
            if not entries:
                raise FileNotFoundError(path)
        listed = [entries[name] for name in sorted(entries)]
        return listed if detail else [entry['name'] for entry in listed]

    def _open(self, path: str, mode: str = 'rb', **kwargs: Any) -> Any:
        """The file, read with one ranged request per read (no read-ahead: the stream's
        reader buffers)."""
        if mode != 'rb':
            raise NotImplementedError(f'a ModelScope dataset opens for reading only (mode "rb"), not {mode!r}')
        path = self._strip_protocol(path)
        if path not in self._sizes:
            raise FileNotFoundError(path)
        return self._http.open(self.url(path), 'rb', size=self._sizes[path], cache_type='none')
