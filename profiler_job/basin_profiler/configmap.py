"""Writing the profile where the operator and the gateway read it: the profile ConfigMap, and Events.

The ConfigMap holds `profile.json` (the `ProfileDocument`) and a `status` key with the last outcome
(`{"state": "succeeded"|"failed", "reason", "fingerprint", "at"}`); a failed run leaves the previous
profile in place and says why in `status` and in a Warning Event. In a cluster the operator creates the
ConfigMap and the profiler's Role may only get, update and patch that one object (and create Events), so
the write is a patch; a hand run (`basin profile --configmap NS/NAME`) creates it when it is missing.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass
from typing import Any

from basin.errors import BasinError

STATUS_KEY = "status"  # basin_operator.constants.PROFILE_STATUS_KEY
PROFILE_LABEL = "basin.dev/profile"  # on every profile ConfigMap: what the gateway and operator select
COMPONENT = "basin-profiler"


@dataclass(frozen=True)
class Destination:
    namespace: str
    name: str
    key: str = "profile.json"
    deployment: str = ""  # the BasinDeployment an Event is about ("" : the ConfigMap itself)
    kubeconfig: str | None = None

    @classmethod
    def parse(cls, text: str, key: str = "profile.json", kubeconfig: str | None = None) -> Destination:
        namespace, _, name = text.partition("/")
        if not namespace or not name or "/" in name:
            raise BasinError(f"--configmap must be NAMESPACE/NAME, got {text!r}")
        return cls(namespace, name, key, kubeconfig=kubeconfig)


def _api(kubeconfig: str | None) -> Any:
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            return client.CoreV1Api()
        return client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
    except (ConfigException, OSError) as error:
        raise BasinError(f"no Kubernetes credentials: {error}") from None


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write(dest: Destination, data: dict[str, str]) -> str:
    """Patch `data` into the ConfigMap (labelled), creating it when missing; 'created' or 'updated'."""
    from kubernetes.client.exceptions import ApiException

    api = _api(dest.kubeconfig)
    labels = {PROFILE_LABEL: "true"}
    try:
        api.patch_namespaced_config_map(
            dest.name, dest.namespace, {"metadata": {"labels": labels}, "data": data}
        )
        return "updated"
    except ApiException as error:
        if error.status != 404:
            raise BasinError(
                f"cannot write ConfigMap {dest.namespace}/{dest.name}: {_reason(error)}"
            ) from None
    body = {"metadata": {"name": dest.name, "namespace": dest.namespace, "labels": labels}, "data": data}
    try:
        api.create_namespaced_config_map(dest.namespace, body)
    except ApiException as error:
        raise BasinError(f"cannot create ConfigMap {dest.namespace}/{dest.name}: {_reason(error)}") from None
    return "created"


def write_profile(dest: Destination, profile_json: str, fingerprint: str) -> str:
    status = {"state": "succeeded", "reason": "", "fingerprint": fingerprint, "at": _now()}
    return write(dest, {dest.key: profile_json, STATUS_KEY: json.dumps(status)})


def write_failure(dest: Destination, reason: str, fingerprint: str) -> list[str]:
    """Record a failed run in the status key and a Warning Event; returns what could not be written
    (the run has failed already, so a second failure is reported, not raised)."""
    problems = []
    status = {"state": "failed", "reason": reason, "fingerprint": fingerprint, "at": _now()}
    try:
        write(dest, {STATUS_KEY: json.dumps(status)})
    except BasinError as error:
        problems.append(str(error))
    try:
        post_event(dest, "Warning", "ProfilerFailed", reason)
    except BasinError as error:
        problems.append(str(error))
    return problems


def post_event(dest: Destination, kind: str, reason: str, message: str) -> None:
    """A core/v1 Event about the BasinDeployment (in a Job) or the ConfigMap (a hand run)."""
    from kubernetes.client.exceptions import ApiException

    api = _api(dest.kubeconfig)
    if dest.deployment:
        involved = {"apiVersion": "basin.dev/v1alpha1", "kind": "BasinDeployment", "name": dest.deployment}
    else:
        involved = {"apiVersion": "v1", "kind": "ConfigMap", "name": dest.name}
    now = _now()
    body = {
        "metadata": {
            "generateName": f"{dest.deployment or dest.name}-profiler-",
            "namespace": dest.namespace,
        },
        "involvedObject": {**involved, "namespace": dest.namespace},
        "type": kind,
        "reason": reason,
        "message": message[:1000],
        "source": {"component": COMPONENT},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        api.create_namespaced_event(dest.namespace, body)
    except ApiException as error:
        raise BasinError(f"cannot post an Event in {dest.namespace}: {_reason(error)}") from None


def _reason(error: Any) -> str:
    try:
        return str(json.loads(error.body).get("message") or error.reason)
    except (TypeError, ValueError, AttributeError):
        return f"HTTP {error.status} {error.reason}"
