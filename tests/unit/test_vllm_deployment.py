"""The vLLM backend's deployment config and rendered commands.

Golden files (tests/unit/golden/vllm/<shape>.sh) hold the exact commands of each of the seed's example
shapes; ROLLFLOW_UPDATE_GOLDEN=1 rewrites them (review the diff). Every validation rule has a test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from config.inference import InferenceConfig
from config.run import RunConfig
from engines.inference.backend import check, launch_plan
from engines.inference.vllm.processes import check_local
from engines.registry import PluginError
from launch import vllm as vllm_launch

GOLDEN = Path(__file__).parent / "golden" / "vllm"

# The seed's examples, as [inference] tables.
SHAPES: dict[str, dict] = {
    "single_node": {},
    "single_node_tp2_dp4_ep": {"enable_expert_parallel": True, "parallel": {"tp": 2, "dp": 4}},
    "multi_replica": {"deployment": {"type": "multi_node", "num_nodes": 2}, "parallel": {"tp": 2, "dp": 4}},
    "wide_ep": {
        "deployment": {"type": "multi_node", "num_nodes": 2},
        "enable_expert_parallel": True,
        "parallel": {"tp": 2, "dp": 8},
    },
    "disaggregated": {
        "deployment": {
            "type": "disaggregated",
            "num_prefill_nodes": 2,
            "num_decode_nodes": 2,
            "num_prefill_replicas": 2,
            "num_decode_replicas": 1,
            "prefill_env_overrides": {"VLLM_ENABLE_MOE_DP_CHUNK": "0", "VLLM_DEEP_GEMM_WARMUP": "skip"},
            "decode_env_overrides": {"VLLM_DEEP_GEMM_WARMUP": "skip"},
        },
        "parallel": {"tp": 2, "dp": 4},
        "num_infer_replicas": 3,
    },
    "kv_offload_cpu": {"kv_cache_offload": {"type": "native", "cpu": {"num_bytes": 128_000_000_000}}},
    "kv_offload_cpu_disk": {
        "kv_cache_offload": {"type": "native", "cpu": {"num_bytes": 128_000_000_000}, "disk": {"path": "/scratch/kv"}}
    },
    "kv_offload_mooncake": {
        "deployment": {"type": "multi_node", "num_nodes": 2},
        "kv_cache_offload": {
            "type": "mooncake",
            "cpu": {"num_bytes": 128_000_000_000},
            "disk": {"path": "/scratch/kv"},
        },
    },
    "round_robin_extra": {
        "deployment": {"type": "multi_node", "num_nodes": 2},
        "router": {"policy": "round_robin"},
        "vllm_extra": {"enable_dbo": True, "gpu_memory_utilization": 0.9, "compilation_config": {"level": 3}},
    },
}


def inference(**keys) -> InferenceConfig:
    return InferenceConfig.model_validate({"backend": "vllm", **keys})


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_rendered_commands_match_golden(shape):
    replicas = vllm_launch.render(inference(**SHAPES[shape]), under_slurm=True)
    text = vllm_launch.plan_script(replicas)
    path = GOLDEN / f"{shape}.sh"
    if os.environ.get("ROLLFLOW_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"rendered commands of {shape} changed; ROLLFLOW_UPDATE_GOLDEN=1 rewrites"


def test_node_and_process_counts_follow_the_seed():
    count = {k: vllm_launch.render(inference(**v), under_slurm=True) for k, v in SHAPES.items()}
    # disaggregated: 2x2 prefill + 1x2 decode = 6 nodes per replica, 3 replicas, one router each
    dis = count["disaggregated"]
    assert [len(r.nodes) for r in dis] == [6, 6, 6]
    assert [sum(p.name.startswith("router") for p in r.processes) for r in dis] == [1, 1, 1]
    assert len({n for r in dis for n in r.nodes}) == 18
    # wide EP: one server over 2 nodes, dp_local = 8 / 2, ranks 0 and 4
    argvs = [p.argv for p in count["wide_ep"][0].processes if not p.name.startswith("router")]
    assert [a[a.index("--data-parallel-start-rank") + 1] for a in argvs] == ["0", "4"]
    assert all(a[a.index("--data-parallel-size-local") + 1] == "4" for a in argvs)
    # multi-replica: independent servers, each tp=2 dp=4, behind one router
    servers = [p for p in count["multi_replica"][0].processes if p.name.startswith("vllm")]
    assert len(servers) == 2 and all("--data-parallel-address" not in p.argv for p in servers)


def test_single_node_binds_loopback_and_ports_are_unique():
    (rep,) = vllm_launch.render(inference())
    (server,) = rep.processes
    assert server.argv[server.argv.index("--host") + 1] == "127.0.0.1"
    many = vllm_launch.render(inference(**SHAPES["disaggregated"]), under_slurm=True)
    ports = [p.url for r in many for p in r.processes]
    assert len(ports) == len(set(ports))


def test_local_nodes_put_every_server_on_this_host():
    cfg = inference(deployment={"type": "multi_node", "num_nodes": 2, "backend_port": 9100})
    (rep,) = vllm_launch.render(cfg, model="/m", nodes=["127.0.0.1"] * 2, python="/v/bin/python")
    router = rep.processes[-1]
    assert router.argv[0] == "/v/bin/vllm-router"
    assert router.argv[router.argv.index("--worker-urls") + 1 :] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]


def test_kv_transfer_config_is_valid_json_for_vllm():
    (rep,) = vllm_launch.render(inference(**SHAPES["kv_offload_cpu_disk"]))
    argv = rep.processes[0].argv
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "OffloadingConnector"
    assert kv["kv_connector_extra_config"]["spec_name"] == "TieringOffloadingSpec"
    assert "--enable-prefix-caching" in argv


def test_dry_run_writes_the_commands(tmp_path):
    """The vLLM backend's launch plan (its declared capability) is what --dry-run writes; the embedded has none."""
    from runtime.rundir import write_configs

    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "inference": {"backend": "vllm", **SHAPES["wide_ep"]}})
    write_configs(cfg, "run-1", "http://127.0.0.1:1", plan=launch_plan(cfg))
    plan = json.loads((tmp_path / "config" / "vllm-plan.json").read_text())
    assert len(plan["replicas"][0]["processes"]) == 3
    assert "vllm-router" in (tmp_path / "config" / "vllm-commands.sh").read_text()
    assert launch_plan(RunConfig.model_validate({"output_dir": str(tmp_path)})) == {}


