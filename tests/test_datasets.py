"""Dataset loaders read small files written here in each dataset's true on-disk format."""

from __future__ import annotations

import csv
import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import write_jpg, write_leaf

import common.datasets as D


def _bytes_image(n: int, channels: int, side: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, channels, side, side), dtype=np.uint8)


# ------------------------------------------------------------------------------------------- Animal-MNIST
def test_animal_mnist_reads_the_installed_package_then_its_npz_cache(tmp_path, monkeypatch):
    if D._animal_mnist_dir() is None:
        pytest.skip("animal-mnist is not installed (pip install --no-deps animal-mnist==0.4)")
    d = D.animal_mnist(tmp_path)
    assert d.x.shape == (10000, 1, 28, 28) and d.x.dtype == np.float32 and d.y.dtype == np.int64
    assert d.x.min() >= 0.0 and d.x.max() == 1.0 and d.num_classes == 10
    assert np.bincount(d.y).tolist() == [1000] * 10 and d.groups is None and d.fine is None
    assert (tmp_path / "animal-mnist" / "animal_mnist_v3.npz").is_file()

    def fail(*a, **k):
        raise AssertionError("the cached load must not read the package's gzip files")

    monkeypatch.setattr(gzip, "open", fail)
    monkeypatch.setattr(gzip, "decompress", fail)
    monkeypatch.setattr(D, "_animal_mnist_dir", fail)
    again = D.animal_mnist(tmp_path)
    np.testing.assert_array_equal(again.x, d.x)
    np.testing.assert_array_equal(again.y, d.y)


def test_animal_mnist_not_installed_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "_animal_mnist_dir", lambda: None)
    with pytest.raises(D.DatasetNotFound, match=r"pip install --no-deps animal-mnist==0\.4") as e:
        D.animal_mnist(tmp_path)
    assert "MIT" in str(e.value) and str(tmp_path / "animal-mnist") in str(e.value)
    assert not (tmp_path / "animal-mnist").exists()


# ------------------------------------------------------------------------------------------ Fashion-MNIST
def _idx(path: Path, arr: np.ndarray, magic: int, gz: bool) -> None:
    raw = struct.pack(f">I{arr.ndim}I", magic, *arr.shape) + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def test_fashion_mnist_parses_idx_files_gzipped_or_not(tmp_path):
    folder = tmp_path / "fashion-mnist"
    folder.mkdir()
    xtr, xte = _bytes_image(3, 1, 28, 0)[:, 0], _bytes_image(2, 1, 28, 1)[:, 0]
    _idx(folder / "train-images-idx3-ubyte.gz", xtr, 2051, gz=True)
    _idx(folder / "train-labels-idx1-ubyte.gz", np.array([9, 0, 3]), 2049, gz=True)
    _idx(folder / "t10k-images-idx3-ubyte", xte, 2051, gz=False)
    _idx(folder / "t10k-labels-idx1-ubyte", np.array([7, 1]), 2049, gz=False)
    d = D.fashion_mnist(tmp_path)
    assert d.x.shape == (5, 1, 28, 28) and d.x.dtype == np.float32 and d.num_classes == 10
    np.testing.assert_allclose(d.x[:, 0], np.concatenate([xtr, xte]) / 255.0, rtol=0, atol=1e-7)
    assert d.y.tolist() == [9, 0, 3, 7, 1] and d.y.dtype == np.int64

    _idx(folder / "t10k-labels-idx1-ubyte", np.array([7, 1]), 2051, gz=False)  # wrong magic
    with pytest.raises(ValueError, match="magic 2051, expected 2049"):
        D.fashion_mnist(tmp_path)


