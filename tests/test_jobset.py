"""The Kubernetes launcher (launch/kustomization.yaml, launch/k8s/) checked against JobSet's own rules, no cluster.

What `kubectl apply -k launch/` would send -- with no cluster component and with each of launch/k8s/overlays/ -- is
rendered (by `kubectl kustomize` where kubectl is installed, else by `_render_here`, limited to what launch/ uses;
where both exist a test proves they agree) and each JobSet in it must pass what the API server and JobSet's
webhooks would check on create:
- the CRD's OpenAPI v3 schema (tests/jobset/, JobSet commit 01078527ec43), with the API server's defaults and its
  strict field validation (an unknown field fails), the list-map key uniqueness and the CEL rule that apply on create;
- the Job template inside it against Kubernetes' own schema (kubernetes-validate, strict);
- JobSet's mutating then validating webhook (pkg/webhooks/jobset_webhook.go at the same commit): failure-policy rule
  names (pattern, length, uniqueness), job failure reasons, target replicated jobs, the DNS-1035 length of the Job
  and Pod names it will generate, the network subdomain, the coordinator (and its label value, JobSet v0.11.0),
  dependsOn.
Then what happens after admission, for the parts launch/ relies on: the environment each pod starts with (JobSet's
pod labels and annotations, the kubelet's downward API and $(VAR) expansion) read by jaxtrain's own cluster
detection, and which failures restart the set with or without counting against maxRestarts (the Job controller's
podFailurePolicy, JobSet's failurePolicy). Those checks and models live in tests/jobset_admission.py.
"""

import os
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

import jobset_admission as ja
from jaxtrain.cluster.distributed import resolve
from jaxtrain.config.ops import DistConfig
from jaxtrain_testing import REPO
from jobset_admission import K8S_VERSION, admission_errors

LAUNCH = os.path.join(REPO, "launch")
COMPONENTS = sorted(os.listdir(os.path.join(LAUNCH, "k8s", "overlays")))
POD = ("spec", "replicatedJobs", 0, "template", "spec", "template", "spec")


def _at(doc, path):
    for key in path:
        doc = doc[key]
    return doc


# ---- rendering ----------------------------------------------------------------------------------------------------

def _with_component(root: str, component: str | None) -> None:
    """Enable one component in the copy of launch/ at `root` the way docs/multihost.md says: uncomment its line."""
    path = os.path.join(root, "kustomization.yaml")
    text = open(path).read()
    if component:
        line = f"#  - k8s/overlays/{component} "
        assert line in text, f"launch/kustomization.yaml has no commented line for component {component}"
        text = text.replace(line, line[1:])
    open(path, "w").write(text)


