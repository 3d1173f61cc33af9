"""The value types operators write in the config (HOST:PORT, an address or CIDR, an RTP port range)
and `Section`, the base of every config section: unknown keys are refused, values are frozen.

Each parser raises `ValueError` with the expected form, so the error line names the key and shows
an example (gateway/config_errors.py words it).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainValidator

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