# --- validation: one test per rule -------------------------------------------------------------------


def refused(match: str, **keys) -> None:
    with pytest.raises(ValidationError, match=match):
        RunConfig.model_validate({"inference": keys})


def test_disk_only_offload_is_refused():
    refused("needs a cpu tier", backend="vllm", kv_cache_offload={"type": "native", "disk": {"path": "/x"}})


def test_router_replay_with_kv_offload_is_refused():
    offload = {"cpu": {"num_bytes": 1}}
    inference(kv_cache_offload=offload)
    with pytest.raises(ValidationError, match="enable_return_routed_experts.*kv_cache_offload"):
        inference(kv_cache_offload=offload, enable_return_routed_experts=True)
    # turned on by the trainer's router replay: the same refusal, whatever order the checks run in
    with pytest.raises(ValidationError, match="enable_return_routed_experts.*kv_cache_offload"):
        RunConfig.model_validate(
            {"trainer": {"enable_router_replay": True}, "inference": {"backend": "vllm", "kv_cache_offload": offload}}
        )


def test_mooncake_runs_only_under_slurm():
    cfg = inference(kv_cache_offload={"type": "mooncake", "cpu": {"num_bytes": 1}})
    with pytest.raises(vllm_launch.RenderError, match="only under Slurm"):
        vllm_launch.render(cfg, under_slurm=False)
    with pytest.raises(SystemExit, match="mooncake"):
        check_local(cfg)


def test_wide_ep_dp_must_split_over_the_nodes():
    refused("dp=3 must be a multiple", backend="vllm", **{**SHAPES["wide_ep"], "parallel": {"tp": 2, "dp": 3}})


def test_multi_node_needs_two_nodes():
    refused("num_nodes", backend="vllm", deployment={"type": "multi_node", "num_nodes": 1})


def test_keys_of_another_shape_are_refused():
    refused("single_node.num_nodes", backend="vllm", deployment={"type": "single_node", "num_nodes": 2})
    refused("prefill_env_overrides", backend="vllm", deployment={"type": "multi_node", "prefill_env_overrides": {}})


def test_vllm_extra_cannot_override_what_rollflow_sets():
    refused(
        "vllm_extra.tensor-parallel-size is set by rollflow; use inference.parallel.tp",
        backend="vllm",
        vllm_extra={"tensor-parallel-size": 2},
    )
    refused("vllm_extra.port", backend="vllm", vllm_extra={"port": 1})


def capability_refused(match: str, **keys) -> None:
    """Refused by the backend's declared capabilities (the CLI's load-time check), not by the config."""
    cfg = RunConfig.model_validate(keys)
    with pytest.raises(PluginError, match=match):
        check(cfg.inference, cfg.weight_broadcast)


def test_deployment_keys_need_a_backend_that_runs_them():
    capability_refused(
        r"inference.parallel is a deployment key: inference.backend = 'embedded' does not run it \(registered "
        r"backends that do: vllm\)",
        inference={"parallel": {"tp": 2}},
    )
    capability_refused("inference.vllm_extra is a deployment key", inference={"vllm_extra": {"enable_dbo": True}})
    for ok in ({"inference": {"parallel": {"tp": 1}}}, {"inference": {"backend": "vllm", "parallel": {"tp": 2}}}):
        cfg = RunConfig.model_validate(ok)  # the default is no deployment choice; vLLM runs the key
        check(cfg.inference, cfg.weight_broadcast)


def test_unknown_router_policy_is_refused():
    refused("consistent_hash", backend="vllm", router={"policy": "cache_aware"})


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        (SHAPES["wide_ep"], "wide EP"),
        (SHAPES["disaggregated"], "disaggregated"),
    ],
)
def test_local_launch_refuses_what_needs_slurm(keys, match):
    with pytest.raises(SystemExit, match=match):
        check_local(inference(**keys))
    check_local(inference(**SHAPES["multi_replica"]))  # several replicas behind a router fit on one host
    check_local(inference(num_infer_replicas=2))  # and so do several copies, each behind its own router


def test_sessions_stick_to_a_replica_and_requests_name_their_session():
    from engines.inference.frontend import generation
    from engines.inference.vllm.backend import Upstream, upstream_headers
    from engines.protocol import CompletionRequest

    up = Upstream(["http://r0", "http://r1", "http://r2"], [], 0)
    sessions = [f"s000001-g{g:04d}" for g in range(30)]
    first = [up.entry(s) for s in sessions]
    assert [up.entry(s) for s in sessions] == first  # stable
    assert set(first) == set(up.entries)  # and spread
    assert [up.entry(None) for _ in range(4)] == ["http://r0", "http://r1", "http://r2", "http://r0"]
    body = CompletionRequest(prompt=[1])

    def forwarded(headers: dict, session_header: str = "X-Session-ID") -> dict:
        from starlette.datastructures import Headers

        return upstream_headers(generation(body, Headers(headers), session_header))

    headers = forwarded({"X-Session-ID": "s1-g2", "Authorization": "x", "content-type": "y", "X-Trace": "t"})
    assert headers["x-session-id"] == "s1-g2" and headers["x-request-id"].startswith("s1-g2-")
    assert set(headers) == {"x-session-id", "x-request-id", "x-trace"}  # only x- headers travel upstream
    assert forwarded({"X-Request-Id": "mine", "X-Session-ID": "a"})["x-request-id"] == "mine"
    # a configured session header (inference.router.session_header) reaches vllm-router as the header it reads
    custom = forwarded({"X-Rollout": "s2-g1", "X-Session-ID": "ignored"}, session_header="X-Rollout")
    assert custom["x-session-id"] == "s2-g1" and "x-rollout" not in custom


