"""common.partitions on synthetic labels: determinism, coverage, skew and each scheme's own promise."""

from __future__ import annotations

import numpy as np
import pytest

from common import partitions as P

C, PER_CLASS, K = 10, 200, 10
LABELS = np.repeat(np.arange(C), PER_CLASS)
# 40 owners of uneven size (natural ids), independent of the labels.
GROUPS = np.random.default_rng(7).integers(0, 40, size=len(LABELS))

SCHEMES = {
    "iid": dict(),
    "dirichlet": dict(alpha=0.5),
    "pathological": dict(classes_per_client=2),
    "clusters": dict(num_clusters=3),
    "clusters-dirichlet": dict(num_clusters=3, cluster_alpha=1.0, cluster_sizes="fedmerge"),
    "natural": dict(groups=GROUPS),
    "feddual": dict(alpha=0.1),
}


def run(scheme: str, seed: int = 0, k: int = K, labels: np.ndarray = LABELS, **over) -> P.Parts:
    return P.partition(scheme.split("-")[0], labels, k, seed, **{**SCHEMES[scheme], **over})


def skew(parts: P.Parts, labels: np.ndarray = LABELS) -> float:
    """Mean total-variation distance between the clients' label distributions and the global one."""
    glob = np.bincount(labels, minlength=C) / len(labels)
    return float(np.mean([0.5 * np.abs(np.bincount(labels[p], minlength=C) / len(p) - glob).sum() for p in parts]))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fixed_by_the_seed_and_well_formed(scheme):
    a, b, c = run(scheme, 3), run(scheme, 3), run(scheme, 4)
    assert len(a) == K and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    for p in a:
        assert p.dtype == np.int64 and len(p) > 0 and np.all(np.diff(p) > 0)  # sorted, no repeats within a client


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "pathological", "clusters", "clusters-dirichlet"])
def test_every_sample_in_exactly_one_partition(scheme):
    merged = np.concatenate(run(scheme))
    np.testing.assert_array_equal(np.sort(merged), np.arange(len(LABELS)))


def test_dirichlet_tops_up_small_clients_where_redrawing_would_not_end():
    """The Feddle protocol on Animal-MNIST: 7000 samples, 100 clients, Dir(0.1). flwr-datasets'
    re-draw loop gives up here; the top-up gives every client 10 samples and keeps the skew."""
    labels = np.repeat(np.arange(C), 700)
    parts = run("dirichlet", labels=labels, k=100, alpha=0.1)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() == 10 and sizes.sum() == len(labels)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
    classes = [len(np.unique(labels[p])) for p in parts]
    assert np.mean(classes) < 5 and skew(parts, labels) > 0.6


