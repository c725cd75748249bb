"""DNS discovery: ``--backend-dns NAME:PORT`` (A and AAAA records) and ``--backend-srv NAME``
(SRV records: each target's host and port), re-resolved every ``--dns-interval`` seconds with
dnspython's asyncio resolver, each answer applied by router/discovery.Reconciler. Either may
end in ``@kv=auto``: each instance found follows the KV events it announces.

Every address is an instance, ``http://ADDRESS:PORT``, named ``ADDRESS:PORT`` (``[V6]:PORT``).
SRV priorities and weights are not used: every target is an instance (as in a Kubernetes
headless service's records). A failed lookup (a timeout, NXDOMAIN, no answer at all) changes
nothing: an empty or missing answer is far more often a DNS hiccup than a fleet scaled to zero.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.resolver

from router.discovery import DiscoveryError, Reconciler, Status, host_port
from router.state import Backend
from store.errors import CliError

#: One lookup's limit (all its tries together), seconds.
LOOKUP_TIMEOUT_S = 2.0


def split_kv(spec: str) -> tuple[str, str | None]:
    """``NAME...@kv=auto`` -> (NAME..., "auto"): discovered instances follow the KV events they
    announce. CliError for any other option (DNS cannot say where an instance publishes)."""
    target, sep, opt = spec.partition("@")
    if not sep:
        return spec, None
    if opt != "kv=auto":
        raise CliError(f"{spec!r}: the only option a DNS name takes is @kv=auto (each instance's announced "
                       "KV events)")
    return target, "auto"


def parse_dns_target(spec: str) -> tuple[str, int]:
    """``NAME:PORT`` for --backend-dns; CliError when malformed."""
    name, sep, port = spec.rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(f"--backend-dns {spec!r}: expected NAME:PORT (e.g. vllm.default.svc.cluster.local:8000)")
    return name, int(port)


def parse_server(spec: str) -> tuple[str, int]:
    """``--dns-server HOST[:PORT]`` (an IP address; port 53 by default)."""
    host, port = spec, 53
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise CliError(f"--dns-server {spec!r}: expected IP[:PORT] ([V6]:PORT for IPv6)")
            port = int(rest[1:])
    elif spec.count(":") == 1:
        host, _, p = spec.partition(":")
        if not p.isdigit():
            raise CliError(f"--dns-server {spec!r}: expected IP[:PORT]")
        port = int(p)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise CliError(f"--dns-server {spec!r}: expected an IP address, IP:PORT or [V6]:PORT") from None
    if not 0 < port < 65536:
        raise CliError(f"--dns-server {spec!r}: port out of range")
    return host, port


def make_resolver(server: str | None) -> dns.asyncresolver.Resolver:
    """The system's resolver (/etc/resolv.conf), or only ``server``; no cache: each look asks."""
    if server is None:
        r = dns.asyncresolver.Resolver()
    else:
        host, port = parse_server(server)
        r = dns.asyncresolver.Resolver(configure=False)
        r.nameservers = [host]
        r.port = port
    r.lifetime = LOOKUP_TIMEOUT_S
    r.timeout = LOOKUP_TIMEOUT_S / 2
    r.cache = None
    return r


def _url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


async def addresses(resolver: Any, name: str) -> list[str]:
    """A and AAAA records of ``name``; DiscoveryError when neither answers with an address."""
    out: list[str] = []
    errors: list[str] = []
    for rdtype in ("A", "AAAA"):
        try:
            ans = await resolver.resolve(name, rdtype)
        except dns.resolver.NoAnswer:
            continue
        except dns.resolver.NXDOMAIN:
            raise DiscoveryError(f"{name}: no such name (NXDOMAIN)") from None
        except dns.exception.DNSException as exc:
            errors.append(f"{rdtype}: {exc}")
            continue
        out += [r.address for r in ans]
    if not out:
        raise DiscoveryError(f"{name}: no address" + (f" ({'; '.join(errors)})" if errors else " (no A or AAAA record)"))
    return out


