"""Starting the operator: credentials, kopf settings (one startup handler), handlers, and the run loop."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from basin.errors import BasinError
from basin_operator import constants as c
from basin_operator import handlers, kube


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """Progress in annotations (a structural status would prune `status.kopf` and rerun handlers),
    bounded watches (a silent stream otherwise leaves the operator deaf), events for every action."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{c.PREFIX}/finalizer"
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = c.MANAGED_BY
    settings.scanning.disabled = True  # the CRD is installed beforehand; no cluster-wide CRD watch needed
    settings.peering.standalone = True
    settings.execution.max_workers = 8


def run_operator(
    kubeconfig: str | None,
    namespaces: tuple[str, ...],
    resync_seconds: float,
    log_json: bool,
    verbose: bool,
    liveness: str | None,
) -> None:
    """Run until interrupted: every namespace when `namespaces` is empty."""
    if resync_seconds <= 0:
        raise BasinError(f"--resync-seconds must be positive, got {resync_seconds}")
    if kubeconfig is not None:
        if not os.path.isfile(kubeconfig):
            raise BasinError(f"--kubeconfig {kubeconfig}: no such file")
        os.environ["KUBECONFIG"] = kubeconfig  # kopf's own login reads the same file
    try:
        kube.load_config(kubeconfig)
    except Exception as error:  # the client raises several kinds for unusable configs
        raise BasinError(f"no usable Kubernetes credentials: {error}") from None
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.JSON if log_json else kopf.LogFormat.FULL)
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, logger: Any, **_: Any) -> None:
        configure_settings(settings)
        logger.info(f"basin operator watching {', '.join(namespaces) or 'all namespaces'}")

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        # The client library read $KUBECONFIG at import, before --kubeconfig set it: read the file directly.
        if kubeconfig is not None:
            return kopf.login_with_kubeconfig(**kwargs)
        return kopf.login_via_client(**kwargs)

    handlers.register(registry, resync_seconds)
    asyncio.run(
        kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            liveness_endpoint=liveness,
        )
    )
