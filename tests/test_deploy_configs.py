"""The deploy configs are safe by default (issue 14, item 10).

Every manifest under deploy/kubernetes/ (PyYAML, every document) and docker-compose.yml are parsed
and checked for the properties docs/deploy.md promises:

- Ray runs with token authentication wherever it runs (head, workers, the compose container), the
  token from a required Secret / a required compose variable, and memfit's Jobs API client gets the
  same token;
- no literal secret, no CHANGE_ME, no default password: Kubernetes secrets come from Secrets the
  manifests reference but do not contain, compose's from ``${VAR:?message}`` variables, so
  ``docker compose up`` refuses to start without them;
- nothing is published outside the cluster (no LoadBalancer, NodePort, hostPort, Ingress), the Ray
  dashboard that listens on 0.0.0.0 inside its pod is fenced by a NetworkPolicy admitting only the
  Ray cluster's own pods and memfit's, and compose publishes the API on the host's loopback only;
- containers run as non-root, with a read-only root filesystem, no privilege escalation, no
  capabilities and no service-account token, and every container has CPU and memory limits;
- images are pinned, the Dockerfile ends as a numeric non-root user and says how torch is chosen.

The manifests are also validated against the Kubernetes JSON schemas (kubernetes-validate ships them,
so this runs offline); the RayCluster, whose CRD schema is not among them, has its pod templates
validated as PodTemplates and its spec's field names checked against KubeRay's ray.io/v1 API.

The last test starts a real Ray head the way the compose container does (memfit's LocalRayHead,
token mode, the token in RAY_AUTH_TOKEN) and checks that Ray refuses a client without the token while
memfit's own Jobs API client, given the env the manifests give memfit, submits a job whose driver
connects to the cluster (as ``python -m workers.run`` does) and succeeds.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
KUBERNETES_VERSION = "1.33"

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob", "Pod"}
PUBLISHING_KINDS = {"Ingress", "IngressClass", "Gateway", "HTTPRoute", "GRPCRoute", "TCPRoute", "Route"}
# ray.io/v1 RayCluster spec fields (KubeRay's API), for a typo check where no schema is at hand.
RAYCLUSTER_SPEC_FIELDS = {
    "authOptions", "autoscalerOptions", "enableInTreeAutoscaling", "gcsFaultToleranceOptions", "headGroupSpec",
    "headServiceAnnotations", "managedBy", "networkPolicy", "rayVersion", "suspend", "tlsOptions",
    "upgradeStrategy", "workerGroupSpecs",
}
HEAD_GROUP_FIELDS = {"enableIngress", "headService", "ingressOptions", "labels", "rayStartParams", "resources",
                     "serviceType", "template"}
WORKER_GROUP_FIELDS = {"groupName", "idleTimeoutSeconds", "labels", "maxReplicas", "minReplicas", "numOfHosts",
                       "priority", "rayStartParams", "replicas", "resources", "scaleStrategy", "suspend", "template"}
RAY_PORTS = {8265, 6379, 10001}  # Jobs API/dashboard, GCS, Ray client
SECRET_NAME = re.compile(r"PASSWORD|PASSWD|TOKEN|SECRET|API_KEY|ACCESS_KEY|DATABASE_URL", re.IGNORECASE)
PLACEHOLDERS = re.compile(r"change[_-]?me|replace[_-]?me|<password>|password123|s3cr3t", re.IGNORECASE)
URL_WITH_PASSWORD = re.compile(r"://(?P<user>[^:/@\s]+):(?P<password>\$\{[^}]*\}|[^@\s/]+)@")


# --- reading the files ---------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(KUBERNETES_DIR.glob("*.yaml")) + sorted(KUBERNETES_DIR.glob("*.yml"))


def manifests() -> list[tuple[str, dict]]:
    """(where, document) for every non-empty document of every manifest."""
    out = []
    for path in manifest_files():
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                out.append((f"{path.relative_to(ROOT)}[{i}] {doc.get('kind')}/{doc['metadata']['name']}", doc))
    return out


def of_kind(kind: str) -> list[tuple[str, dict]]:
    return [(where, doc) for where, doc in manifests() if doc.get("kind") == kind]


def pod_templates(where: str, doc: dict) -> Iterator[tuple[str, dict]]:
    """(where, pod template {metadata, spec}) of a workload or of a RayCluster's groups."""
    kind = doc.get("kind")
    if kind == "Pod":
        yield where, doc
    elif kind == "CronJob":
        yield where, doc["spec"]["jobTemplate"]["spec"]["template"]
    elif kind in WORKLOAD_KINDS:
        yield where, doc["spec"]["template"]
    elif kind == "RayCluster":
        yield f"{where} head", doc["spec"]["headGroupSpec"]["template"]
        for group in doc["spec"].get("workerGroupSpecs") or []:
            yield f"{where} worker group {group.get('groupName')}", group["template"]


