"""The pure manifest builders: flags, labels and selectors that tie the children together, names, hashes."""

import pytest

pytest.importorskip("kopf")  # the `operator` extra

from basin_operator import builders
from basin_operator.constants import MAX_NAME_LENGTH
from basin_operator.spec import BasinDeploymentSpec


def spec(**extra: object) -> BasinDeploymentSpec:
    return BasinDeploymentSpec.model_validate({"model": {"path": "org/model"}, **extra})


def by_key(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def test_children_of_a_managed_deployment() -> None:
    children = by_key(builders.build_children("x", "ns", spec()))
    kinds = sorted(children)
    assert kinds == sorted(
        [("ServiceAccount", f"x-{c}") for c in ("router", "gateway", "profiler")]
        + [("Role", f"x-{c}") for c in ("router", "gateway", "profiler")]
        + [("RoleBinding", f"x-{c}") for c in ("router", "gateway", "profiler")]
        + [("ConfigMap", "x-profile"), ("Service", "x-redis"), ("StatefulSet", "x-redis")]
        + [("Deployment", f"x-{c}") for c in ("prefill", "decode", "router", "gateway")]
        + [("Service", "x-router"), ("Service", "x-gateway")]
    )
    for child in children.values():
        assert child["metadata"]["labels"]["app.kubernetes.io/instance"] == "x"
        assert child["metadata"]["namespace"] == "ns"
        assert child["metadata"]["annotations"]["basin.dev/spec-hash"]
    external = spec(redis={"mode": "external", "url": "redis://r:6379/0"})
    names = by_key(builders.build_children("x", "ns", external))
    assert ("StatefulSet", "x-redis") not in names and ("Service", "x-redis") not in names


def test_engine_flags() -> None:
    s = spec(
        prefill={
            "gpusPerReplica": 2,
            "hicache": {"hostRatio": 3.5},
            "extraArgs": ["--mem-fraction-static", "0.8"],
        }
    )
    prefill = builders.engine_args(s, "prefill")
    assert prefill[prefill.index("--tp-size") + 1] == "2"
    assert prefill[prefill.index("--hicache-ratio") + 1] == "3.5"
    assert prefill[prefill.index("--hicache-write-policy") + 1] == "write_through"
    assert prefill[prefill.index("--disaggregation-bootstrap-port") + 1] == "8998"
    assert prefill[-2:] == ["--mem-fraction-static", "0.8"]
    decode = builders.engine_args(s, "decode")
    assert "--enable-hierarchical-cache" not in decode and "--disaggregation-bootstrap-port" not in decode
    for args in (prefill, decode):
        assert {
            "--enable-metrics",
            "--enable-priority-scheduling",
            "--schedule-low-priority-values-first",
        } <= set(args)
    off = builders.engine_args(spec(prefill={"hicache": {"hostRatio": 0}}), "prefill")
    assert "--enable-hierarchical-cache" not in off
    deployment = builders.build_engine_deployment("x", "ns", s, "prefill")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert deployment["spec"]["template"]["metadata"]["annotations"] == {"sglang.ai/bootstrap-port": "8998"}


def test_router_selectors_match_engine_pods() -> None:
    """Scaling needs no router rewrite: its selectors pick the engine pods by label."""
    s = spec()
    router = builders.build_router_deployment("x", "ns", s)["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    for mode in ("prefill", "decode"):
        start = router.index(f"--{mode}-selector") + 1
        pairs = []
        for arg in router[start:]:
            if arg.startswith("--"):
                break
            pairs.append(arg)
        pod_labels = builders.build_engine_deployment("x", "ns", s, mode)["spec"]["template"]["metadata"][
            "labels"
        ]
        assert pairs and all(pod_labels.get(k) == v for k, v in (p.split("=", 1) for p in pairs))
        other = "decode" if mode == "prefill" else "prefill"
        other_labels = builders.build_engine_deployment("x", "ns", s, other)["spec"]["template"]["metadata"][
            "labels"
        ]
        assert not all(other_labels.get(k) == v for k, v in (p.split("=", 1) for p in pairs))


def test_gateway_configuration() -> None:
    s = spec(
        redis={
            "mode": "external",
            "url": "rediss://cache:6380/1",
            "passwordSecret": {"name": "r", "key": "pw"},
        },
        gateway={"predictor": {"configMap": "pred"}, "policy": {"margin": 0.7}, "sessionHeader": "X-Agent"},
    )
    pod = builders.build_gateway_deployment("x", "ns", s)["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["BASIN_REDIS_URL"]["value"] == "rediss://cache:6380/1"
    assert env["BASIN_REDIS_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "r", "key": "pw"}}
    assert env["BASIN_POLICY_MARGIN"]["value"] == "0.7"
    assert env["BASIN_SESSION_HEADER"]["value"] == "X-Agent"
    assert env["BASIN_PREDICTOR_PATH"]["value"] == "/etc/basin/predictor/model.json"
    assert env["BASIN_PROFILE_PATH"]["value"] == "/etc/basin/profile/profile.json"
    assert {v["name"]: v["configMap"]["name"] for v in pod["volumes"]} == {
        "profile": "x-profile",
        "predictor": "pred",
    }


def gateway_env(s: BasinDeploymentSpec) -> dict[str, str | None]:
    pod = builders.build_gateway_deployment("x", "ns", s)["spec"]["template"]["spec"]
    return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}


def test_the_gateway_addresses_the_engine_pods_directly_unless_told_to_use_the_router() -> None:
    direct = gateway_env(spec())
    assert direct["BASIN_DIRECT_ENGINES"] == "1" and direct["BASIN_BOOTSTRAP_PORT"] == "8998"
    assert direct["BASIN_ENGINE_PORT"] == "30000" and "prefill" in str(direct["BASIN_PREFILL_SELECTOR"])
    assert "BASIN_DIRECT_ENGINES" not in gateway_env(spec(gateway={"addressing": "router"}))
    # one emulator pod stands for both roles behind the router's Service: nothing to address directly
    assert "BASIN_DIRECT_ENGINES" not in gateway_env(spec(emulator={"enabled": True}))
    with pytest.raises(ValueError, match="addressing"):
        spec(gateway={"addressing": "sideways"})


def test_spec_hash_and_fingerprint() -> None:
    a = by_key(builders.build_children("x", "ns", spec()))
    b = by_key(builders.build_children("x", "ns", spec(prefill={"replicas": 2})))
    changed = {k for k in a if a[k]["metadata"]["annotations"] != b[k]["metadata"]["annotations"]}
    assert changed == {("Deployment", "x-prefill")}
    s = spec()
    assert builders.profile_fingerprint(s, 1, 1) == builders.profile_fingerprint(spec(), 1, 1)
    assert builders.profile_fingerprint(s, 2, 1) != builders.profile_fingerprint(s, 1, 1)
    assert builders.profile_fingerprint(
        spec(router={"policy": "random"}), 1, 1
    ) != builders.profile_fingerprint(s, 1, 1)
    # Images or gateway settings do not change what a profile measured.
    assert builders.profile_fingerprint(spec(gateway={"replicas": 4}), 1, 1) == builders.profile_fingerprint(
        s, 1, 1
    )


def test_names_fit_kubernetes_limits() -> None:
    name = "n" * MAX_NAME_LENGTH
    s = spec()
    job = builders.build_profile_job(name, "ns", s, builders.profile_fingerprint(s, 1, 1), 1, 1, 99)
    assert len(job["metadata"]["name"]) <= 63  # the Job's pods carry it in the job-name label
    for child in builders.build_children(name, "ns", s):
        assert len(child["metadata"]["name"]) <= 63 - len("-0") - 11  # StatefulSet pods and revision hashes


def test_engine_pods_enable_the_plugin_by_its_entry_point_name() -> None:
    """SGLANG_PLUGINS filters by entry-point name: it must be the one pyproject.toml registers."""
    import tomllib
    from pathlib import Path

    from basin_operator import constants

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["sglang.srt.plugins"]
    assert constants.ENGINE_PLUGIN in plugins
    assert plugins[constants.ENGINE_PLUGIN].startswith("basin_engine_ext:")


def test_both_engine_roles_agree_on_the_unit_port_and_only_decode_carries_the_lend_cap() -> None:
    """φ is read by decode's lender alone; in prefill's pod template a φ edit would roll prefill too."""
    from basin_operator import constants

    shaped = spec(gateway={"policy": {"lendCap": 0.3}})
    envs = {}
    for mode in ("prefill", "decode"):
        pod = builders.build_engine_deployment("bd", "ns", shaped, mode)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        envs[mode] = {e["name"]: e["value"] for e in container["env"]}
        assert envs[mode]["BASIN_ENGINE_UNIT_PORT"] == str(constants.UNIT_PORT)
        assert envs[mode].get("BASIN_ENGINE_LEND_CAP") == ("0.3" if mode == "decode" else None)
        assert envs[mode][constants.ENGINE_PLUGIN_ENV] == constants.ENGINE_PLUGIN
    decode_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert decode_ports["units"] == constants.UNIT_PORT


def test_reservation_at_prefill_completion_flags() -> None:
    def args(mode: str, **extra: object) -> list[str]:
        return builders.engine_args(spec(**extra), mode)

    for mode in ("prefill", "decode"):
        assert "--disaggregation-transfer-backend" not in args(mode)
        assert "--disaggregation-decode-allocation-policy" not in args(mode)
        reserved = args(mode, disaggregation={"decodeAllocation": "prefill_complete"})
        assert reserved[reserved.index("--disaggregation-transfer-backend") + 1] == "nixl"
        assert reserved[reserved.index("--disaggregation-decode-allocation-policy") + 1] == "prefill_complete"
        mooncake = args(mode, disaggregation={"transferBackend": "mooncake"})
        assert mooncake[mooncake.index("--disaggregation-transfer-backend") + 1] == "mooncake"


def test_profiling_job_has_a_deadline_and_a_ttl() -> None:
    job = builders.build_profile_job("x", "ns", spec(), "f", 1, 1, 1)["spec"]
    assert job["activeDeadlineSeconds"] == 2 * 4 * 8 * 720 + 600
    assert job["ttlSecondsAfterFinished"] > 0 and job["backoffLimit"] == 0
    short = spec(profiling={"deadlineSeconds": 900})
    assert builders.build_profile_job("x", "ns", short, "f", 1, 1, 1)["spec"]["activeDeadlineSeconds"] == 900


def test_the_gateway_role_names_its_configmap() -> None:
    rules = builders.build_role("x", "ns", "gateway")["rules"]
    for rule in rules:
        if "configmaps" in rule["resources"]:
            assert rule["resourceNames"] == ["x-profile"]


def test_emulated_engines_replace_engines_and_router_behind_the_same_service() -> None:
    emulated = spec(decode={"replicas": 3}, emulator={"enabled": True, "timeScale": 10})
    assert emulated.check() == []
    children = by_key(builders.build_children("x", "ns", emulated))
    for gone in ("x-prefill", "x-decode", "x-router"):
        assert ("Deployment", gone) not in children
    assert ("ServiceAccount", "x-router") not in children and ("Role", "x-router") not in children
    pod = children[("Deployment", "x-emulator")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == emulated.images.basin and container["command"] == ["basin"]
    args = container["args"]
    assert args[0] == "emulate"
    assert args[args.index("--deployment") + 1] == "h200-1p3d"
    assert args[args.index("--time-scale") + 1] == "10"
    assert args[args.index("--host-tier") + 1] == "2"
    assert args[args.index("--port") + 1] == "8000"
    service = children[("Service", "x-router")]["spec"]
    assert service["selector"]["app.kubernetes.io/component"] == "emulator"
    assert {p["targetPort"] for p in service["ports"]} == {8000}
    gateway = children[("Deployment", "x-gateway")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    assert env["BASIN_ROUTER_URL"] == "http://x-router:8000" and env["BASIN_ENGINES_EMULATED"] == "1"
    assert "emulator" in env["BASIN_PREFILL_SELECTOR"] and env["BASIN_ENGINE_PORT"] == "8000"
    assert env["BASIN_TIME_SCALE"] == "10"  # the emulator's pace
    assert [k for _, k, n in builders.obsolete_children("x", emulated)].count("Deployment") == 3
    assert builders.obsolete_children("x", spec()) == [("apps/v1", "Deployment", "x-emulator")]
    # Any shape of a calibrated GPU emulates (scaling reshapes the emulator); an unknown preset is named in
    # the problem; an explicit preset overrides the derived one.
    scaled = spec(prefill={"replicas": 2}, emulator={"enabled": True})
    assert scaled.check() == [] and "h200-2p1d" in builders.emulator_args(scaled)
    odd = spec(emulator={"enabled": True, "preset": "b200-1p1d"})
    assert any("spec.emulator.preset" in problem for problem in odd.check())
    named = spec(prefill={"replicas": 3}, emulator={"enabled": True, "preset": "h200-2p6d"})
    assert named.check() == [] and "h200-2p6d" in builders.emulator_args(named)
