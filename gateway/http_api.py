"""The operator's HTTP endpoints: `GET /metrics` for Prometheus and `GET /healthz` for load balancers.

/healthz answers 200 with {status, engine, calls_active, draining, ...} while the gateway takes calls and
503 while it drains or its engine is down or warming (`healthy` false), so a balancer stops sending new
calls before the process exits and while no call could be spoken. A full engine is healthy (200, status
"full"): it is the SIP layer's 503 that sheds those calls. The status
comes from a callable the gateway provides; this module knows nothing about SIP or engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

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


async def start_http(status_provider: StatusProvider, host: str, port: int) -> HttpServer:
    runner = web.AppRunner(make_http_app(status_provider), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    return HttpServer(runner=runner, host=bound[0], port=bound[1])


async def stop_http(server: HttpServer) -> None:
    await server.runner.cleanup()
