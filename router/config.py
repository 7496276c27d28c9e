"""`RouterConfig`: how the router is built. Built once, validated, passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

from headrace.sdk.credentials import ClientSecurity
from headrace.sdk.errors import InvalidArgumentError

POLICIES = ("least-loaded", "prefix-affinity", "round-robin")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    #: Workers as HOST:PORT (a static list).
    workers: tuple[str, ...] = ()
    #: Or a DNS name NAME:PORT whose addresses are the workers (a Kubernetes headless
    #: Service); re-resolved every `dns_refresh_s`.
    workers_dns: str | None = None
    dns_refresh_s: float = 5.0
    #: "least-loaded", "prefix-affinity" or "round-robin".
    policy: str = "least-loaded"
    #: Requests a worker is given at once; more wait in the router's priority queue, where a
    #: later high-priority request can still overtake them. Match the workers' max_num_seqs.
    max_inflight_per_worker: int = 256
    #: Admission limits: beyond them new requests get RESOURCE_EXHAUSTED with RetryInfo.
    max_queued_requests: int = 4096
    #: Estimated prompt tokens waiting in the queue (text counts 1 token per 4 characters).
    max_queued_tokens: int = 4_000_000
    #: What RESOURCE_EXHAUSTED tells clients to wait before retrying.
    retry_after_s: float = 1.0
    #: Aging: a waiting request gains this much priority per second, so none starves.
    aging_per_s: float = 1.0
    #: prefix-affinity: how much of a prompt identifies its prefix (characters of text, or
    #: token ids) ...
    affinity_prefix_chars: int = 256
    affinity_prefix_tokens: int = 64
    #: ... and how much busier (requests in flight) the preferred worker may be than the
    #: least-loaded one before the request goes to the least-loaded one instead.
    affinity_slack: int = 16
    #: Load reports: how often workers send them, and how long a silent worker stays in
    #: rotation.
    load_interval_s: float = 0.05
    unhealthy_after_s: float = 3.0
    #: Queued requests fail with UNAVAILABLE once no worker has been healthy this long.
    unavailable_after_s: float = 10.0
    #: How the router reaches its workers: TLS (mTLS with a client certificate) and the API
    #: key it sends them. Default: plaintext, no key.
    worker_security: ClientSecurity = field(default_factory=ClientSecurity)

    def __post_init__(self) -> None:
        if not self.workers and not self.workers_dns:
            raise InvalidArgumentError("workers", "give --workers HOST:PORT,... or --workers-dns")
        if self.workers and self.workers_dns:
            raise InvalidArgumentError("workers", "give either --workers or --workers-dns")
        for target in self.workers:
            _check_target("workers", target)
        if self.workers_dns:
            _check_target("workers_dns", self.workers_dns)
        if self.policy not in POLICIES:
            raise InvalidArgumentError("policy", f"must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_inflight_per_worker", "max_queued_requests", "max_queued_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("load_interval_s", "unhealthy_after_s", "dns_refresh_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(name, "must be > 0")


def _check_target(name: str, target: str) -> None:
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgumentError(name, f"{target!r} is not HOST:PORT")
