"""A job runs one trainer for its whole life: the engine records it (status.trainer) and the job's later pods are
rendered with it, whichever operator renders them; a trainer outside the operator's window (n-1) is warned of."""

from __future__ import annotations

import pytest

from kubetrain.shared import __version__
from kubetrain.shared.timestamps import iso
from kubetrain.api import from_object, versions
from kubetrain.api.status import TrainerImage, read_status, to_dict
from kubetrain.engine import engine
from kubetrain.engine.children import Settings
from kubetrain.engine.reconcile import PodObservation as Pod, reconcile

T0 = 1_800_000_000.0
OLD = "kubetrain/trainer:0.1.0"  # what a 0.1.0 operator's pods run
NEW = Settings(image=f"kubetrain/trainer:{__version__}")  # the upgraded operator's


def job(mode="ParameterServer", **spec):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "generation": 1}, "spec": {"mode": mode, **spec}})


def images(act) -> dict[str, str]:
    """The trainer image of every pod (and StatefulSet) the round renders, by object name."""
    out = {}
    for obj in act.create + act.replace:
        spec = obj["spec"]["template"]["spec"] if obj["kind"] == "StatefulSet" else obj["spec"] if obj["kind"] == "Pod" \
            else None
        if spec is not None:
            out[obj["metadata"]["name"]] = next(c["image"] for c in spec["containers"] if c["name"] == "trainer")
    return out


def old_status(**memory) -> dict:
    """A running job's status as a 0.1.0 operator wrote it: no trainer."""
    return {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0, **memory}}


def test_a_new_job_records_the_operators_trainer_and_its_pods_run_it():
    act = reconcile(job(), "u", "tok", {}, {}, T0, settings=NEW)
    assert to_dict(act.status)["trainer"] == {"image": NEW.image, "version": __version__}
    assert set(images(act).values()) == {NEW.image} and len(images(act)) == 3
    assert not [e for e in act.events if e[1] == versions.SKEW_REASON]


def test_a_job_an_older_operator_started_records_the_image_its_running_pods_run():
    pods = {n: Pod(n, "Running", image=OLD) for n in ("ps-0", "worker-0", "worker-1")}
    act = reconcile(job(), "u", "tok", pods, old_status(), T0 + 10, settings=NEW, existing=set())
    assert to_dict(act.status)["trainer"] == {"image": OLD, "version": "0.1.0"}


def test_a_replica_restarted_after_an_upgrade_runs_the_trainer_its_peers_run():
    """A 0.1.0 ParameterServer job's worker dies after the operator was upgraded: its replacement is rendered
    with 0.1.0's trainer, the one its shard and the other worker run (they talk gRPC to each other), not with
    the new operator's."""
    pods = {n: Pod(n, "Running", image=OLD) for n in ("ps-0", "worker-0", "worker-1")}
    pods["worker-1"] = Pod("worker-1", "Failed", exit_code=137, image=OLD)
    act = reconcile(job(), "u", "tok", pods, old_status(), T0 + 10, settings=NEW, existing=set())
    assert act.delete_pods == ["j-worker-1"]
    del pods["worker-1"]
    again = reconcile(job(), "u", "tok", pods, act.status, T0 + 10.5, settings=NEW, existing=set())
    assert images(again) == {"j-worker-1": OLD}


def test_the_record_stands_once_made_whatever_the_pods_run_later():
    status = {**old_status(), "trainer": {"image": OLD, "version": "0.1.0"}}
    pods = {"ps-0": Pod("ps-0", "Running", image="someone/else:9"), "worker-0": Pod("worker-0", "Running")}
    act = reconcile(job(), "u", "tok", pods, status, T0 + 10, settings=NEW, existing=set())
    assert to_dict(act.status)["trainer"] == {"image": OLD, "version": "0.1.0"}
    assert images(act) == {"j-worker-1": OLD}


def test_an_old_job_with_no_pod_to_see_records_the_operators_own_trainer():
    """Suspended (or queued) when the operator was upgraded: nothing runs, so nothing mixes; it resumes on the
    new operator's trainer (and its checkpoints with it, docs/operating.md#upgrades)."""
    act = reconcile(job(), "u", "tok", {}, old_status(), T0 + 10, settings=NEW, existing=set())
    assert to_dict(act.status)["trainer"]["image"] == NEW.image


