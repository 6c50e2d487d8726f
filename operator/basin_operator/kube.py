"""The operator's few API verbs over the kubernetes dynamic client: get, ensure (create or replace when the
built spec changed), delete, and the BasinDeployment's status patch."""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any

from kubernetes import client, config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError

from basin_operator.constants import ANNOTATION_SPEC_HASH, GROUP, KIND, VERSION

Manifest = dict[str, Any]
CREATE_ONLY = {"ConfigMap"}  # the profile ConfigMap's data belongs to the profiling Job

_lock = threading.Lock()
_client: DynamicClient | None = None


def load_config(kubeconfig: str | None = None) -> None:
    """In-cluster credentials inside a pod, else a kubeconfig (this file, $KUBECONFIG, ~/.kube/config)."""
    if kubeconfig is None:
        try:
            config.load_incluster_config()
            return
        except config.ConfigException:
            pass
    config.load_kube_config(config_file=kubeconfig)


def api() -> DynamicClient:
    """One dynamic client per process (discovery is cached in it)."""
    global _client
    with _lock:
        if _client is None:
            _client = DynamicClient(client.ApiClient())
        return _client


def _resource(api_version: str, kind: str) -> Any:
    return api().resources.get(api_version=api_version, kind=kind)


def get(api_version: str, kind: str, name: str, namespace: str) -> Manifest | None:
    try:
        return _resource(api_version, kind).get(name=name, namespace=namespace).to_dict()
    except NotFoundError:
        return None


def get_basin_deployment(name: str, namespace: str) -> Manifest | None:
    return get(f"{GROUP}/{VERSION}", KIND, name, namespace)


def ensure(manifest: Manifest) -> str:
    """Make the child exist as built: 'created', 'updated' (its spec hash changed) or 'unchanged'.

    Replacing keeps what the apiserver owns (a Service's cluster IP); create-only kinds are never rewritten.
    A 409 on create means a concurrent pass or a restarted operator's earlier create: the object exists.
    """
    resource = _resource(manifest["apiVersion"], manifest["kind"])
    meta = manifest["metadata"]
    existing = get(manifest["apiVersion"], manifest["kind"], meta["name"], meta["namespace"])
    if existing is None:
        try:
            resource.create(body=manifest, namespace=meta["namespace"])
        except ConflictError:
            return "unchanged"
        return "created"
    if manifest["kind"] in CREATE_ONLY:
        return "unchanged"
    have = (existing["metadata"].get("annotations") or {}).get(ANNOTATION_SPEC_HASH)
    if have == meta["annotations"][ANNOTATION_SPEC_HASH]:
        return "unchanged"
    body = copy.deepcopy(manifest)
    body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
    if manifest["kind"] == "Service":
        for key in ("clusterIP", "clusterIPs"):
            if key in existing["spec"]:
                body["spec"][key] = existing["spec"][key]
    if manifest["kind"] == "ServiceAccount" and existing.get("secrets"):
        body["secrets"] = existing["secrets"]  # the token controller's
    try:
        resource.replace(body=body, namespace=meta["namespace"])
    except ConflictError:
        return "unchanged"  # changed meanwhile; the next pass sees the new version
    return "updated"


def list_objects(api_version: str, kind: str, namespace: str, selector: str) -> list[Manifest]:
    """Objects of a kind in a namespace by label selector."""
    found = _resource(api_version, kind).get(namespace=namespace, label_selector=selector).to_dict()
    return list(found.get("items") or [])


def create(manifest: Manifest) -> bool:
    """Create once; False when an object of that name already exists."""
    try:
        _resource(manifest["apiVersion"], manifest["kind"]).create(
            body=manifest, namespace=manifest["metadata"]["namespace"]
        )
    except ConflictError:
        return False
    return True


def delete(api_version: str, kind: str, name: str, namespace: str) -> None:
    """Delete with background propagation (a Job's pods go too); absent is fine."""
    with contextlib.suppress(NotFoundError):
        _resource(api_version, kind).delete(name=name, namespace=namespace, propagation_policy="Background")


def patch_status(name: str, namespace: str, status: Manifest) -> None:
    """JSON merge patch of the status subresource (None values remove keys)."""
    resource = _resource(f"{GROUP}/{VERSION}", KIND)
    resource.status.patch(
        body={"status": status}, name=name, namespace=namespace, content_type="application/merge-patch+json"
    )
