"""The address a client used, when a proxy stands between it and the server: a gateway, a load balancer.

The links the server hands out (``links.py``: checkpoint files, Tinker's exported weights, traces) and the
redirects the framework answers are built from the request (``request.base_url``): its ``Host`` header, its
scheme and its root path. Behind a proxy those are the proxy's connection to the server, which the client
cannot reach and should not learn, unless the proxy says what the client used:

- ``X-Forwarded-Host``: the host and port the client sent in its ``Host`` (a gateway passes ``Host`` itself);
- ``X-Forwarded-Proto``: ``http`` or ``https``, as the client spoke to the proxy;
- ``X-Forwarded-Prefix``: the path the proxy serves the API under (``/twinkle-svc``), which it took off;
- ``X-Forwarded-For``: the client's address (for the logs).

``ForwardedHeaders`` believes them only from a peer in ``trusted_proxies`` (addresses or networks): from any
other caller they change nothing, so a client talking to the server directly cannot make it hand out links
to another host. (uvicorn's own ``proxy_headers`` is turned off by ``uvicorn_options``: one list decides.)

>>> trusted = TrustedProxies(['127.0.0.1', '10.0.0.0/24'])
>>> [trusted.trusts(peer) for peer in ('127.0.0.1', '10.0.0.7', '10.0.1.7', 'not-an-address', None)]
[True, True, False, False, False]
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

#: What a forwarded prefix may be: a path of plain segments, without a query or a trailing slash.
_PREFIX = re.compile(r'(/[A-Za-z0-9._~!$&\'()*+,;=:@%-]+)+')
#: What a forwarded host may be: a name or an address, and a port.
_HOST = re.compile(r'[A-Za-z0-9.-]+(:\d{1,5})?|\[[0-9A-Fa-f:.]+\](:\d{1,5})?')


class TrustedProxies:
    """Addresses and networks (``'10.0.0.5'``, ``'10.0.0.0/24'``, ``'::1'``) whose forwarded headers count
    (``ServerConfig.trusted_proxies``, which checked them)."""

    def __init__(self, entries: Sequence[str]):
        self.networks = [ipaddress.ip_network(entry, strict=False) for entry in entries]

    def trusts(self, peer: str | None) -> bool:
        if peer is None or not self.networks:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:  # a unix socket's path, or no address at all
            return False
        return any(address in network for network in self.networks)


class ForwardedHeaders:
    """ASGI middleware: a trusted proxy's ``X-Forwarded-*`` headers become the request's host, scheme,
    root path and client, as if the client had come straight here."""

    def __init__(self, app: ASGIApp, trusted_proxies: Sequence[str]):
        self.app = app
        self.trusted = TrustedProxies(trusted_proxies)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope['type'] == 'http' and self.trusted.trusts((scope.get('client') or (None,))[0]):
            scope = forwarded_scope(scope)
        await self.app(scope, receive, send)


def forwarded_scope(scope: Scope) -> Scope:
    """``scope`` as its forwarded headers describe the client's request; a header with a value no client
    could have used is left out (it changes nothing)."""
    headers: list[tuple[bytes, bytes]] = scope['headers']
    forwarded = {
        name.decode('latin-1'): value.decode('latin-1').strip() for name, value in headers if name[:2] == b'x-'
    }
    scope = dict(scope)
    proto = forwarded.get('x-forwarded-proto', '').lower()
    if proto in ('http', 'https'):
        scope['scheme'] = proto
    host = forwarded.get('x-forwarded-host', '').split(',')[0].strip()
    if _HOST.fullmatch(host):
        others = [(name, value) for name, value in scope['headers'] if name != b'host']
        scope['headers'] = [(b'host', host.encode()), *others]
    prefix = forwarded.get('x-forwarded-prefix', '').rstrip('/')
    if _PREFIX.fullmatch(prefix):
        raw_path = scope.get('raw_path') or scope['path'].encode()
        scope['root_path'] = prefix + scope.get('root_path', '')
        scope['path'], scope['raw_path'] = prefix + scope['path'], prefix.encode() + raw_path
    client = forwarded.get('x-forwarded-for', '').split(',')[-1].strip()
    if client:
        scope['client'] = (client, 0)
    return scope


__all__ = ['ForwardedHeaders', 'TrustedProxies', 'forwarded_scope']
