"""The operator's few API verbs over the kubernetes dynamic client: get, ensure (server-side apply of a built
child), delete, events, and the BasinDeployment's status patch."""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, DynamicApiError, NotFoundError

from basin_operator.constants import GROUP, KIND, MANAGED_BY, VERSION

Manifest = dict[str, Any]
CREATE_ONLY = {"ConfigMap"}  # the profile ConfigMap's data belongs to the profiling Job
FIELD_MANAGER = "basin-operator"  # server-side apply: the fields this manager set are the operator's

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
    """Make the child exist as built: 'created', 'updated' (a field the operator owns differed) or
    'unchanged'.

    Server-side apply under the operator's field manager, forced, on every pass: every field the built
    manifest sets is the operator's and is put back whatever changed it (`kubectl scale`, `kubectl set
    image`, another controller), while fields it does not set stay with their owners (a Service's cluster
    IP, the token controller's ServiceAccount secrets, defaults) and a field the operator stops setting is
    removed. 'updated' means the applied fields differ from what they were before (other managers' writes
    meanwhile, such as status, do not count). Create-only kinds are never rewritten (the profile
    ConfigMap's data is the Job's).
    """
    resource = _resource(manifest["apiVersion"], manifest["kind"])
    meta = manifest["metadata"]
    existing = get(manifest["apiVersion"], manifest["kind"], meta["name"], meta["namespace"])
    if existing is not None and manifest["kind"] in CREATE_ONLY:
        return "unchanged"
    if existing is None and manifest["kind"] in CREATE_ONLY:
        return "created" if create(manifest) else "unchanged"
    applied = resource.server_side_apply(
        body=manifest, namespace=meta["namespace"], field_manager=FIELD_MANAGER, force_conflicts=True
    ).to_dict()
    if existing is None:
        return "created"
    if _project(applied, manifest) == _project(existing, manifest):
        return "unchanged"
    return "updated"


def _project(value: Any, shape: Any) -> Any:
    """`value` restricted to the keys `shape` has, at every depth (lists element by element)."""
    if isinstance(shape, dict) and isinstance(value, dict):
        return {key: _project(value.get(key), part) for key, part in shape.items()}
    if isinstance(shape, list) and isinstance(value, list) and len(shape) == len(value):
        return [_project(item, part) for item, part in zip(value, shape, strict=True)]
    return value


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


def post_event(obj: Manifest, kind: str, reason: str, message: str, logger: Any) -> None:
    """A core/v1 Event about `obj` (what `kubectl describe` shows); a failure to post is only logged."""
    meta = obj["metadata"]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": obj["apiVersion"],
            "kind": obj["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        },
        "type": kind,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": MANAGED_BY},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        _resource("v1", "Event").create(body=event, namespace=meta["namespace"])
    except (ApiException, DynamicApiError) as error:
        logger.warning(f"could not post event {reason}: {error}")
