"""Names the operator and its children share: API group, labels, annotations, child-name templates."""

from __future__ import annotations

GROUP = "basin.dev"
VERSION = "v1alpha1"
KIND = "BasinDeployment"
PLURAL = "basindeployments"
SINGULAR = "basindeployment"
SHORT_NAMES = ["bd"]

# Images: `make images` builds and tags these (images/README.md); the tag is Basin's version, the one
# stated in pyproject.toml and basin.__version__. The engine image is SGLANG_IMAGE plus Basin's extension.
IMAGE_REPOSITORY = "ghcr.io/basin-project"
BASIN_IMAGE = f"{IMAGE_REPOSITORY}/basin"
ENGINE_IMAGE = f"{IMAGE_REPOSITORY}/basin-engine"
# The SGLang the engine image builds on (pyproject.toml pins sglang==0.5.23).
SGLANG_IMAGE = "lmsysorg/sglang:v0.5.23"
# Debian's redis-server for clusters without a registry (images/redis; `make e2e` sets spec.images.redis
# to it). spec.images.redis defaults to the upstream image, which real clusters pull.
REDIS_IMAGE = f"{IMAGE_REPOSITORY}/basin-redis"

# One domain prefix for every label and annotation the operator writes.
PREFIX = GROUP
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
MANAGED_BY = "basin-operator"
LABEL_ROLE = f"{PREFIX}/role"  # prefill or decode: what the router's service discovery selects on
LABEL_FINGERPRINT = f"{PREFIX}/profile-fingerprint"
ANNOTATION_SPEC_HASH = f"{PREFIX}/spec-hash"  # a digest of the built child, for people and tools to compare

# SGLang's router reads a prefill pod's bootstrap port from this annotation (sglang-router defaults).
BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"

# Ports of the children.
ENGINE_PORT = 30000
DRAIN_SECONDS = 5  # gateway and emulator Pods serve this long after deletion before SIGTERM
BOOTSTRAP_PORT = 8998
ADMIN_TOKEN_KEY = "token"  # in the <name>-gateway-admin Secret
UNIT_PORT = 8997  # the engine extension's unit service (decode) and fetch target (prefill), plus TP rank
ROUTER_PORT = 8000
ROUTER_METRICS_PORT = 29000
GATEWAY_PORT = 8080
REDIS_PORT = 6379

# The profile ConfigMap: the profiling Job writes PROFILE_KEY, the gateway mounts it at PROFILE_MOUNT.
PROFILE_KEY = "profile.json"
# The profiler's last outcome (JSON: state, reason, fingerprint, at); a failed run's reason is read from here.
PROFILE_STATUS_KEY = "status"
PROFILE_MOUNT = "/etc/basin/profile"
PREDICTOR_MOUNT = "/etc/basin/predictor"

# SGLang loads general plugins from installed entry points; this whitelists the Basin engine extension
# by its entry-point name in the `sglang.srt.plugins` group (pyproject.toml).
ENGINE_PLUGIN_ENV = "SGLANG_PLUGINS"
ENGINE_PLUGIN = "basin"

# The longest child name is "<name>-profile-<10 hex>-<attempt>"; Job pods carry it in a 63-character label.
MAX_NAME_LENGTH = 40

# A finished profiling Job is kept a day where the API honours ttlSecondsAfterFinished: long enough for
# the operator to collect it and for a person to read its logs.
JOB_TTL_SECONDS = 86_400
# Besides the current Job, the operator keeps this many of the latest finished ones (their pods' logs).
KEEP_FINISHED_JOBS = 1

COMPONENTS = ("prefill", "decode", "router", "gateway", "redis", "profiler", "emulator")


def child_name(parent: str, component: str) -> str:
    """The one template for child names: `<parent>-<component>`."""
    return f"{parent}-{component}"


def object_key(namespace: str, name: str) -> str:
    """The one composite key of a namespaced object (memo entries, logs)."""
    return f"{namespace}/{name}"
