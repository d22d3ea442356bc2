"""``ForwardedHeaders``: a trusted proxy's ``X-Forwarded-*`` make the request's address the client's; any
other caller's change nothing. (Through a real gateway: ``tests/server/test_server_gateways.py``.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from twinkle.errors import ConfigurationError
from twinkle.server.api.forwarded import ForwardedHeaders
from twinkle.server.config import ServerConfig

FORWARDED = {
    'Host': 'gateway.example:8443',
    'X-Forwarded-Proto': 'https',
    'X-Forwarded-Prefix': '/svc',
    'X-Forwarded-For': '203.0.113.7',
}


async def where(request: Request) -> JSONResponse:
    """What a route builds its links from, and who it thinks asked."""
    client = request.client.host if request.client else None
    return JSONResponse({'base_url': str(request.base_url), 'url': str(request.url), 'client': client})


def ask(peer: str, headers: dict[str, str], trusted: list[str], path: str = '/runs') -> dict[str, str]:
    app = ForwardedHeaders(Starlette(routes=[Route('/runs', where)]), trusted_proxies=trusted)

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=(peer, 5000))
        async with httpx.AsyncClient(transport=transport, base_url='http://worker.internal:8001') as http:
            return await http.get(path, headers=headers)

    answer = asyncio.run(send())
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_trusted_proxy_s_forwarded_headers_name_the_client_s_address():
    seen = ask('10.0.0.5', FORWARDED, trusted=['10.0.0.0/24'])
    # The prefix the proxy took off is in front of the path; the route matched without it.
    assert seen == {
        'base_url': 'https://gateway.example:8443/svc/',
        'url': 'https://gateway.example:8443/svc/runs',
        'client': '203.0.113.7',
    }
    by_host = ask('::1', {'X-Forwarded-Host': 'lb.example', 'X-Forwarded-Proto': 'http'}, trusted=['::1'])
    assert by_host['base_url'] == 'http://lb.example/'


def test_another_caller_s_forwarded_headers_change_nothing():
    for peer, trusted in (('10.0.1.5', ['10.0.0.0/24']), ('127.0.0.1', [])):
        seen = ask(peer, {**FORWARDED, 'Host': 'worker.internal:8001', 'X-Forwarded-Host': 'evil.example'}, trusted)
        assert seen == {
            'base_url': 'http://worker.internal:8001/',
            'url': 'http://worker.internal:8001/runs',
            'client': peer,
        }


@pytest.mark.parametrize(
    'header, value',
    [('X-Forwarded-Proto', 'javascript'), ('X-Forwarded-Prefix', '/a?b=1'), ('X-Forwarded-Host', 'a.example/evil')],
)
def test_a_value_no_client_could_have_used_is_left_out(header, value):
    seen = ask('127.0.0.1', {'Host': 'worker.internal:8001', header: value}, trusted=['127.0.0.1'])
    assert seen['base_url'] == 'http://worker.internal:8001/'


def test_a_trusted_proxy_that_is_no_address_is_refused_by_name():
    with pytest.raises(ConfigurationError, match="'gateway-1' is not an IP address or network"):
        ServerConfig.build(base_model='m', trusted_proxies=['10.0.0.5', 'gateway-1'])
    assert ServerConfig.build(base_model='m').trusted_proxies == ['127.0.0.1', '::1']  # a proxy beside it