def test_fashion_mnist_falls_back_to_the_system_datasets_folder(tmp_path, monkeypatch):
    """The data root wins; without the files there, the Debian package's folder is read."""
    system, root = tmp_path / "usr-share-datasets", tmp_path / "data"
    for base, label in ((system, 4), (root, 8)):
        (base / "fashion-mnist").mkdir(parents=True)
        for split in ("train", "t10k"):
            _idx(base / "fashion-mnist" / f"{split}-images-idx3-ubyte.gz", _bytes_image(1, 1, 28, label)[:, 0], 2051,
                 gz=True)
            _idx(base / "fashion-mnist" / f"{split}-labels-idx1-ubyte.gz", np.array([label]), 2049, gz=True)
    monkeypatch.setattr(D, "SYSTEM_ROOTS", (system,))
    assert D.fashion_mnist(root).y.tolist() == [8, 8]
    (root / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz").unlink()  # an incomplete data root is passed over
    assert D.fashion_mnist(root).y.tolist() == [4, 4]
    (system / "fashion-mnist" / "train-images-idx3-ubyte.gz").unlink()
    with pytest.raises(D.DatasetNotFound) as e:
        D.fashion_mnist(root)
    assert str(root / "fashion-mnist") in str(e.value) and str(system / "fashion-mnist") in str(e.value)


REAL_FASHION = D.SYSTEM_ROOTS[0] / "fashion-mnist"


@pytest.mark.skipif(not (REAL_FASHION / "train-images-idx3-ubyte.gz").is_file(),
                    reason=f"no Fashion-MNIST in {REAL_FASHION} (make data: apt-get install dataset-fashion-mnist)")
def test_the_real_fashion_mnist_files():
    d = D.fashion_mnist(Path("/nonexistent-data-root"))
    assert d.x.shape == (70000, 1, 28, 28) and d.x.dtype == np.float32
    assert np.bincount(d.y).tolist() == [7000] * 10  # 6000 train + 1000 test per class
    assert d.y[:5].tolist() == [9, 0, 0, 3, 0]  # the first training labels (ankle boot, T-shirt, ...)
    assert d.x.min() == 0.0 and d.x.max() == 1.0 and abs(float(d.x.mean()) - 0.286) < 0.001


# ---------------------------------------------------------------------------------------------------- CIFAR
def _pickle(path: Path, **entries) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({k.encode(): v for k, v in entries.items()}))


