"""What creating a JobSet would meet on a cluster with JobSet installed, reproduced without a cluster for
tests/test_jobset.py: the API server's checks of JobSet's CRD (schema, defaults, strict fields, list-map keys, the CEL
rule on create), JobSet's mutating and validating webhooks (pkg/webhooks/jobset_webhook.go) and, for the Job template
inside, Kubernetes' own schema (kubernetes-validate). Both JobSet sources are read at kubernetes-sigs/jobset commit
01078527ec4383c3d7289b5af3e0a788324e14ec (tests/jobset/ holds the CRD), plus one later webhook check that catches at
admission what that commit's controller fails on at run time (the coordinator label, v0.11.0).

And, for what happens after admission, the parts launch/ relies on: the labels and annotations JobSet's controller
puts on each pod (including the coordinator's address), the environment the kubelet builds from them, the Job
controller's podFailurePolicy and JobSet's failurePolicy deciding whether a failed pod restarts the set and whether
that restart counts against maxRestarts."""

import copy
import os
import re

import jsonschema
import kubernetes_validate
import yaml

from jaxtrain_testing import REPO

CRD = os.path.join(REPO, "tests", "jobset", "jobset.x-k8s.io_jobsets.excerpt.yaml")
K8S_VERSION = "1.31"

# jobset_webhook.go: validOnJobFailureReasons (batch/v1's Job failure condition reasons) and the rule-name limits.
JOB_FAILURE_REASONS = ("BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy")
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
MAX_RULE_NAME = 128
# k8s.io/apimachinery/pkg/util/validation: IsDNS1035Label, IsDNS1123Subdomain.
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_INT32 = 2**31 - 1
# validation.IsValidLabelValue: at most 63 characters, alphanumerics with '-', '_', '.' inside.
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
COORDINATOR_KEY = "jobset.sigs.k8s.io/coordinator"  # api/jobset/v1alpha2/jobset_types.go, since v0.6.0


# ---- the API server: CRD schema, defaults, list-map keys, CEL on create -----------------------------------------

def _crd_schema() -> dict:
    crd = yaml.safe_load(open(CRD))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return version["schema"]["openAPIV3Schema"]


def _strict(schema: dict) -> dict:
    """The schema with unknown fields refused, as the API server's strict field validation (kubectl's default)
    refuses fields a structural schema does not declare."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if "properties" in node and "additionalProperties" not in node:
            if not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
        stack.extend(node.get("properties", {}).values())
        stack.extend(v for k, v in node.items() if k in ("items", "additionalProperties") and isinstance(v, dict))
    return out


def _apply_defaults(schema: dict, obj) -> None:
    """The API server's structural defaulting: a missing field with a `default` gets it, in every object present."""
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                _apply_defaults(sub, obj[name])
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            _apply_defaults(schema["items"], item)


