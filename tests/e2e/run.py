"""End to end on a real Kubernetes node, the way a user runs Basin (`make e2e`; docs/e2e.md).

A control plane and one node (containerd, kubelet, kube-proxy; tests/cluster/k8s) holding the images `make
images` built, then, each step logging what it waits for and failing with the reason:

1. `helm install` the chart: the operator runs as a Pod under the chart's RBAC;
2. `kubectl apply -f examples/emulated.yaml`: an emulated 1P3D BasinDeployment (time-scaled);
3. its Redis, emulator and two gateway Pods become Ready and answer through their Services;
4. the profiling Job ramps through the gateway and writes the profile; the BasinDeployment becomes Ready
   with κ and λc (`kubectl get basindeployments` columns) and both gateways run BASIN on it;
5. a real Prometheus (outside the cluster, Kubernetes service discovery) scrapes the Pods;
6. `basin replay` sends a x5 surge through the gateway Service: BASIN holds (late hit rate >= 0.8), nothing
   is lost, and the gateways' metrics count the 429s the client saw;
7. every dashboard and rule expression returns data from that Prometheus;
8. `kubectl scale basindeployment --replicas 2` reprofiles; the gateways take the new profile while calls
   keep flowing, none lost;
9. the leading gateway Pod is deleted mid-run: the other leads; the Redis Pod is deleted: the gateways keep
   serving and reconcile; no call lost;
10. `helm uninstall`, then the BasinDeployment deleted with no operator running: nothing is left behind.

The node is always torn down (node-down.sh), whatever fails. A summary (per step: passed, seconds) ends the
run; the exit status is 1 when a step failed. The host stands in for two cluster add-ons
(tests/cluster/nodenet.py): DNS for Service names and a relay to the apiserver, which listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from harness import free_port, wait_for
from nodenet import ApiRelay, ClusterDns, service_addresses

from basin import __version__
from basin_gateway.local import surge_replay
from basin_monitoring import alerts, verify
from basin_operator import constants as c

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "tests" / "cluster" / "k8s"
CHART = REPO / "helm" / "basin"
EXAMPLE = REPO / "examples" / "emulated.yaml"
IMAGES = [REPO / "images" / "out" / "basin.tar", REPO / "images" / "out" / "redis.tar"]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
KUBE_BIN = CACHE / "basin-k8s" / "bin"
HELM = Path(os.environ.get("BASIN_TOOLS") or CACHE / "basin") / "bin" / "helm"
BASIN = Path(sys.executable).with_name("basin")
BRIDGE_IP = "10.88.77.1"
RELEASE, SYSTEM = "basin", "basin-system"
NAMESPACE = "agents"
HELD = 0.8  # the late hit rate at which BASIN holds the deployment (the gateway issue's target)
# `basin up`'s surge (x5 from minute 3 to 15) run to minute 45, so the late window (the last 30 minutes) is
# what follows the surge: whether the deployment came out of it, not the surge itself.
SURGE_MINUTES = 45

console = Console(highlight=False)


class StepFailed(Exception):
    """A step's check failed; the message is the cause."""


def log(message: str) -> None:
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}")


def wait(check: Callable[[], Any], timeout: float, what: str, every: float = 2.0) -> Any:
    """Poll `check` until it returns something truthy (a refused connection counts as not yet)."""
    log(f"waiting for {what} (up to {timeout:.0f} s)")

    def fail(message: str) -> None:
        raise StepFailed(message)

    return wait_for(check, timeout, what, every, fail=fail, transient=(requests.RequestException,))


