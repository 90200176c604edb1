"""httpx clients for the control plane (discovery, parity canaries, doctor),
sharing one TLS context per process: httpx otherwise loads the CA bundle for every client
it makes, a tenth of a second of CPU on the event loop each time. Environment proxies are
ignored (``trust_env=False``): every call goes to a worker or a Switchyard service directly.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default verification context (certifi's CA bundle), made once."""
    return httpx.create_ssl_context(trust_env=False)


def async_client(**options: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` with the shared TLS context; ``options`` as httpx takes them."""
    return httpx.AsyncClient(verify=tls_context(), trust_env=False, **options)
