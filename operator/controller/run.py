"""`kubetrain operator`: run the kopf operator against the current kubeconfig (or in-cluster)."""

from __future__ import annotations

import asyncio
import logging

import kopf

from ..core.children import Settings
from . import handlers, metrics


def run(
    namespaces: list[str],
    metrics_port: int,
    liveness_port: int,
    trainer_image: str,
    pull_policy: str,
    scrape_networks: list[str],
    scrape: bool = True,
) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers.CONFIG.settings = Settings(image=trainer_image, pull_policy=pull_policy)
    handlers.CONFIG.scrape_networks = scrape_networks
    handlers.CONFIG.scrape = scrape
    metrics.serve(metrics_port)
    liveness = f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None
    asyncio.run(
        kopf.operator(
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=liveness,
            standalone=True,
        )
    )
    return 0
