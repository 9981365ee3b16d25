"""Bearer API keys: ``KVBATCH_API_KEYS`` is a comma-separated list whose entries are keys or
``sha256:<hex>`` (a key given by its hash, so the secret need not be stored anywhere).

Only hashes are kept in memory; a request's key is hashed and compared in constant time. What
the server stores next to a file or a batch is the key's *owner tag*, a hash of the hash, so
neither state files nor logs nor error messages ever hold a key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

ANONYMOUS = "anonymous"  # the owner of everything under --insecure-no-auth
_HEX64 = re.compile(r"[0-9a-f]{64}")


class KeyConfigError(ValueError):
    """``KVBATCH_API_KEYS`` cannot be read; the message names the entry by position, never by value."""


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def owner_tag(digest: str) -> str:
    """The stored owner of a key's files and batches: not the key, and not its hash either."""
    return hashlib.sha256(b"kvbatch-owner\x00" + digest.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ApiKeys:
    digests: tuple[str, ...]  # sha256 hex of each accepted key

    @classmethod
    def parse(cls, text: str | None) -> ApiKeys:
        digests = []
        for i, entry in enumerate((text or "").split(","), start=1):
            entry = entry.strip()
            if not entry:
                continue
            if entry.startswith("sha256:"):
                hexpart = entry.removeprefix("sha256:").lower()
                if not _HEX64.fullmatch(hexpart):
                    raise KeyConfigError(f"KVBATCH_API_KEYS entry {i}: sha256: must be followed by 64 hex digits")
                digests.append(hexpart)
            else:
                digests.append(_digest(entry))
        return cls(tuple(digests))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def owner_of(self, key: str) -> str | None:
        """The owner tag of ``key`` if it is one of ours, else None."""
        d = _digest(key)
        found = None
        for known in self.digests:  # no early exit: the time taken says nothing about which matched
            if hmac.compare_digest(known, d):
                found = known
        return owner_tag(found) if found else None


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
