"""Which GPUs each role gets on one machine: the automatic split for 1, 2, 4 and 8 visible GPUs with
tensor-parallel 1 and 2, mixed plans (a server beside the learner, the others on GPUs of their own), explicit lists,
the refusals (each naming its keys), and the weight-sync backend and memory share each server's place gives it."""

import logging
import os
import re
import subprocess
import sys

import pytest

from asyncrl.config import load_config
from asyncrl.gpu_ids import pin
from asyncrl.placement import (PlacementError, Plan, as_overrides, check_ray_placement, place_local_job, plan_placement,
                               server_places, servers_on_learner_gpu, weight_sync_backend, write_lists)


def config(*overrides: str):
    return load_config(None, list(overrides))


def test_no_gpu_no_plan():
    assert plan_placement(config(), []) is None


def test_a_command_started_alone_without_lists_uses_what_it_sees():
    # e.g. `asyncrl learner` pinned by the user with CUDA_VISIBLE_DEVICES: no plan, nothing changed
    assert plan_placement(config(), [0], automatic=False) is None
    assert plan_placement(config("learner.gpus=[1]"), [0, 1], automatic=False).learner == (1,)


def test_the_run_hands_its_plan_to_the_two_commands_as_lists_they_apply_as_given():
    for visible, servers in (([0], 2), ([0, 1, 2], 2), ([0, 1], 2)):
        overrides = [f"rollout.num_servers={servers}"]
        plan = plan_placement(config(*overrides), visible)
        assert plan_placement(config(*overrides, *as_overrides(plan)), visible, automatic=False) == plan


def test_one_gpu_is_shared_by_the_learner_and_every_server():
    plan = plan_placement(config("rollout.num_servers=2"), [0])
    assert plan.learner == (0,) and plan.servers == ((0,), (0,)) and plan.colocated
    assert weight_sync_backend(config(), plan) == "ipc"  # auto: the servers map the learner's buffer on that GPU
    assert weight_sync_backend(config("rollout.weight_sync.backend=gloo"), plan) == "gloo"  # an explicit choice stays


def test_colocated_synchronous_ranks_each_share_their_gpu_with_their_engine():
    # the async job would give its server a GPU of its own here; each synchronous rank runs its engine beside it
    colocated = ("learner.mode=synchronous", "learner.nproc=2", "buffer.batch_groups=2")
    for visible in ([0, 1], [0, 1, 2, 3]):
        plan = plan_placement(config(*colocated), visible)
        assert plan.learner == (0, 1) and plan.servers == ((0,),) and plan.colocated
        assert plan_placement(config(*colocated, *as_overrides(plan)), visible, automatic=False) == plan
    assert not plan_placement(config("learner.nproc=2"), [0, 1, 2]).colocated  # async: the server on a GPU of its own
    greedy = config(*colocated, "rollout.engine.gpu_memory_utilization=0.9")
    (place,) = server_places(greedy, plan_placement(greedy, [0, 1, 2, 3]))
    assert place.with_learner and place.backend == "ipc" and place.gpu_memory_utilization == 0.4  # lowered beside it


@pytest.mark.parametrize(("visible", "servers", "tp", "nproc", "expected_servers", "expected_learner"), [
    (2, 1, 1, 1, ((0,),), (1,)),
    (4, 3, 1, 1, ((0,), (1,), (2,)), (3,)),
    (4, 1, 2, 2, ((0, 1),), (2, 3)),
    (8, 3, 2, 2, ((0, 1), (2, 3), (4, 5)), (6, 7)),
    (8, 6, 1, 2, ((0,), (1,), (2,), (3,), (4,), (5,)), (6, 7)),
])
def test_automatic_split(visible, servers, tp, nproc, expected_servers, expected_learner):
    plan = plan_placement(config(f"rollout.num_servers={servers}", f"rollout.engine.tensor_parallel_size={tp}",
                                 f"learner.nproc={nproc}"), list(range(visible)))
    assert plan.servers == expected_servers and plan.learner == expected_learner and not plan.colocated
    assert weight_sync_backend(config(), plan) == "auto"  # NCCL where the roles have GPUs of their own
    with pytest.raises(PlacementError, match="rollout.weight_sync.backend=ipc"):  # IPC needs one GPU for both
        weight_sync_backend(config("rollout.weight_sync.backend=ipc"), plan)


def test_the_physical_ids_of_visible_gpus_are_kept():
    plan = plan_placement(config(), [3, 5])
    assert plan.servers == ((3,),) and plan.learner == (5,)