def test_iid_is_balanced_and_lower_alpha_is_more_skewed():
    assert {len(p) for p in run("iid")} == {len(LABELS) // K}
    assert skew(run("iid")) < 0.1
    for scheme in ("dirichlet", "feddual"):
        mild, strong = skew(run(scheme, alpha=10.0)), skew(run(scheme, alpha=0.1))
        assert mild < 0.2 < strong, (scheme, mild, strong)
    within_mild = skew(run("clusters", cluster_alpha=100.0))
    within_strong = skew(run("clusters", cluster_alpha=0.05))
    assert within_mild < within_strong


@pytest.mark.parametrize("c", [1, 2, 3, 10])
def test_pathological_clients_hold_exactly_c_classes_and_classes_are_split_evenly(c):
    parts = run("pathological", classes_per_client=c)
    assert all(len(np.unique(LABELS[p])) == c for p in parts)
    holders = np.bincount(np.concatenate([np.unique(LABELS[p]) for p in parts]), minlength=C)
    assert holders.min() >= 1 and holders.max() - holders.min() <= 1  # every class held, balanced
    for cls in range(C):  # a class's samples split evenly (±1) among its holders
        sizes = [np.sum(LABELS[p] == cls) for p in parts if np.any(LABELS[p] == cls)]
        assert sum(sizes) == PER_CLASS and max(sizes) - min(sizes) <= 1


def test_pathological_with_too_few_slots_leaves_unheld_classes_out():
    parts = run("pathological", k=3, classes_per_client=2)  # 6 of 10 classes held
    held = np.unique(LABELS[np.concatenate(parts)])
    assert len(held) == 6 and len(np.concatenate(parts)) == 6 * PER_CLASS
    with pytest.raises(ValueError, match="classes-per-client"):
        run("pathological", classes_per_client=C + 1)


@pytest.mark.parametrize("scheme", ["clusters", "clusters-dirichlet"])
def test_clusters_clients_stay_inside_one_disjoint_class_group(scheme):
    parts = run(scheme, k=12)
    # Every client holds all classes of its group (IID, or Dirichlet with the >= 1 fix-up).
    sets = [tuple(np.unique(LABELS[p])) for p in parts]
    groups = list(dict.fromkeys(sets))  # in order of first appearance
    assert len(groups) == 3 and sorted(sum(groups, ())) == list(range(C))  # disjoint groups covering all classes
    ids = [groups.index(s) for s in sets]
    assert ids == sorted(ids)  # a cluster's clients are one contiguous block of partition ids


def test_clusters_sizes_and_errors():
    sizes = P._fedmerge_cluster_sizes(50, 5, np.random.default_rng(0))
    assert sizes.sum() == 50 and sizes.min() >= 2
    assert P._fedmerge_cluster_sizes(10, 5, np.random.default_rng(0)).tolist() == [2] * 5
    with pytest.raises(ValueError, match="num-clusters"):
        run("clusters", num_clusters=K + 1)
    with pytest.raises(ValueError, match="sizes"):
        run("clusters", cluster_sizes="odd")


def test_natural_partitions_are_whole_sampled_owners():
    parts = run("natural")
    owners = [np.unique(GROUPS[p]) for p in parts]
    assert all(len(o) == 1 for o in owners)
    chosen = np.array([o[0] for o in owners])
    assert len(np.unique(chosen)) == K and np.all(np.diff(chosen) > 0)
    for o, p in zip(chosen, parts):
        np.testing.assert_array_equal(p, np.flatnonzero(o == GROUPS))
    everyone = run("natural", k=40)  # all owners: every sample used, the seed plays no part
    assert len(np.concatenate(everyone)) == len(LABELS)
    with pytest.raises(ValueError, match=r"'num-clients' = 41 .*at most the data's 40 natural owners"):
        run("natural", k=41)
    with pytest.raises(ValueError, match="natural owners"):
        run("natural", groups=None)


def test_feddual_every_client_has_every_class_and_sizes_follow_the_reference_rule():
    parts = run("feddual", k=20, alpha=0.01)
    assert all(np.array_equal(np.unique(LABELS[p]), np.arange(C)) for p in parts)
    sizes = np.array([[np.sum(LABELS[p] == c) for c in range(C)] for p in parts])
    props = np.random.default_rng([0, 1]).dirichlet(np.full(20, 0.01), size=C)  # the draw the function makes first
    np.testing.assert_array_equal(sizes, np.maximum((props * PER_CLASS).astype(int), 1).T)
    merged = np.concatenate(parts)
    assert len(merged) > len(np.unique(merged))  # overlap: min-1 samples are drawn independently per client


def test_label_noise_flips_exactly_the_asked_fraction_to_other_classes():
    noisy, flipped = P.label_noise(LABELS, 0.1, C, seed=5)
    assert len(flipped) == round(0.1 * len(LABELS)) and np.all(np.diff(flipped) > 0)
    assert np.all(noisy[flipped] != LABELS[flipped]) and noisy.min() >= 0 and noisy.max() < C
    keep = np.setdiff1d(np.arange(len(LABELS)), flipped)
    np.testing.assert_array_equal(noisy[keep], LABELS[keep])
    again, other = P.label_noise(LABELS, 0.1, C, seed=5), P.label_noise(LABELS, 0.1, C, seed=6)
    np.testing.assert_array_equal(again[0], noisy)
    assert not np.array_equal(other[1], flipped)
    assert len(P.label_noise(LABELS, 0.0, C, 5)[1]) == 0
    assert len(P.label_noise(LABELS[:7], 0.5, C, 5)[1]) == round(3.5)  # Python's round: 4
    with pytest.raises(ValueError):
        P.label_noise(LABELS, 1.5, C, 5)


def test_unknown_scheme_and_too_many_clients():
    with pytest.raises(KeyError, match="unknown partitioner"):
        P.partition("shards", LABELS, K, 0)
    with pytest.raises(ValueError, match=r"'num-clients' = \d+ .*at most the 5 training samples"):
        P.partition("iid", LABELS[:5], K, 0)
    assert set(P.PARTITIONERS) == {"iid", "dirichlet", "pathological", "clusters", "natural", "feddual"}


def test_picked_cluster_classes_keep_the_codes_structure_on_ten_classes():
    """FedMerge's code picks 30 of CIFAR-100's classes per cluster from a refilled pool: clusters 1–3 disjoint,
    4–5 reuse classes. 3 of 10 per cluster keeps that on Fashion-MNIST; shared classes go to both clusters."""
    labels = np.repeat(np.arange(10), 60)
    parts = P.clusters(labels, 20, 5, seed=3, alpha=10.0, sizes="fedmerge", classes_per_cluster=3)
    rng = np.random.default_rng([3, 1])  # the partitioners' stream: the groups are drawn first, then the sizes
    groups = P._picked_groups(np.arange(10), 5, 3, rng)
    block = P._fedmerge_cluster_sizes(20, 5, rng)
    assert all(len(g) == 3 for g in groups)
    assert len(set(np.concatenate(groups[:3]))) == 9  # the first three are disjoint
    owner = np.repeat(np.arange(5), block)  # client -> cluster (id blocks)
    for client, part in enumerate(parts):
        assert set(labels[part]) <= set(groups[owner[client]])
    held = np.concatenate(parts)
    assert len(held) == len(np.unique(held))  # no sample twice
    picked = set(np.concatenate(groups))
    assert set(labels[held]) == picked and len(held) == 60 * len(picked)  # every sample of a picked class
    for cls in picked:  # a class several clusters hold reaches clients of each of them
        holders = {owner[c] for c, part in enumerate(parts) if cls in set(labels[part])}
        assert holders == {g for g, group in enumerate(groups) if cls in group}
