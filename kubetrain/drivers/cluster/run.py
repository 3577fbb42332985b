"""`kubetrain operator`: run the kopf operator against the current kubeconfig (or in-cluster).

With leader election, the process first waits for the Lease (kubetrain/drivers/cluster/leader.py)
and runs kopf only while it holds it: two replicas make one leader and one standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kopf

from kubetrain.engine.children import Settings
from . import handlers, leader, metrics
from .state import WORKERS, Controller, OperatorConfig

log = logging.getLogger(__name__)


class _Terminated(SystemExit):
    """SIGTERM before kopf took over the signal: leave the wait, or kopf's start, through `finally`.
    A SystemExit, because asyncio lets only those (and KeyboardInterrupt) out of a task at once."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated()


@contextlib.contextmanager
def _healthz_while_standing_by(port: int, elector: leader.LeaderElector) -> Iterator[None]:
    """Serve /healthz while waiting for the lease. kopf serves its own liveness endpoint only once
    it runs, and a standby is healthy, just waiting: without this the liveness probe would kill
    and restart it every minute. The port is free again before kopf binds it."""
    if not port:
        yield
        return

    class Healthz(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen = elector.seen.record if elector.seen is not None else None
            body = json.dumps({"leader": False, "holder": seen.holder if seen else ""}).encode()
            self.send_response(200 if self.path.split("?")[0] == "/healthz" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # probes every 20 s are not news
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Healthz)
    thread = threading.Thread(target=server.serve_forever, name="standby-healthz", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


API_MAX_DEPTH = 10_000
"""How deep the API server lets an object nest (apimachinery's JSON decoder refuses deeper): a
TrainingJob's podTemplate, whose schema keeps unknown fields, may nest that deep."""
RECURSION_LIMIT = API_MAX_DEPTH + 1_000
"""Python's JSON decoder counts each level of nesting against the recursion limit (1,000 by default),
and kopf decodes every watched TrainingJob with it: one job nested 3,000 levels, created by any
tenant, broke the operator's watch of every job in its scope (the list and each watch failed on it).
The limit is raised so that anything the API server stores can be read (and then refused: the
operator checks a spec's depth without recursion, api/load.depth_problem, before anything walks it;
kopf's own deep copy of each object is gone, handlers.EssenceFreeDiffBaseStorage). 1,000 more for
the frames of the event loop and kopf below the decoder."""


def run(
    namespaces: list[str],
    metrics_port: int,
    liveness_port: int,
    trainer_image: str,
    pull_policy: str,
    scrape_networks: list[str],
    scrape: bool = True,
    leader_elect: bool = False,
    lease_name: str = "kubetrain-operator",
    lease_namespace: str = "",
    pod_security_allow: frozenset[str] = frozenset(),
    object_store_secrets: frozenset[str] = frozenset(),
    network_policy: bool = True,
    metrics_from: tuple[dict[str, Any], ...] = (),
    kueue: bool = False,
    kueue_slices: bool = False,
    gang_schedulers: tuple[tuple[str, str], ...] = (),
    volcano_queues: frozenset[str] = frozenset(),
    workers: int = WORKERS,
) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setrecursionlimit(max(sys.getrecursionlimit(), RECURSION_LIMIT))
    settings = Settings(image=trainer_image, pull_policy=pull_policy, pod_security_allow=pod_security_allow,
                        object_store_secrets=object_store_secrets, network_policy=network_policy, metrics_from=metrics_from, gang_schedulers=gang_schedulers,
                        volcano_queues=volcano_queues)
    config = OperatorConfig(settings=settings, scrape_networks=scrape_networks, scrape=scrape,
                            namespaces=list(namespaces), workers=workers, kueue=kueue,
                            kueue_slices=kueue_slices)
    handlers.register(Controller(config))
    metrics.serve(metrics_port)
    liveness = f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None
    elector = None
    if leader_elect:
        # The pod's own namespace (the downward API's POD_NAMESPACE) where the chart grants the Lease.
        namespace = lease_namespace or os.environ.get("POD_NAMESPACE") or "default"
        elector = leader.LeaderElector(lease_name, namespace, leader.new_identity())
        # Until kopf installs its own handler, SIGTERM unwinds through the `finally` below,
        # which releases the lease if this process got it: the standby then takes over at
        # its next look instead of after LEASE_SECONDS.
        signal.signal(signal.SIGTERM, _terminate)
    try:
        if elector is not None:
            log.info("leader election: %s as %s", elector.where, elector.identity)
            with _healthz_while_standing_by(liveness_port, elector):
                elector.acquire()
            elector.start_renewing()
        metrics.LEADER.set(1)
        asyncio.run(
            kopf.operator(
                clusterwide=not namespaces,
                namespaces=namespaces,
                liveness_endpoint=liveness,
                standalone=True,
            )
        )
    except _Terminated:
        log.info("SIGTERM: stopping")
    finally:
        # kopf has stopped acting (its run returned, or never began): only now may another lead.
        metrics.LEADER.set(0)
        if elector is not None:
            elector.release()
    return 0