def test_explicit_lists_and_the_other_role_takes_what_is_left():
    plan = plan_placement(config("learner.gpus=[0]", "rollout.num_servers=2"), list(range(4)))
    assert plan.learner == (0,) and plan.servers == ((1,), (2,))
    plan = plan_placement(config("rollout.gpus=[2,3]", "rollout.engine.tensor_parallel_size=2"), list(range(4)))
    assert plan.servers == ((2, 3),) and plan.learner == (0,)
    shared = plan_placement(config("learner.gpus=[1]", "rollout.gpus=[1]"), list(range(2)))
    assert shared.colocated and shared.learner == (1,) and shared.servers == ((1,),)
    two_on_one = plan_placement(config("rollout.gpus=[0,0]", "rollout.num_servers=2"), list(range(2)))
    assert two_on_one.servers == ((0,), (0,)) and two_on_one.learner == (1,)  # servers may share a GPU


def test_two_gpus_and_two_servers_give_each_gpu_a_server_and_one_of_them_the_learner():
    two = config("rollout.num_servers=2", "rollout.engine.gpu_memory_utilization=0.85")
    plan = plan_placement(two, [0, 1])
    assert plan == Plan(learner=(1,), servers=((0,), (1,)))
    assert [plan.shares(0), plan.shares(1)] == [False, True] and plan.sharing == 1
    assert plan.describe() == "GPU plan: learner → [1]; server-0 → [0], server-1 → [1] (with the learner) (mixed)"
    places = server_places(two, plan)
    # the server beside the learner reads its buffer (ipc) and takes at most 0.4 of the GPU; the other keeps its share
    assert [(p.gpus, p.backend, p.gpu_memory_utilization, p.with_learner) for p in places] == [
        ((0,), "nccl", 0.85, False), ((1,), "ipc", 0.4, True)]
    assert weight_sync_backend(two, plan) == "auto"  # the job's default: what the servers apart receive on
    gloo = config("rollout.num_servers=2", "rollout.weight_sync.backend=gloo")
    assert [place.backend for place in server_places(gloo, plan)] == ["gloo", "gloo"]  # works beside and apart


@pytest.mark.parametrize(("visible", "overrides", "expected"), [
    (2, ["rollout.num_servers=2"], Plan((1,), ((0,), (1,)))),  # auto: the servers outnumber the GPUs left
    (2, ["rollout.num_servers=3"], Plan((1,), ((0,), (1,), (1,)))),
    (2, [], Plan((1,), ((0,),))),  # auto: every server fits on a GPU of its own
    (2, ["rollout.placement=shared"], Plan((0,), ((0,),))),  # at least one beside: GPU 1 left unused
    (3, ["rollout.num_servers=2", "rollout.placement=shared"], Plan((1,), ((0,), (1,)))),
    (4, ["rollout.num_servers=3", "learner.nproc=2"], Plan((2, 3), ((0,), (1,), (2,)))),  # beside the first rank
    (2, ["learner.gpus=[0]", "rollout.num_servers=2"], Plan((0,), ((1,), (0,)))),
    (2, ["learner.gpus=[1]", "rollout.gpus=[0,1]", "rollout.num_servers=2"], Plan((1,), ((0,), (1,)))),  # listed
])
def test_mixed_and_shared_plans(visible, overrides, expected):
    assert plan_placement(config(*overrides), list(range(visible))) == expected


def test_the_apart_placement_keeps_the_old_split_and_refuses_sharing():
    assert plan_placement(config("rollout.placement=apart"), [0, 1]) == Plan((1,), ((0,),))
    for overrides, visible in ((["rollout.num_servers=2"], 2), ([], 1)):
        with pytest.raises(PlacementError, match="need .* GPUs and .* are visible.*rollout.placement=shared"):
            plan_placement(config("rollout.placement=apart", *overrides), list(range(visible)))
    with pytest.raises(PlacementError, match="rollout.placement=apart: .* puts a server on the learner's GPU"):
        plan_placement(config("rollout.placement=apart", "learner.gpus=[1]", "rollout.gpus=[1]"), [0, 1])
    with pytest.raises(PlacementError, match="rollout.placement=shared: .* puts no server on the learner's GPU"):
        plan_placement(config("rollout.placement=shared", "learner.gpus=[1]", "rollout.gpus=[0]"), [0, 1])


