"""The torchrun argv of a DDP node, as the operator and the local backend build it (no torch needed)."""

import subprocess
import sys

import pytest

from kubetrain.api import from_spec_dict
from kubetrain.shared.launch import torchrun_command


def spec(**ddp):
    return from_spec_dict("job", {"mode": "DDP", "ddp": ddp}).spec


def test_node_0_hosts_the_rendezvous_and_every_flag_comes_from_the_spec():
    argv = torchrun_command(spec(nodes=3, procsPerNode=2, maxRestarts=5), 0, "job-ddp-0.job-ddp:29400", "uid-1")
    assert argv == [
        "python", "-m", "kubetrain.trainer.ddp.agent",
        "--nnodes", "3", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "job-ddp-0.job-ddp:29400", "--rdzv-id", "uid-1",
        "--rdzv-conf", "is_host=true", "--max-restarts", "5",
        "-m", "kubetrain.trainer", "ddp",
    ]


def test_other_nodes_join_as_clients_and_can_pin_their_address():
    argv = torchrun_command(spec(nodes=2), 1, "127.0.0.1:29400", "j", python="/venv/bin/python",
                            local_addr="127.0.0.1")
    assert argv[0] == "/venv/bin/python"
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=false"
    assert argv[argv.index("--local-addr") + 1] == "127.0.0.1"
    assert argv[-3:] == ["-m", "kubetrain.trainer", "ddp"]


@pytest.mark.parametrize(
    "node_rank, endpoint, mode, message",
    [
        (2, "h:1", "DDP", "node_rank 2 is outside spec.ddp.nodes (2)"),
        (-1, "h:1", "DDP", "node_rank -1 is outside spec.ddp.nodes (2)"),
        (0, "h", "DDP", "rdzv_endpoint: expected 'host:port', got 'h'"),
        (0, ":29400", "DDP", "rdzv_endpoint: expected 'host:port', got ':29400'"),
        (0, "h:1", "Single", "spec.mode: torchrun_command needs mode DDP, got 'Single'"),
    ],
    ids=["node past the end", "negative node", "no port", "no host", "not DDP"],
)
def test_bad_arguments_are_refused_with_their_values(node_rank, endpoint, mode, message):
    job_spec = spec(nodes=2) if mode == "DDP" else from_spec_dict("job", {"mode": mode}).spec
    with pytest.raises(ValueError) as err:
        torchrun_command(job_spec, node_rank, endpoint, "j")
    assert str(err.value) == message


def test_the_control_plane_builds_the_command_without_importing_torch():
    code = (
        "import sys; from kubetrain.shared.launch import torchrun_command, rank_replica; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(rank_replica(3))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ddp-3"
