"""The operator's HTTP endpoints: `GET /metrics` for Prometheus and `GET /healthz` for load balancers.

/healthz answers 200 with {status, engine, calls_active, draining, ...} while the gateway takes calls and
503 (`healthy` false) whenever a new INVITE would get 503: draining, engine down or warming, every slot
taken ("full"), every worker over the first-audio bound, max_calls reached. The same decision answers a
qualify OPTIONS, so a balancer and a SIP proxy never see two stories. The status comes from a callable the
gateway provides; this module knows nothing about SIP or engines.

The listener is capped (connection_caps): `http.max_connections` in total and `http.max_connections_per_source`,
drawn from the process's descriptor budget that SIP TCP shares, `http.header_timeout_s` for a first request head
and `http.idle_timeout_s` for keep-alive; accept errors at the descriptor limit are counted, logged once per 10 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from connection_caps.budget import ConnectionCaps, DescriptorBudget
from connection_caps.listener import CappedSite, HttpLimits, ListenerGuard, ListenerMetrics, quiet_accept_errors, \
    runner_options
from gateway import metrics
from gateway.metrics import registry

StatusProvider = Callable[[], dict]
_STATUS_KEY = web.AppKey("status_provider", StatusProvider)


@dataclass(frozen=True)
class HttpServer:
    runner: web.AppRunner
    host: str
    port: int  # the bound port (useful when asked for port 0)


def make_http_app(status_provider: StatusProvider) -> web.Application:
    app = web.Application()
    app[_STATUS_KEY] = status_provider
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    return app


async def _metrics(_request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    """With engine workers the body also counts them (`workers_ready` of `workers_total`, `workers`: each one's
    pid and slots, or why it is not ready; gateway/worker_report.py). Some down is status "degraded" and still
    200, since calls are served; none ready is the engine warming, 503."""
    status = dict(request.app[_STATUS_KEY]())
    healthy = bool(status.get("healthy", not status.get("draining", False)))
    status.setdefault("status", "ok" if healthy else "unavailable")
    return web.json_response(status, status=200 if healthy else 503)


async def start_http(status_provider: StatusProvider, host: str, port: int, limits: HttpLimits = HttpLimits(),
                     budget: DescriptorBudget | None = None) -> HttpServer:
    """Serve on host:port with `limits`; `budget` is the descriptor budget shared with SIP TCP."""
    quiet_accept_errors(asyncio.get_running_loop(), metrics.accept_errors_total)
    runner = web.AppRunner(make_http_app(status_provider), access_log=None, **runner_options(limits))
    await runner.setup()
    guard = ListenerGuard(ConnectionCaps(limits.max_connections, limits.max_connections_per_source, budget=budget),
                          limits, ListenerMetrics(metrics.http_connections_refused_total,
                                                  metrics.http_connections_closed_total,
                                                  metrics.http_connections_open))
    site = CappedSite(runner, host, port, guard)
    await site.start()
    bound = runner.addresses[0]
    return HttpServer(runner=runner, host=bound[0], port=bound[1])


async def stop_http(server: HttpServer) -> None:
    await server.runner.cleanup()