@pytest.mark.parametrize(("overrides", "named"), [
    # NCCL cannot reach the server beside the learner: the advice names what reaches both servers
    (["rollout.weight_sync.backend=nccl"], "rollout.weight_sync.backend=nccl: server-1 on [1] shares the learner's "
                                           "GPU"),
    (["rollout.weight_sync.backend=ipc"], "rollout.weight_sync.backend=ipc: server-0 on [0] has GPUs of its own"),
])
def test_a_mixed_plan_refuses_a_backend_one_of_its_servers_cannot_receive_on(overrides, named):
    mixed = config("rollout.num_servers=2", *overrides)
    with pytest.raises(PlacementError, match=re.escape(named)) as refused:
        server_places(mixed, plan_placement(mixed, [0, 1]))
    assert str(refused.value).endswith("use gloo or auto")


def test_ipc_reaches_a_server_only_on_the_first_learner_ranks_gpu():
    listed = config("learner.nproc=2", "learner.gpus=[0,1]", "rollout.num_servers=2", "rollout.gpus=[0,1]")
    with pytest.raises(PlacementError, match=re.escape("server-1 on [1] shares the learner's GPU")):
        server_places(listed, plan_placement(listed, [0, 1]))
    listed.rollout.weight_sync.backend = "gloo"  # through CPU memory: any GPU will do
    assert [place.backend for place in server_places(listed, plan_placement(listed, [0, 1]))] == ["gloo", "gloo"]


@pytest.mark.parametrize(("overrides", "visible", "named"), [
    (["rollout.num_servers=2", "rollout.placement=apart"], 2, "rollout.num_servers"),  # 2 servers + 1 rank on 2 GPUs
    (["learner.nproc=2", "rollout.placement=apart"], 2, "learner.nproc"),
    (["learner.nproc=2"], 1, "learner.nproc"),  # colocated: one learner rank only
    (["rollout.num_servers=2", "rollout.engine.tensor_parallel_size=2"], 3, "rollout.engine.tensor_parallel_size"),
    (["rollout.engine.tensor_parallel_size=2"], 1, "rollout.engine.tensor_parallel_size"),
    (["learner.gpus=[0,1]"], 4, "learner.gpus"),  # two GPUs for one rank
    (["learner.gpus=[1,1]", "learner.nproc=2"], 4, "learner.gpus"),  # two ranks on one GPU
    (["rollout.gpus=[1,1]", "rollout.engine.tensor_parallel_size=2"], 4, "rollout.gpus"),  # twice in one server
    (["learner.gpus=[7]"], 4, "learner.gpus"),  # not visible
    (["learner.gpus=[1]", "rollout.gpus=[1,2]", "rollout.engine.tensor_parallel_size=2"], 4, "shares some"),
    (["learner.gpus=[0]"], 0, "learner.gpus"),  # no GPU at all
])
def test_impossible_plans_are_refused_naming_the_keys(overrides, visible, named):
    with pytest.raises(PlacementError) as refused:
        plan_placement(config(*overrides), list(range(visible)))
    assert named in str(refused.value)


def test_nccl_is_refused_where_the_roles_share_a_gpu():
    plan = plan_placement(config(), [0])
    with pytest.raises(PlacementError, match="rollout.weight_sync.backend=nccl"):
        weight_sync_backend(config("rollout.weight_sync.backend=nccl"), plan)


@pytest.mark.parametrize(("backend", "title"), [("ipc", "CUDA IPC"), ("nccl", "NCCL")])
def test_a_gpu_backend_is_refused_where_no_gpu_is_visible(monkeypatch, backend, title):
    monkeypatch.setattr("asyncrl.placement.visible_gpus", lambda: [])
    with pytest.raises(PlacementError, match=f"rollout.weight_sync.backend={backend}: {title} needs a GPU and none is "
                                             "visible; use gloo or auto"):
        place_local_job(config(f"rollout.weight_sync.backend={backend}"), logging.getLogger(__name__))


