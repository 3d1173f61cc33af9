"""What /healthz says of the engine workers: how many serve ("n of m"), and for each that does not, why.

A worker serves when the gateway's link to it is up and its engine ready (engines.worker_link.WorkerLink.usable);
why one does not comes from its supervisor (starting, restarting after an exit, settings refused, hung; see
gateway/worker_supervisor.py) or, for a remote worker, from its link. Some workers down is "degraded": still
200, since calls are served; none ready is the engine warming, 503 (gateway.app decides health). A ready worker
also says its `speed` when its status tells (status.graphs): a cosyvoice2 worker serves on slower graphs until its
compiled ones are in, ~2 min after ready; readiness does not wait for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engines.worker_link import WorkerLink
from gateway import metrics
from gateway.worker_supervisor import WorkerSupervisor

StatusProvider = Callable[[], dict]


def with_workers(status: StatusProvider, links: Sequence[WorkerLink],
                 supervisor: WorkerSupervisor | None) -> StatusProvider:
    """The gateway's status with the workers' report added; an "ok" gateway with a worker down says "degraded".
    Also makes gateway_engine_workers_ready read the links at each scrape."""
    metrics.engine_workers_ready.set_function(lambda: sum(link.usable for link in links))

    def status_with_workers() -> dict:
        body = status()
        report = workers_report(links, supervisor)
        body.update(report)
        if body.get("status") == "ok" and report["workers_ready"] < report["workers_total"]:
            body["status"] = "degraded"
        return body

    return status_with_workers


def workers_report(links: Sequence[WorkerLink], supervisor: WorkerSupervisor | None) -> dict:
    workers = {}
    for link in links:
        process = supervisor.describe(link.name) if supervisor is not None and supervisor.supervises(link.name) \
            else None
        entry: dict = {"ready": link.usable}
        if process is not None:
            entry["pid"] = process["pid"]
        if link.usable:
            assert link.status is not None
            entry.update(slots_free=link.slots_free, slots_total=link.status.slots_total)
            if (speed := _SPEED.get(link.status.graphs or "")) is not None:  # None: an older worker says nothing
                entry["speed"] = speed
        elif process is None:
            entry["why"] = _link_why(link)
        elif process["state"] == "listening":
            entry["why"] = f"{process['why']}: {_link_why(link)}"
        else:
            entry["why"] = process["why"]
        workers[link.name] = entry
    ready = sum(entry["ready"] for entry in workers.values())
    return {"workers_ready": ready, "workers_total": len(workers),
            "workers_summary": f"{ready} of {len(workers)} engine workers ready", "workers": workers}


_SPEED = {"compiled": "full", "compiling": "warming: compiled graphs not in yet",
          "failed": "slow: compiling its graphs failed, serving on the eager graphs until restarted"}


def _link_why(link: WorkerLink) -> str:
    if link.url is None:
        return "not listening yet"
    if link.hello is None:
        return f"not connected to {link.url}"
    if link.status is None:
        return "connected, no status yet"
    return f"its engine is {link.status.state}"
