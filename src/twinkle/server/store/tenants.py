"""Tenants and their API keys: who may call the server. Only a key's hash is stored, never the key."""

from __future__ import annotations

from pydantic import BaseModel

from twinkle.errors import ConfigurationError
from twinkle.server.auth import MIN_KEY_LENGTH, hash_key, new_api_key
from twinkle.server.store.database import Aggregate, check_name, new_id, violates


class Tenant(BaseModel, frozen=True):
    id: str
    name: str
    created_at: float


class Tenants(Aggregate):
    """The tenants table. Removing a tenant removes its runs, checkpoint rows, sessions and futures with it."""

    def add(self, name: str, key: str | None = None) -> tuple[Tenant, str]:
        """Create a tenant; return it with its API key, the only time the plaintext key is available."""
        check_name('tenant', name)
        if key is None:
            key = new_api_key()
        elif len(key) < MIN_KEY_LENGTH or key != key.strip():
            raise ConfigurationError(
                f'An API key for tenant {name!r} must be at least {MIN_KEY_LENGTH} random characters without '
                'surrounding whitespace; leave key=None to have one generated'
            )
        tenant = Tenant(id=new_id('tn'), name=name, created_at=self._db.clock())
        try:
            self._db.execute(
                'INSERT INTO tenants (id, name, key_hash, created_at) VALUES (?, ?, ?, ?)',
                (tenant.id, name, hash_key(key), tenant.created_at),
            )
        except self._db.integrity_error as exc:
            what = f'a tenant named {name!r}' if violates(exc, 'tenants', 'name') else 'a tenant with that API key'
            raise ConfigurationError(f'There is already {what}; choose another') from exc
        return tenant, key

    def sync_keys_file(self, key_hashes: dict[str, str]) -> None:
        """Make the tenants of the API keys file (name -> key hash) exactly ``key_hashes``: add the
        new ones, give changed keys their new hash, and remove the file's former tenants that it
        no longer lists. Tenants added with ``add`` are left alone."""
        with self._db.write() as conn:
            rows = conn.execute('SELECT name FROM tenants WHERE from_keys_file = 1').fetchall()
            listed = {row['name'] for row in rows}
            for name in listed - set(key_hashes):
                conn.execute('DELETE FROM tenants WHERE name = ?', (name,))
            for name, key_hash in key_hashes.items():
                check_name('tenant', name)
                try:
                    conn.execute(
                        'INSERT INTO tenants (id, name, key_hash, created_at, from_keys_file) VALUES (?, ?, ?, ?, 1) '
                        'ON CONFLICT (name) DO UPDATE SET key_hash = excluded.key_hash, from_keys_file = 1',
                        (new_id('tn'), name, key_hash, self._db.clock()),
                    )
                except self._db.integrity_error as exc:
                    message = f'the API keys file gives tenant {name!r} a key another tenant has'
                    raise ConfigurationError(message) from exc

    def for_key(self, key: str) -> Tenant | None:
        """The tenant whose API key this is, or None."""
        rows = self._db.query('SELECT id, name, created_at FROM tenants WHERE key_hash = ?', (hash_key(key),))
        return Tenant.model_validate(dict(rows[0])) if rows else None

    def name_of(self, tenant_id: str) -> str | None:
        """The name of the tenant of this id (None: no such tenant)."""
        rows = self._db.query('SELECT name FROM tenants WHERE id = ?', (tenant_id,))
        return str(rows[0][0]) if rows else None

    def all(self) -> list[Tenant]:
        """Every tenant, by name."""
        rows = self._db.query('SELECT id, name, created_at FROM tenants ORDER BY name')
        return [Tenant.model_validate(dict(row)) for row in rows]

    def remove(self, name: str) -> bool:
        """Delete a tenant with its runs, checkpoint rows and futures; False if there was none.

        Files on disk are the caller's to remove.
        """
        return self._db.execute('DELETE FROM tenants WHERE name = ?', (name,)) > 0
