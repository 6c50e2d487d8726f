"""The BasinDeployment CRD, generated from the pydantic models in `basin_operator.spec`.

`crds/basindeployment.yaml` is this module's output (`basin operator crd --out crds/basindeployment.yaml`);
a test keeps the two identical. Pydantic's JSON schema is turned into a Kubernetes structural schema:
references inlined, optional fields (`X | None`) as plain optional properties, `gt` as OpenAPI 3.0's
boolean `exclusiveMinimum`, int-or-string quantities marked, and `default: {}` on nested objects so the
apiserver fills their defaults in.
"""

from __future__ import annotations

from typing import Any

import yaml

from basin_operator.constants import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from basin_operator.spec import BasinDeploymentSpec, BasinDeploymentStatus


def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic (JSON Schema 2020-12) node as an apiextensions/v1 structural schema node."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return _structural(merged, defs)
    options = schema.get("anyOf")
    if options is not None:
        kept = [o for o in options if o.get("type") != "null"]
        types = {o.get("type") for o in kept}
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        if types == {"integer", "string"}:  # a Kubernetes quantity
            out = {"x-kubernetes-int-or-string": True}
            if "description" in rest:
                out["description"] = rest["description"]
            return out
        if len(kept) != 1:
            raise ValueError(f"cannot express a union of {types} in a structural schema")
        node = _structural({**kept[0], **rest}, defs)
        if node.get("default", "") is None:
            del node["default"]
        return node
    out: dict[str, Any] = {}
    for key in ("description", "type", "enum", "minimum", "maximum", "minLength", "format", "default"):
        if key in schema:
            out[key] = schema[key]
    if "const" in schema:
        out["enum"] = [schema["const"]]
    if "exclusiveMinimum" in schema:
        out["minimum"] = schema["exclusiveMinimum"]
        out["exclusiveMinimum"] = True
    if "exclusiveMaximum" in schema:
        out["maximum"] = schema["exclusiveMaximum"]
        out["exclusiveMaximum"] = True
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    kind = out.get("type")
    if kind == "object" or "properties" in schema:
        out["type"] = "object"
        properties = schema.get("properties", {})
        if properties:
            out["properties"] = {name: _structural(node, defs) for name, node in properties.items()}
            for name, node in out["properties"].items():
                # Nested objects with defaults of their own default to {} so the apiserver fills them in;
                # optional objects (`X | None = None`) stay absent.
                optional = properties[name].get("default", {}) is None
                defaultable = "properties" in node and "required" not in node and not optional
                if node.get("type") == "object" and defaultable and name not in schema.get("required", []):
                    node.setdefault("default", {})
            if schema.get("required"):
                out["required"] = list(schema["required"])
        elif isinstance(schema.get("additionalProperties"), dict):
            out["additionalProperties"] = _structural(schema["additionalProperties"], defs)
    if kind == "array":
        out["items"] = _structural(schema["items"], defs)
    if out.get("type") == "number" and isinstance(out.get("default"), int):
        out["default"] = float(out["default"])
    return out


def _without_defaults(node: Any) -> Any:
    """Status is written by the operator only: defaults there mean nothing (and "" trips 1.20's checks)."""
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


def openapi_schema(model: type) -> dict[str, Any]:
    """The structural schema of a pydantic model, by its camelCase aliases."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition: schema, printer columns, status and scale subresources."""
    spec_schema = openapi_schema(BasinDeploymentSpec)
    status_schema = _without_defaults(openapi_schema(BasinDeploymentStatus))
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A Basin-managed SGLang prefill-decode deployment.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.prefill.replicas",
                            "statusReplicasPath": ".status.prefillReplicas",
                            "labelSelectorPath": ".status.prefillSelector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Prefill", "type": "integer", "jsonPath": ".spec.prefill.replicas"},
                        {"name": "Decode", "type": "integer", "jsonPath": ".spec.decode.replicas"},
                        {"name": "Kappa", "type": "number", "jsonPath": ".status.profile.kappa"},
                        {"name": "Profile", "type": "string", "jsonPath": ".status.profile.state"},
                        {"name": "Limit", "type": "string", "jsonPath": ".status.firstLimit", "priority": 1},
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Writes repeated lists (enums) in full instead of as YAML anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


HEADER = "# Generated by `basin operator crd` from basin_operator/spec.py; do not edit by hand.\n"


def render_crd() -> str:
    """The CRD as the YAML text kept in `crds/basindeployment.yaml`."""
    return HEADER + yaml.dump(
        build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=110, allow_unicode=True
    )
