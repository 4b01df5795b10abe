"""The deployment files are valid and agree with each other and with the code: the cluster
launcher config (Ray's own validation), the Serve configs (ServeDeploySchema, and the copy in
the RayService differs only where production must), the KubeRay manifests (the fields their
CRDs require), the entrypoints they name, and the Dockerfile."""

from __future__ import annotations

import copy
import glob
import json
import os
import re
import shlex

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KUBERAY = os.path.join(REPO, "infra", "kuberay")


def load(path: str) -> dict:
    with open(os.path.join(REPO, path)) as f:
        return yaml.safe_load(f)


def manifests(kind: str) -> dict[str, dict]:
    found = {}
    for path in sorted(glob.glob(os.path.join(KUBERAY, "*.yaml"))):
        doc = load(path)
        if doc["kind"] == kind:
            found[os.path.basename(path)] = doc
    return found


def images() -> set[str]:
    """Every container image the deployment files name."""
    out = {load("ray_cluster.yaml")["docker"]["image"]}
    for path in glob.glob(os.path.join(KUBERAY, "*.yaml")):
        with open(path) as f:
            out |= set(re.findall(r"image: (\S+)", f.read()))
    return out


# ----------------------------------------------------------------------------- cluster launcher


def launcher_check(config: dict) -> dict:
    """What ``ray up`` does first: fill in the provider's defaults, then validate the schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    filled = prepare_config(copy.deepcopy(config))
    validate_config(filled)
    return filled


def test_cluster_launcher_config_passes_rays_validation():
    config = load("ray_cluster.yaml")
    filled = launcher_check(config)
    types = filled["available_node_types"]
    head = types[filled["head_node_type"]]
    assert "GPU" not in head["resources"]
    (gpu,) = [t for name, t in types.items() if name != filled["head_node_type"]]
    assert gpu["resources"]["GPU"] == 1
    assert 0 <= gpu["min_workers"] <= gpu["max_workers"] <= filled["max_workers"]
    # the project is shipped to every node, and the operator's Ray token
    assert filled["file_mounts"] == {"~/kvrank": ".", "~/.ray/auth_token": "~/.ray/auth_token"}
    assert any("pip install" in c and "~/kvrank" in c for c in filled["setup_commands"])
    # every node runs Ray with token authentication; the dashboard (Jobs API) on 127.0.0.1
    starts = filled["head_start_ray_commands"] + filled["worker_start_ray_commands"]
    assert [c for c in starts if "ray start" in c and "RAY_AUTH_MODE=token" not in c] == []
    (head_start,) = [c for c in starts if "--head" in c]
    assert "--dashboard-host=127.0.0.1" in head_start


@pytest.mark.parametrize(
    "breakage",
    [
        lambda c: c["available_node_types"]["gpu_worker"].update(min_worker=1),  # a typo
        lambda c: c.update(head_node_type="no_such_type"),
        lambda c: c["available_node_types"]["gpu_worker"].update(min_workers=99),
    ],
)
def test_cluster_launcher_validation_catches_a_broken_copy(breakage):
    config = load("ray_cluster.yaml")
    breakage(config)
    with pytest.raises(Exception):  # noqa: B017 - jsonschema's or Ray's own error type
        launcher_check(config)


# ----------------------------------------------------------------------------- Serve configs


def test_serve_config_is_valid_and_matches_the_typed_defaults():
    from ray.serve.schema import ServeDeploySchema

    from services.settings import ServeSettings

    config = ServeDeploySchema.model_validate(load("infra/serve_config.yaml"))
    (app,) = config.applications
    assert app.import_path == "services.app:build_app"
    defaults = ServeSettings(manifest_uri="x")
    settings = ServeSettings.from_args(app.args)
    for name in app.args:
        if name != "manifest_uri":
            assert getattr(settings, name) == getattr(defaults, name), name
    (ranker,) = [d for d in app.deployments if d.name == "Ranker"]
    assert ranker.max_ongoing_requests == defaults.ranker_max_ongoing_requests
    auto = ranker.autoscaling_config
    assert (auto["min_replicas"], auto["max_replicas"]) == (
        defaults.ranker_min_replicas,
        defaults.ranker_max_replicas,
    )
    assert auto["target_ongoing_requests"] == defaults.ranker_target_ongoing_requests
    assert auto["upscale_delay_s"] == defaults.ranker_upscale_delay_s
    assert auto["downscale_delay_s"] == defaults.ranker_downscale_delay_s
    assert ranker.ray_actor_options.num_cpus == defaults.ranker_num_cpus


def test_rayservice_serves_the_serve_config_with_only_the_production_changes():
    from ray.serve.schema import ServeDeploySchema

    (service,) = manifests("RayService").values()
    theirs = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(theirs)
    ours = load("infra/serve_config.yaml")
    app = ours["applications"][0]
    app["args"]["manifest_uri"] = theirs["applications"][0]["args"]["manifest_uri"]
    assert app["args"]["manifest_uri"].startswith("s3://")
    # states on S3, the store on infra/redis/redis.yaml's server
    app["args"]["store_uri"] = theirs["applications"][0]["args"]["store_uri"]
    assert app["args"]["store_uri"] == f"redis://{redis_service()}:6379/0"
    ours["http_options"]["host"] = "0.0.0.0"  # reachable from the Kubernetes service
    # and so behind API tokens: the Secret's file, mounted on every pod of the cluster
    app["args"]["api_tokens_file"] = "/etc/kvrank/api-tokens/tokens"
    ranker = app["deployments"][0]
    ranker["ray_actor_options"]["num_gpus"] = 1.0  # a GPU per Ranker replica
    ranker["autoscaling_config"]["max_replicas"] = 8  # as many as the gpu group has pods
    assert theirs == ours
    # and it runs on the same cluster shape the jobs use, as the serving identity, with the
    # API tokens' Secret where api_tokens_file reads it
    (cluster,) = manifests("RayCluster").values()
    # (the files share lists through YAML anchors: each pod is rebuilt, not edited in place)
    serving = copy.deepcopy(service["spec"]["rayClusterConfig"])
    for pod in pod_specs(serving):
        assert pod.pop("serviceAccountName") == "kvrank-serve"
        (tokens,) = [v for v in pod["volumes"] if v["name"] == "api-tokens"]
        assert tokens["secret"] == {"secretName": "kvrank-api-tokens"}
        pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "api-tokens"]
        for c in pod["containers"]:
            (mount,) = [m for m in c["volumeMounts"] if m["name"] == "api-tokens"]
            assert mount["readOnly"] is True
            assert app["args"]["api_tokens_file"].startswith(mount["mountPath"] + "/")
            c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "api-tokens"]
    jobs = copy.deepcopy(cluster["spec"])
    assert {p.pop("serviceAccountName") for p in pod_specs(jobs)} == {"kvrank-jobs"}
    assert serving == jobs


def pod_specs(cluster_spec: dict) -> list[dict]:
    """The pod specs of a RayCluster spec: the head's and every worker group's."""
    groups = [cluster_spec["headGroupSpec"], *cluster_spec.get("workerGroupSpecs", [])]
    return [g["template"]["spec"] for g in groups]


def security_docs() -> dict[tuple[str, str], dict]:
    with open(os.path.join(REPO, "infra", "security.yaml")) as f:
        return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(f)}


def every_pod() -> dict[str, dict]:
    """Every pod spec the deployment files define, by where it is."""
    pods = {}
    for name, doc in manifests("RayCluster").items():
        pods |= {f"{name} pod {i}": p for i, p in enumerate(pod_specs(doc["spec"]))}
    for name, doc in manifests("RayService").items():
        pods |= {
            f"{name} pod {i}": p for i, p in enumerate(pod_specs(doc["spec"]["rayClusterConfig"]))
        }
    for name, doc in manifests("RayJob").items():
        pods[f"{name} submitter"] = doc["spec"]["submitterPodTemplate"]["spec"]
    pods["redis"] = redis_manifests()["StatefulSet"]["spec"]["template"]["spec"]
    return pods


def test_every_pod_runs_unprivileged_on_a_read_only_root_without_static_keys():
    for where, pod in every_pod().items():
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] > 0, where
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["readOnlyRootFilesystem"] is True, where
            # what such a container writes goes to its volumes: Ray's session files in /tmp
            mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
            volumes = {v["name"] for v in pod.get("volumes", [])}
            assert set(mounts) <= volumes | {"data"}, where  # redis: its volume claim
            if "ray" in c["name"] or c["name"] == "submitter":
                assert mounts["tmp"] == "/tmp", where
            # no credentials in the pods: cloud identities through the service accounts
            assert "envFrom" not in c, where
            names = {e["name"] for e in c.get("env", [])}
            assert not names & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}, where
    with open(os.path.join(REPO, "infra", "Dockerfile")) as f:
        assert "AWS_" not in f.read()


def test_jobs_and_serving_run_as_their_own_cloud_identities():
    docs = security_docs()
    for who in ("kvrank-jobs", "kvrank-serve"):
        account = docs[("ServiceAccount", who)]
        role = account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
        assert role.endswith(f":role/{who}"), role
    (cluster,) = manifests("RayCluster").values()
    (service,) = manifests("RayService").values()
    assert {p["serviceAccountName"] for p in pod_specs(cluster["spec"])} == {"kvrank-jobs"}
    serving = pod_specs(service["spec"]["rayClusterConfig"])
    assert {p["serviceAccountName"] for p in serving} == {"kvrank-serve"}
    for name, doc in manifests("RayJob").items():  # submitters hold no cloud identity
        pod = doc["spec"]["submitterPodTemplate"]["spec"]
        assert "serviceAccountName" not in pod, name
        assert pod["automountServiceAccountToken"] is False, name


def test_every_cluster_wants_rays_token_and_only_named_pods_reach_the_jobs_api():
    (cluster,) = manifests("RayCluster").values()
    (service,) = manifests("RayService").values()
    specs = [cluster["spec"], service["spec"]["rayClusterConfig"]]
    assert [s["authOptions"] for s in specs] == [
        {"mode": "token", "secretName": "kvrank-ray-token"}
    ] * 2
    for name, doc in manifests("RayJob").items():
        pod = doc["spec"]["submitterPodTemplate"]
        assert pod["metadata"]["labels"]["kvrank.io/ray-client"] == "true", name
        (c,) = pod["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", name
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "kvrank-ray-token", "key": "auth_token"}, name
    # no Service, Ingress or host port takes the dashboard out of the cluster
    for path in glob.glob(os.path.join(REPO, "infra", "**", "*.yaml"), recursive=True):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if "kind" not in doc:  # infra/serve_config.yaml
                    continue
                exposed = doc["kind"] in ("Service", "Ingress")
                assert not exposed or doc["metadata"]["name"] == "kvrank-redis", path
                assert "LoadBalancer" not in json.dumps(doc) and "hostPort" not in json.dumps(doc)
    policy = security_docs()[("NetworkPolicy", "kvrank-ray")]["spec"]
    assert policy["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "kvrank"}}
    by_port = {}
    for rule in policy["ingress"]:
        for port in rule.get("ports", [{"port": "any"}]):
            by_port.setdefault(port["port"], []).extend(rule["from"])
    # the dashboard: the KubeRay operator and labelled Ray clients only; HTTP: the ingress
    assert by_port[8265] == [
        {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
        },
        {"podSelector": {"matchLabels": {"kvrank.io/ray-client": "true"}}},
    ]
    assert by_port[8000] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    ]
    assert by_port["any"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvrank"}}}
    ]
    for doc in (cluster, service):  # the policy selects every Ray pod
        spec = doc["spec"].get("rayClusterConfig", doc["spec"])
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for g in groups:
            assert g["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "kvrank"


# ----------------------------------------------------------------------------- the store's Redis


def redis_manifests() -> dict[str, dict]:
    with open(os.path.join(REPO, "infra", "redis", "redis.yaml")) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


def redis_service() -> str:
    return redis_manifests()["Service"]["metadata"]["name"]


def test_the_redis_statefulset_runs_its_config_on_a_volume_behind_its_service(tmp_path):
    from benchmarks.redis_server import RedisServer

    docs = redis_manifests()
    assert sorted(docs) == ["ConfigMap", "NetworkPolicy", "Service", "StatefulSet"]
    sts = docs["StatefulSet"]["spec"]
    assert sts["serviceName"] == redis_service()
    labels = sts["template"]["metadata"]["labels"]
    assert sts["selector"]["matchLabels"] == labels
    assert docs["Service"]["spec"]["selector"] == labels
    assert docs["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"] == labels
    (container,) = sts["template"]["spec"]["containers"]
    conf_dir = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert container["command"] == ["redis-server", f"{conf_dir['config']}/redis.conf"]
    assert {c["metadata"]["name"] for c in sts["volumeClaimTemplates"]} == {"data"}
    # the ConfigMap's redis.conf runs on a real server (here on 127.0.0.1 in a temporary
    # folder) with the persistence the app's default redis_fsync asks for
    text = docs["ConfigMap"]["data"]["redis.conf"]
    assert f"dir {conf_dir['data']}\n" in text
    conf = tmp_path / "redis.conf"
    conf.write_text(text.replace(f"dir {conf_dir['data']}\n", f"dir {tmp_path}\n"))
    server = RedisServer(tmp_path, conf=str(conf))
    try:
        client = server.client()
        want = {"appendonly": "yes", "appendfsync": "always", "maxmemory-policy": "noeviction"}
        assert {k: client.config_get(k)[k] for k in want} == want
    finally:
        server.kill()


# ----------------------------------------------------------------------------- KubeRay manifests

# Required fields of ray.io/v1 (KubeRay's CRD types: fields without `omitempty`), plus what
# Kubernetes needs of a pod template: containers with a name and an image.


def require(doc: dict, path: str, where: str) -> object:
    node: object = doc
    for key in path.split("."):
        assert isinstance(node, dict) and key in node, f"{where}: missing {path}"
        node = node[key]
    return node


def check_pod_template(template: dict, where: str) -> None:
    containers = require(template, "spec.containers", where)
    assert containers, f"{where}: no containers"
    for c in containers:
        assert c.get("name") and c.get("image"), f"{where}: a container needs a name and an image"


def check_cluster_spec(spec: dict, where: str) -> None:
    require(spec, "headGroupSpec.rayStartParams", where)
    check_pod_template(require(spec, "headGroupSpec.template", where), f"{where} head")
    for group in spec.get("workerGroupSpecs", []):
        w = f"{where} group {group.get('groupName')}"
        for key in ("groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"):
            require(group, key, w)
        assert 0 <= group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"], w
        check_pod_template(group["template"], w)


def test_kuberay_manifests_have_the_fields_their_crds_require():
    kinds = {}
    for path in sorted(glob.glob(os.path.join(KUBERAY, "*.yaml"))):
        doc, name = load(path), os.path.basename(path)
        assert doc["apiVersion"] == "ray.io/v1", name
        require(doc, "metadata.name", name)
        kinds.setdefault(doc["kind"], []).append(name)
        if doc["kind"] == "RayCluster":
            check_cluster_spec(doc["spec"], name)
            assert doc["spec"]["enableInTreeAutoscaling"] is True
        elif doc["kind"] == "RayService":
            assert isinstance(require(doc, "spec.serveConfigV2", name), str)
            check_cluster_spec(require(doc, "spec.rayClusterConfig", name), name)
        elif doc["kind"] == "RayJob":
            assert isinstance(require(doc, "spec.entrypoint", name), str)
            # submitted to the long-lived cluster, by its name
            clusters = {c["metadata"]["name"] for c in manifests("RayCluster").values()}
            assert require(doc, "spec.clusterSelector", name)["ray.io/cluster"] in clusters
        else:
            pytest.fail(f"{name}: unexpected kind {doc['kind']}")
    assert sorted(kinds) == ["RayCluster", "RayJob", "RayService"]
    assert len(images()) == 1, images()  # one image everywhere: infra/Dockerfile's


def test_the_gpu_group_asks_kubernetes_for_a_gpu():
    (cluster,) = manifests("RayCluster").values()
    (group,) = cluster["spec"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


JOBS = [
    "prepare_data",
    "encode_items",
    "train_ranker",
    "evaluate",
    "fit_item_prior",
    "train_kv_pool",
    "build_user_states",
    "recommend",
]


def test_there_is_a_rayjob_per_pipeline_and_its_entrypoint_exists(capsys):
    import importlib

    entries = {}
    for name, doc in manifests("RayJob").items():
        argv = shlex.split(doc["spec"]["entrypoint"])
        assert argv[:2] == ["python", "-m"] and argv[2].startswith("pipelines."), name
        entries[argv[2].split(".", 1)[1]] = argv[3:]
    assert sorted(entries) == sorted(JOBS)
    for job, args in entries.items():
        module = importlib.import_module(f"pipelines.{job}")
        with pytest.raises(SystemExit) as done:
            module.main(["--help"])
        assert done.value.code == 0
        usage = capsys.readouterr().out
        for flag in (a for a in args if a.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", usage), f"{job} has no option {flag}"


# ----------------------------------------------------------------------------- Dockerfile


def test_dockerfile_builds_on_the_ray_version_we_pin_and_copies_every_package():
    import ray

    with open(os.path.join(REPO, "infra", "Dockerfile")) as f:
        text = f.read()
    base = re.search(r"ARG RAY_IMAGE=rayproject/ray:(\S+)", text).group(1)
    assert base.split("-")[0] == ray.__version__ and "gpu" in base
    assert '".[gpu]"' in text  # the gpu extra (vLLM)
    copied = set(re.findall(r"^COPY (?:--\S+ )*(\S+)", text, flags=re.M))
    for src in copied:
        assert os.path.exists(os.path.join(REPO, src)), src
    packages = load_packages()
    assert packages <= copied, packages - copied
    assert "PYTHONPATH=/home/ray/kvrank" in text


def load_packages() -> set[str]:
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    return {p.rstrip("*") for p in include}