def _render_kubectl(root: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", root], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return list(yaml.safe_load_all(out.stdout))


def _env_file(path: str) -> dict:
    """An `envs:` file as kustomize reads it: KEY=VALUE lines, # comments and blank lines skipped."""
    data = {}
    for line in open(path):
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:  # kustomize would take the value from its own environment: not used by launch/
                raise NotImplementedError(f"{path}: {line!r} has no '='")
            data[key] = value
    return data


def _json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 add/replace/remove (the ops launch/k8s/overlays use), in place."""
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        elif op["op"] in ("add", "replace") and isinstance(node, dict):
            if op["op"] == "replace" and last not in node:
                raise KeyError(f"replace: {op['path']} does not exist")
            node[last] = op["value"]
        elif op["op"] == "replace":
            node[int(last)] = op["value"]
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise NotImplementedError(f"JSON patch op {op['op']!r}")


def _matches(doc: dict, target: dict) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    want = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    if set(target) - set(want):
        raise NotImplementedError(f"patch target fields {sorted(set(target) - set(want))}")
    return all(want[k] == v for k, v in target.items())


def _render_here(root: str) -> list[dict]:
    """kustomize's output for the kustomization at `root`, for the features launch/ uses and no others (anything
    else raises): file resources, a configMapGenerator from env files without name hashes, and Components made of
    JSON 6902 patches with a target. Output order as kustomize's: ConfigMaps, then the other resources."""
    kust = yaml.safe_load(open(os.path.join(root, "kustomization.yaml")))
    known = {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions", "components"}
    if set(kust) - known or kust.get("generatorOptions") != {"disableNameSuffixHash": True}:
        raise NotImplementedError(f"kustomization fields {sorted(set(kust) - known)} or hashed generator names")
    docs = [d for r in kust["resources"] for d in yaml.safe_load_all(open(os.path.join(root, r)))]
    maps = []
    for gen in kust.get("configMapGenerator") or []:
        if set(gen) != {"name", "envs"}:
            raise NotImplementedError(f"configMapGenerator fields {sorted(gen)}")
        data = {k: v for env in gen["envs"] for k, v in _env_file(os.path.join(root, env)).items()}
        maps.append({"apiVersion": "v1", "data": data, "kind": "ConfigMap", "metadata": {"name": gen["name"]}})
    for path in kust.get("components") or []:
        comp = yaml.safe_load(open(os.path.join(root, path, "kustomization.yaml")))
        if comp["kind"] != "Component" or set(comp) != {"apiVersion", "kind", "patches"}:
            raise NotImplementedError(f"{path}: only a Component of patches")
        for patch in comp["patches"]:
            if set(patch) != {"target", "patch"}:
                raise NotImplementedError(f"{path}: patch fields {sorted(patch)}")
            for doc in docs:
                if _matches(doc, patch["target"]):
                    _json_patch(doc, yaml.safe_load(patch["patch"]))
    return maps + docs


def render(component: str | None, tmp_path, use_kubectl: bool | None = None) -> list[dict]:
    """The documents `kubectl apply -k launch/` sends with `component` enabled (None: as shipped)."""
    root = str(tmp_path / f"launch-{component}")
    shutil.copytree(LAUNCH, root)
    _with_component(root, component)
    if use_kubectl is None:
        use_kubectl = shutil.which("kubectl") is not None
    return _render_kubectl(root) if use_kubectl else _render_here(root)


def the_jobset(docs: list[dict]) -> dict:
    (js,) = [d for d in docs if d["kind"] == "JobSet"]
    return js


# ---- the tests ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    """Component (None: as shipped) -> the documents `kubectl apply -k launch/` would send."""
    tmp = tmp_path_factory.mktemp("render")
    return {c: render(c, tmp) for c in [None, *COMPONENTS]}


def base_jobset() -> dict:
    (doc,) = yaml.safe_load_all(open(os.path.join(LAUNCH, "k8s", "jaxtrain.yaml")))
    return doc


@pytest.mark.parametrize("component", [None, *COMPONENTS])
def test_what_kubectl_applies_passes_jobset_admission(rendered, component):
    docs = rendered[component]
    errors = admission_errors(the_jobset(docs))
    assert not errors, "JobSet would refuse it: " + " | ".join(errors)
    for doc in docs:
        if doc["kind"] != "JobSet":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _mutated(change) -> dict:
    js = base_jobset()
    change(js)
    return js


def _rules(js):
    return js["spec"]["failurePolicy"]["rules"]


REJECTED = {
    # The rule name shipped until this test existed: JobSet's webhook refuses hyphens.
    "rule name with a hyphen": (lambda js: _rules(js)[0].update(name="preempted-and-saved"),
                                "invalid failure policy rule name 'preempted-and-saved'"),
    "rule name ending in ':'": (lambda js: _rules(js)[0].update(name="preempted:"), "invalid failure policy rule"),
    "rule name over 128": (lambda js: _rules(js)[0].update(name="a" * 129), "rule name of length 129"),
    "duplicate rule names": (lambda js: _rules(js).append(dict(_rules(js)[0])), "rule names are not unique"),
    "unknown job failure reason": (lambda js: _rules(js)[0].update(onJobFailureReasons=["Evicted"]),
                                   "invalid job failure reason 'Evicted'"),
    "unknown target": (lambda js: _rules(js)[0].update(targetReplicatedJobs=["worker"]),
                       "invalid replicatedJob name 'worker' in failure policy"),
    "unknown action": (lambda js: _rules(js)[0].update(action="RestartJob"), "'RestartJob' is not one of"),
    "rule without action": (lambda js: _rules(js)[0].pop("action"), "'action' is a required property"),
    "unknown field": (lambda js: js["spec"].update(failurepolicy={}), "'failurepolicy' was unexpected"),
    "long JobSet name": (lambda js: js["metadata"].update(name="jaxtrain-" + "x" * 40),
                         "pod names generated for this JobSet will exceed 63 characters"),
    "very long JobSet name": (lambda js: js["metadata"].update(name="j" * 56),
                              "job names generated for this JobSet will exceed 63 characters"),
    "subdomain not DNS": (lambda js: js["spec"]["network"].update(subdomain="jax_train"), "RFC 1123 subdomain"),
    "two replicated jobs of one name": (lambda js: js["spec"]["replicatedJobs"].append(js["spec"]["replicatedJobs"][0]),
                                        "Duplicate value: ('workers',)"),
    "coordinator pod out of range": (
        lambda js: js["spec"].update(coordinator={"replicatedJob": "workers", "podIndex": 1}),
        "coordinator pod index 1 is invalid"),
    "dependsOn on the first replicated job": (
        lambda js: js["spec"]["replicatedJobs"][0].update(dependsOn=[{"name": "prep", "status": "Complete"}]),
        "DependsOn can't be set for the first ReplicatedJob"),
    "InOrder startup with dependsOn": (
        lambda js: js["spec"].update(startupPolicy={"startupPolicyOrder": "InOrder"}) or
        js["spec"]["replicatedJobs"][0].update(dependsOn=[{"name": "prep", "status": "Complete"}]),
        "StartupPolicy and DependsOn APIs are mutually exclusive"),
    "group name not DNS-1035": (lambda js: js["spec"]["replicatedJobs"][0].update(groupName="Workers"),
                                "'Workers': a DNS-1035 label"),
    "JobSet name with capitals": (lambda js: js["metadata"].update(name="JaxTrain"), "metadata.name: Invalid value"),
    "typo in the pod template": (lambda js: _at(js, POD)["containers"][0].update(resource={}),
                                 "replicatedJobs[workers].template"),
    "unknown restart strategy": (lambda js: js["spec"]["failurePolicy"].update(restartStrategy="Blocking"),
                                 "'Blocking' is not one of ['Recreate', 'BlockingRecreate']"),
    "coordinator of a replicated job that does not exist": (
        lambda js: js["spec"]["coordinator"].update(replicatedJob="worker"),
        "coordinator replicatedJob worker does not exist"),
    # 44 characters: every generated Job and Pod name fits in 63 (the pod name check above), the coordinator's
    # address (label value) does not: jaxtrain-xx...x-workers-0-0.jaxtrain is 65 characters.
    "coordinator address over 63 characters": (lambda js: js["metadata"].update(name="jaxtrain-" + "x" * 35),
                                               "invalid label value"),
    "pod condition pattern without status": (
        lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][0]
        ["onPodConditions"][0].pop("status"), "'status' is a required property"),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_admission_refuses_what_jobset_refuses(case):
    """Each check can fail: a one-field change of the shipped JobSet that JobSet (or Kubernetes) refuses."""
    change, message = REJECTED[case]
    errors = admission_errors(_mutated(change))
    assert any(message in e for e in errors), errors


def _pod_env(js: dict, job_index: int, rendered) -> dict:
    """The environment pod `job_index` of the set starts with, ConfigMap jaxtrain-env as kustomize renders it."""
    (rjob,) = js["spec"]["replicatedJobs"]
    maps = {d["metadata"]["name"]: d["data"] for d in rendered[None] if d["kind"] == "ConfigMap"}
    (c,) = _at(js, POD)["containers"]
    return ja.container_environment(c, ja.pod_metadata(js, rjob["name"], job_index), maps)


def test_every_pod_finds_the_coordinator_through_jobset(rendered):
    """Each pod's JAX_COORDINATOR_ADDRESS, as the kubelet builds it from JobSet's coordinator annotation, is what
    jaxtrain's cluster detection uses, and names pod 0 of Job 0 (its hostname jaxtrain-workers-0-0 in the
    headless service jaxtrain) on the port the container declares; process ids 0..7, 8 processes."""
    js = base_jobset()
    port = next(p["containerPort"] for p in _at(js, POD)["containers"][0]["ports"] if p["name"] == "coordinator")
    assert port == 8476
    for i in range(8):
        settings = resolve(DistConfig(), _pod_env(js, i, rendered) | {"JAX_PLATFORMS": "cpu"})
        assert settings.coordinator == "jaxtrain-workers-0-0.jaxtrain:8476"
        assert (settings.num_processes, settings.process_id) == (8, i)
        assert settings.sources["coordinator"] == "environment: JAX_COORDINATOR_ADDRESS"
        assert settings.bind_address == "[::]:8476"  # process 0 listens on every interface of its pod


def test_the_coordinator_address_follows_the_jobset_not_a_written_pod_name(rendered):
    """Renamed set, replicated job and subdomain, and 4 nodes: the address follows; no pod name is written in the
    manifest."""
    js = base_jobset()
    (c,) = _at(js, POD)["containers"]
    assert "jaxtrain-workers-0-0" not in yaml.safe_dump(c)
    js["metadata"]["name"], js["spec"]["network"]["subdomain"] = "llama", "llama-net"
    js["spec"]["replicatedJobs"][0].update(name="hosts", replicas=4)
    js["spec"]["coordinator"]["replicatedJob"] = "hosts"
    assert not admission_errors(js)
    settings = resolve(DistConfig(), _pod_env(js, 3, rendered) | {"JAX_PLATFORMS": "cpu"})
    assert (settings.coordinator, settings.num_processes, settings.process_id) == ("llama-hosts-0-0.llama-net:8476",
                                                                                   4, 3)


def test_without_jobsets_coordinator_the_address_has_no_host(rendered):
    """What a JobSet older than 0.6 (no spec.coordinator, no annotation) would give: the downward API reads an
    absent annotation as empty, so the address is ':8476' -- why the manifest says it needs JobSet >= 0.7."""
    js = base_jobset()
    del js["spec"]["coordinator"]
    assert _pod_env(js, 1, rendered)["JAX_COORDINATOR_ADDRESS"] == ":8476"


def test_kubernetes_expansion_of_env_values():
    """$(VAR) as Kubernetes expands it (hand-worked cases from its expansion rules)."""
    defined = {"A": "x", "B": ""}
    assert ja.expand("$(A):1", defined) == "x:1"
    assert ja.expand("$(B):1", defined) == ":1"
    assert ja.expand("$(C):1", defined) == "$(C):1"  # undefined: left as written
    assert ja.expand("$$(A)", defined) == "$(A)"  # escaped
    assert ja.expand("a$b$(A", defined) == "a$b$(A"


def test_base_schedules_on_any_gpu_node_and_components_add_their_network(rendered):
    """As shipped: 8 GPUs, CPU and memory, no node selector, no fast-network device. Each component adds its node
    selector and network device (requests == limits, as extended resources require) and nothing else."""
    pods = {c: _at(the_jobset(docs), POD) for c, docs in rendered.items()}
    base = pods[None]
    (c,) = base["containers"]
    assert "nodeSelector" not in base and "securityContext" not in c
    assert set(c["resources"]["requests"]) == {"cpu", "memory", "nvidia.com/gpu"}
    assert c["resources"]["limits"] == {"memory": "1000Gi", "nvidia.com/gpu": 8}
    want = {
        "gpu-operator": ({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, {"rdma/rdma_shared_device_a": 1}, {}),
        "gke": ({"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}, {}, {}),
        "eks": ({"node.kubernetes.io/instance-type": "p5.48xlarge"},
                {"vpc.amazonaws.com/efa": 32, "hugepages-2Mi": "5120Mi"},
                {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}),
    }
    assert set(want) == set(COMPONENTS)
    for name, (selector, resources, env) in want.items():
        pod = pods[name]
        (pc,) = pod["containers"]
        assert pod["nodeSelector"] == selector
        for kind in ("requests", "limits"):
            assert pc["resources"][kind] == c["resources"][kind] | resources, (name, kind)
        assert pc["env"] == c["env"] + [{"name": k, "value": v} for k, v in env.items()]
        assert pc.get("securityContext") == ({"capabilities": {"add": ["IPC_LOCK"]}} if resources else None)
        rest = {k: v for k, v in pod.items() if k not in ("nodeSelector", "containers")}
        assert rest == {k: v for k, v in base.items() if k != "containers"}
        assert [d for d in rendered[name] if d["kind"] != "JobSet"] == [d for d in rendered[None]
                                                                        if d["kind"] != "JobSet"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed")
@pytest.mark.parametrize("component", [None, *COMPONENTS])
def test_the_renderer_here_gives_what_kubectl_kustomize_gives(tmp_path, component):
    assert render(component, tmp_path / "a", use_kubectl=False) == render(component, tmp_path / "b", use_kubectl=True)


def test_every_component_is_offered_in_the_kustomization():
    text = open(os.path.join(LAUNCH, "kustomization.yaml")).read()
    assert re.findall(r"^#  - k8s/overlays/([\w-]+) ", text, re.M) == ["gpu-operator", "gke", "eks"]
    assert sorted(["gpu-operator", "gke", "eks"]) == COMPONENTS
    assert yaml.safe_load(text)["components"] is None  # as shipped: none enabled


def test_jobset_has_what_a_jax_job_needs():
    js = base_jobset()
    spec = js["spec"]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["kind"] == "JobSet"
    assert spec["failurePolicy"]["maxRestarts"] >= 1  # any failure restarts every pod
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]  # gang admission
    (rjob,) = spec["replicatedJobs"]
    job = rjob["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 1 and job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= 120
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    (c,) = pod["containers"]
    assert re.fullmatch(r"[\w./-]+@sha256:[0-9a-f]{64}", c["image"])  # pinned by digest
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # The node count lives in one place: replicas. Processes read it and their index from JobSet's pod labels.
    env = {e["name"]: e for e in c["env"]}
    assert env["JAX_NUM_PROCESSES"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']"
    assert env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['jobset.sigs.k8s.io/job-index']"
    assert not any(str(rjob["replicas"]) == a.split("=")[-1] for a in c["args"] if "dcn" in a)
    assert "mesh.dcn.data=-1" in c["args"]
    # args, not command: a command would replace the image's ENTRYPOINT (NVIDIA's, which sets up CUDA's forward
    # compatibility before running its arguments); launch/container/Dockerfile keeps the base image's.
    assert "command" not in c and c["args"][:4] == ["python", "-m", "jaxtrain", "train"]


def test_jobset_restarts_a_run_that_stopped_early():
    """A run stopped by SIGTERM exits EXIT_PREEMPTED; the Job fails on it (podFailurePolicy, reason PodFailurePolicy)
    and the JobSet's first rule matching that reason restarts every Job without counting against maxRestarts.
    Exit 0 (finished) matches no rule: the Job completes."""
    from jaxtrain.errors import EXIT_PREEMPTED

    spec = base_jobset()["spec"]
    job = spec["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # Kubernetes accepts a podFailurePolicy only with Never
    (rule,) = [r for r in job["podFailurePolicy"]["rules"] if "onExitCodes" in r]
    codes = rule["onExitCodes"]
    assert rule["action"] == "FailJob" and codes["operator"] == "In" and codes["values"] == [EXIT_PREEMPTED]
    assert codes["containerName"] == pod["containers"][0]["name"]
    first = next(r for r in spec["failurePolicy"]["rules"] if "PodFailurePolicy" in r.get("onJobFailureReasons", []))
    assert first["action"] == "RestartJobSetAndIgnoreMaxRestarts", first
    assert "targetReplicatedJobs" not in first or spec["replicatedJobs"][0]["name"] in first["targetReplicatedJobs"]


def _attempts(js: dict, pod_statuses: list[dict]) -> tuple[list[str], dict]:
    """Feed one failed pod per attempt through the Job controller and JobSet's failure policy."""
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    status, outcomes = {"restarts": 0, "restartsCountTowardsMax": 0}, []
    for pod in pod_statuses:
        reason = ja.job_failure_reason(job, pod)
        outcomes.append(ja.jobset_on_job_failure(js, "workers", reason, status) if reason else "pod replaced")
    return outcomes, status


CRASH = {"exitCodes": {"jaxtrain": 1}}
SAVED = {"exitCodes": {"jaxtrain": 75}, "conditions": {"DisruptionTarget": "True"}}  # evicted, saved, exited 75
NODE_LOST = {"exitCodes": {"jaxtrain": 137}, "conditions": {"DisruptionTarget": "True"}}  # killed: no time to save
NOT_STARTED = {"conditions": {"DisruptionTarget": "True"}}  # deleted by the pod GC before its container ran
PREEMPTED_75 = {"exitCodes": {"jaxtrain": 75}}  # SIGTERM from elsewhere (e.g. a Kueue preemption), saved


def test_evictions_and_lost_nodes_restart_without_using_up_max_restarts():
    """maxRestarts is 5, for crashes only. Hand-worked: 20 disruptions of every kind, then 5 crashes, restart 25
    times with 5 counted; the 6th crash fails the JobSet. A pod with DisruptionTarget fails its Job with reason
    PodFailurePolicy whatever its exit code (137 here: SIGKILL after the grace period)."""
    js = base_jobset()
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 5
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    for pod in (SAVED, NODE_LOST, NOT_STARTED, PREEMPTED_75):
        assert ja.job_failure_reason(job, pod) == "PodFailurePolicy", pod
    assert ja.job_failure_reason(job, CRASH) == "BackoffLimitExceeded"
    outcomes, status = _attempts(js, [SAVED, NODE_LOST, NOT_STARTED, PREEMPTED_75] * 5 + [CRASH] * 6)
    assert outcomes == ["restart"] * 25 + ["failed"]
    assert status == {"restarts": 25, "restartsCountTowardsMax": 5}


def test_without_the_disruption_rule_a_lost_node_counts_as_a_crash():
    """The rule is what makes the difference: without it six lost nodes end the run."""
    js = base_jobset()
    pfp = js["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]
    pfp["rules"] = [r for r in pfp["rules"] if "onPodConditions" not in r]
    assert not admission_errors(js)
    outcomes, status = _attempts(js, [NODE_LOST] * 6)
    assert outcomes == ["restart"] * 5 + ["failed"] and status["restartsCountTowardsMax"] == 5


def test_restarts_wait_for_the_old_pods_to_be_gone():
    """BlockingRecreate as written survives admission; without the field the CRD's default is Recreate (new Jobs
    are created while the old pods may still be in their grace period)."""
    js = base_jobset()
    assert js["spec"]["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    assert not ja.api_server_errors(js) and js["spec"]["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    del js["spec"]["failurePolicy"]["restartStrategy"]
    assert not ja.api_server_errors(js) and js["spec"]["failurePolicy"]["restartStrategy"] == "Recreate"