def test_colocated_servers_leave_the_learner_most_of_the_gpu(monkeypatch, caplog):
    monkeypatch.setattr("asyncrl.placement.visible_gpus", lambda: [3])
    greedy = config("rollout.num_servers=2", "rollout.engine.gpu_memory_utilization=0.85")
    with caplog.at_level(logging.INFO):
        plan = place_local_job(greedy, logging.getLogger(__name__), automatic=True)
    shares = [place.gpu_memory_utilization for place in server_places(greedy, plan)]
    assert shares == [0.2, 0.2]  # 0.4 of the GPU for the two servers together
    assert "rollout.engine.gpu_memory_utilization=0.85 × 2 server(s) on the learner's GPU" in caplog.text
    assert "server-1 beside the learner: weights by ipc, gpu_memory_utilization 0.2" in caplog.text  # each place logged
    modest = config("rollout.num_servers=2", "rollout.engine.gpu_memory_utilization=0.15")
    plan = place_local_job(modest, logging.getLogger(__name__), automatic=True)
    assert [place.gpu_memory_utilization for place in server_places(modest, plan)] == [0.15, 0.15]
    assert modest.rollout.weight_sync.backend == "ipc"
    mixed = config("rollout.num_servers=3", "rollout.engine.gpu_memory_utilization=0.85")
    monkeypatch.setattr("asyncrl.placement.visible_gpus", lambda: [0, 1])
    plan = place_local_job(mixed, logging.getLogger(__name__), automatic=True)
    # only the two servers beside the learner split its 0.4; the one with a GPU of its own keeps its share
    assert [place.gpu_memory_utilization for place in server_places(mixed, plan)] == [0.85, 0.2, 0.2]
    assert mixed.rollout.engine.gpu_memory_utilization == 0.85 and mixed.rollout.weight_sync.backend == "auto"


def test_a_server_takes_its_place_in_its_own_process():
    mixed = config("rollout.num_servers=2", "rollout.engine.gpu_memory_utilization=0.85")
    beside = server_places(mixed, plan_placement(mixed, [0, 1]))[1]
    beside.apply(mixed)
    assert (mixed.rollout.weight_sync.backend, mixed.rollout.engine.gpu_memory_utilization) == ("ipc", 0.4)


def test_a_colocated_learner_knows_the_servers_on_its_gpu():
    shared = config("rollout.num_servers=2", "rollout.engine.gpu_memory_utilization=0.2", "learner.gpus=[1]",
                    "rollout.gpus=[1,1]")
    assert servers_on_learner_gpu(shared) == (2, pytest.approx(0.2))
    apart = config("rollout.engine.gpu_memory_utilization=0.9", "learner.gpus=[1]", "rollout.gpus=[0]")
    assert servers_on_learner_gpu(apart)[0] == 0
    mixed = config("rollout.num_servers=3", "rollout.engine.gpu_memory_utilization=0.85", "learner.gpus=[1]",
                   "rollout.gpus=[0,1,1]")
    assert servers_on_learner_gpu(mixed) == (2, pytest.approx(0.2))  # the two beside it, lowered; not the third


def test_a_plan_written_into_the_config_names_the_servers_beside_the_learner():
    one_gpu = config("rollout.num_servers=1", "rollout.engine.gpu_memory_utilization=0.85")
    plan = plan_placement(one_gpu, [3])
    assert servers_on_learner_gpu(one_gpu)[0] == 0  # no lists: the learner cannot know
    write_lists(one_gpu, plan)
    assert (one_gpu.learner.gpus, one_gpu.rollout.gpus) == ([3], [3])
    assert servers_on_learner_gpu(one_gpu) == (1, pytest.approx(0.4))


@pytest.mark.parametrize(("overrides", "named"), [
    (["learner.gpus=[0]"], "learner.gpus=[0]: under asyncrl launch Ray picks"),
    (["rollout.gpus=[1]"], "rollout.gpus=[1]"),
    (["ray.learner.num_gpus=0.5"], "ray.learner.num_gpus=0.5"),
    (["learner.device=cuda"], "learner.device=cuda with ray.learner.num_gpus=0"),
    (["rollout.weight_sync.backend=ipc"], "rollout.weight_sync.backend=ipc: under asyncrl launch"),
    (["rollout.placement=shared"], "rollout.placement=shared: under asyncrl launch"),
])
def test_ray_placement_follows_the_same_rule_and_refuses_the_rest(overrides, named):
    with pytest.raises(PlacementError, match=re.escape(named)):
        check_ray_placement(config(*overrides))
    check_ray_placement(config("learner.device=cuda", "ray.learner.num_gpus=1", "ray.rollout.num_gpus=1"))  # accepted


def test_pin_limits_what_children_see(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pin((2, 3))
    seen = subprocess.run([sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert seen == "2,3" == os.environ["CUDA_VISIBLE_DEVICES"]


def test_run_refuses_a_plan_before_any_role_starts(tmp_path):
    done = subprocess.run([sys.executable, "-m", "launch.cli", "run", f"run.root_dir={tmp_path}", "run.name=x",
                           "data.train_files=[README.md]", "learner.gpus=[0]"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "learner.gpus: no GPU is visible" in done.stderr
    assert not (tmp_path / "x").exists()  # nothing started, no run directory
