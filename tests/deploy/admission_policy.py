"""A ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1) evaluated as the API server
evaluates it, for tests: which requests it matches (matchConstraints' resource rules, then
its matchConditions), its variables in order, then its validations. The CEL expressions run in
cel-python (celpy), a CEL implementation of its own, so what the tests find is what the
expressions say, not what a hand-written copy of them says.

Not modelled, because the policies shipped here use none of it: params, namespace and object
selectors, auditAnnotations, messageExpression, Kubernetes' CEL extension libraries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import celpy

_ENVIRONMENT = celpy.Environment()


@dataclass
class Verdict:
    matched: bool
    # The message of each validation that evaluated to false, in order.
    denials: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.denials


def _evaluate(expression: str, activation: dict[str, Any]) -> Any:
    program = _ENVIRONMENT.program(_ENVIRONMENT.compile(expression))
    result = program.evaluate(activation)
    if isinstance(result, celpy.CELEvalError):
        raise result
    return result


def _rule_matches(rule: dict, *, group: str, version: str, resource: str, operation: str) -> bool:
    def has(values: list[str], value: str) -> bool:
        return "*" in values or value in values

    return (
        has(rule["apiGroups"], group)
        and has(rule["apiVersions"], version)
        and has(rule["resources"], resource)
        and has(rule["operations"], operation)
    )


def admit(
    policy: dict,
    *,
    username: str,
    old: dict | None,
    new: dict | None,
    operation: str = "UPDATE",
    resource: tuple[str, str, str] = ("", "v1", "pods"),
) -> Verdict:
    """The policy's verdict on one request by `username` changing `old` into `new`."""
    spec = policy["spec"]
    group, version, plural = resource
    rules = spec["matchConstraints"]["resourceRules"]
    if not any(
        _rule_matches(rule, group=group, version=version, resource=plural, operation=operation)
        for rule in rules
    ):
        return Verdict(matched=False)
    request = {
        "operation": operation,
        "userInfo": {"username": username},
        "resource": {"group": group, "version": version, "resource": plural},
    }
    activation: dict[str, Any] = {
        "object": celpy.json_to_cel(new),
        "oldObject": celpy.json_to_cel(old),
        "request": celpy.json_to_cel(request),
    }
    for condition in spec.get("matchConditions", []):
        if not _evaluate(condition["expression"], activation):
            return Verdict(matched=False)
    variables: dict[str, Any] = {}
    for variable in spec.get("variables", []):
        activation["variables"] = celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): v for k, v in variables.items()}
        )
        variables[variable["name"]] = _evaluate(variable["expression"], activation)
    activation["variables"] = celpy.celtypes.MapType(
        {celpy.celtypes.StringType(k): v for k, v in variables.items()}
    )
    denials = [
        " ".join(validation["message"].split())
        for validation in spec["validations"]
        if not _evaluate(validation["expression"], activation)
    ]
    return Verdict(matched=True, denials=denials)