def _list_map_errors(schema: dict, obj, path: str) -> list[str]:
    """x-kubernetes-list-type: map -- no two items with the same x-kubernetes-list-map-keys."""
    errors = []
    if isinstance(obj, list) and "items" in schema:
        if schema.get("x-kubernetes-list-type") == "map":
            keys = [tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"]) for item in obj]
            errors += [f"{path}: Duplicate value: {k}" for k in sorted(set(keys), key=str) if keys.count(k) > 1]
        for i, item in enumerate(obj):
            errors += _list_map_errors(schema["items"], item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                errors += _list_map_errors(sub, obj[name], f"{path}.{name}")
    return errors


def api_server_errors(js: dict) -> list[str]:
    """What the API server refuses when the JobSet is created (it also applies the CRD's defaults to `js`)."""
    schema = _crd_schema()
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in jsonschema.Draft7Validator(_strict(schema)).iter_errors(js)]
    if errors:
        return errors
    _apply_defaults(schema, js)
    name = js["metadata"].get("name", "")
    if len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
        errors.append(f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain")
    errors += _list_map_errors(schema, js, "")
    spec = js["spec"]  # the CEL rule on spec; the others (self == oldSelf) apply to updates only
    if spec.get("startupPolicy", {}).get("startupPolicyOrder") == "InOrder" and any(
            "dependsOn" in r for r in spec["replicatedJobs"]):
        errors.append("spec: StartupPolicy and DependsOn APIs are mutually exclusive")
    return errors


# ---- JobSet's webhooks -------------------------------------------------------------------------------------------

def webhook_default(js: dict) -> None:
    """jobSetWebhook.Default, which runs before validation."""
    spec = js["spec"]
    spec.setdefault("successPolicy", {"operator": "All"})
    spec.setdefault("startupPolicy", {"startupPolicyOrder": "AnyOrder"})
    for rjob in spec["replicatedJobs"]:
        job = rjob["template"]["spec"]
        job.setdefault("completionMode", "Indexed")
        if not job["template"].get("spec", {}).get("restartPolicy"):
            job["template"].setdefault("spec", {})["restartPolicy"] = "OnFailure"
    network = spec.setdefault("network", {})
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("publishNotReadyAddresses", True)
    for i, rule in enumerate(spec.get("failurePolicy", {}).get("rules", [])):
        if not rule.get("name"):
            rule["name"] = f"failurePolicyRule{i}"


def _dns1035(value: str, too_long: str) -> list[str]:
    """validation.IsDNS1035Label's errors, with the webhook's replacement for the length one."""
    errors = [too_long] if len(value) > 63 else []
    if not DNS1035_LABEL.match(value):
        errors.append(f"{value!r}: a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
                      "start with an alphabetic character, and end with an alphanumeric character")
    return errors


def _failure_policy_errors(policy: dict, rjob_names: list[str]) -> list[str]:
    """validateFailurePolicy."""
    errors: list[str] = []
    seen: dict[str, list[int]] = {}
    for index, rule in enumerate(policy.get("rules", [])):
        name = rule["name"]
        if not 1 <= len(name) <= MAX_RULE_NAME:
            errors.append(f"invalid failure policy rule name of length {len(name)}")
        seen.setdefault(name, []).append(index)
        if not RULE_NAME.match(name):
            errors.append(f"invalid failure policy rule name '{name}', a failure policy rule name must start with an "
                          "alphabetic character, optionally followed by a string of alphanumeric characters or "
                          "'_,:', and must end with an alphanumeric character or '_'")
        errors += [f"invalid replicatedJob name '{r}' in failure policy does not appear in .spec.ReplicatedJobs"
                   for r in rule.get("targetReplicatedJobs", []) if r not in rjob_names]
        errors += [f"invalid job failure reason '{r}' in failure policy is not a recognized job failure reason"
                   for r in rule.get("onJobFailureReasons", []) if r not in JOB_FAILURE_REASONS]
    errors += [f"rule names are not unique, rules with indices {ix} all have the same name '{n}'"
               for n, ix in seen.items() if len(ix) > 1]
    return errors


def _coordinator_errors(js: dict) -> list[str]:
    """validateCoordinator."""
    coord = js["spec"]["coordinator"]
    rjob = next((r for r in js["spec"]["replicatedJobs"] if r["name"] == coord["replicatedJob"]), None)
    if rjob is None:
        return [f"coordinator replicatedJob {coord['replicatedJob']} does not exist"]
    if not 0 <= coord.get("jobIndex", 0) < rjob["replicas"]:
        return [f"coordinator job index {coord.get('jobIndex', 0)} is invalid for replicatedJob {rjob['name']}"]
    job = rjob["template"]["spec"]
    if job.get("completionMode") != "Indexed":
        return ["job for coordinator pod must be indexed completion mode"]
    if not 0 <= coord.get("podIndex", 0) < job.get("completions", 0):
        return [f"coordinator pod index {coord.get('podIndex', 0)} is invalid for replicatedJob {rjob['name']}"]
    # validateCoordinatorLabelValue (jobset a9461e60, v0.11.0). Before it, the controller put the same value on
    # every Job and pod as a label and the API server refused the Job at run time: the set never started.
    value = coordinator_endpoint(js)
    if len(value) > 63 or not LABEL_VALUE.match(value):
        return [f"spec will lead to invalid label value {value!r} for coordinator label {COORDINATOR_KEY!r}"]
    return []


def _replicated_job_errors(js: dict, rjob: dict, earlier: list[str]) -> list[str]:
    """ValidateCreate's checks of one replicated job (names as placement.GenJobName / GenPodName build them)."""
    job, name = rjob["template"]["spec"], js["metadata"]["name"]
    errors = []
    if job.get("parallelism", 1) * rjob["replicas"] > MAX_INT32:
        errors.append(f"the product of replicas and parallelism must not exceed {MAX_INT32} for '{rjob['name']}'")
    errors += _dns1035(rjob["groupName"], ".spec.replicatedJob[].groupName is too long, must be less than 63 "
                                          "characters")
    errors += _dns1035(f"{name}-{rjob['name']}-{rjob['replicas'] - 1}",
                       "JobSet name is too long, job names generated for this JobSet will exceed 63 characters")
    if job.get("completionMode") == "Indexed" and "completions" in job:
        # The Job controller appends a 5-character random suffix to <job name>-<completion index>.
        pod = f"{name}-{rjob['name']}-{rjob['replicas'] - 1}-{job['completions'] - 1}-abcde"
        errors += _dns1035(pod, "JobSet name is too long, pod names generated for this JobSet will exceed 63 "
                                "characters")
    for dep in rjob.get("dependsOn", []):
        if dep["name"] not in earlier:
            errors.append(f"replicatedJob: {rjob['name']} cannot depend on replicatedJob: {dep['name']}")
    return errors


def webhook_errors(js: dict) -> list[str]:
    """jobSetWebhook.ValidateCreate, on a JobSet that has been through webhook_default."""
    spec = js["spec"]
    names = [r["name"] for r in spec["replicatedJobs"]]
    errors = ["DependsOn can't be set for the first ReplicatedJob"] if "dependsOn" in spec["replicatedJobs"][0] else []
    subdomain = spec["network"].get("subdomain", "")
    if subdomain:
        if len(subdomain) > 253 or not DNS1123_SUBDOMAIN.match(subdomain):
            errors.append(f"{subdomain!r}: a lowercase RFC 1123 subdomain")
        errors += _dns1035(subdomain, ".spec.network.subdomain is too long, must be less than 63 characters")
    for i, rjob in enumerate(spec["replicatedJobs"]):
        errors += _replicated_job_errors(js, rjob, names[:i])
    errors += [f"invalid replicatedJob name '{r}' does not appear in .spec.ReplicatedJobs"
               for r in spec["successPolicy"].get("targetReplicatedJobs", []) if r not in names]
    errors += _failure_policy_errors(spec.get("failurePolicy", {}), names)
    if "coordinator" in spec:
        errors += _coordinator_errors(js)
    return errors


def admission_errors(js: dict) -> list[str]:
    """Everything creating `js` on a cluster with JobSet would refuse, in admission order; [] when accepted."""
    js = copy.deepcopy(js)
    errors = api_server_errors(js)
    if errors:
        return errors
    webhook_default(js)
    errors = webhook_errors(js)
    for rjob in js["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job", "spec": rjob["template"]["spec"],
               "metadata": {"name": f"{js['metadata']['name']}-{rjob['name']}-0"}}
        try:
            kubernetes_validate.validate(job, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"replicatedJobs[{rjob['name']}].template: {e.message}")
    return errors


# ---- after admission: the pods' metadata and environment -------------------------------------------------------

def subdomain(js: dict) -> str:
    """GetSubdomain (pkg/controllers/jobset_controller.go): spec.network.subdomain, else the JobSet's name."""
    return js["spec"].get("network", {}).get("subdomain") or js["metadata"]["name"]


def coordinator_endpoint(js: dict) -> str:
    """coordinatorEndpoint: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>, the DNS name of that pod
    (its hostname <job name>-<completion index> in the headless service named by the subdomain)."""
    c = js["spec"]["coordinator"]
    return (f"{js['metadata']['name']}-{c['replicatedJob']}-{c.get('jobIndex', 0)}-{c.get('podIndex', 0)}."
            f"{subdomain(js)}")


def pod_metadata(js: dict, rjob_name: str, job_index: int, restarts: int = 0) -> dict:
    """The labels and annotations JobSet's controller puts on the pod template of Job `job_index` of `rjob_name`
    (labelAndAnnotateObject: the keys launch/ reads or that identify the attempt; the controller writes each key
    as both label and annotation), on top of the template's own."""
    (rjob,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == rjob_name]
    meta = rjob["template"]["spec"]["template"].get("metadata", {})
    ours = {"jobset.sigs.k8s.io/jobset-name": js["metadata"]["name"],
            "jobset.sigs.k8s.io/replicatedjob-name": rjob_name,
            "jobset.sigs.k8s.io/restart-attempt": str(restarts),
            "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob["replicas"]),
            "jobset.sigs.k8s.io/job-index": str(job_index)}
    if "coordinator" in js["spec"]:
        ours[COORDINATOR_KEY] = coordinator_endpoint(js)
    return {"labels": meta.get("labels", {}) | ours, "annotations": meta.get("annotations", {}) | ours}


def expand(value: str, defined: dict) -> str:
    """Kubernetes' $(VAR) expansion of an env value (third_party/forked/golang/expansion): $(NAME) of a variable
    defined before it is replaced, an undefined one is left as written, $$ is a literal $."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i) and ")" in value[i + 2:]:
            end = value.index(")", i + 2)
            name = value[i + 2:end]
            out.append(defined.get(name, value[i:end + 1]))
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def container_environment(container: dict, metadata: dict, config_maps: dict) -> dict:
    """The environment the kubelet starts `container` with (makeEnvironmentVariables): each envFrom ConfigMap's
    data, then `env` in order, later names replacing earlier ones; a value is expanded with the variables before
    it; a fieldRef to metadata.labels['k'] / metadata.annotations['k'] reads the pod's (the empty string where the
    key is absent, as the downward API gives)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        match = _FIELD.match(var["valueFrom"]["fieldRef"]["fieldPath"])
        if match is None:
            raise NotImplementedError(f"env {var['name']}: {var['valueFrom']}")
        env[var["name"]] = metadata[match.group(1)].get(match.group(2), "")
    return env


# ---- after admission: a failed pod, its Job, the JobSet -----------------------------------------------------------

def job_failure_reason(job: dict, pod_status: dict) -> str | None:
    """The reason the Job controller fails a Job of parallelism 1 when its pod fails with `pod_status`
    ({"exitCodes": {container: code}, "conditions": {type: status}}), or None if the Job does not fail (it
    replaces the pod). kubernetes pkg/controller/job/pod_failure_policy.go, matchPodFailurePolicy: the first rule
    matching wins; onExitCodes looks at terminated containers with a non-zero code; FailJob fails the Job with
    reason PodFailurePolicy, Ignore does not count the failure; else it counts against backoffLimit."""
    for rule in job.get("podFailurePolicy", {}).get("rules", []):
        if "onExitCodes" in rule:
            req = rule["onExitCodes"]
            codes = [c for name, c in pod_status.get("exitCodes", {}).items()
                     if c != 0 and req.get("containerName") in (None, name)]
            hit = any((c in req["values"]) == (req["operator"] == "In") for c in codes)
        else:
            hit = any(pod_status.get("conditions", {}).get(p["type"]) == p["status"] for p in rule["onPodConditions"])
        if hit and rule["action"] == "FailJob":
            return "PodFailurePolicy"
        if hit and rule["action"] == "Ignore":
            return None
        if hit:  # Count (FailIndex needs backoffLimitPerIndex, which launch/ does not use)
            break
    return "BackoffLimitExceeded" if job.get("backoffLimit", 6) < 1 else None


def jobset_on_job_failure(js: dict, rjob_name: str, reason: str, status: dict) -> str:
    """What JobSet's controller does when a Job of `rjob_name` fails with `reason` (pkg/controllers/
    failure_policy.go, executeFailurePolicy): the first rule whose onJobFailureReasons and targetReplicatedJobs
    (empty: any) match gives the action, none matching gives RestartJobSet. Updates `status` ("restarts",
    "restartsCountTowardsMax") and returns "restart" or "failed"."""
    policy = js["spec"].get("failurePolicy")
    if policy is None:
        return "failed"
    action = next((r["action"] for r in policy.get("rules", [])
                   if reason in r.get("onJobFailureReasons", [reason])
                   and rjob_name in r.get("targetReplicatedJobs", [rjob_name])), "RestartJobSet")
    if action == "FailJobSet":
        return "failed"
    counts = action == "RestartJobSet"
    if counts and status["restartsCountTowardsMax"] >= policy.get("maxRestarts", 0):
        return "failed"  # ReachedMaxRestarts
    status["restarts"] += 1
    status["restartsCountTowardsMax"] += counts
    return "restart"
