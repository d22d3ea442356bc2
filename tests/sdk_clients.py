"""Tinker SDK clients that a test closes: each ``tinker.ServiceClient`` runs a session heartbeat
that, left open, outlives the test's server and logs ``Session heartbeat failed`` until the
process ends. ``ServiceClients`` makes clients and closes every one it made;
``open_sdk_sessions`` finds the heartbeats still running, for the check that none outlive a module.

The SDK runs each heartbeat as an asyncio task (``InternalClientHolder._session_heartbeat``) on
one daemon thread shared by every client of the process, that runs for the life of the process:
what a closed client stops is its task, never that thread, so the task is what is looked for.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a client is made: tinker imports torch, and conftest.py imports this
    import tinker

#: Seconds a close may take: it tells the server that the session finished, which takes
#: milliseconds; when the server is already gone the SDK would retry for 5 minutes.
CLOSE_TIMEOUT_S = 30.0


class ServiceClients:
    """``clients(url, key)`` is a ``tinker.ServiceClient``; ``close()`` (or the end of a ``with``)
    closes every client made or ``keep``-ed, so none of their heartbeats outlives the test.

    Close before the server stops: a close finishes the session on the server. The fixtures of
    conftest.py (``sdk_clients``, ``module_sdk_clients``) do this when requested after the server.
    """

    def __init__(self) -> None:
        self._made: list[tinker.ServiceClient] = []

    def __call__(self, url: str, key: str, **options: Any) -> tinker.ServiceClient:
        """A client of ``key``'s tenant at ``url``; ``options`` are more ``ServiceClient`` arguments."""
        import tinker

        return self.keep(tinker.ServiceClient(base_url=url, api_key=key, **options))

    def keep(self, client: tinker.ServiceClient) -> tinker.ServiceClient:
        """Close ``client`` with the others: for a client made elsewhere (``init_tinker_compat_client``)."""
        self._made.append(client)
        return client

    def close(self) -> None:
        """Close every client (each is tried even when one fails), then raise the first failure."""
        failures: list[BaseException] = []
        while self._made:
            client = self._made.pop()
            try:
                client.close('success').result(timeout=CLOSE_TIMEOUT_S)
            except Exception as error:  # the others are still closed
                failures.append(error)
        if failures:
            raise RuntimeError(
                f'{len(failures)} Tinker SDK client(s) failed to close, each given {CLOSE_TIMEOUT_S:.0f} s '
                f'(was their server stopped first?); the first: {failures[0]!r}'
            ) from failures[0]

    def __enter__(self) -> ServiceClients:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def open_sdk_sessions() -> list[str]:
    """The ids of the sessions whose heartbeat task is running in this process; ``[]`` before
    ``tinker`` is imported or its loop started (no client can have started one then)."""
    if 'tinker' not in sys.modules:
        return []
    from tinker.lib import internal_client_holder as holder_module

    loop = holder_module._internal_client_holder_thread_singleton.loop_if_started()
    if loop is None:
        return []
    heartbeat = holder_module.InternalClientHolder._session_heartbeat.__code__

    async def heartbeats() -> list[str]:  # all_tasks reads the loop's tasks: on the loop's own thread
        coroutines = [task.get_coro() for task in asyncio.all_tasks()]
        return [
            str(inspect.getcoroutinelocals(coroutine).get('session_id'))
            for coroutine in coroutines
            if inspect.iscoroutine(coroutine) and coroutine.cr_code is heartbeat
        ]

    return asyncio.run_coroutine_threadsafe(heartbeats(), loop).result(timeout=10)
