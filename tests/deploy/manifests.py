"""Rendering and offline validation of the Kubernetes manifests in deploy/kubernetes/.

- `render(directory)`: `kubectl kustomize` of a base or an overlay, as the list of its objects.
- `problems(obj)`: what the API server would refuse in one object, validated without a
  cluster: built-in kinds against the Kubernetes OpenAPI schemas that kubernetes-validate ships
  (its strict variant, which refuses unknown fields as `kubectl apply`'s default
  field validation does); the custom resources of the vendored CRDs (deploy/kubernetes/crds/)
  against their `openAPIV3Schema` with jsonschema, made strict the same way.
- `rbac_rules(mode)`: the Role of deploy/kubernetes/rbac/<mode>.yaml as {(group, resource): verbs}.

Nothing here downloads anything: the schemas are in the installed package and the repository.
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
CRD_DIR = KUBERNETES_DIR / "crds"
RBAC_DIR = KUBERNETES_DIR / "rbac"
EXAMPLES_DIR = KUBERNETES_DIR / "examples"
# The cluster version the manifests are written for: kubectl's own (v1.32 on these machines).
KUBERNETES_VERSION = "1.32"
RBAC_MODES = ("replicas", "hpa-bounds", "metric")

# The LibYAML parser: the vendored CRDs are 3 MB of YAML (half a second, against several with
# the pure-Python one).
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_all(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.load_all(text, Loader=Loader) if doc]


def overlays() -> list[Path]:
    return sorted(
        path.parent for path in (KUBERNETES_DIR / "overlays").glob("*/kustomization.yaml")
    )


def kubectl() -> str:
    """kubectl's path. Missing, the test fails rather than skips: these machines have it
    (Debian's google-cloud-cli-kubectl, /usr/bin/kubectl), and a skip would let manifests
    that no longer render pass unnoticed."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not on PATH: tests/deploy renders deploy/kubernetes/ with "
            "`kubectl kustomize` (install kubectl, e.g. `apt-get install kubectl` or "
            "google-cloud-cli-kubectl)."
        )
    return path


@functools.cache
def _render_text(directory: str) -> str:
    result = subprocess.run(
        [kubectl(), "kustomize", directory],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise RenderError(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return result.stdout


class RenderError(Exception):
    pass


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` renders (a fresh copy each call)."""
    return load_all(_render_text(str(directory)))


def load_file(path: Path) -> list[dict[str, Any]]:
    return load_all(path.read_text())


# --- Custom resources ---------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """The schema as the API server applies it with strict field validation: an object that
    lists its properties accepts no others, unless it preserves unknown fields. Embedded
    resources (x-kubernetes-embedded-resource) also accept apiVersion, kind and metadata."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if strict.get("x-kubernetes-embedded-resource"):
        properties = strict.setdefault("properties", {})
        for name in ("apiVersion", "kind"):
            properties.setdefault(name, {"type": "string"})
        properties.setdefault("metadata", {"type": "object"})
    if (
        "properties" in strict
        and "additionalProperties" not in strict
        and not strict.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    if strict.get("nullable") and isinstance(strict.get("type"), str):
        strict["type"] = [strict["type"], "null"]
    return strict


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> a validator of the vendored CRD's served version."""
    validators = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in load_file(path):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if not version.get("served"):
                    continue
                schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
                # OpenAPI v3.0's schema objects are JSON Schema draft 4 with extensions
                # (x-kubernetes-*, which jsonschema ignores).
                validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft4Validator(
                    schema
                )
    return validators


def _path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(part) for part in error.absolute_path) or "(top level)"


def problems(obj: dict[str, Any]) -> list[str]:
    """What is wrong with one object, as `path: message` lines; empty when it validates."""
    api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    name = (obj.get("metadata") or {}).get("name", "?")
    where = f"{kind} {name}"
    validator = crd_validators().get((api_version, kind))
    if validator is not None:
        found = [
            f"{where}: {_path(error)}: {error.message}"
            for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
        ]
        # The API server checks a custom resource's metadata as every object's ObjectMeta,
        # which the CRD's schema leaves open: check it with a ConfigMap's.
        carrier = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata")}
        try:
            kubernetes_validate.validate(carrier, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            found.append(f"{where}: {_path(error)}: {error.message}")
        if not (obj.get("metadata") or {}).get("name"):
            found.append(f"{where}: metadata.name: required")
        return found
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{where}: {_path(error)}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"{where}: no schema: {error.message}"]
    return []


# --- RBAC -----------------------------------------------------------------------------------------


def rbac_documents(mode: str) -> list[dict[str, Any]]:
    return load_file(RBAC_DIR / f"{mode}.yaml")


def rbac_rules(mode: str) -> dict[tuple[str, str], set[str]]:
    """The scaler Role of a mode: (API group, resource) -> verbs."""
    role = next(
        doc
        for doc in rbac_documents(mode)
        if doc["kind"] == "Role" and doc["metadata"]["name"] == "model-unit-control-plane-scaler"
    )
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted
