"""A run over two Ray nodes: the rendezvous is where rank 0 runs, and the output folder is checked.

Two real raylets on this machine (``ray.cluster_utils.Cluster``, the way Ray tests itself): the
head, which the controller joins, and a second node whose address is ``127.0.0.2`` (the loopback
network is 127.0.0.0/8 on Linux), so that an address can tell the nodes apart. A policy of two
fsdp2 ranks is placed with its rank 0 on the second node and rank 1 on the head; it forms its
process group, makes one update and exports it. Everything runs in one child process with its
own cluster (the test session's Ray is a single node), once for the whole module.

What one machine cannot show: every node here reaches every port of every other, so a wrong
address that pointed at this machine would also connect. The tests therefore check the
addresses themselves: the one rank 0 reported is its own node's (not the controller's), and
it is the one the other rank dialed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from raylign.rl.experience import response_tensor

from .rl_helpers import fp32_model, shard_for_ranks, state_dict_of, worker_config
from .test_rl_data_parallel import (
    ADAM_EPS,
    ADVANTAGES,
    CLIP,
    LR,
    MAX_TOKENS,
    NORM_RTOL,
    WEIGHT_ATOL,
    _max_gap,
    _old_logprobs,
    _reference_update,
    _samples,
)

pytestmark = pytest.mark.slow

SECOND_NODE_IP = "127.0.0.2"

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import ray
    import torch
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group

    from raylign.cluster import get_within, start_ray
    from raylign.rl.group import WorkerGroup
    from raylign.rl.shared_dir import SharedDirectoryError, check_shared_directory, check_views

    ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def node_with(resource):
        (node,) = [n for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
        return node["NodeID"], node["NodeManagerAddress"]

    def train_across_nodes(spec, node_a, node_b):
        # Bundle 0 (rank 0) on the second node, bundle 1 (rank 1) on the head.
        group_pg = placement_group([{"CPU": 1, "node_b": 1}, {"CPU": 1, "node_a": 1}], strategy="SPREAD")
        get_within(group_pg.ready(), 120, "the placement group", "the test's limit")
        group = WorkerGroup("policy", spec["cfg"], 2, 1, group_pg, env=ENV, startup_timeout_s=300, call_timeout_s=300)
        try:
            result = {"rendezvous": list(group.rendezvous), "placement": group.call("placement_info")}
            shards = torch.load(spec["shards"], weights_only=False)
            stats = group.call_sharded("train_policy", shards)
            result["grad_norm"] = [s["grad_norm"].value for s in stats]
            group.call("export_hf", spec["export"])
        finally:
            group.kill()
            ray.util.remove_placement_group(group_pg)
        return result

    def shared_folder_checks(spec, node_a, node_b, head):
        result = {}
        # One node (the controller's): nothing is written, so even a folder nobody can create passes.
        check_shared_directory("/proc/raylign-no-such-folder", {head}, "train.output_dir", 60)
        result["one_node_passed"] = True
        check_shared_directory(spec["shared"], {node_a, node_b}, "train.output_dir", 60)
        result["shared_passed"] = True
        result["shared_left"] = sorted(os.listdir(spec["shared"]))
        try:
            views = {node_a: spec["view_a"], node_b: spec["view_b"]}
            check_views(views, "train.output_dir", 60, settle_s=1.0)
            result["not_shared_error"] = None
        except SharedDirectoryError as err:
            result["not_shared_error"] = str(err)
        return result

    if __name__ == "__main__":
        spec = json.load(open(sys.argv[1]))
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}})
        try:
            cluster.add_node(num_cpus=1, resources={"node_b": 1}, node_ip_address=spec["second_ip"])
            cluster.wait_for_nodes(timeout=120)
            start_ray(cluster.address)
            (node_a, ip_a), (node_b, ip_b) = node_with("node_a"), node_with("node_b")
            result = {
                "controller_ip": ray.util.get_node_ip_address(),
                "head": ray.get_runtime_context().get_node_id(),
                "node_a": [node_a, ip_a],
                "node_b": [node_b, ip_b],
            }
            result.update(train_across_nodes(spec, node_a, node_b))
            result.update(shared_folder_checks(spec, node_a, node_b, result["head"]))
            print("RESULT " + json.dumps(result), flush=True)
        finally:
            ray.shutdown()
            cluster.shutdown()
""")


@pytest.fixture(scope="module")
def two_nodes(rl_model_dir, prompt_file, tmp_path_factory):
    """Runs the child process once; its report, the update it exported, and the expected update."""
    tmp = tmp_path_factory.mktemp("multinode")
    samples = _samples()
    old = _old_logprobs(fp32_model(rl_model_dir), samples)
    per_token = {
        "old_logprobs": response_tensor(old),
        "advantages": response_tensor([[a] * len(s.response_ids) for a, s in zip(ADVANTAGES, samples)]),
    }
    torch.save(shard_for_ranks(samples, per_token, 2, MAX_TOKENS), tmp / "shards.pt")
    cfg = worker_config(
        rl_model_dir,
        prompt_file,
        tmp / "run" / "run",
        "fsdp2",
        2,
        optim={"lr": LR, "eps": ADAM_EPS, "max_grad_norm": 0.0, "scheduler": "constant"},
        algorithm={"aggregation": "token_mean", "clip_eps_low": CLIP},
    )
    for name in ("shared", "view_a", "view_b"):
        (tmp / name).mkdir()
    spec = {
        "cfg": cfg,
        "shards": str(tmp / "shards.pt"),
        "export": str(tmp / "export"),
        "second_ip": SECOND_NODE_IP,
        **{name: str(tmp / name) for name in ("shared", "view_a", "view_b")},
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    script = tmp / "two_nodes.py"
    script.write_text(SCRIPT)
    # One authentication setting for the head, the second node, the driver and their workers alike.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp / "spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    report = json.loads(lines[-1][len("RESULT ") :])
    expected, expected_norm = _reference_update(rl_model_dir, samples, old)
    return report, state_dict_of(tmp / "export"), expected, expected_norm


def test_rank_0_on_the_second_node_hosts_the_rendezvous_the_other_rank_dials(two_nodes):
    report = two_nodes[0]
    (node_a, ip_a), (node_b, ip_b) = report["node_a"], report["node_b"]
    rank0, rank1 = report["placement"]
    assert (rank0["node"], rank1["node"]) == (node_b, node_a)  # rank 0 away from the controller's node
    assert report["head"] == node_a and report["controller_ip"] == ip_a
    assert ip_b == SECOND_NODE_IP != ip_a  # the nodes' addresses tell them apart
    assert rank0["ip"] == SECOND_NODE_IP
    host, port = report["rendezvous"]
    assert host == SECOND_NODE_IP  # rank 0's own node, not the controller's
    assert rank0["rendezvous"] == rank1["rendezvous"] == f"{SECOND_NODE_IP}:{port}"  # what rank 1 dialed


def test_a_policy_split_over_two_nodes_makes_the_one_process_update(two_nodes):
    report, exported, expected, expected_norm = two_nodes
    assert _max_gap(exported, expected) <= WEIGHT_ATOL
    assert report["grad_norm"] == [pytest.approx(expected_norm, rel=NORM_RTOL)] * 2


def test_output_folder_check_does_nothing_on_one_node(two_nodes):
    assert two_nodes[0]["one_node_passed"]


def test_output_folder_check_passes_when_both_nodes_share_it_and_leaves_nothing(two_nodes):
    report = two_nodes[0]
    assert report["shared_passed"]
    assert report["shared_left"] == []


def test_output_folder_check_names_the_nodes_that_do_not_share_it(two_nodes):
    report = two_nodes[0]
    (_, ip_a), (_, ip_b) = report["node_a"], report["node_b"]
    message = report["not_shared_error"]
    assert message is not None
    assert message.startswith("train.output_dir (")  # both nodes' views of it, as they differ
    assert f"{ip_a} (node " in message and f"{ip_b} (node " in message
    assert f"{ip_b} (node {report['node_b'][0][:8]}) does not see the files written by {ip_a}" in message
    assert f"{ip_a} (node {report['node_a'][0][:8]}) does not see the files written by {ip_b}" in message
    assert "a filesystem every node mounts at the same path" in message