def run(command: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """A command's output; a non-zero exit fails the step with its output."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if result.returncode != 0:
        raise StepFailed(f"`{' '.join(command)}` exited {result.returncode}:\n{result.stdout}{result.stderr}")
    return result.stdout


@dataclass
class Outcome:
    name: str
    seconds: float
    passed: bool
    message: str = ""


@dataclass
class Background:
    """A `basin replay` running while a step changes the deployment under it; `finish` stops it (SIGINT:
    the replay ends cleanly and writes its result) and returns that result."""

    process: subprocess.Popen[str]
    out: Path

    def finish(self, timeout: float = 120) -> dict[str, Any]:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            output, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as error:
            self.process.kill()
            raise StepFailed("the replay did not stop within 120 s of SIGINT (hung calls)") from error
        if not self.out.is_file():
            raise StepFailed(
                f"the replay wrote no result (exit {self.process.returncode}):\n{output[-3000:]}"
            )
        return dict(json.loads(self.out.read_text()))


class PodTargets(threading.Thread):
    """Every 2 s, the gateway and emulator Pods with an address, as a Prometheus file_sd target list."""

    def __init__(self, core: client.CoreV1Api, path: Path) -> None:
        super().__init__(daemon=True)
        self.core, self.path, self.stopped = core, path, threading.Event()
        self.write()

    def write(self) -> None:
        groups = []
        for pod in self.core.list_namespaced_pod(NAMESPACE).items:
            component = (pod.metadata.labels or {}).get(c.LABEL_COMPONENT)
            ports = [p.container_port for k in pod.spec.containers for p in k.ports or [] if p.name == "http"]
            if component in ("gateway", "emulator") and ports and pod.status.pod_ip:
                labels = {"namespace": NAMESPACE, "pod": pod.metadata.name, "component": component}
                groups.append({"targets": [f"{pod.status.pod_ip}:{ports[0]}"], "labels": labels})
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(groups))
        temporary.replace(self.path)  # Prometheus never reads a half-written file

    def run(self) -> None:
        while not self.stopped.wait(2.0):
            with contextlib.suppress(ApiException, OSError):
                self.write()


@dataclass
class EndToEnd:
    work: Path
    scale: float
    helm_set: list[str] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    kubeconfig: str = ""
    api: client.ApiClient | None = None
    services: list[ApiRelay | ClusterDns] = field(default_factory=list)
    prometheus: subprocess.Popen[str] | None = None
    prometheus_url: str = ""
    pod_targets: PodTargets | None = None
    replays: list[Background] = field(default_factory=list)
    surge_window: tuple[float, float] = (0.0, 0.0)
    families: frozenset[str] = frozenset()
    node_started: bool = False

    # ------------------------------------------------------------------ plumbing
    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    def kubectl(self, *args: str, timeout: float = 120) -> str:
        return run([str(KUBE_BIN / "kubectl"), "--kubeconfig", self.kubeconfig, *args], timeout)

    def helm(self, *args: str, timeout: float = 360) -> str:
        return run([str(HELM), "--kubeconfig", self.kubeconfig, *args], timeout)

    def script(self, name: str, *args: str, timeout: float = 600) -> str:
        return run(["bash", str(K8S / name), *args], timeout, self.env or None)

    def step(self, name: str, action: Callable[[], None]) -> bool:
        console.rule(f"[bold]{name}")
        start = time.monotonic()
        try:
            action()
        except Exception as error:  # the summary names the step and the cause, whatever failed
            message = str(error) if isinstance(error, StepFailed) else traceback.format_exc()
            self.outcomes.append(Outcome(name, time.monotonic() - start, False, message))
            console.print(f"[red]FAILED[/red] {name}: {message}")
            console.print(self.diagnosis())
            return False
        self.outcomes.append(Outcome(name, time.monotonic() - start, True))
        log(f"[green]passed[/green] {name} ({time.monotonic() - start:.0f} s)")
        return True

    def diagnosis(self) -> str:
        """Pods, their container states and recent events in both namespaces, and the operator's log tail:
        what a failure needs to be understood."""
        if self.api is None:
            return ""
        lines = []
        for namespace in (SYSTEM, NAMESPACE):
            with contextlib.suppress(ApiException):
                for pod in self.core.list_namespaced_pod(namespace).items:
                    states = [
                        f"{s.name}: ready={s.ready} restarts={s.restart_count} {s.state.to_dict()}"
                        for s in pod.status.container_statuses or []
                    ]
                    lines.append(f"{namespace}/{pod.metadata.name} {pod.status.phase} {states}")
                for event in self.core.list_namespaced_event(namespace).items[-20:]:
                    lines.append(f"event {event.involved_object.name}: {event.reason} {event.message}")
        with contextlib.suppress(StepFailed, subprocess.TimeoutExpired):
            tail = self.kubectl("logs", "-n", SYSTEM, "deployment/basin-operator", "--tail", "30")
            lines.append(f"operator log:\n{tail}")
        return "\n".join(lines)

    def get(self) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(c.GROUP, c.VERSION, NAMESPACE, c.PLURAL, "demo"))

    def pods(self, component: str, ready: bool = True) -> list[client.V1Pod]:
        """The component's live Pods (Ready ones only by default); fails at once on one that cannot start."""
        selector = f"{c.LABEL_INSTANCE}=demo,{c.LABEL_COMPONENT}={component}"
        found = []
        listed = self.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        stuck(listed)
        for pod in listed:
            is_ready = any(k.type == "Ready" and k.status == "True" for k in pod.status.conditions or [])
            if pod.metadata.deletion_timestamp is None and (is_ready or not ready):
                found.append(pod)
        return found

    def service_url(self, component: str, port: int) -> str:
        service = self.core.read_namespaced_service(c.child_name("demo", component), NAMESPACE)
        return f"http://{service.spec.cluster_ip}:{port}"

    def gateway_state(self) -> list[dict[str, Any]]:
        """/ready of every Ready gateway Pod, by its own address."""
        return [
            requests.get(f"http://{p.status.pod_ip}:{c.GATEWAY_PORT}/ready", timeout=10).json()
            for p in self.pods("gateway")
        ]

    def gateway_metric(self, name: str, *labels: str) -> float:
        """Sum over the Ready gateway Pods of the samples of `name` whose labels include each of `labels`
        (as printed: 'outcome="shed"')."""
        total = 0.0
        for pod in self.pods("gateway"):
            page = requests.get(f"http://{pod.status.pod_ip}:{c.GATEWAY_PORT}/metrics", timeout=10).text
            for line in page.splitlines():
                sample, _, value = line.rpartition(" ")
                if sample.partition("{")[0] == name and all(label in sample for label in labels):
                    total += float(value)
        return total

    def replay(self, name: str, *scenario: str) -> Background:
        out = self.work / f"{name}.json"
        command = [
            str(BASIN), "replay", "--target", self.service_url("gateway", c.GATEWAY_PORT), "--api", "sglang",
            "--time-scale", f"{self.scale:g}", "--quiet", "--json", str(out), *scenario,
        ]  # fmt: skip
        log(f"replay {name}: {' '.join(scenario)}")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        background = Background(process, out)
        self.replays.append(background)
        return background

    # ------------------------------------------------------------------ steps
    def cluster(self) -> None:
        missing = [str(p) for p in IMAGES if not p.is_file()]
        if missing:
            raise StepFailed(f"run `make images` first (the node loads {', '.join(missing)})")
        self.script("build-kube.sh", timeout=3600)
        ports = {
            n: str(free_port()) for n in ("API_PORT", "ETCD_PORT", "PEER_PORT", "KCM_PORT", "SCHED_PORT")
        }
        folder = self.work / "cluster"
        self.env = {**os.environ, "D": str(folder), **ports, "PROXY": "1", "CLUSTER_DNS": BRIDGE_IP}
        log("starting etcd, the apiserver, the controller-manager and the scheduler")
        self.kubeconfig = self.script("start-cluster.sh", timeout=180).strip().splitlines()[-1]
        self.api = config.new_client_from_config(config_file=self.kubeconfig)
        log("starting the node (containerd, kubelet, kube-proxy) with the images")
        self.node_started = True
        node = self.script("node-up.sh", *map(str, IMAGES))
        if not node.strip().endswith("True"):
            raise StepFailed(f"the node is not Ready:\n{node[-2000:]}")
        relay = ApiRelay(BRIDGE_IP, int(ports["API_PORT"]))
        dns = ClusterDns(BRIDGE_IP, service_addresses(self.core))
        for service in (relay, dns):
            service.start()
            self.services.append(service)
        # The `kubernetes` Service onto the relay, so in-cluster clients (the operator) reach the apiserver.
        endpoints = {"addresses": [{"ip": BRIDGE_IP}], "ports": [{"name": "https", "port": relay.port}]}
        self.core.create_namespaced_endpoints(
            "default", {"metadata": {"name": "kubernetes"}, "subsets": [endpoints]}
        )

    def install(self) -> None:
        args = ["--set", "image.pullPolicy=Never"]
        for value in self.helm_set:
            args += ["--set", value]
        log(f"helm install {RELEASE} {CHART.relative_to(REPO)} --namespace {SYSTEM} {' '.join(args)}")
        self.helm("install", RELEASE, str(CHART), "--namespace", SYSTEM, "--create-namespace", *args)
        selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"

        def operator_ready() -> bool:
            pods = self.core.list_namespaced_pod(SYSTEM, label_selector=selector).items
            stuck(pods)
            return any(
                any(k.type == "Ready" and k.status == "True" for k in p.status.conditions or []) for p in pods
            )

        wait(operator_ready, 300, "the operator Pod to be Ready")
        crd = client.ApiextensionsV1Api(self.api).read_custom_resource_definition(f"{c.PLURAL}.{c.GROUP}")
        assert any(k.type == "Established" and k.status == "True" for k in crd.status.conditions)
        dashboards = self.core.list_namespaced_config_map(SYSTEM, label_selector="grafana_dashboard=1").items
        if not dashboards:
            raise StepFailed("the chart made no dashboard ConfigMaps")
        log(f"operator Ready; CRD established; {len(dashboards)} dashboard ConfigMaps")

    def apply(self) -> None:
        """examples/emulated.yaml as a user applies it, but for the managed Redis's image: the spec's default
        is the upstream `redis` image, which a node without a registry cannot pull; our basin-redis image
        (images/README.md), loaded onto the node, stands in."""
        manifest = yaml.safe_load(EXAMPLE.read_text())
        if float(manifest["spec"]["emulator"]["timeScale"]) != self.scale:
            raise StepFailed(
                f"{EXAMPLE.name} runs at x{manifest['spec']['emulator']['timeScale']}, not x{self.scale}"
            )
        manifest["spec"].setdefault("images", {})["redis"] = f"{c.REDIS_IMAGE}:{__version__}"
        path = self.work / "basindeployment.yaml"
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
        self.core.create_namespace({"metadata": {"name": NAMESPACE}})
        log(f"{EXAMPLE.relative_to(REPO)} with spec.images.redis {c.REDIS_IMAGE}:{__version__} (no registry)")
        log(self.kubectl("apply", "-n", NAMESPACE, "-f", str(path)).strip())

    def children(self) -> None:
        for component, count in (("redis", 1), ("emulator", 1), ("gateway", 2)):
            pods = wait(
                lambda component=component, count=count: len(self.pods(component)) >= count and True,
                420,
                f"{count} Running and Ready {component} Pod(s)",
            )
            assert pods
        for pod in self.pods("emulator") + self.pods("gateway"):
            container = pod.spec.containers[0]
            if not container.image.startswith(c.BASIN_IMAGE):
                raise StepFailed(f"{pod.metadata.name} runs {container.image}, not the Basin image")
        # Through the Services, as the Pods call each other: Redis by its DNS name, the emulator through the
        # router Service (kube-proxy), the gateway through its own.
        (address,) = service_addresses(self.core)(f"demo-redis.{NAMESPACE}.svc.cluster.local") or [None]
        if address != self.pods("redis")[0].status.pod_ip:
            raise StepFailed(f"demo-redis resolves to {address}, not the Redis Pod")
        router = self.service_url("router", c.ROUTER_PORT)
        info = requests.get(f"{router}/get_server_info", timeout=10).json()
        log(f"emulator through the router Service: {info.get('deployment')} at x{info.get('time_scale')}")
        gateway = self.service_url("gateway", c.GATEWAY_PORT)
        wait(
            lambda: requests.get(f"{gateway}/ready", timeout=10).status_code == 200,
            120,
            "the gateway's /ready",
        )
        # The gateways' model-second clock runs at the emulator's pace, as each says when it starts.
        for pod in self.pods("gateway"):
            text = self.core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE)
            if f"time x{self.scale:g}" not in text:
                raise StepFailed(f"{pod.metadata.name} does not run at x{self.scale:g}:\n{text[-2000:]}")

    def profiled(self) -> None:
        def ready() -> dict[str, Any] | None:
            obj = self.get()
            profiling = obj.get("status", {}).get("profiling") or {}
            if profiling.get("state") == "Failed":
                raise StepFailed(f"the profiling Job failed: {profiling}")
            return obj if obj.get("status", {}).get("phase") == "Ready" else None

        obj = wait(
            ready, 900, "the profiling Job to write the profile and the BasinDeployment to be Ready", 5
        )
        profile = obj["status"]["profile"]
        if obj["status"]["profiling"]["attempt"] != 1:  # the Job waits for the gateway it ramps through
            raise StepFailed(f"profiled only at attempt {obj['status']['profiling']['attempt']}")
        if not (profile["kappa"] > 0 and profile["lambdaCPerMin"] > 0 and profile["state"] == "fresh"):
            raise StepFailed(f"the status holds no usable profile: {profile}")
        table = self.kubectl("get", "basindeployments", "-n", NAMESPACE)
        console.print(table)
        # The printer column prints the float as stored; compare numbers, not a rounded string
        # (κ 1.0987 rounds to "1.1", which the column never shows).
        header, *rows = (line.split() for line in table.splitlines() if line.strip())
        row = dict(zip(header, rows[0], strict=False)) if rows else {}
        try:
            shown_kappa = float(row.get("KAPPA", "nan"))
        except ValueError:
            shown_kappa = float("nan")
        if not abs(shown_kappa - profile["kappa"]) < 1e-6 or row.get("PHASE") != "Ready":
            raise StepFailed(f"`kubectl get basindeployments` shows no κ or phase: {row}")
        log(
            f"profile: κ {profile['kappa']:.2f}, λc {profile['lambdaCPerMin']:.2f}/min;"
            f" {obj['status']['profiling']}"
        )
        wait(
            lambda: len(s := self.gateway_state()) == 2 and all(g["policy"] == "basin" for g in s) and s,
            300,
            "both gateways to run BASIN on the profile",
        )

    def start_prometheus(self) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise StepFailed(
                "prometheus is not on PATH (Debian: apt-get install prometheus; make system-deps)"
            )
        folder = self.work / "prometheus"
        folder.mkdir()
        (folder / "basin.yaml").write_text(alerts.render(self.scale))
        # The Pods the chart's ServiceMonitors select (gateways, the emulator standing in for the engines and
        # router), with namespace and pod labels. Debian's Prometheus is built without Kubernetes service
        # discovery, so a thread lists them from the API into a file_sd file, as kubernetes_sd would.
        targets = folder / "pods.json"
        self.pod_targets = PodTargets(self.core, targets)
        self.pod_targets.start()
        scrape = {
            "job_name": "basin",
            "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "2s"}],
        }
        settings = {
            # a model minute between scrapes at x20, as the monitoring service test
            "global": {"scrape_interval": "3s", "scrape_timeout": "3s", "evaluation_interval": "1s"},
            "rule_files": [str(folder / "basin.yaml")],
            "scrape_configs": [scrape],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(settings))
        port = free_port()
        self.prometheus_url = f"http://127.0.0.1:{port}"
        self.prometheus = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(folder / "log").open("w"), text=True,
        )  # fmt: skip

        def targets_up() -> list[str] | None:
            answer = requests.get(f"{self.prometheus_url}/api/v1/targets", timeout=5).json()
            active = answer["data"]["activeTargets"]
            up = [t["labels"]["pod"] for t in active if t["health"] == "up"]
            return up if len(up) >= 3 else None

        log(
            "Prometheus scrapes "
            + ", ".join(wait(targets_up, 120, "Prometheus to scrape 2 gateways and the emulator"))
        )

    def surge(self) -> None:
        parked_before = self.gateway_metric("basin_gateway_parked_answers_total")
        start = time.time()
        replay = self.replay("surge", *surge_replay(SURGE_MINUTES), "--seed", "0")
        try:
            replay.process.wait(timeout=900)
        except subprocess.TimeoutExpired as error:
            raise StepFailed("the surge replay ran past 900 s") from error
        result = replay.finish()
        self.surge_window = (start, time.time() + 3)
        time.sleep(3)  # one more scrape after the last call
        info = requests.get(f"{self.service_url('router', c.ROUTER_PORT)}/get_server_info", timeout=10).json()
        lag = float(info["loop_lag_mean_s"]) * self.scale  # model seconds the emulator ran late, on average
        parked = self.gateway_metric("basin_gateway_parked_answers_total") - parked_before
        sheds = self.gateway_metric("basin_gateway_sessions_ended", 'outcome="shed"')
        load = (
            f"emulator {lag:.2f} model s late, client CPU {result['client_cpu_fraction']:.2f},"
            f" load average {os.getloadavg()[0]:.1f}"
        )
        log(
            f"surge: goodput {result['goodput_sessions_per_h']:.0f} sessions/h, late hit"
            f" {result['hit_rate_late']:.3f}, {result['requests']} requests, {result['parked_answers']}"
            f" parked (the gateways counted {parked:.0f}), {sheds:.0f} sessions shed; {load}"
        )
        if result["connection_errors"] or result["failed_requests"] or result["stopped_early"]:
            raise StepFailed(f"calls were lost: {result['first_errors']} {result['stopped_early'] or ''}")
        if result["hit_rate_late"] < HELD:
            raise StepFailed(
                f"BASIN did not hold: late hit rate {result['hit_rate_late']:.3f} < {HELD} ({load})"
            )
        # Every 429 the client read, the gateways counted; they may have sent a few more to requests
        # still out when the replay ended, which the client cancelled unread (`cut_off`).
        seen, cut_off = result["parked_answers"], result["cut_off"]
        if seen == 0 or not seen <= parked <= seen + cut_off:
            raise StepFailed(
                f"the gateways counted {parked:.0f} parked answers, the client saw {seen}"
                f" with {cut_off} requests cut off at the end"
            )
        self.families = verify.exported_families(
            requests.get(f"http://{p.status.pod_ip}:{c.GATEWAY_PORT}/metrics", timeout=10).text
            for p in self.pods("gateway")
        ) | verify.exported_families(
            [requests.get(f"{self.service_url('router', c.ROUTER_PORT)}/metrics", timeout=10).text]
        )

    def queries(self) -> None:
        start, end = self.surge_window

        def has_data(expr: str) -> bool:
            answer = requests.get(
                f"{self.prometheus_url}/api/v1/query_range",
                params={"query": expr, "start": start, "end": end, "step": "2s"},
                timeout=30,
            ).json()
            if answer["status"] != "success":
                raise StepFailed(f"Prometheus refused {expr!r}: {answer}")
            return any(
                v[1] not in ("NaN", "+Inf", "-Inf") for s in answer["data"]["result"] for v in s["values"]
            )

        rate_interval = f"{max(20, round(400 / self.scale))}s"  # Grafana's $__rate_interval: ~6.7 model min
        empty = verify.empty_dashboard_queries(has_data, rate_interval, NAMESPACE)
        unknown = verify.unknown_rule_metrics(has_data, self.scale, self.families)
        total = len(verify.dashboard_expressions(rate_interval)) + len(verify.rule_expressions(self.scale))
        if empty or unknown:
            raise StepFailed(f"no data: dashboards {empty}; rules naming unexported metrics {unknown}")
        log(f"{total} dashboard and rule expressions checked against Prometheus")

    def rescale(self) -> None:
        before = self.get()["status"]["profile"]
        calls = self.replay("during-scale", "--base-rate", "4", "--duration-min", "600", "--seed", "1")
        time.sleep(5)
        log(self.kubectl("scale", "basindeployment/demo", "-n", NAMESPACE, "--replicas", "2").strip())

        def reprofiled() -> dict[str, Any] | None:
            obj = self.get()
            status = obj.get("status", {})
            profiling = status.get("profiling") or {}
            if profiling.get("state") == "Failed":
                raise StepFailed(f"the reprofiling Job failed: {profiling}")
            profile = status.get("profile") or {}
            new = profile.get("fingerprint") not in (None, before["fingerprint"])
            return obj if new and profile.get("state") == "fresh" and status.get("phase") == "Ready" else None

        obj = wait(reprofiled, 900, "a new profile for 2P3D and the BasinDeployment Ready again", 5)
        fingerprint = obj["status"]["profile"]["fingerprint"]
        wait(
            lambda: self.gateway_metric("basin_gateway_profile_info", f'fingerprint="{fingerprint}"') == 2,
            240,
            f"both gateways to take the profile {fingerprint} (the mounted ConfigMap)",
            5,
        )
        result = calls.finish()
        log(
            f"reprofiled: κ {obj['status']['profile']['kappa']:.2f}, λc"
            f" {obj['status']['profile']['lambdaCPerMin']:.2f}/min;"
            f" {result['requests']} calls during the scale"
        )
        if result["connection_errors"] or result["failed_requests"] or result["answered"] == 0:
            raise StepFailed(f"calls were lost during the scale: {result['first_errors']}")

    def deletions(self) -> None:
        calls = self.replay("during-deletions", "--base-rate", "4", "--duration-min", "600", "--seed", "2")
        time.sleep(10)
        states = {p.metadata.name: self.gateway_state_of(p) for p in self.pods("gateway")}
        leader = next((name for name, s in states.items() if s.get("leader")), None)
        if leader is None:
            raise StepFailed(f"no gateway leads: {states}")
        log(f"deleting the leading gateway Pod {leader}")
        self.core.delete_namespaced_pod(leader, NAMESPACE)
        wait(
            lambda: any(
                self.gateway_state_of(p).get("leader")
                for p in self.pods("gateway")
                if p.metadata.name != leader
            ),
            120,
            "another gateway replica to lead",
        )
        wait(lambda: len(self.pods("gateway")) == 2, 240, "the gateway Deployment to replace the Pod")
        redis_pod, redis_uid = self.pods("redis")[0].metadata.name, self.pods("redis")[0].metadata.uid
        errors_before = self.gateway_metric("basin_gateway_redis_errors_total")
        log(f"deleting the Redis Pod {redis_pod}")
        self.core.delete_namespaced_pod(redis_pod, NAMESPACE)
        wait(
            lambda: (p := self.pods("redis")) and p[0].metadata.uid != redis_uid and p,
            240,
            "the Redis StatefulSet to bring Redis back",
        )
        wait(
            lambda: (
                all(s.get("redis") for s in self.gateway_state())
                and any(s.get("leader") for s in self.gateway_state())
            ),
            120,
            "both gateways to reconnect to Redis, one leading",
        )
        time.sleep(10)
        result = calls.finish()
        redis_errors = self.gateway_metric("basin_gateway_redis_errors_total") - errors_before
        log(
            f"{result['requests']} calls across the deletions;"
            f" the gateways saw {redis_errors:.0f} Redis errors"
        )
        if result["connection_errors"] or result["failed_requests"] or result["answered"] == 0:
            raise StepFailed(f"calls were lost across the deletions: {result['first_errors']}")

    def gateway_state_of(self, pod: client.V1Pod) -> dict[str, Any]:
        return dict(requests.get(f"http://{pod.status.pod_ip}:{c.GATEWAY_PORT}/ready", timeout=10).json())

    def uninstall(self) -> None:
        log(self.helm("uninstall", RELEASE, "--namespace", SYSTEM, "--wait").strip())
        wait(lambda: not self.core.list_namespaced_pod(SYSTEM).items, 180, "the operator Pod to go")
        log("deleting the BasinDeployment with no operator running (no finalizer may hold it)")
        self.kubectl(
            "delete", "basindeployment/demo", "-n", NAMESPACE, "--wait=true", "--timeout=120s", timeout=150
        )

        def leftovers() -> list[str]:
            found = self.kubectl(
                "get",
                "all,configmaps,secrets,roles,rolebindings,serviceaccounts,jobs",
                "-n",
                NAMESPACE,
                "-o",
                "name",
            )
            system = self.kubectl("get", "all,configmaps,secrets,serviceaccounts", "-n", SYSTEM, "-o", "name")
            cluster = self.kubectl("get", "clusterroles,clusterrolebindings", "-o", "name")
            names = [n for n in (found + system).split() if not _default_object(n)]
            names += [n for n in cluster.split() if RELEASE in n]
            return names

        rest = leftovers()
        if rest:
            deadline = time.monotonic() + 180
            while rest and time.monotonic() < deadline:
                time.sleep(5)
                rest = leftovers()
            if rest:
                raise StepFailed(f"left behind after 180 s: {rest}")
        log("nothing left in the namespaces or the cluster's RBAC; the CRD stays (helm never deletes crds/)")

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        for replay in self.replays:
            if replay.process.poll() is None:
                replay.process.kill()
        if self.pod_targets is not None:
            self.pod_targets.stopped.set()
        if self.prometheus is not None:
            self.prometheus.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.prometheus.wait(20)
        if self.node_started:
            with contextlib.suppress(StepFailed, subprocess.TimeoutExpired):
                self.script("node-down.sh", timeout=300)
        for service in self.services:
            service.stop()
        if self.env:
            with contextlib.suppress(StepFailed, subprocess.TimeoutExpired):
                self.script("stop-cluster.sh", timeout=120)