def test_a_ddp_statefulset_rendered_again_at_a_resize_keeps_the_jobs_trainer():
    """A resize renders the StatefulSet again (engine.RESIZED_KINDS): its template keeps the recorded trainer, so
    the pods it makes at the new size run what the job ran before."""
    spec = {"ddp": {"nodes": 2, "minNodes": 1, "maxNodes": 3}, "replicas": 3}
    status = {**old_status(size=2), "trainer": {"image": OLD, "version": "0.1.0"}}
    act = reconcile(job("DDP", **spec), "u", "tok", {}, status, T0 + 10, settings=NEW, existing=set())
    assert act.replace, "the resize renders the StatefulSet again"
    assert images(act) == {"j-ddp": OLD}


def test_spec_image_comes_before_the_record():
    status = {**old_status(), "trainer": {"image": OLD, "version": "0.1.0"}}
    act = reconcile(job(image="me/mine:1"), "u", "tok", {}, status, T0 + 10, settings=NEW, existing=set())
    assert set(images(act).values()) == {"me/mine:1"}


def test_a_job_with_its_own_image_records_it_and_no_version():
    """spec.image: the user's image (FROM the trainer, which one it does not say): no version, so no skew."""
    act = reconcile(job(image="me/mine:1"), "u", "tok", {}, {}, T0, settings=NEW)
    assert to_dict(act.status)["trainer"]["image"] == "me/mine:1"
    assert not to_dict(act.status)["trainer"].get("version")
    pods = {n: Pod(n, "Running", image="me/mine:1") for n in ("ps-0", "worker-0", "worker-1")}
    later = reconcile(job(image="me/mine:1"), "u", "tok", pods, old_status(), T0 + 10, settings=NEW, existing=set())
    assert to_dict(later.status)["trainer"]["image"] == "me/mine:1"


def minor(offset: int) -> str:
    """The version `offset` minor versions from this one (0.2.0, -1: 0.1.0; +1: 0.3.0)."""
    v = versions.parse(__version__)
    assert v is not None and v.minor + offset >= 0
    return f"{v.major}.{v.minor + offset}.0"


@pytest.mark.parametrize(("name", "trainer", "warned"), [
    ("the operator's own minor version", __version__, False),
    ("n-1: the release before", minor(-1), False),
    ("n-2: older than the window", minor(-2), True),
    ("newer than the operator: after a rollback", minor(+1), True),
    ("a user's image: unknown", "", False),
])
def test_a_trainer_outside_the_window_is_warned_of_once_per_operator_version(name, trainer, warned):
    image = f"kubetrain/trainer:{trainer}" if trainer else "me/mine:1"
    status = {**old_status(), "trainer": {"image": image, "version": trainer}}
    pods = {"single-0": Pod("single-0", "Running", image=image)}
    operator = TrainerImage(NEW.image, __version__)
    first = engine.step(job("Single"), status, pods, T0 + 10, trainer=operator)
    skews = [e for e in first.actions.events if e[1] == versions.SKEW_REASON]
    assert len(skews) == (1 if warned else 0), (name, first.actions.events)
    assert first.status.state == "Running"  # it runs on
    if warned:
        assert skews[0][0] == "Warning" and trainer in skews[0][2] and "n-1" in skews[0][2]
        assert first.status.memory.skew_warned == __version__
    second = engine.step(job("Single"), first.status, pods, T0 + 20, trainer=operator)
    assert not [e for e in second.actions.events if e[1] == versions.SKEW_REASON], name
    if warned:  # an operator of another version (upgraded again) warns again: the memory names the one that did
        again = read_status(to_dict(second.status))
        again.memory.skew_warned = "0.0.0"
        third = engine.step(job("Single"), again, pods, T0 + 30, trainer=operator)
        assert [e[1] for e in third.actions.events].count(versions.SKEW_REASON) == 1


def test_a_local_runs_record_follows_the_installed_kubetrain():
    """A local run's processes run whatever kubetrain is installed: its record (image "") says so each round,
    resumed by a newer kubetrain or not."""
    local = TrainerImage(image="", version=__version__)
    status = {**old_status(), "trainer": {"image": "", "version": "0.1.0"}}
    done = engine.step(job("Single"), status, {}, T0 + 10, trainer=local)
    assert to_dict(done.status)["trainer"] == {"image": "", "version": __version__}
    assert not [e for e in done.actions.events if e[1] == versions.SKEW_REASON]


def test_no_driver_trainer_records_nothing():
    done = engine.step(job(), {}, {}, T0)
    assert done.status.trainer is None


def test_a_finished_job_records_nothing():
    status = {"state": "Succeeded", "startTime": iso(T0), "completionTime": iso(T0 + 5)}
    act = reconcile(job(), "u", "tok", {}, status, T0 + 10, settings=NEW, existing=set())
    assert "trainer" not in to_dict(act.status)