def all_pod_templates() -> list[tuple[str, dict]]:
    return [t for where, doc in manifests() for t in pod_templates(where, doc)]


def containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


def secret_ref(entry: dict | None) -> tuple[str, str] | None:
    """(Secret name, key) an env entry takes its value from, when it is a required secretKeyRef."""
    ref = ((entry or {}).get("valueFrom") or {}).get("secretKeyRef")
    if not ref or ref.get("optional"):
        return None
    return ref["name"], ref["key"]


def ray_clusters() -> list[tuple[str, dict]]:
    return of_kind("RayCluster")


def memfit_containers() -> list[tuple[str, dict]]:
    """Containers that run memfit's scheduler (they name a Ray cluster to submit to)."""
    return [(f"{where} {c['name']}", c) for where, t in all_pod_templates() for c in containers(t)
            if "MEMFIT_RAY_ADDRESS" in env_of(c)]


def compose_raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def walk_strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from walk_strings(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk_strings(v, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


# --- compose's variable interpolation (the Compose Specification's rules) -------------------------


class MissingVariable(Exception):
    def __init__(self, name: str, message: str):
        super().__init__(f"required variable {name} is missing a value: {message}")
        self.name = name


_REFERENCE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(text: str, env: dict[str, str]) -> str:
    """``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``/``-``, ``${VAR:?error}``/``?``, ``${VAR:+alt}``/``+``,
    as ``docker compose`` applies them to every value; a required variable that is missing raises."""

    def one(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("named")
        value, op, arg = env.get(name), m.group("op"), m.group("arg") or ""
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op in (":?", "?") and unset:
            raise MissingVariable(name, arg)
        if op in (":-", "-") and unset:
            return arg
        if op in (":+", "+"):
            return "" if unset else arg
        return value or ""

    return _REFERENCE.sub(one, text)


def interpolated(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: interpolated(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolated(v, env) for v in node]
    if isinstance(node, str):
        return interpolate(node, env)
    return node


def required_variables(text: str) -> set[str]:
    """Variables written ``${VAR:?…}``: unset or empty, compose refuses to start."""
    return {m.group("braced") for m in _REFERENCE.finditer(text) if m.group("op") == ":?"}


def test_the_interpolation_rules_are_compose_s():
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("a$$b ${SET} $SET ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${SET:+alt} ${UNSET:+alt}", env) == \
        "a$b v v d d  alt "
    assert interpolate("${SET:?why}", env) == "v"
    with pytest.raises(MissingVariable, match="EMPTY is missing a value: why"):
        interpolate("${EMPTY:?why}", env)
    assert interpolate("${EMPTY?why}", env) == ""  # without the colon an empty value passes
    assert required_variables("${A:?x} ${B?y} ${C:-z} ${D}") == {"A"}


# --- schemas -------------------------------------------------------------------------------------


def test_manifests_match_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the [dev] extra is not installed")
    docs = manifests()
    assert {doc["kind"] for _, doc in docs} >= {"RayCluster", "Deployment", "Service", "NetworkPolicy"}
    for where, doc in docs:
        if doc["kind"] != "RayCluster":
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            continue
        spec = doc["spec"]
        assert doc["apiVersion"] == "ray.io/v1", where
        assert set(spec) <= RAYCLUSTER_SPEC_FIELDS, (where, set(spec) - RAYCLUSTER_SPEC_FIELDS)
        assert set(spec["headGroupSpec"]) <= HEAD_GROUP_FIELDS, where
        for group in spec.get("workerGroupSpecs") or []:
            assert set(group) <= WORKER_GROUP_FIELDS, (where, group.get("groupName"))
        for part, template in pod_templates(where, doc):
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                            "metadata": {"name": "check"}, "template": template}
            try:
                kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{part}: {exc}") from None


# --- Ray's token authentication ----------------------------------------------------------------------


def test_ray_runs_with_token_auth_everywhere():
    from service.settings import load_settings

    clusters = ray_clusters()
    assert clusters, "no RayCluster in deploy/kubernetes"
    ray_secrets = set()
    for where, doc in clusters:
        auth = doc["spec"].get("authOptions")
        assert auth is None or auth.get("mode", "token") == "token", f"{where}: authOptions.mode {auth}"
        for part, template in pod_templates(where, doc):
            for c in containers(template):
                env = env_of(c)
                assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{part} {c['name']}: RAY_AUTH_MODE"
                ref = secret_ref(env.get("RAY_AUTH_TOKEN"))
                assert ref, f"{part} {c['name']}: RAY_AUTH_TOKEN must come from a required secretKeyRef"
                ray_secrets.add(ref)
    assert len(ray_secrets) == 1, f"head and workers must share one token, got {ray_secrets}"

    schedulers = memfit_containers()
    assert schedulers, "no memfit container names MEMFIT_RAY_ADDRESS"
    for where, c in schedulers:
        env = env_of(c)
        mode = env.get("MEMFIT_RAY_AUTH_MODE", {}).get("value")
        assert mode == "token", f"{where}: MEMFIT_RAY_AUTH_MODE={mode!r}"
        assert load_settings(ray_auth_mode=mode).ray_auth_mode == "token"  # memfit accepts what is given
        assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{where}: RAY_AUTH_MODE"
        assert secret_ref(env.get("RAY_AUTH_TOKEN")) in ray_secrets, f"{where}: not the Ray cluster's token"

    for where, template in all_pod_templates():
        for c in containers(template):
            for name in ("RAY_AUTH_MODE", "MEMFIT_RAY_AUTH_MODE"):
                value = env_of(c).get(name, {}).get("value")
                assert value in (None, "token"), f"{where} {c['name']}: {name}={value!r}"

    # compose: the Ray head memfit starts inside its container (no MEMFIT_RAY_ADDRESS) runs in token mode.
    text = COMPOSE.read_text()
    for name, service in compose_raw()["services"].items():
        env = compose_env(service)
        if not any(k.startswith("MEMFIT_") for k in env):
            continue
        assert env.get("MEMFIT_RAY_AUTH_MODE") == "token", f"compose {name}: MEMFIT_RAY_AUTH_MODE"
        assert env.get("RAY_AUTH_MODE") == "token", f"compose {name}: RAY_AUTH_MODE"
        token_vars = {m.group("braced") for m in _REFERENCE.finditer(env.get("RAY_AUTH_TOKEN", ""))}
        assert token_vars and token_vars <= required_variables(text), \
            f"compose {name}: RAY_AUTH_TOKEN must be a required ${{VAR:?…}} variable"


# --- secrets -------------------------------------------------------------------------------------------


def test_no_literal_secrets_placeholders_or_default_passwords():
    for path in [*manifest_files(), COMPOSE, DOCKERFILE]:
        found = PLACEHOLDERS.search(path.read_text())
        assert not found, f"{path.relative_to(ROOT)}: placeholder secret {found.group(0)!r}"

    for where, doc in manifests():
        if doc["kind"] == "Secret":
            assert not doc.get("data") and not doc.get("stringData"), \
                f"{where}: a committed Secret with values; create it out of band (docs/deploy.md)"
        for path, value in walk_strings(doc):
            m = URL_WITH_PASSWORD.search(value)
            assert not m, f"{where}{path}: a URL with an inline password"
    for where, template in all_pod_templates():
        for c in containers(template):
            for name, entry in env_of(c).items():
                if SECRET_NAME.search(name):
                    assert "value" not in entry and secret_ref(entry), \
                        f"{where} {c['name']}: {name} must come from a required secretKeyRef, not a value"

    text = COMPOSE.read_text()
    required = required_variables(text)
    for name, service in compose_raw()["services"].items():
        for key, value in compose_env(service).items():
            refs = [m for m in _REFERENCE.finditer(value) if m.group("braced")]
            if SECRET_NAME.search(key) and not URL_WITH_PASSWORD.search(value):
                assert refs and all(m.group("braced") in required for m in refs) and \
                    _REFERENCE.sub("", value) == "", f"compose {name}: {key} must be a ${{VAR:?…}} variable"
            m = URL_WITH_PASSWORD.search(value)
            if m:
                assert _REFERENCE.fullmatch(m.group("password")) and \
                    _REFERENCE.fullmatch(m.group("password")).group("braced") in required, \
                    f"compose {name}: {key} has a literal password in its URL"


def test_compose_refuses_to_start_without_its_secrets():
    text = COMPOSE.read_text()
    raw = compose_raw()
    required = required_variables(text)
    assert required, "docker-compose.yml requires no variable"
    with pytest.raises(MissingVariable):
        interpolated(raw, {})
    for name in required:  # each one alone is enough to refuse
        env = {other: secrets.token_hex(8) for other in required if other != name}
        with pytest.raises(MissingVariable) as exc:
            interpolated(raw, env)
        assert exc.value.name == name
        with pytest.raises(MissingVariable):
            interpolated(raw, {**env, name: ""})

    # Given them, every secret lands where it is used, and both ends of the database password agree.
    env = {name: secrets.token_hex(16) for name in required}
    services = interpolated(raw, env)["services"]
    pg, memfit = compose_env(services["postgres"]), compose_env(services["memfit"])
    password = pg["POSTGRES_PASSWORD"]
    assert password in env.values()
    m = URL_WITH_PASSWORD.search(memfit["MEMFIT_DATABASE_URL"])
    assert m and (m.group("user"), m.group("password")) == (pg["POSTGRES_USER"], password)
    assert memfit["RAY_AUTH_TOKEN"] in env.values() and memfit["RAY_AUTH_TOKEN"] != password


# --- what is reachable from outside --------------------------------------------------------------------------


def _selects(selector: dict, labels: dict) -> bool:
    if selector.get("matchExpressions"):
        return False  # not needed here; refuse rather than guess
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def test_nothing_is_published_outside_the_cluster():
    for where, doc in manifests():
        assert doc["kind"] not in PUBLISHING_KINDS, f"{where}: published by default"
        if doc["kind"] == "Service":
            kind = doc["spec"].get("type", "ClusterIP")
            assert kind == "ClusterIP", f"{where}: type {kind}"
            assert not doc["spec"].get("externalIPs"), where
    for where, template in all_pod_templates():
        spec = template["spec"]
        assert not spec.get("hostNetwork"), f"{where}: hostNetwork"
        for c in containers(template):
            assert not any("hostPort" in p for p in c.get("ports") or []), f"{where} {c['name']}: hostPort"

    memfit_labels = [t["metadata"].get("labels") or {} for where, doc in of_kind("Deployment")
                     for _, t in pod_templates(where, doc) if any("MEMFIT_RAY_ADDRESS" in env_of(c) for c in containers(t))]
    assert memfit_labels, "no memfit Deployment"
    policies = of_kind("NetworkPolicy")
    for where, doc in ray_clusters():
        head = doc["spec"]["headGroupSpec"]
        assert head.get("serviceType") == "ClusterIP", f"{where}: headGroupSpec.serviceType must be ClusterIP"
        assert not head.get("enableIngress"), f"{where}: enableIngress"
        # KubeRay starts the dashboard on 0.0.0.0 unless told otherwise: that is fine on the pod
        # network only if a NetworkPolicy admits nothing but this cluster's pods and memfit's.
        host = (head.get("rayStartParams") or {}).get("dashboard-host", "0.0.0.0")
        if ipaddress.ip_address(host).is_loopback:
            continue
        name = doc["metadata"]["name"]
        head_labels = {"ray.io/cluster": name, "ray.io/node-type": "head", "ray.io/group": "headgroup",
                       **(head["template"]["metadata"].get("labels") or {})}
        fencing = [(pw, p) for pw, p in policies if _selects(p["spec"]["podSelector"], head_labels)
                   and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
        assert fencing, f"{where}: dashboard-host {host} and no NetworkPolicy selects the head pod"
        for pw, policy in fencing:
            for rule in policy["spec"].get("ingress") or []:
                peers = rule.get("from")
                assert peers, f"{pw}: an ingress rule without `from` admits every source"
                for peer in peers:
                    assert set(peer) == {"podSelector"}, f"{pw}: only pod selectors of this namespace, got {peer}"
                    own = (peer["podSelector"].get("matchLabels") or {}).get("ray.io/cluster") == name
                    memfit = any(_selects(peer["podSelector"], labels) for labels in memfit_labels)
                    assert own or memfit, f"{pw}: admits pods other than {name}'s and memfit's: {peer}"
                    if not own:
                        ports = {p.get("port") for p in rule.get("ports") or []}
                        assert ports and ports <= RAY_PORTS, f"{pw}: memfit admitted to ports {ports or 'all'}"
            admitted = [rule for rule in policy["spec"].get("ingress") or []
                        if any(_selects(peer["podSelector"], labels) for peer in rule["from"] for labels in memfit_labels)
                        and any(p.get("port") == 8265 for p in rule.get("ports") or [])]
            assert admitted, f"{pw}: memfit's pods cannot reach the Jobs API (8265)"

    for name, service in compose_raw()["services"].items():
        assert service.get("network_mode") != "host", f"compose {name}: network_mode host"
        for port in service.get("ports") or []:
            if isinstance(port, dict):
                host_ip = port.get("host_ip")
            else:
                parts = str(port).rsplit(":", 2)
                host_ip = parts[0].strip("[]") if len(parts) == 3 else None
            assert host_ip and ipaddress.ip_address(host_ip).is_loopback, \
                f"compose {name}: port {port} is published on every interface of the host"


# --- least privilege and limits ---------------------------------------------------------------------------------


def test_containers_run_unprivileged():
    templates = all_pod_templates()
    assert templates
    for where, template in templates:
        spec = template["spec"]
        pod_security = spec.get("securityContext") or {}
        assert spec.get("automountServiceAccountToken") is False, f"{where}: automountServiceAccountToken"
        for flag in ("hostPID", "hostIPC", "hostNetwork"):
            assert not spec.get(flag), f"{where}: {flag}"
        assert not any("hostPath" in v for v in spec.get("volumes") or []), f"{where}: a hostPath volume"
        for c in containers(template):
            security = c.get("securityContext") or {}
            merged = {**pod_security, **security}
            label = f"{where} {c['name']}"
            assert merged.get("runAsNonRoot") is True, f"{label}: runAsNonRoot"
            assert merged.get("runAsUser", 1) != 0, f"{label}: runAsUser 0"
            assert security.get("allowPrivilegeEscalation") is False, f"{label}: allowPrivilegeEscalation"
            assert not security.get("privileged"), f"{label}: privileged"
            assert security.get("readOnlyRootFilesystem") is True, f"{label}: readOnlyRootFilesystem"
            caps = security.get("capabilities") or {}
            assert "ALL" in (caps.get("drop") or []) and not caps.get("add"), f"{label}: capabilities"

    for name, service in compose_raw()["services"].items():
        assert not service.get("privileged"), f"compose {name}: privileged"
        assert "no-new-privileges:true" in (service.get("security_opt") or []), f"compose {name}: no-new-privileges"
        if name == "postgres":
            continue  # the official image starts as root to set up its data directory, then drops to postgres
        user = str(service.get("user") or "")
        assert user and user.split(":")[0] not in ("0", "root"), f"compose {name}: user {user!r}"
        assert service.get("read_only") is True, f"compose {name}: read_only"
        assert "ALL" in (service.get("cap_drop") or []) and not service.get("cap_add"), f"compose {name}: cap_drop"

    users = re.findall(r"^\s*USER\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    assert users, "deploy/Dockerfile sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"deploy/Dockerfile ends as USER {users[-1]} (numeric, non-root)"


def _quantity(value: Any) -> float:
    """A Kubernetes quantity (``500m``, ``4``, ``16Gi``) or a compose one (``16g``, ``512m``) as a number."""
    text = str(value)
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    assert m, f"not a quantity: {text!r}"
    return float(m.group(1)) * units.get(m.group(2), 1)


def test_every_container_has_resource_requests_and_limits():
    for where, template in all_pod_templates():
        for c in containers(template):
            resources = c.get("resources") or {}
            requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
            for kind in ("cpu", "memory"):
                assert kind in limits, f"{where} {c['name']}: no {kind} limit"
                assert kind in requests, f"{where} {c['name']}: no {kind} request"
                assert _quantity(requests[kind]) <= _quantity(limits[kind]), f"{where} {c['name']}: {kind}"
    compose = interpolated(compose_raw(), {name: "x" for name in required_variables(COMPOSE.read_text())})
    for name, service in compose["services"].items():
        limits = ((service.get("deploy") or {}).get("resources") or {}).get("limits") or {}
        assert "cpus" in limits and "memory" in limits, f"compose {name}: deploy.resources.limits"
        assert _quantity(limits["cpus"]) > 0 and _quantity(limits["memory"].rstrip("bB")) > 0


def _ray_version() -> str:
    pyproject = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"ray\[[^\]]*\]==([0-9.]+)"', pyproject).group(1)


def _pinned(image: str) -> bool:
    tag = image.rpartition(":")[2] if ":" in image.split("/")[-1] else ""
    return "@sha256:" in image or (bool(tag) and tag != "latest" and any(ch.isdigit() for ch in tag))


def test_images_are_pinned_and_the_dockerfile_says_how_torch_is_chosen():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG\s+BASE=(\S+)", text, re.MULTILINE)
    assert base and re.search(r"^FROM\s+\$\{BASE\}", text, re.MULTILINE), "deploy/Dockerfile: FROM ${BASE}"
    assert _pinned(base.group(1)) and f":{_ray_version()}-" in base.group(1), \
        f"deploy/Dockerfile: base {base.group(1)} is not pinned to ray {_ray_version()}"
    # The CPU/GPU torch choice is a build argument, and the torch install uses it.
    assert re.search(r"^ARG\s+TORCH_INDEX=\S*cpu", text, re.MULTILINE), "deploy/Dockerfile: ARG TORCH_INDEX"
    assert re.search(r"pip install[^\n]*TORCH_INDEX[^\n]*\"torch", text), "the torch install ignores TORCH_INDEX"

    for where, template in all_pod_templates():
        for c in containers(template):
            assert _pinned(c["image"]), f"{where} {c['name']}: image {c['image']} is not pinned"
    for where, doc in ray_clusters():
        assert doc["spec"]["rayVersion"] == _ray_version(), where
    for name, service in compose_raw()["services"].items():
        image = service.get("image")
        assert image and _pinned(image), f"compose {name}: image {image!r} is not pinned"
        if "build" not in service:  # an upstream image: a minor version at least, not a moving major tag
            assert re.search(r":\d+\.\d+", image), f"compose {name}: image {image!r} pins only a major version"


# --- the token contract, against a real Ray head --------------------------------------------------------------

_SUBMIT = r"""
import json, sys, time
from service.scheduler.ray_jobs import RayJobs
ray = RayJobs(sys.argv[1], auth_mode="token", ship_code=False)
sid = "deploy-token-check"
ray.submit(sid, sys.executable + " -c 'import ray; ray.init(address=\"auto\"); print(\"CPUs\", ray.cluster_resources().get(\"CPU\"))'",
           {"RAY_AUTH_MODE": ray.auth_mode}, {})
deadline = time.monotonic() + float(sys.argv[2])
status = ray.status(sid)
while status.status in ("PENDING", "RUNNING") and time.monotonic() < deadline:
    time.sleep(1)
    status = ray.status(sid)
print(json.dumps({"status": status.status, "message": status.message, "logs": ray.log_tail(sid)}))
"""


@pytest.mark.ray
@pytest.mark.slow
def test_token_mode_as_configured_locks_out_strangers_and_lets_memfit_in(tmp_path, monkeypatch):
    """The compose container's env (a LocalRayHead in token mode, RAY_AUTH_TOKEN) and the memfit
    container's (MEMFIT_RAY_AUTH_MODE/RAY_AUTH_MODE token + RAY_AUTH_TOKEN) against a real head."""
    pytest.importorskip("ray", reason="the [train] extra is not installed")
    from service.scheduler.local_head import LocalRayHead

    compose_memfit = compose_env(compose_raw()["services"]["memfit"])
    (_, memfit), *_ = memfit_containers()
    memfit_env = {name: e["value"] for name, e in env_of(memfit).items() if "value" in e}
    assert compose_memfit["MEMFIT_RAY_AUTH_MODE"] == memfit_env["MEMFIT_RAY_AUTH_MODE"] == "token"

    token = secrets.token_hex(32)
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)  # what the Secret / the compose variable provides
    head = LocalRayHead(num_cpus=1, auth_mode=compose_memfit["MEMFIT_RAY_AUTH_MODE"], log_path=tmp_path / "head.log")
    head.start(timeout_s=240)
    try:
        # No token: 401 Unauthorized; a wrong one: 403 Forbidden.
        for headers, code in (({}, 401), ({"Authorization": "Bearer " + secrets.token_hex(32)}, 403)):
            request = urllib.request.Request(f"{head.dashboard_url}/api/jobs/", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == code

        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update({"PYTHONPATH": str(ROOT), "RAY_AUTH_TOKEN": token,
                    **{k: memfit_env[k] for k in ("MEMFIT_RAY_AUTH_MODE", "RAY_AUTH_MODE")}})
        run = subprocess.run([sys.executable, "-c", _SUBMIT, head.dashboard_url, "300"], env=env,
                             capture_output=True, text=True, timeout=420)
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["status"] == "SUCCEEDED", result
        assert any(line.startswith("CPUs") for line in result["logs"]), result["logs"]

        stranger = {**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        run = subprocess.run([sys.executable, "-c", _SUBMIT, head.dashboard_url, "60"], env=stranger,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode != 0 and "token" in run.stderr.lower(), run.stderr[-2000:]
    finally:
        head.stop()