# Container states that do not resolve by waiting (no registry here to pull from, a broken entrypoint).
STUCK = {"ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff",
         "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}  # fmt: skip


def stuck(pods: list[client.V1Pod]) -> None:
    """Fail at once, with the kubelet's reason, when a Pod's container cannot start."""
    for pod in pods:
        for status in pod.status.container_statuses or []:
            waiting = status.state.waiting
            if waiting is not None and waiting.reason in STUCK:
                raise StepFailed(f"{pod.metadata.name}: {waiting.reason}: {waiting.message or ''}".strip())


def _default_object(name: str) -> bool:
    """Objects every namespace has (the default ServiceAccount, its token, the root CA ConfigMap)."""
    return name in ("serviceaccount/default", "configmap/kube-root-ca.crt") or name.startswith(
        "secret/default-token-"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--set",
        dest="helm_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra `helm install --set` values (repeatable), e.g. to break the chart on purpose",
    )
    parser.add_argument(
        "--keep", metavar="DIR", help="work folder to keep (logs, replay results); default: a temporary one"
    )
    args = parser.parse_args(argv)
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the node is still torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scale = float(yaml.safe_load(EXAMPLE.read_text())["spec"]["emulator"]["timeScale"])
    lock_path = CACHE / "basin-k8s" / "node.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock, contextlib.ExitStack() as stack:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one node per machine: the bridge, iptables and kubelet ports
        work = (
            Path(args.keep)
            if args.keep
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="basin-e2e-")))
        )
        work.mkdir(parents=True, exist_ok=True)
        e2e = EndToEnd(work, scale, args.helm_set)
        steps = [
            ("cluster and node", e2e.cluster),
            ("helm install", e2e.install),
            ("kubectl apply", e2e.apply),
            ("children Ready", e2e.children),
            ("profiled, Ready", e2e.profiled),
            ("Prometheus scrapes", e2e.start_prometheus),
            ("x5 surge holds", e2e.surge),
            ("dashboards and rules", e2e.queries),
            ("scale and reprofile", e2e.rescale),
            ("Pod deletions", e2e.deletions),
            ("helm uninstall", e2e.uninstall),
        ]
        console.print(f"Basin {__version__} end to end: {len(steps)} steps at x{scale:g}, work folder {work}")
        try:
            for name, action in steps:
                if not e2e.step(name, action):
                    break
        finally:
            e2e.step("teardown", e2e.teardown)
        table = Table(title="make e2e")
        for column in ("step", "result", "seconds"):
            table.add_column(column)
        outcomes = {outcome.name: outcome for outcome in e2e.outcomes}
        for name in [*(name for name, _ in steps), "teardown"]:
            outcome = outcomes.get(name)
            if outcome is None:
                table.add_row(name, "not run", "")
                continue
            result = "passed" if outcome.passed else f"FAILED: {outcome.message.splitlines()[0][:100]}"
            table.add_row(name, result, f"{outcome.seconds:.0f}")
        console.print(table)
        return 0 if all(o.passed for o in e2e.outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