def test_the_seeds_top_level_num_infer_replicas_is_the_inference_key():
    cfg = RunConfig.model_validate({"deployment": {"num_infer_replicas": 3}, "inference": {"backend": "vllm"}})
    assert cfg.inference.vllm.num_infer_replicas == 3
    stored = cfg.model_dump(mode="json")  # stored once, under the key rollflow reads
    assert stored["inference"]["num_infer_replicas"] == 3 and "num_infer_replicas" not in stored["deployment"]
    assert RunConfig.model_validate(stored) == cfg
    both = {"deployment": {"num_infer_replicas": 3}, "inference": {"backend": "vllm", "num_infer_replicas": 3}}
    assert RunConfig.model_validate(both) == cfg  # what run configs stored by earlier versions hold
    with pytest.raises(ValidationError, match="disagree"):
        RunConfig.model_validate(
            {"deployment": {"num_infer_replicas": 3}, "inference": {"backend": "vllm", "num_infer_replicas": 2}}
        )
    capability_refused(r"deployment.num_infer_replicas\) = 2 needs a backend that runs replicas",
                       deployment={"num_infer_replicas": 2})  # fmt: skip


def test_the_shape_keys_are_written_flat_in_the_inference_table():
    cfg = inference(**SHAPES["disaggregated"], vllm={"python": "/v/bin/python"})
    assert (cfg.vllm.parallel.dp, cfg.vllm.num_infer_replicas, cfg.vllm.python) == (4, 3, "/v/bin/python")
    data = cfg.model_dump(mode="json")
    assert data["parallel"] == {"tp": 2, "dp": 4} and data["deployment"]["backend_port"] == 8100
    assert set(data["vllm"]) == {"python", "env", "startup_timeout_s"}  # the [inference.vllm] table
    assert InferenceConfig.model_validate(data) == cfg
    with pytest.raises(ValidationError, match="`vllm.parallel` is written `parallel`"):
        inference(vllm={"parallel": {"tp": 2}})  # one spelling per key


def test_vllms_routed_experts_become_the_rollout_column():
    import base64
    import io

    import numpy as np

    from engines.inference.vllm.backend import decode_routes

    routes = np.arange(7 * 3 * 2, dtype=np.int16).reshape(7, 3, 2)  # vLLM: [seq, layers, top_k]
    buf = io.BytesIO()
    np.save(buf, routes, allow_pickle=False)  # vllm.utils.serial_utils.numpy2base64's encoding
    b64 = base64.b64encode(buf.getvalue()).decode()
    assert decode_routes(b64, 6) == routes[:6].tolist()  # prompt 4 + completion 3 - 1 positions ran
    with pytest.raises(ValueError, match="expected"):
        decode_routes(b64, 8)


def test_routed_experts_from_the_cpu_build_of_vllm_are_refused_at_launch():
    from engines.inference.vllm.processes import ROOT

    if not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        pytest.skip("no vLLM environment")
    with pytest.raises(SystemExit, match="Model Runner V2"):
        check_local(inference(enable_return_routed_experts=True))


def test_the_configured_session_header_reaches_the_orchestrator():
    from config.process import OrchestratorProcessConfig, component_configs

    for cfg, header in (
        (
            RunConfig.model_validate({"inference": {"backend": "vllm", "router": {"session_header": "X-Rollout"}}}),
            "X-Rollout",
        ),
        (RunConfig(), "X-Session-ID"),
    ):
        orchestrator = component_configs(cfg, "r", "http://127.0.0.1:1")["orchestrator"]
        assert isinstance(orchestrator, OrchestratorProcessConfig) and orchestrator.session_header == header
