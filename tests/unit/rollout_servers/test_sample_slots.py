"""Generation capacity in samples: what groups fit, and slots freed sample by sample."""

from rollout_servers.sample_slots import SampleSlots

N = 4  # samples per group


def test_groups_fit_into_the_free_sample_slots():
    slots = SampleSlots(capacity=10)
    assert slots.free_groups(N, running_groups=0) == 2  # 10 // 4
    first = slots.claim(N)
    assert (slots.in_use, slots.free_groups(N, running_groups=1)) == (4, 1)
    slots.claim(N)
    assert (slots.in_use, slots.free_groups(N, running_groups=2)) == (8, 0)
    for _ in range(3):  # three of the first group's samples finish, its longest still generates
        first.sample_done()
    assert (slots.in_use, slots.free_groups(N, running_groups=2)) == (5, 1), "finished samples free their slots"


def test_a_group_larger_than_the_capacity_runs_alone():
    slots = SampleSlots(capacity=2)
    assert slots.free_groups(N, running_groups=0) == 1
    slots.claim(N)
    assert (slots.in_use, slots.free_groups(N, running_groups=1)) == (4, 0)


def test_a_claim_frees_each_slot_once_and_the_rest_on_release():
    slots = SampleSlots(capacity=8)
    claim = slots.claim(N)
    for _ in range(N + 2):  # more finishes than samples (a stopped sample reported twice) free nothing extra
        claim.sample_done()
    assert slots.in_use == 0
    other = slots.claim(N)
    other.sample_done()
    other.release()
    other.release()
    assert slots.in_use == 0