async def resolve_a(resolver: Any, name: str, port: int) -> list[Backend]:
    return _backends([(a, port) for a in await addresses(resolver, name)])


async def resolve_srv(resolver: Any, name: str) -> list[Backend]:
    try:
        ans = await resolver.resolve(name, "SRV")
    except dns.resolver.NXDOMAIN:
        raise DiscoveryError(f"{name}: no such name (NXDOMAIN)") from None
    except dns.resolver.NoAnswer:
        raise DiscoveryError(f"{name}: no SRV record") from None
    except dns.exception.DNSException as exc:
        raise DiscoveryError(f"{name}: SRV lookup failed: {exc}") from None
    pairs = []
    for rr in ans:
        target = rr.target.to_text(omit_final_dot=True)
        pairs += [(a, rr.port) for a in await addresses(resolver, target)]
    return _backends(pairs)


def _backends(pairs: list[tuple[str, int]]) -> list[Backend]:
    out, seen = [], set()
    for address, port in sorted(set(pairs)):
        url = _url(address, port)
        if url not in seen:
            seen.add(url)
            out.append(Backend(name=host_port(url), url=url))
    return out


class DnsSource:
    """One ``--backend-dns`` or ``--backend-srv`` name, looked up every ``interval_s``."""

    def __init__(self, kind: str, spec: str, resolver: Any, interval_s: float):
        self.kind, self.spec, self.resolver, self.interval_s = kind, spec, resolver, interval_s
        self.last: list[Backend] | None = None

    @property
    def source(self) -> str:
        return "dns" if self.kind == "a" else "srv"

    async def resolve(self) -> list[Backend]:
        target, kv = split_kv(self.spec)
        if self.kind == "a":
            name, port = parse_dns_target(target)
            found = await resolve_a(self.resolver, name, port)
        else:
            found = await resolve_srv(self.resolver, target)
        for b in found:
            b.kv_events = kv  # "auto": each instance is asked when it joins (router/kv_sources.py)
        return found

    async def run(self, rec: Reconciler, acts: Any) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                found = await self.resolve()
                if found != self.last:
                    await rec.apply(found, acts)
                    self.last = found
                else:
                    await rec.tick(acts)
            except DiscoveryError as exc:
                rec.failed(str(exc))
                await rec.tick(acts)  # drains already begun still finish
            else:
                rec.succeeded()


def targets(cfg: Any) -> list[tuple[str, str]]:
    return [("a", s) for s in cfg.backend_dns] + [("srv", s) for s in cfg.backend_srv]


async def resolve_at_start(cfg: Any) -> dict[tuple[str, str], list[Backend]]:
    """Each DNS target's backends before the router starts; CliError when one cannot be resolved."""
    resolver = make_resolver(cfg.dns_server)
    out = {}
    for kind, spec in targets(cfg):
        src = DnsSource(kind, spec, resolver, cfg.dns_interval_s)
        try:
            out[(kind, spec)] = await src.resolve()
        except DiscoveryError as exc:
            raise CliError(f"--backend-{'dns' if kind == 'a' else 'srv'} {spec}: {exc}") from None
    return out


def sources(cfg: Any, acts: Any, owned: dict[str, list[Backend]]) -> list[tuple[Reconciler, Callable[[], Awaitable[None]]]]:
    """router/fleet_api.setup_discovery's DNS half: a reconciler and a running loop per name."""
    resolver = make_resolver(cfg.dns_server)
    out = []
    for kind, spec in targets(cfg):
        src = DnsSource(kind, spec, resolver, cfg.dns_interval_s)
        key = f"{src.source}:{spec}"
        start = list(owned.get(key, ()))
        src.last = start
        rec = Reconciler(Status(src.source, spec), start, drain_timeout_s=cfg.discovery_drain_timeout_s)
        out.append((rec, lambda src=src, rec=rec: src.run(rec, acts)))
    return out
