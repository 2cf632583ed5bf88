"""API keys and tenants: the ``tenants`` option (serve.yaml, ``--tenants`` JSON) and who a request's key is.

``tenants`` maps a tenant name to its API keys and its share of each engine replica::

    tenants:
      acme: {api_keys: [sk-acme-1, sk-acme-2], weight: 2, max_kv_fraction: 0.5, max_queued_requests: 64}
      beta: {api_keys: [sk-beta]}

- The engines get the policy without the keys (``TenantConfig``: weight, max_kv_fraction, max_queued_requests;
  cluster/fair_share.py). Quotas are per engine replica.
- With tenants, every route but /health needs a key: a tenant's, or ``api_key`` (the admin key, whose requests
  belong to the tenant ``default``; a table entry named ``default`` sets that tenant's share). Any other key is
  a 401. Loading and unloading LoRA adapters (which changes what every tenant is served) takes the admin key
  only: a tenant's key gets a 403.
- Without tenants, ``api_key`` alone works as before (no key needed when it is unset).
- Keys are kept as SHA-256 digests; metrics and logs name tenants, never keys.
"""

from __future__ import annotations

import hashlib
import hmac

from pagedray.workers.contract.config import DEFAULT_TENANT, TenantConfig

from ..openai.errors import APIError, invalid_api_key

_POLICY_FIELDS = ("weight", "max_kv_fraction", "max_queued_requests")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_tenants(table: dict | None) -> tuple[tuple[TenantConfig, ...], dict[bytes, str]]:
    """The ``tenants`` option as (the engines' TenantConfigs, {SHA-256 of a key: tenant name}); ValueError naming
    the entry (``tenants.NAME.FIELD``) when it is malformed."""
    if table is None:
        return (), {}
    if not isinstance(table, dict) or not table:
        raise ValueError(f"tenants: must be a non-empty mapping of tenant name to its settings, got {table!r:.80}")
    configs, keys = [], {}
    for name, entry in table.items():
        if not isinstance(entry, dict):
            raise ValueError(f"tenants.{name}: must be a mapping (api_keys, weight, ...), got {entry!r:.80}")
        unknown = sorted(set(entry) - {"api_keys", *_POLICY_FIELDS})
        if unknown:
            raise ValueError(f"tenants.{name}: unknown field {unknown[0]!r} (fields: api_keys, "
                             f"{', '.join(_POLICY_FIELDS)})")
        config = TenantConfig(name, **{f: entry[f] for f in _POLICY_FIELDS if f in entry})
        config.validate()
        api_keys = entry.get("api_keys", [])
        if not isinstance(api_keys, list) or not all(isinstance(k, str) and k.strip() for k in api_keys):
            raise ValueError(f"tenants.{name}.api_keys: must be a list of non-empty strings")
        if not api_keys and name != DEFAULT_TENANT:
            raise ValueError(f"tenants.{name}.api_keys: give the tenant at least one key")
        for key in api_keys:
            digest = _digest(key.strip())
            if digest in keys:
                raise ValueError(f"tenants.{name}.api_keys: a key is given twice (also for {keys[digest]!r})")
            keys[digest] = name
        configs.append(config)
    return tuple(configs), keys


class ApiKeys:
    """Who a request is: ``tenant_of`` checks its key and names its tenant (None without tenants)."""

    def __init__(self, api_key: str | None = None, tenant_keys: dict[bytes, str] | None = None) -> None:
        self._admin = api_key or None
        self._tenants = dict(tenant_keys or {})
        if self._admin is not None and _digest(self._admin) in self._tenants:
            raise ValueError("tenants: a tenant's key equals api_key (the admin key); give them different keys")

    @property
    def has_tenants(self) -> bool:
        return bool(self._tenants)

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant of a request presenting ``key`` (None: the default tenant); 401 for a missing or wrong key
        when keys are required."""
        if self._admin is None and not self._tenants:
            return None
        key = (key or "").strip()
        if self._is_admin(key):
            return None
        tenant = self._tenants.get(_digest(key)) if key else None
        if tenant is None:
            raise invalid_api_key()
        return tenant

    def _is_admin(self, key: str) -> bool:
        return self._admin is not None and hmac.compare_digest(key.encode(), self._admin.encode())

    def check_admin(self, key: str | None) -> None:
        """Only the admin key passes (when tenants are configured; else ``tenant_of``'s check)."""
        self.tenant_of(key)
        if self._tenants and not self._is_admin((key or "").strip()):
            raise APIError(403, "this route changes what every tenant is served: it takes the admin api_key, "
                                "not a tenant's key", "permission_error", code="admin_key_required")
