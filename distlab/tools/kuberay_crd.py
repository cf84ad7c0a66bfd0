"""KubeRay's own CustomResourceDefinitions as the schema of distlab's manifests.

The RayCluster and RayJob CRDs of KubeRay v1.7.0 are vendored byte for byte under
distlab/vendor/kuberay-v1.7.0/ (Apache-2.0, LICENSE and SOURCE.md beside them). Their
`openAPIV3Schema` (version v1) is turned into a JSON Schema and checked strictly, as
`kubectl apply --validate=strict` would: an unknown field fails (every object that lists its
properties gets additionalProperties: false unless the CRD keeps unknown fields), a wrong type
or a value outside an enum fails. OpenAPI's `nullable` allows null; `x-kubernetes-int-or-string`
is already an anyOf in the file. The CEL rules some fields carry (x-kubernetes-validations)
cannot be evaluated here, so a manifest that sets such a field fails too, naming it.
"""
from __future__ import annotations

import functools
from pathlib import Path

KUBERAY_VERSION = "v1.7.0"
CRD_DIR = Path(__file__).resolve().parent.parent / "vendor" / f"kuberay-{KUBERAY_VERSION}"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
CEL = "x-kubernetes-validations"


def _strict(node):
    """An OpenAPI v3 schema node as a strict JSON Schema node (recursively, new objects)."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strict(value) for key, value in node.items() if key not in ("nullable", "description")}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    """The v1 openAPIV3Schema of a kind's vendored CRD, strict."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(version["schema"]["openAPIV3Schema"])


def _cel_field(validator, rules, instance, schema):
    from jsonschema.exceptions import ValidationError

    yield ValidationError(f"sets a field with {len(rules)} CEL rule(s) (x-kubernetes-validations) that cannot be "
                          "checked here")


def crd_errors(manifest: dict) -> list[str]:
    """Every way `manifest` breaks its kind's KubeRay v1.7.0 CRD schema ('path: message')."""
    import jsonschema

    kind = manifest.get("kind")
    if kind not in CRD_FILES:
        return [f"kind: {kind!r} is none of {sorted(CRD_FILES)}"]
    validator_class = jsonschema.validators.extend(jsonschema.Draft202012Validator, {CEL: _cel_field})
    errors = validator_class(crd_schema(kind)).iter_errors(manifest)
    return sorted(f"{'.'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message[:300]}" for e in errors)
