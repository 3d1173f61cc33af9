"""deploy/k8s/: every manifest passes the Kubernetes schemas (offline: kubernetes-validate bundles them), and says
what the deployment relies on: one GPU per worker pod, readiness on the worker's /healthz, a drain before stop,
disruption budgets, host networking for RTP, secrets from the Secret, configs that the gateway accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.config import load_config

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install '.[test]' brings it")

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
# The oldest Kubernetes still maintained when this was written, and the newest the package knows.
VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())


def resources() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def resource(kind: str, name: str) -> dict:
    (found,) = [r for r in resources() if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def container(workload: dict) -> dict:
    (first,) = workload["spec"]["template"]["spec"]["containers"]
    return first


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_passes_the_schemas_strictly(version: str) -> None:
    assert len(resources()) >= 9
    for doc in resources():
        # strict: an unknown or misspelt field is an error, not silently dropped by the API server
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_misspelt_field_fails_validation() -> None:
    """The check above can fail: a typo in a real manifest is caught offline."""
    worker = resource("StatefulSet", "cosyvoice-worker")
    container(worker)["readinessProbes"] = container(worker).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, VERSIONS[0], strict=True)


def test_gpu_workers_get_one_gpu_each_are_ready_on_healthz_and_drain() -> None:
    worker = resource("StatefulSet", "cosyvoice-worker")
    spec = container(worker)
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 9100}
    assert "--listen 0.0.0.0:9100" in spec["args"][0] and "--token-file" in spec["args"][0]
    assert "tts_worker_streams_active" in spec["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 60  # preStop's 60 s, then SIGTERM
    budget = resource("PodDisruptionBudget", "cosyvoice-worker")
    assert budget["spec"]["selector"]["matchLabels"] == worker["spec"]["selector"]["matchLabels"]


def test_gateways_use_host_networking_and_advertise_the_node() -> None:
    gateway = resource("Deployment", "cosyvoice-gateway")
    pod = gateway["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    env = {item["name"]: item for item in container(gateway)["env"]}
    assert env["COSYVOICE_GATEWAY_ADVERTISED_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert pod["terminationGracePeriodSeconds"] > 30  # the config's shutdown.drain_timeout_s
    budget = resource("PodDisruptionBudget", "cosyvoice-gateway")
    assert budget["spec"]["selector"]["matchLabels"] == gateway["spec"]["selector"]["matchLabels"]


def load_config_text(tmp_path: Path, text: str, overrides: dict):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load_config(path, overrides)


def test_the_configs_load_and_list_every_worker_replica(tmp_path: Path) -> None:
    data = resource("ConfigMap", "cosyvoice-config")["data"]
    gateway_yaml = yaml.safe_load(data["gateway.yaml"])
    overrides = {"sip.advertised_host": "10.0.0.21", "engine.remote.token": "t"}  # the pod's env sets these
    config = load_config_text(tmp_path, data["gateway.yaml"], overrides)
    assert config.engine.name == "remote"
    assert gateway_yaml["shutdown"]["drain_timeout_s"] < resource("Deployment", "cosyvoice-gateway")[
        "spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    replicas = resource("StatefulSet", "cosyvoice-worker")["spec"]["replicas"]
    assert list(config.engine.remote.urls) == [
        f"ws://cosyvoice-worker-{i}.cosyvoice-worker.cosyvoice.svc.cluster.local:9100/v1/engine/stream"
        for i in range(replicas)]
    worker = load_config_text(tmp_path, data["worker.yaml"], {})
    assert worker.engine.name == "cosyvoice2"


def test_secrets_and_config_maps_referenced_exist() -> None:
    defined = {(r["kind"], r["metadata"]["name"]) for r in resources()}
    gateway = container(resource("Deployment", "cosyvoice-gateway"))
    for item in gateway["env"]:
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ("Secret", ref["name"]) in defined
            assert ref["key"] in resource("Secret", ref["name"])["stringData"]
    for workload in (resource("StatefulSet", "cosyvoice-worker"), resource("Deployment", "cosyvoice-gateway"),
                     resource("Deployment", "kamailio")):
        for volume in workload["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                assert ("Secret", volume["secret"]["secretName"]) in defined
            if "configMap" in volume and volume["configMap"]["name"] != "cosyvoice-kamailio":
                assert ("ConfigMap", volume["configMap"]["name"]) in defined
    # cosyvoice-kamailio is made from the repository's file (kubectl create configmap --from-file): it exists
    mounts = container(resource("Deployment", "kamailio"))["volumeMounts"]
    cfg = next(m for m in mounts if m["name"] == "cfg")
    assert (REPO / "sip_config" / "kamailio" / cfg["subPath"]).is_file()

