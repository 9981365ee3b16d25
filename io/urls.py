"""Credentials out of URLs before they reach a log line, an error message or metadata.

A user may write a secret into a URL (``s3://KEY:SECRET@bucket/prefix``,
``https://user:pass@host/path``, a presigned ``?X-Amz-Signature=...``); whatever echoes a URL
or an exception's text that may quote one passes it through here first.
"""

from __future__ import annotations

import re

__all__ = ["one_line", "redact", "redact_text"]

_MASK = "***"
# scheme://userinfo@ : a user (or token) before the host, or KEY:SECRET where an AWS secret may
# itself hold "/" (so "s3://AKIA:ab/cd@bucket" is caught whole).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)(?:[^/\s@?#\"':]+:[^\s@\"']+|[^/\s@?#\"']+)@")
# Query parameters that carry a secret (presigned URLs, SAS tokens, API keys).
_SECRET_PARAM = re.compile(
    r"(?i)([?&](?:x-amz-signature|x-amz-security-token|x-amz-credential|signature|sig|token|access_token"
    r"|secret|password|api_key|apikey|key)=)[^&\s#\"']*"
)


def redact_text(text: str, *urls: str) -> str:
    """``text`` with the credentials of every URL in it masked (userinfo and secret query values).

    Pass the URLs the text may be about: their userinfo is masked wherever it appears, even
    without its scheme (s3fs quotes ``KEY:SECRET@bucket`` back as a bucket name).
    """
    pieces: set[str] = set()
    for url in urls:
        m = _USERINFO.match(url.strip())
        if m:
            # The whole userinfo, and the parts a parser may quote alone: s3fs splits
            # "KEY:SE/CRET@bucket" at the "/" and names "KEY:SE" as the bucket.
            info = m.group(0)[len(m.group(1)):-1]
            pieces.add(info)
            pieces.update(p for part in info.split("/") for p in (part, *part.split(":")) if len(p) >= 4)
            pieces.update(p for p in info.split(":") if len(p) >= 4)
    for piece in sorted(pieces, key=len, reverse=True):
        text = text.replace(piece, _MASK)
    return _SECRET_PARAM.sub(rf"\g<1>{_MASK}", _USERINFO.sub(rf"\g<1>{_MASK}@", text))


def one_line(exc: BaseException, *urls: str) -> str:
    """An exception as one redacted line (its lines joined, at most ~300 characters), or its type
    when it has no text."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__
    text = redact_text(text, *urls)
    return text if len(text) <= 300 else text[:297] + "..."


def redact(url: str) -> str:
    """One URL with its credentials masked: ``s3://KEY:SECRET@bucket/kv`` -> ``s3://***@bucket/kv``."""
    return redact_text(url)
