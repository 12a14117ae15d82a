"""Client partitions of a training split, and client label noise.

Pure functions of numpy arrays and a seed: the same arguments give the same partitions on every node,
so a client computes its own partition from the run's spec and its ``partition-id``.
Every partitioner returns one sorted int64 index array per client (``Parts``); unless its docstring
says otherwise, every sample lies in exactly one partition and no partition is empty.

Names for the ``partitioner`` config key (see :data:`PARTITIONERS` and :func:`partition`):
``iid``, ``dirichlet``, ``pathological``, ``clusters``, ``natural``, ``feddual``.

Random streams: the partitioners draw from ``default_rng([seed, 1])`` (the stream the IID shuffle has
always used), :func:`label_noise` from ``default_rng([seed, 4])``; ``[seed, 0]`` (splits),
``[seed, 2]`` (delays), ``[seed, 3]`` (server data), ``[seed, 5, id]`` (a client's held-out parts), ``[seed, 6]``
(the label shift's central split) and ``[seed, 7]`` (``data-fraction``) belong to other modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from common.errors import ConfigError

Parts = tuple[np.ndarray, ...]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, 1])


def _finish(parts: Iterable[np.ndarray], what: str) -> Parts:
    """Sorted int64 index arrays; an empty partition is an error naming the scheme."""
    out = tuple(np.sort(np.asarray(p, dtype=np.int64)) for p in parts)
    if empty := [i for i, p in enumerate(out) if len(p) == 0]:
        raise ConfigError("num-clients", len(out), f"fewer clients or a milder setting: {what} leaves partitions "
                          f"{empty} empty")
    return out


def _check_k(n: int, k: int) -> None:
    if k < 1 or n < k:
        raise ConfigError("num-clients", k, f"at least 1 and at most the {n} training samples")


def _counts(n: int, p: np.ndarray) -> np.ndarray:
    """Split `n` items by proportions `p`: floors, then the largest remainders get one more (sum = n)."""
    raw = n * np.asarray(p, dtype=float) / np.sum(p)
    c = np.floor(raw).astype(np.int64)
    c[np.argsort(c - raw, kind="stable")[: n - c.sum()]] += 1
    return c


def _flwr(partitioner: Any, labels: np.ndarray, order: np.ndarray) -> Parts:
    """Run a flwr-datasets partitioner on an in-memory ``datasets.Dataset`` of (label, index) rows."""
    from datasets import Dataset

    partitioner.dataset = Dataset.from_dict({"label": labels[order].tolist(), "index": order.tolist()})
    return _finish((partitioner.load_partition(i)["index"] for i in range(partitioner.num_partitions)), "flwr")


def iid(labels: np.ndarray, k: int, seed: int) -> Parts:
    """Uniformly random, equal-size (±1) partitions: flwr-datasets ``IidPartitioner`` after a seeded
    shuffle (the partitioner splits in order, so the shuffle lets the seed decide who gets what)."""
    from flwr_datasets.partitioner import IidPartitioner

    _check_k(len(labels), k)
    return _flwr(IidPartitioner(num_partitions=k), labels, _rng(seed).permutation(len(labels)))


def dirichlet(labels: np.ndarray, k: int, alpha: float, seed: int) -> Parts:
    """Label skew, per class proportions over clients from Dir(alpha) (Yurochkin et al. 2019, as in
    Feddle §3.2 and FedMerge "Personal"): for each class one draw p ~ Dir_k(alpha), its samples split
    by p (largest remainders). Then every client is topped up to ``m = min(10, n / (4k))`` samples,
    one random sample at a time taken from the currently largest client.

    The top-up replaces the usual "re-draw until every client has m samples" loop (flwr-datasets'
    ``DirichletPartitioner``, NIID-Bench), which almost never ends for Dir(0.1) over 100 clients with
    ~70 samples each (the Feddle protocol on Animal-MNIST); it moves few samples (docs/methods.md).
    """
    n = len(labels)
    _check_k(n, k)
    rng = _rng(seed)
    owner = np.empty(n, dtype=np.int64)
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        owner[idx] = np.repeat(np.arange(k), _counts(len(idx), rng.dirichlet(np.full(k, alpha))))
    size, m = np.bincount(owner, minlength=k), min(10, max(1, n // (4 * k)))
    while size.min() < m:
        small, large = int(np.argmin(size)), int(np.argmax(size))
        owner[rng.choice(np.flatnonzero(owner == large))] = small
        size[small], size[large] = size[small] + 1, size[large] - 1
    return _finish((np.flatnonzero(owner == i) for i in range(k)), "dirichlet")


def pathological(labels: np.ndarray, k: int, classes_per_client: int, seed: int) -> Parts:
    """Label skew "#C=c" (NIID-Bench, Li et al. 2022): every client holds exactly `classes_per_client` classes.

    Own assignment, not flwr-datasets' ``PathologicalPartitioner`` (which leaves rows unassigned):
    clients pick classes in turn, each taking the `c` classes held by the fewest clients so far (ties
    at random). So a class is held by ⌊kc/C⌋ or ⌈kc/C⌉ clients, and every class is held when
    ``k * c >= C``. Each class's samples are shuffled and split evenly (±1) among its holders.

    Coverage: every sample lies in exactly one partition when ``k * c >= C``; otherwise the samples
    of the ``C - k*c`` unheld classes are in no partition (not used).
    """
    classes = np.unique(labels)
    c = classes_per_client
    if not 1 <= c <= len(classes):
        raise ConfigError("classes-per-client", c, f"a value in [1, {len(classes)}], the data's classes")
    _check_k(len(labels), k)
    rng = _rng(seed)
    held = np.zeros(len(classes), dtype=np.int64)
    holders: list[list[int]] = [[] for _ in classes]
    for client in range(k):
        for j in np.lexsort((rng.random(len(classes)), held))[:c]:
            held[j] += 1
            holders[j].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for j, cls in enumerate(classes):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        if not holders[j]:
            continue
        if len(idx) < len(holders[j]):
            raise ConfigError("num-clients", k, f"fewer clients: class {cls} has {len(idx)} training samples for "
                              f"its {len(holders[j])} holders")
        for client, chunk in zip(holders[j], np.array_split(idx, len(holders[j]))):
            parts[client].append(chunk)
    return _finish(map(np.concatenate, parts), "pathological")


def _fedmerge_cluster_sizes(k: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """Clients per cluster as the FedMerge code draws them: uniform randoms smoothed over 3 neighbours,
    scaled to `k`, at least 2 (here min(2, k // m)), then fixed to sum to `k` by moving one client at a
    time off the largest / onto the smallest cluster."""
    r = np.convolve(np.pad(rng.random(m), 1, mode="symmetric"), np.ones(3) / 3, mode="valid")
    s = np.maximum(np.round(r * k / r.sum()).astype(np.int64), min(2, k // m))
    while s.sum() > k:
        s[np.argmax(s)] -= 1
    while s.sum() < k:
        s[np.argmin(s)] += 1
    return s


def _picked_groups(classes: np.ndarray, num_clusters: int, per_cluster: int,
                   rng: np.random.Generator) -> list[np.ndarray]:
    """FedMerge code's class picker: each cluster takes `per_cluster` classes off a shuffled pool, refilled
    with every class when it runs out, so early clusters are disjoint and later ones reuse classes (CIFAR-100,
    5 × 30: clusters 1–3 disjoint). A class already in the cluster is left in the pool for the next one."""
    pool: list[int] = []
    groups = []
    for _ in range(num_clusters):
        group: list[int] = []
        while len(group) < per_cluster:
            if not pool or all(c in group for c in pool):
                pool.extend(int(c) for c in rng.permutation(classes))
            pick = next(i for i, c in enumerate(pool) if c not in group)
            group.append(pool.pop(pick))
        groups.append(np.array(sorted(group)))
    return groups


def clusters(labels: np.ndarray, k: int, num_clusters: int, seed: int, alpha: float | None = None, *,
             sizes: str = "equal", classes_per_cluster: int = 0) -> Parts:
    """FedMerge's "Cluster Non-IID" (spec fedmerge.md §3.2): classes form `num_clusters` groups, each
    group is owned by a block of clients, and a client only gets samples of its group's classes.

    * Class groups: ``classes_per_cluster = 0``: a seeded permutation of the classes cut into
      `num_clusters` disjoint groups of equal size (±1) [inferred: the paper says "labels grouped into 5
      clusters"]; ``classes_per_cluster = c``: the code's picker (:func:`_picked_groups`), c classes per
      cluster, later clusters reusing classes (the code's 5 × 30 of CIFAR-100; 5 × 3 keeps that 30 %
      share on a 10-class dataset). A class several clusters hold is split among all their clients.
    * Clients: contiguous blocks of partition ids, cluster 0 first, as in the paper's ground truth
      {1–6}, {7–11}, … and the code. ``sizes="equal"``: block sizes differ by at most 1 [inferred];
      ``sizes="fedmerge"``: random uneven sizes drawn as the code does (paper: 6/5/8/13/18 of 50).
    * Within a group: ``alpha=None`` (or <= 0) splits the group's samples IID and evenly (±1) among its
      clients [inferred]; otherwise each class's samples are split among the group's clients by
      proportions from Dir(alpha), rounded by largest remainder, then moved one at a time from the
      largest to the smallest share until every client has >= 1 sample of the class where the class
      has enough (the code: Dirichlet(10), the same fix-up).

    Coverage: every sample lies in exactly one partition, except, with `classes_per_cluster`, the samples of
    classes no cluster picked (in no partition).
    """
    classes = np.unique(labels)
    if not 1 <= num_clusters <= min(len(classes), k):
        raise ConfigError("num-clusters", num_clusters, f"a value in [1, min(classes={len(classes)}, clients={k})]")
    _check_k(len(labels), k)
    rng = _rng(seed)
    if not 0 <= classes_per_cluster <= len(classes):
        raise ConfigError("cluster-classes", classes_per_cluster, f"a value in [0, classes={len(classes)}]")
    groups = (_picked_groups(classes, num_clusters, classes_per_cluster, rng) if classes_per_cluster
              else np.array_split(rng.permutation(classes), num_clusters))
    if sizes == "equal":
        block = np.array([len(b) for b in np.array_split(np.arange(k), num_clusters)])
    elif sizes == "fedmerge":
        block = _fedmerge_cluster_sizes(k, num_clusters, rng)
    else:
        raise ValueError(f"cluster sizes {sizes!r}: expected 'equal' or 'fedmerge'")
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    if classes_per_cluster:  # overlapping groups: each class over the clients of every cluster that holds it
        owners = {int(c): np.concatenate([np.arange(first, first + m) for group, first, m in
                                          zip(groups, np.cumsum(block) - block, block) if c in group])
                  for c in classes if any(c in g for g in groups)}
        for cls, members in owners.items():
            idx = rng.permutation(np.flatnonzero(labels == cls))
            if alpha is None or alpha <= 0:
                share = _counts(len(idx), np.ones(len(members)))
            else:
                share = _counts(len(idx), rng.dirichlet(np.full(len(members), alpha)))
                while len(idx) >= len(members) and share.min() < 1:
                    share[np.argmax(share)] -= 1
                    share[np.argmin(share)] += 1
            for client, chunk in zip(members, np.split(idx, np.cumsum(share)[:-1])):
                parts[client].append(chunk)
        return _finish(map(np.concatenate, parts), "clusters")
    for group, first, m in zip(groups, np.cumsum(block) - block, block):
        members = range(first, first + m)
        if alpha is None or alpha <= 0:
            idx = rng.permutation(np.flatnonzero(np.isin(labels, group)))
            for client, chunk in zip(members, np.array_split(idx, m)):
                parts[client].append(chunk)
            continue
        for cls in group:
            idx = rng.permutation(np.flatnonzero(labels == cls))
            share = _counts(len(idx), rng.dirichlet(np.full(m, alpha)))
            while len(idx) >= m and share.min() < 1:
                share[np.argmax(share)] -= 1
                share[np.argmin(share)] += 1
            for client, chunk in zip(members, np.split(idx, np.cumsum(share)[:-1])):
                parts[client].append(chunk)
    return _finish(map(np.concatenate, parts), "clusters")


def natural(groups: np.ndarray | None, k: int, seed: int) -> Parts:
    """Natural-id partitions (LEAF writers, CelebA celebrities; Feddle §3.2): one client per owner.

    With more owners than `k`, `k` owners are sampled uniformly without replacement with the seed
    ("1000 clients randomly sampled from the LEAF users"); the samples of the other owners are in no
    partition (not used). With exactly `k` owners all are used and the seed plays no part. Partition
    ``i`` is the ``i``-th sampled owner in sorted owner-id order.
    """
    if groups is None:
        raise ConfigError("partitioner", "natural", "a dataset with natural owners (groups) for it")
    groups = np.asarray(groups)
    owners = np.unique(groups)
    if len(owners) < k:
        raise ConfigError("num-clients", k, f"at most the data's {len(owners)} natural owners")
    chosen = np.sort(_rng(seed).choice(owners, size=k, replace=False)) if len(owners) > k else owners
    order = np.argsort(groups, kind="stable")
    lo, hi = np.searchsorted(groups[order], chosen, "left"), np.searchsorted(groups[order], chosen, "right")
    return _finish((order[a:b] for a, b in zip(lo, hi)), "natural")


def feddual_reference(labels: np.ndarray, k: int, alpha: float, seed: int) -> Parts:
    """FedDUAL's reference partition (spec feddual-and-mixing.md A.3, the code's ``Data Prepration.py``),
    followed exactly: per class proportions over the `k` clients from Dir(alpha) (one draw of a
    C × k matrix); then for each class and each client in turn, ``n = max(int(p[c, i] * n_c), 1)``
    samples of the class drawn without replacement *independently per client*.

    So every client holds >= 1 sample of every class, and partitions OVERLAP: a sample may lie in
    several partitions, and some samples lie in none. (Unlike ``DirichletPartitioner``: no overlap,
    no min-1 rule, re-draws until a minimum size.)
    """
    _check_k(len(labels), k)
    rng = _rng(seed)
    classes = np.unique(labels)
    props = rng.dirichlet(np.full(k, alpha), size=len(classes))
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for c, cls in enumerate(classes):
        idx = np.flatnonzero(labels == cls)
        for i in range(k):
            parts[i].append(rng.choice(idx, size=max(int(props[c, i] * len(idx)), 1), replace=False))
    return _finish(map(np.concatenate, parts), "feddual")


def label_noise(labels: np.ndarray, fraction: float, num_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random labels on a `fraction` of the samples (Zhu et al. 2025, "Guided Model Merging for Hybrid Data
    Learning", arXiv 2503.20138v3, Table 4: "fraction of decentralized training data with random labels"; apply to
    client data only, never to the server's splits).

    Exactly ``round(fraction * n)`` samples, chosen uniformly without replacement, get a label drawn
    uniformly from the ``num_classes - 1`` OTHER classes, so the asked fraction is exactly the fraction
    of labels changed. [inferred: the paper does not say whether a random label may equal the true
    one; allowing it would change only (C-1)/C of them.] Returns (noisy labels, sorted flipped indices).
    """
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError("label-noise", fraction, "a value in [0, 1]")
    labels = np.asarray(labels, dtype=np.int64)
    m = int(round(fraction * len(labels)))
    if m == 0:
        return labels.copy(), np.zeros(0, dtype=np.int64)
    if num_classes < 2 or labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"label noise needs labels in [0, {num_classes}) and at least 2 classes")
    rng = np.random.default_rng([seed, 4])
    flipped = np.sort(rng.choice(len(labels), size=m, replace=False)).astype(np.int64)
    noisy = labels.copy()
    noisy[flipped] = (labels[flipped] + rng.integers(1, num_classes, size=m)) % num_classes
    return noisy, flipped


# name -> adapter(labels, k, seed, **params): each adapter takes the parameters it needs by keyword
# (alpha, classes_per_client, num_clusters, cluster_alpha, cluster_sizes, cluster_classes, groups) and ignores
# the rest.
PARTITIONERS: dict[str, Callable[..., Parts]] = {
    "iid": lambda labels, k, seed, **_: iid(labels, k, seed),
    "dirichlet": lambda labels, k, seed, *, alpha, **_: dirichlet(labels, k, alpha, seed),
    "pathological": lambda labels, k, seed, *, classes_per_client, **_:
        pathological(labels, k, classes_per_client, seed),
    "clusters": lambda labels, k, seed, *, num_clusters, cluster_alpha=0.0, cluster_sizes="equal",
    cluster_classes=0, **_: clusters(labels, k, num_clusters, seed, cluster_alpha or None, sizes=cluster_sizes,
                                     classes_per_cluster=cluster_classes),
    "natural": lambda labels, k, seed, *, groups=None, **_: natural(groups, k, seed),
    "feddual": lambda labels, k, seed, *, alpha, **_: feddual_reference(labels, k, alpha, seed),
}


def partition(name: str, labels: np.ndarray, k: int, seed: int, **params: Any) -> Parts:
    """Partitions by the scheme `name` (a key of :data:`PARTITIONERS`), `params` as the adapters take."""
    if name not in PARTITIONERS:
        raise KeyError(f"unknown partitioner {name!r}; known: {sorted(PARTITIONERS)}")
    return PARTITIONERS[name](np.asarray(labels), k, seed, **params)
