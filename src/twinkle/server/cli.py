"""``twinkle-server``: serve a base model to many tenants, and manage their API keys.

twinkle-server serve --config server.yaml            # or: --base-model tiny-qwen3 --port 8000
twinkle-server keys add alice --config server.yaml   # prints alice's new key, once
twinkle-server keys list --config server.yaml
twinkle-server gateway --worker http://10.0.0.5:8001 --port 8000   # store: postgresql://... (or TWINKLE_STORE)
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from typing import Any

from twinkle.server.config import ServerConfig

#: Seconds ``BackgroundServer.stop`` waits for the server thread: its adapters are saved first.
STOP_TIMEOUT_S = 30.0
#: Seconds a thread that wants the GIL waits before the one holding it must let go, in the process
#: ``serve`` runs (CPython's default: 0.005). The event loop answers requests while the worker thread
#: and the store's threads run Python; at 5 ms a small request waits for them (get_train_configs'
#: round trip fell from 9.4 to 6.9 ms with 0.5 ms, on 2 cores shared with other work). Not set for
#: ``BackgroundServer``, whose process is the caller's.
SWITCH_INTERVAL_S = 0.0005


def load_config(args: argparse.Namespace) -> ServerConfig:
    overrides = {
        'base_model': args.base_model,
        'host': args.host,
        'port': args.port,
        'data_dir': args.data_dir,
        'device': args.device,
        # The dashboard's admin key, from the environment rather than a flag (a flag shows in `ps`).
        'admin_api_key': os.environ.get('TWINKLE_ADMIN_KEY') or None,
        # The store's URL holds a password: from the environment too.
        'store': os.environ.get('TWINKLE_STORE') or None,
    }
    if args.command in ('keys', 'gateway') and not args.config and args.base_model is None:
        overrides['base_model'] = '(no model here)'  # keys need only the store, a gateway the store and its worker
    if args.config:
        return ServerConfig.load(args.config, **overrides)
    return ServerConfig.build(**{k: v for k, v in overrides.items() if v is not None})


def serve(config: ServerConfig, log_level: str = 'info') -> None:
    import uvicorn

    from twinkle.server.api.request_limits import uvicorn_options
    from twinkle.server.app import create_app

    options = uvicorn_options(config.limits)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=log_level, **options)


class BackgroundServer:
    """A server on a thread of this process (tests, notebooks): ``with BackgroundServer(config)
    as url: ...``. Port 0 picks a free port."""

    def __init__(self, config: ServerConfig, **app_kwargs: Any):
        import uvicorn

        from twinkle.server.api.request_limits import uvicorn_options
        from twinkle.server.app import create_app

        self.app = create_app(config, **app_kwargs)
        options = uvicorn_options(config.limits)
        settings = uvicorn.Config(self.app, host=config.host, port=config.port, log_level='warning', **options)
        self.server = uvicorn.Server(settings)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> str:
        """Serve on the thread; the base URL once the server answers. A server not stopped by
        the script is stopped at interpreter exit, as a graceful stop: its adapters' state is
        saved, its worker thread joined and its store closed before the process ends."""
        atexit.register(self.stop)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError('the server did not start; see the log above')
            self.thread.join(0.05)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f'http://{host}:{port}'
        return self.url

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(STOP_TIMEOUT_S)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog='twinkle-server', description=__doc__.split('\n\n')[0])
    parser.add_argument('--config', help='a .yaml or .json server config')
    parser.add_argument('--base-model')
    parser.add_argument('--host')
    parser.add_argument('--port', type=int)
    parser.add_argument('--data-dir')
    parser.add_argument('--device', help='cpu, cuda, cuda:1, ... (default: cuda if available)')
    parser.add_argument('--log-level', default='info', choices=['debug', 'info', 'warning', 'error'])
    commands = parser.add_subparsers(dest='command', required=True)
    commands.add_parser('serve', help='serve the base model')
    keys = commands.add_parser('keys', help='API keys (one per tenant, stored hashed)')
    keys.add_argument('action', choices=['add', 'list', 'remove'])
    keys.add_argument('tenant', nargs='?')
    gateway = commands.add_parser('gateway', help='an HTTP gateway to a worker (`serve`) on a PostgreSQL store')
    gateway.add_argument('--worker', required=True, help="the worker's URL, e.g. http://10.0.0.5:8001")
    gateway.add_argument('--drain-timeout-s', type=float, default=120.0, help='how long SIGTERM waits for requests')
    args = parser.parse_args(argv)
    config = load_config(args)
    if args.command == 'serve':
        serve(config, args.log_level)
        return
    if args.command == 'gateway':
        run_gateway(config, args.worker, args.drain_timeout_s, args.log_level)
        return
    manage_keys(config, args.action, args.tenant)


def run_gateway(config: ServerConfig, worker: str, drain_timeout_s: float, log_level: str) -> None:
    from twinkle.server.gateway import GatewaySettings, serve_gateway

    if config.store is None:
        sys.exit('a gateway shares a PostgreSQL store with its worker: set store: postgresql://... or TWINKLE_STORE')
    settings = GatewaySettings(
        worker_url=worker, drain_timeout_s=drain_timeout_s, limits=config.limits, trusted_proxies=config.trusted_proxies
    )
    serve_gateway(config.store, settings, config.host, config.port, log_level)


def manage_keys(config: ServerConfig, action: str, tenant: str | None) -> None:
    from twinkle.server.store import Store

    store = Store(config.store_location)
    try:
        if action == 'list':
            for row in store.tenants.all():
                print(row.name)
        elif tenant is None:
            sys.exit(f'keys {action} needs a tenant name')
        elif action == 'add':
            _, key = store.tenants.add(tenant)
            print(key)
        else:
            store.tenants.remove(tenant)
    finally:
        store.close()


if __name__ == '__main__':
    main()
