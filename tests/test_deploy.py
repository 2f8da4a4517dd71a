"""deploy/kubernetes/ and ``smb2 servers``: the manifests validate against
the Kubernetes schemas (kubernetes-validate ships them: nothing is fetched),
they agree with each other where a mismatch would break a job (the Job's
server list against the StatefulSet and its Service, ranks against
completions, memory against capacity), and the one server order that the
Slurm and Kubernetes helpers share.  The host agents' opt-in
(deploy/kubernetes/agents/, a kustomize component, and
deploy/kubernetes-agents/, the base with it) likewise: the DaemonSet
validates, derives the Job's server list, holds its capacity, and listens
where the Job's SMB2_AGENT points; the Job's SMB2_HOST_WORKERS is the ranks
its scheduling puts on each node of the agents' pool."""

from __future__ import annotations

import copy
import functools
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from smb2 import cli
from smb2.errors import InvalidArgumentError
from smb2.protocol import parse_size
from smb2.serverlist import SLURM_VARIABLES, expand_hostlist, server_list, slurm_hosts, statefulset_hosts
from smb2.train.lifecycle import host_workers

# in the test extra (make test installs them); the soft-RoCE VM's python has
# only what the RDMA tier needs, and skips this module
kv = pytest.importorskip("kubernetes_validate", reason="pip install 'smb2[test]' (kubernetes-validate)")
yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate")

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
AGENTS = KUBE / "agents"
WITH_AGENTS = ROOT / "deploy" / "kubernetes-agents"


def smb2_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``smb2 ARGS``, as a user runs it (outside any Slurm job unless ``env`` says)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, "-m", "smb2.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**base, **(env or {})})


