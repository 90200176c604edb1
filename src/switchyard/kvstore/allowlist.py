"""Where the subscription API may make the store connect: an allow-list of hosts.

``POST /v1/subscriptions`` makes the store open a ZMQ connection to an endpoint a client
names, so an unchecked endpoint would let a caller reach any host the store can (SSRF).
Allowed by default: loopback, and the hosts of the fleet the store was configured with
(``--worker`` URLs, ``--subscribe`` endpoints, ``--kv-listen``). ``subscription_hosts``
adds names, IP addresses or CIDR networks; ``*`` allows every host. Names are compared as
written, never resolved, so a name stands only for itself. ``ipc://`` endpoints (local
sockets) need ``*``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from switchyard.kvstore.settings import KVStoreSettings, zmq_endpoint

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def endpoint_host(endpoint: str) -> str | None:
    """The host of ``tcp://HOST:PORT`` (brackets of an IPv6 literal removed), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class EndpointAllowList:
    """Names and networks a subscription endpoint's host must be among."""

    def __init__(self, hosts: Iterable[str]) -> None:
        self.any = False
        self.names: set[str] = set(LOOPBACK_NAMES)
        self.networks: list[Network] = [
            ipaddress.ip_network("127.0.0.0/8"),
            ipaddress.ip_network("::1/128"),
        ]
        for raw in hosts:
            host = raw.strip().lower()
            if host == "*":
                self.any = True
            elif host:
                self._add(host)

    def _add(self, host: str) -> None:
        try:
            self.networks.append(ipaddress.ip_network(host.strip("[]"), strict=False))
        except ValueError:
            self.names.add(host)

    @classmethod
    def from_settings(cls, settings: KVStoreSettings) -> EndpointAllowList:
        """Loopback, the configured fleet's hosts and ``subscription_hosts``."""
        hosts = [urlsplit(w).hostname or "" for w in settings.workers]
        for sub in settings.subscriptions():
            hosts += [endpoint_host(sub.endpoint) or ""]
            hosts += [endpoint_host(sub.replay_endpoint or "") or ""]
        hosts += [endpoint_host(settings.kv_listen or "") or ""]
        fleet = [h for h in hosts if h and h not in ("*", "0.0.0.0", "::")]
        return cls([*settings.subscription_hosts, *fleet])

    def allows(self, endpoint: str) -> bool:
        """Whether the store may connect to ``endpoint`` (which must be a ZMQ endpoint)."""
        if not zmq_endpoint(endpoint):
            return False
        if self.any:
            return True
        host = endpoint_host(endpoint)
        if host is None:
            return False
        ip = _ip(host)
        if ip is None:
            return host.lower() in self.names
        return any(ip in net for net in self.networks)

    def refusal(self, endpoint: str) -> str | None:
        """Why ``endpoint`` is refused, or None when it is allowed."""
        if not zmq_endpoint(endpoint):
            return f"Endpoint {endpoint[:200]!r} is not tcp://HOST:PORT"
        if not self.allows(endpoint):
            return (
                f"Endpoint {endpoint[:200]!r} is not on the subscription allow-list "
                "(loopback and the configured fleet's hosts; add hosts with subscription_hosts)"
            )
        return None