def test_cifar10_reads_the_python_batches_in_order(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    rows, labels = [], []
    for i, name in enumerate([f"data_batch_{j}" for j in range(1, 6)] + ["test_batch"]):
        data = _bytes_image(2, 3, 32, i).reshape(2, 3072)
        _pickle(folder / name, data=data, labels=[i, 9 - i], batch_label=b"x", filenames=[b"a.png", b"b.png"])
        rows.append(data)
        labels += [i, 9 - i]
    d = D.cifar10(tmp_path)
    assert d.x.shape == (12, 3, 32, 32) and d.x.dtype == np.float32 and d.num_classes == 10
    assert d.y.tolist() == labels
    data = np.concatenate(rows)
    # CIFAR rows are channel-major: 1024 red, 1024 green, 1024 blue, each row-major.
    assert d.x[5, 2, 3, 4] == pytest.approx(data[5, 2 * 1024 + 3 * 32 + 4] / 255.0)
    np.testing.assert_allclose(d.x.reshape(12, -1), data / 255.0, atol=1e-7)


# An independent, hand-written listing of the CIFAR-100 superclasses by name (official order = label id).
SUPERCLASSES = {
    "aquatic_mammals": ["beaver", "dolphin", "otter", "seal", "whale"],
    "fish": ["aquarium_fish", "flatfish", "ray", "shark", "trout"],
    "flowers": ["orchid", "poppy", "rose", "sunflower", "tulip"],
    "food_containers": ["bottle", "bowl", "can", "cup", "plate"],
    "fruit_and_vegetables": ["apple", "mushroom", "orange", "pear", "sweet_pepper"],
    "household_electrical_devices": ["clock", "keyboard", "lamp", "telephone", "television"],
    "household_furniture": ["bed", "chair", "couch", "table", "wardrobe"],
    "insects": ["bee", "beetle", "butterfly", "caterpillar", "cockroach"],
    "large_carnivores": ["bear", "leopard", "lion", "tiger", "wolf"],
    "large_man-made_outdoor_things": ["bridge", "castle", "house", "road", "skyscraper"],
    "large_natural_outdoor_scenes": ["cloud", "forest", "mountain", "plain", "sea"],
    "large_omnivores_and_herbivores": ["camel", "cattle", "chimpanzee", "elephant", "kangaroo"],
    "medium_mammals": ["fox", "porcupine", "possum", "raccoon", "skunk"],
    "non-insect_invertebrates": ["crab", "lobster", "snail", "spider", "worm"],
    "people": ["baby", "boy", "girl", "man", "woman"],
    "reptiles": ["crocodile", "dinosaur", "lizard", "snake", "turtle"],
    "small_mammals": ["hamster", "mouse", "rabbit", "shrew", "squirrel"],
    "trees": ["maple_tree", "oak_tree", "palm_tree", "pine_tree", "willow_tree"],
    "vehicles_1": ["bicycle", "bus", "motorcycle", "pickup_truck", "train"],
    "vehicles_2": ["lawn_mower", "rocket", "streetcar", "tank", "tractor"],
}
FINE_NAMES = [
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
    "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee", "clock",
    "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish",
    "forest", "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion",
    "lizard", "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange",
    "orchid", "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine",
    "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk",
    "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank",
    "telephone", "television", "tiger", "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale",
    "willow_tree", "wolf", "woman", "worm"
]


def _coarse_by_name() -> np.ndarray:
    assert len(FINE_NAMES) == 100 and sorted(FINE_NAMES) == FINE_NAMES  # fine ids are alphabetical
    assert list(SUPERCLASSES) == sorted(SUPERCLASSES) and len(SUPERCLASSES) == 20  # coarse ids too
    coarse_of = {fine: c for c, members in enumerate(SUPERCLASSES.values()) for fine in members}
    assert sorted(coarse_of) == FINE_NAMES  # every fine class in exactly one superclass
    return np.array([coarse_of[name] for name in FINE_NAMES])


def _write_cifar100(root: Path, coarse_of_fine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    fine_train, fine_test = np.arange(100), np.arange(100)[::-1].copy()
    for name, fine, seed in (("train", fine_train, 0), ("test", fine_test, 1)):
        _pickle(root / "cifar-100-python" / name, data=_bytes_image(100, 3, 32, seed).reshape(100, 3072),
                fine_labels=fine.tolist(), coarse_labels=coarse_of_fine[fine].tolist(), filenames=[b"f.png"] * 100)
    fine = np.concatenate([fine_train, fine_test])
    return fine, coarse_of_fine[fine]


def test_cifar100_superclass_table_matches_the_named_listing_for_all_100_classes(tmp_path):
    expected = _coarse_by_name()
    np.testing.assert_array_equal(D.CIFAR100_COARSE_OF_FINE, expected)
    assert tuple(SUPERCLASSES) == D.CIFAR100_SUPERCLASSES
    fine, coarse = _write_cifar100(tmp_path, expected)

    c = D.cifar100_coarse(tmp_path)
    assert c.x.shape == (200, 3, 32, 32) and c.num_classes == 20
    assert c.y.tolist() == coarse.tolist() and c.fine.tolist() == fine.tolist()
    assert c.partition_labels is c.fine
    f = D.cifar100(tmp_path)
    assert f.num_classes == 100 and f.y.tolist() == fine.tolist() and f.fine is None
    np.testing.assert_array_equal(f.x, c.x)


def test_cifar100_coarse_labels_disagreeing_with_the_table_are_an_error(tmp_path):
    wrong = _coarse_by_name()
    wrong[[4, 30]] = wrong[[30, 4]] + 1  # beaver, dolphin moved out of aquatic_mammals
    _write_cifar100(tmp_path, wrong)
    with pytest.raises(ValueError, match="disagree with the superclass table"):
        D.cifar100_coarse(tmp_path)


# ----------------------------------------------------------------------------------------------------- LEAF
def _femnist_rows(values: list[float]) -> list[list[float]]:
    rows = []
    for v in values:
        img = np.ones(784)  # LEAF FEMNIST: 1.0 = white background
        img[28 * 14 : 28 * 14 + 10] = v  # a dark stroke on row 14
        rows.append(img.tolist())
    return rows


def test_femnist_reads_leaf_json_with_writers_as_groups(tmp_path):
    base = tmp_path / "femnist"
    write_leaf(base / "train" / "b.json", {"f0000_00": (_femnist_rows([0.0, 0.5]), [61, 3])})
    write_leaf(base / "train" / "a.json", {"f0002_11": (_femnist_rows([0.1]), [39]),
                                           "f0001_05": (_femnist_rows([0.2, 0.3]), [40, 55]),
                                           "f0003_99": ([], [])})
    write_leaf(base / "test" / "a.json", {"f0002_11": (_femnist_rows([0.4]), [10])})

    d = D.femnist(tmp_path)
    # Order: train/a.json (users in file order), train/b.json, test/a.json. Groups: sorted writer names.
    assert d.y.tolist() == [39, 40, 55, 61, 3, 10] and d.num_classes == 62
    assert d.groups.tolist() == [2, 1, 1, 0, 0, 2] and d.groups.dtype == np.int64
    assert d.x.shape == (6, 1, 28, 28) and d.x.dtype == np.float32
    assert d.x[:, 0, 0, 0].tolist() == [1.0] * 6  # background kept white
    np.testing.assert_allclose(d.x[:, 0, 14, 5], [0.1, 0.2, 0.3, 0.0, 0.5, 0.4], atol=1e-7)

    d40 = D.femnist40(tmp_path)
    assert d40.num_classes == 40 and d40.y.tolist() == [39, 3, 10]
    assert d40.groups.tolist() == [1, 0, 1]  # f0001_05 (only classes >= 40) is gone; ids renumbered
    np.testing.assert_allclose(d40.x[:, 0, 14, 5], [0.1, 0.5, 0.4], atol=1e-7)


def test_celeba_smiling_reads_leaf_json_and_resizes_the_jpegs(tmp_path, monkeypatch):
    base = tmp_path / "celeba"
    colours = {"000001.jpg": (255, 0, 0), "000002.jpg": (0, 255, 0), "000003.jpg": (0, 0, 255),
               "000004.jpg": (200, 200, 200)}
    for name, rgb in colours.items():
        write_jpg(base / "img_align_celeba" / name, rgb)
    # LEAF writes the Smiling label as (attr + 1) / 2, i.e. floats.
    write_leaf(base / "train" / "t.json", {"2880": (["000001.jpg", "000002.jpg"], [1.0, 0.0]),
                                           "15": (["000003.jpg"], [0.0])})
    write_leaf(base / "test" / "t.json", {"2880": (["000004.jpg"], [1.0])})

    d = D.celeba_smiling(tmp_path)
    assert d.x.shape == (4, 3, 32, 32) and d.x.dtype == np.float32 and d.num_classes == 2
    assert d.y.tolist() == [1, 0, 0, 1] and d.y.dtype == np.int64
    assert d.groups.tolist() == [1, 1, 0, 1]  # sorted names: "15" < "2880"
    np.testing.assert_allclose(d.x.mean(axis=(2, 3)), np.array(list(colours.values())) / 255.0, atol=0.02)

    monkeypatch.setattr(D, "IMAGE_SIZE", 8)
    assert D.celeba_smiling(tmp_path).x.shape == (4, 3, 8, 8)


# ------------------------------------------------------------------------------------------- decoded images
def test_isic2019_reads_the_ground_truth_csv(tmp_path):
    base = tmp_path / "isic2019"
    header = ["image", "MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC", "UNK"]
    rows = [("ISIC_0000000", 1), ("ISIC_0000001_downsampled", 7), ("ISIC_0000002", 0)]
    for name, _ in rows:
        write_jpg(base / "ISIC_2019_Training_Input" / f"{name}.jpg", (10, 20, 30), size=(64, 48))
    with (base / "ISIC_2019_Training_GroundTruth.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows([name, *(f"{float(i == c):.1f}" for i in range(9))] for name, c in rows)
    d = D.isic2019(tmp_path)
    assert d.x.shape == (3, 3, 32, 32) and d.num_classes == 8 and d.y.tolist() == [1, 7, 0]


def test_image_folder_classes_are_the_sorted_sub_folders(tmp_path):
    root = tmp_path / "ood"
    write_jpg(root / "dog" / "b.jpg", (0, 0, 0), size=(40, 30))
    write_jpg(root / "dog" / "a.png", (255, 255, 255), size=(40, 30))
    write_jpg(root / "cat" / "x" / "deep.png", (128, 0, 0), size=(10, 10), mode="L")  # grayscale, nested
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / ".cache").mkdir()

    d = D.imagefolder("ood")(tmp_path)
    assert D.imagefolder("ood").__name__ == "imagefolder:ood"
    assert d.num_classes == 2 and d.y.tolist() == [0, 1, 1]  # cat/x/deep.png, dog/a.png, dog/b.jpg
    assert d.x.shape == (3, 3, 32, 32) and d.x.dtype == np.float32
    np.testing.assert_allclose(d.x.mean(axis=(2, 3)), [[128 / 255] * 3, [1.0] * 3, [0.0] * 3], atol=0.02)
    np.testing.assert_array_equal(D.image_folder(root).y, d.y)
    for bad in ("", "../ood", "/abs"):
        with pytest.raises(ValueError):
            D.imagefolder(bad)


# ---------------------------------------------------------------------------------------------- not found
@pytest.mark.parametrize("loader, must_say", [
    (D.fashion_mnist, ["Fashion-MNIST", "fashion-mnist/train-images-idx3-ubyte[.gz]", "t10k-labels-idx1-ubyte",
                       "idx", "zalandoresearch", "MIT", "make data", "apt-get install dataset-fashion-mnist",
                       "system/fashion-mnist/train-images"]),
    (D.cifar10, ["CIFAR-10", "cifar-10-batches-py/data_batch_1", "test_batch",
                 "https://www.cs.toronto.edu/~kriz/cifar.html", "Licence"]),
    (D.cifar100, ["CIFAR-100", "cifar-100-python/train", "cifar.html", "Licence"]),
    (D.cifar100_coarse, ["CIFAR-100", "cifar-100-python/test"]),
    (D.femnist, ["FEMNIST", "femnist/train/*.json", "LEAF", "github.com/TalwalkarLab/leaf", "NIST"]),
    (D.femnist40, ["FEMNIST", "femnist/test/*.json"]),
    (D.celeba_smiling, ["CelebA", "celeba/img_align_celeba", "celeba/train/*.json", "LEAF", "non-commercial"]),
    (D.isic2019, ["ISIC 2019", "isic2019/ISIC_2019_Training_GroundTruth.csv", "isic-archive", "CC BY-NC"]),
    (D.imagefolder("imagenet-subset"), ["imagenet-subset/<class>/<image>", ".jpg"]),
])
def test_missing_files_raise_one_clear_error(tmp_path, loader, must_say, monkeypatch):
    monkeypatch.setattr(D, "SYSTEM_ROOTS", (tmp_path / "system",))
    with pytest.raises(D.DatasetNotFound) as e:
        loader(tmp_path)
    assert isinstance(e.value, FileNotFoundError)
    message = str(e.value)
    assert str(tmp_path) in message and "Licence:" in message
    for text in must_say:
        assert text in message, f"{text!r} missing from:\n{message}"