def smb2_servers(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``smb2 servers ARGS`` in this process (the command's start is tested once, by smb2_cli)."""
    try:
        code = cli.main(["servers", *args])
    except SystemExit as exc:       # argparse's usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------
# the server order


def test_hosts_are_ordered_naturally_whatever_order_they_come_in() -> None:
    want = ["gpu1:7420", "gpu2:7420", "gpu10:7420", "node-a:7420", "node-b:7420"]
    assert server_list(["node-b", "gpu10", "gpu2", "node-a", "gpu1"]) == want
    assert server_list(reversed(["gpu1", "gpu2", "gpu10", "node-a", "node-b"])) == want
    # a StatefulSet's ordinals past 9 stay in ordinal order
    pods = statefulset_hosts("srv", 12, "svc")
    assert server_list(reversed(pods), 7000) == [f"srv-{i}.svc:7000" for i in range(12)]
    # an IPv6 address is bracketed, as smb2.connect parses it
    assert server_list(["fd00::2", "fd00::1"], 1) == ["[fd00::1]:1", "[fd00::2]:1"]


@pytest.mark.parametrize("hosts, port, says", [
    (["a", "b", "a"], 7420, "listed twice"),
    ([], 7420, "no hosts"),
    (["a"], 0, "port 0"),
    (["a,b"], 7420, "not a host name"),
    (["a b"], 7420, "not a host name"),
])
def test_a_bad_server_list_is_an_error(hosts: list[str], port: int, says: str) -> None:
    with pytest.raises(InvalidArgumentError, match=says):
        server_list(hosts, port)


def test_slurm_host_lists_expand() -> None:
    assert expand_hostlist("node[01-03,7],gpu5") == ["node01", "node02", "node03", "node7", "gpu5"]
    assert expand_hostlist("a[1-2]b[8-9]") == ["a1b8", "a1b9", "a2b8", "a2b9"]
    assert expand_hostlist("n[9-11]") == ["n9", "n10", "n11"]
    assert expand_hostlist("single") == ["single"]
    for bad in ("n[1-2", "n1-2]", "n[a-b]", "n[3-1]", ""):
        with pytest.raises(InvalidArgumentError):
            expand_hostlist(bad)
    assert slurm_hosts({"SLURM_JOB_NODELIST": "n[2,1]"}) == ["n2", "n1"]
    with pytest.raises(InvalidArgumentError, match="no Slurm allocation"):
        slurm_hosts({})


def test_smb2_servers_prints_the_list_for_slurm_and_a_statefulset(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run = smb2_cli("servers", "--from-slurm", "--port", "7000", env={"SLURM_JOB_NODELIST": "n[10,9],m1"})
    assert run.returncode == 0, run.stderr
    assert run.stdout == "m1:7000,n9:7000,n10:7000\n"
    code, out, _ = smb2_servers(capsys, "--from-statefulset", "srv", "--replicas", "3", "--service", "svc",
                                "--namespace", "ml")
    assert code == 0 and out == "srv-0.svc.ml.svc:7420,srv-1.svc.ml.svc:7420,srv-2.svc.ml.svc:7420\n"
    # outside an allocation: says why and what to do
    for name in SLURM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    code, out, err = smb2_servers(capsys, "--from-slurm")
    assert code == 1 and out == "" and "no Slurm allocation" in err and "sbatch" in err
    code, _, err = smb2_servers(capsys, "--from-statefulset", "srv")
    assert code == 2 and "--replicas" in err


# ---------------------------------------------------------------------------
# deploy/kubernetes/


@functools.cache
def parsed(folder: Path = KUBE) -> dict[str, list[dict[str, Any]]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in sorted(folder.glob("*.yaml")) if p.name != "kustomization.yaml"}


def manifests(folder: Path = KUBE) -> dict[str, list[dict[str, Any]]]:
    """Each manifest file's documents (a fresh copy: tests may change it)."""
    return copy.deepcopy(parsed(folder))


def one(kind: str) -> dict[str, Any]:
    (found,) = [d for docs in manifests().values() for d in docs if d["kind"] == kind]
    return found


def test_the_manifests_validate_against_the_kubernetes_schemas() -> None:
    version = kv.latest_version()
    kinds = set()
    for docs in manifests().values():
        for doc in docs:
            # strict: a misspelt or misplaced field is an error, not ignored
            kv.validate(doc, version, strict=True)
            kinds.add(doc["kind"])
    assert kinds == {"Service", "StatefulSet", "PodDisruptionBudget", "Job"}
    # what validating would miss: a field in the wrong place is caught
    bad = one("StatefulSet")
    bad["spec"]["template"]["spec"]["containers"][0]["memory"] = "5Gi"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(manifests())


def servers_command(container: dict[str, Any]) -> list[str]:
    """The ``smb2 servers`` line of a container's script, as argv."""
    (line,) = [ln for ln in "\n".join(container["args"]).splitlines() if "smb2 servers" in ln]
    argv = shlex.split(line.split("$(", 1)[1].rsplit(")", 1)[0])
    assert argv[:2] == ["smb2", "servers"]
    return argv


def job_servers_command() -> list[str]:
    """The ``smb2 servers`` line of the training Job's script, as argv."""
    (container,) = one("Job")["spec"]["template"]["spec"]["containers"]
    return servers_command(container)


def test_the_job_derives_its_server_list_from_the_statefulset_and_service(
        capsys: pytest.CaptureFixture[str]) -> None:
    sts, svc, job = one("StatefulSet"), one("Service"), one("Job")
    argv = job_servers_command()
    # the Job's line, run: the pods of this StatefulSet behind this Service
    code, out, err = smb2_servers(capsys, *argv[2:])
    assert code == 0, err
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "smb2")
    want = [f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{port}" for i in range(sts["spec"]["replicas"])]
    assert out.strip().split(",") == want
    # the headless Service is the StatefulSet's, selects its pods and carries its port
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert any(p["port"] == port for p in svc["spec"]["ports"])
    assert f"--port={port}" in container["command"]
    # every rank of the Indexed Job is a worker of the store
    spec = job["spec"]
    env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert spec["completionMode"] == "Indexed"
    assert int(env["SMB2_WORLD_SIZE"]["value"]) == spec["completions"] == spec["parallelism"]
    assert "job-completion-index" in env["SMB2_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]


def test_the_job_checks_the_servers_it_trains_on_and_runs_one_process_per_rank() -> None:
    """The doctor checks the list the workers use (it reads SMB2_SERVERS, set
    just before), and each pod runs one rank under a torchrun of one worker
    (not over several, which would end them all when one dies), which
    restarts it and says so, as the Slurm recipe does."""
    (container,) = one("Job")["spec"]["template"]["spec"]["containers"]
    script = "\n".join(container["args"])
    lines = script.splitlines()
    exported = next(i for i, ln in enumerate(lines) if ln.strip() == "export SMB2_SERVERS")
    (doctor,) = [i for i, ln in enumerate(lines) if "smb2 doctor" in ln]
    assert doctor > exported and shlex.split(lines[doctor]) == ["smb2", "doctor", "--wait", "300"]
    (launch,) = [shlex.split(ln.rstrip("\\")) for ln in lines if "torchrun" in ln]
    assert launch[:2] == ["exec", "torchrun"] and "--nproc-per-node=1" in launch, launch
    assert any(a.startswith("--max-restarts=") and int(a.split("=")[1]) >= 1 for a in launch), launch


def test_the_servers_token_metrics_resources_and_budget() -> None:
    sts, pdb = one("StatefulSet"), one("PodDisruptionBudget")
    pod = sts["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["command"][1:] if "=" in a)
    # the token from the Secret, in the variable smb2-server and the clients read
    env = {e["name"]: e for e in container["env"]}
    for c in (container, one("Job")["spec"]["template"]["spec"]["containers"][0]):
        ref = {e["name"]: e for e in c["env"]}["SMB2_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == env["SMB2_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    # Prometheus finds the port the server serves its metrics on
    metrics_port = int(flags["metrics"].rsplit(":", 1)[1])
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == metrics_port
    assert any(p["containerPort"] == metrics_port for p in container["ports"])
    # the memory limit holds the capacity and the server's own pool besides
    limit = parse_size(container["resources"]["limits"]["memory"].replace("Gi", "GiB").replace("Mi", "MiB"))
    assert limit >= parse_size(flags["capacity"]) + (256 << 20)
    assert container["resources"]["requests"] == container["resources"]["limits"]
    # the budget covers the servers, and allows no eviction
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pdb["spec"]["maxUnavailable"] == 0


# ---------------------------------------------------------------------------
# deploy/kubernetes/agents/ (the host agents, opt-in) and deploy/kubernetes-agents/


def agent_daemonset() -> dict[str, Any]:
    (ds,) = manifests(AGENTS)["daemonset.yaml"]
    return ds


def job_with_agents() -> dict[str, Any]:
    """job.yaml with job-agent.yaml's patch applied as kustomize merges it:
    the patch's variables first (in its order), the Job's own after them."""
    job = one("Job")
    (patch,) = manifests(AGENTS)["job-agent.yaml"]
    assert patch["kind"] == "Job" and patch["metadata"]["name"] == job["metadata"]["name"]
    pod, patched = job["spec"]["template"]["spec"], patch["spec"]["template"]["spec"]
    (extra,) = patched.pop("containers")
    (container,) = pod["containers"]
    assert extra["name"] == container["name"] and set(extra) == {"name", "env"}
    names = {e["name"] for e in extra["env"]}
    container["env"] = extra["env"] + [e for e in container["env"] if e["name"] not in names]
    # the pool and the spread: fields the Job does not have, taken as they are
    assert set(patched) == {"nodeSelector", "topologySpreadConstraints"} and not set(patched) & set(pod)
    pod.update(patched)
    return job


def agent_command(container: dict[str, Any]) -> tuple[dict[str, str], str]:
    """The ``smb2-agent`` line of the DaemonSet's script as {flag: value},
    and the variable its server list was put in."""
    lines = "\n".join(container["args"]).splitlines()
    (listed,) = [ln.strip() for ln in lines if "smb2 servers" in ln]
    (line,) = [ln for ln in lines if "smb2-agent" in ln]
    argv = shlex.split(line)
    assert argv[:2] == ["exec", "smb2-agent"], line       # exec: the agent gets the pod's SIGTERM
    return dict(zip(argv[2::2], argv[3::2])), listed.split("=", 1)[0]


def test_the_agents_manifests_validate_and_are_opt_in() -> None:
    version = kv.latest_version()
    kv.validate(agent_daemonset(), version, strict=True)
    # the Job the patch makes is a valid Job
    kv.validate(job_with_agents(), version, strict=True)
    component = yaml.safe_load((AGENTS / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    assert sorted(component["resources"] + [p["path"] for p in component["patches"]]) == sorted(manifests(AGENTS))
    overlay = yaml.safe_load((WITH_AGENTS / "kustomization.yaml").read_text())
    assert [(WITH_AGENTS / r).resolve() for r in overlay["resources"]] == [KUBE]
    assert [(WITH_AGENTS / c).resolve() for c in overlay["components"]] == [AGENTS]
    # `kubectl apply -k deploy/kubernetes/` stays without agents
    base = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    assert "components" not in base and "agents" not in str(base["resources"])


def test_the_agents_derive_the_jobs_server_list_and_hold_their_capacity() -> None:
    ds, sts = agent_daemonset(), one("StatefulSet")
    pod = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    # the Job's servers, in the Job's order (the Job's line is checked against the StatefulSet above)
    assert servers_command(container) == job_servers_command()
    flags, variable = agent_command(container)
    assert flags["--servers"] == f"${variable}"
    # the memory limit holds the capacity and the agent's server's receive pool besides
    limit = parse_size(container["resources"]["limits"]["memory"].replace("Gi", "GiB").replace("Mi", "MiB"))
    assert limit >= parse_size(flags["--capacity"]) + (256 << 20)
    assert container["resources"]["requests"] == container["resources"]["limits"]
    # the token from the servers' Secret, in the variable smb2-agent reads
    (server,) = sts["spec"]["template"]["spec"]["containers"]
    token = {e["name"]: e for e in container["env"]}["SMB2_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {e["name"]: e for e in server["env"]}["SMB2_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    # run as the servers are: not root, no privilege, no capability
    assert pod["spec"]["securityContext"] == sts["spec"]["template"]["spec"]["securityContext"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_the_jobs_ranks_reach_their_nodes_agent_where_it_listens() -> None:
    (container,) = agent_daemonset()["spec"]["template"]["spec"]["containers"]
    flags, _ = agent_command(container)
    host, port = flags["--listen"].rsplit(":", 1)
    assert host == "0.0.0.0"        # the node's address reaches it through the hostPort
    (opening,) = container["ports"]
    assert opening["containerPort"] == opening["hostPort"] == int(port)
    assert container["readinessProbe"]["tcpSocket"]["port"] in (opening["name"], int(port))
    # each rank: its node's address (the downward API) and that port, defined before it is used
    (train,) = job_with_agents()["spec"]["template"]["spec"]["containers"]
    env = [e["name"] for e in train["env"]]
    by_name = {e["name"]: e for e in train["env"]}
    assert by_name["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert by_name["SMB2_AGENT"]["value"] == f"$(NODE_IP):{port}"
    assert env.index("NODE_IP") < env.index("SMB2_AGENT")
    # the Job's doctor runs with SMB2_AGENT set: it checks the agent before the training
    assert any(ln.strip() == "smb2 doctor --wait 300" for ln in "\n".join(train["args"]).splitlines())


def test_each_nodes_agent_gathers_as_many_ranks_as_the_node_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """SMB2_HOST_WORKERS (what the agent gathers into one exchange) is the
    ranks per node, which the Job fixes: its ranks run only on the pool's
    nodes, where the agents run, spread evenly (at most one more on any
    node than on another), so a pool of completions / SMB2_HOST_WORKERS
    nodes runs that many on each."""
    job, ds = job_with_agents(), agent_daemonset()
    pod = job["spec"]["template"]
    (train,) = pod["spec"]["containers"]
    value = {e["name"]: e for e in train["env"]}["SMB2_HOST_WORKERS"]["value"]
    monkeypatch.setenv("SMB2_HOST_WORKERS", value)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    per_node = host_workers()           # what AsyncOptimizer tells the agent
    assert per_node >= 1 and job["spec"]["completions"] % per_node == 0
    # the pool: the Job's nodes are the agents' nodes
    assert pod["spec"]["nodeSelector"] and pod["spec"]["nodeSelector"] == ds["spec"]["template"]["spec"]["nodeSelector"]
    # spread evenly over the pool's nodes, counting this Job's pods only
    (spread,) = pod["spec"]["topologySpreadConstraints"]
    assert (spread["maxSkew"], spread["topologyKey"], spread["whenUnsatisfiable"]) == (
        1, "kubernetes.io/hostname", "DoNotSchedule")
    assert spread["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert spread["matchLabelKeys"] == ["batch.kubernetes.io/controller-uid"]


def test_kustomize_renders_the_base_alone_and_the_agents_on_opt_in() -> None:
    """What `kubectl apply -k` applies (kubectl's own kustomize, offline):
    the base as before; the overlay, the base plus the DaemonSet and the
    Job as job_with_agents merges it."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its kustomize renders the overlays)")

    def render(folder: Path) -> dict[str, dict[str, Any]]:
        out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        return {d["kind"]: d for d in yaml.safe_load_all(out) if d}

    base, with_agents = render(KUBE), render(WITH_AGENTS)
    assert base == {d["kind"]: d for docs in manifests().values() for d in docs}
    assert with_agents == {**base, "DaemonSet": agent_daemonset(), "Job": job_with_agents()}
