"""The value types operators write in the config (HOST:PORT, an address or CIDR, an RTP port range)
and `Section`, the base of every config section: unknown keys are refused, values are frozen.

Each parser raises `ValueError` with the expected form, so the error line names the key and shows
an example (gateway/config_errors.py words it).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, model_validator

from gateway.config_errors import FieldProblem

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConnectionCapsSection(Section):
    """A listener's connection caps: `max_connections` in total and `max_connections_per_source` from one IP
    address (each subclass declares both, with its own defaults); the per-source cap within the total."""

    @model_validator(mode="after")
    def _per_source_within_total(self) -> ConnectionCapsSection:
        if self.max_connections_per_source > self.max_connections:
            raise FieldProblem("max_connections_per_source", "must not exceed max_connections")
        return self


class HttpCapsSection(ConnectionCapsSection):
    """What an HTTP listener holds (the gateway's `http`, a worker's `engine.worker`); connection_caps applies it."""

    max_connections: int = Field(256, ge=1)  # open at once; more are refused at accept
    max_connections_per_source: int = Field(64, ge=1)  # from one IP address
    idle_timeout_s: float = Field(60.0, gt=0)  # a keep-alive connection without a request this long: closed
    header_timeout_s: float = Field(10.0, gt=0)  # a connection's first request head must arrive within this

    @model_validator(mode="before")
    @classmethod
    def _per_source_default(cls, data: Any) -> Any:
        # A small max_connections alone lowers the per-source default with it.
        if isinstance(data, dict) and "max_connections_per_source" not in data and \
                isinstance(data.get("max_connections"), int) and not isinstance(data["max_connections"], bool):
            data = {**data, "max_connections_per_source": max(1, min(64, data["max_connections"]))}
        return data

    def http_limits(self):
        from connection_caps.listener import HttpLimits

        return HttpLimits(self.max_connections, self.max_connections_per_source, self.idle_timeout_s,
                          self.header_timeout_s)


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _host_port(value: Any) -> HostPort:
    if isinstance(value, HostPort):
        return value
    if not isinstance(value, str):
        raise ValueError("expected HOST:PORT")
    if value.startswith("["):  # [IPv6]:port
        host, _, port = value[1:].partition("]:")
    else:
        host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535 or (":" in host and not value.startswith("[")):
        raise ValueError("expected HOST:PORT (e.g. 0.0.0.0:5060 or [::]:5060)")
    return HostPort(host, int(port))


def _network(value: Any) -> IPNetwork:
    try:
        return ipaddress.ip_network(str(value), strict=False)
    except ValueError:
        raise ValueError(f"expected an IP address or CIDR (e.g. 192.0.2.10 or 10.0.0.0/24), got {value!r}") from None


def _ip_address(value: Any) -> str:
    try:
        return str(ipaddress.ip_address(str(value)))
    except ValueError:
        raise ValueError(f"expected an IP address of this host (e.g. 10.0.0.5, 0.0.0.0 for all), "
                         f"got {value!r}") from None


def _reachable_host(value: Any) -> str:
    """An address or name peers can send to: a wildcard (0.0.0.0, ::) names no host."""
    text = str(value).strip()
    if not text or any(char.isspace() for char in text):
        raise ValueError(f"expected an IP address or host name, got {value!r}")
    try:
        wildcard = ipaddress.ip_address(text).is_unspecified
    except ValueError:  # a host name
        wildcard = False
    if wildcard:
        raise ValueError(f"{text} is a wildcard, which peers cannot send to: put the address they reach this "
                         "host at (a public or 1:1 NAT address is fine)")
    return text


def _port_range(value: Any) -> tuple[int, int]:
    low, _, high = str(value).partition("-")
    if not (low.strip().isdigit() and high.strip().isdigit()):
        raise ValueError("expected LOW-HIGH (e.g. 20000-30000)")
    low_port, high_port = int(low), int(high)
    if not 1024 <= low_port < high_port <= 65535:
        raise ValueError("expected 1024 <= LOW < HIGH <= 65535")
    if high_port - low_port < 3:
        raise ValueError("range must hold at least one RTP/RTCP port pair")
    return low_port, high_port


ListenAddress = Annotated[HostPort, PlainValidator(_host_port)]
Network = Annotated[IPNetwork, PlainValidator(_network)]
PortRange = Annotated[tuple[int, int], PlainValidator(_port_range)]
LocalAddress = Annotated[str, PlainValidator(_ip_address)]  # to bind on: an IP literal (a wildcard allowed)
ReachableHost = Annotated[str, PlainValidator(_reachable_host)]  # to advertise: never a wildcard
