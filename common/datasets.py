"""Loaders for the papers' datasets, read from their original on-disk formats below a data root.

Nothing is downloaded: every loader reads files you put below ``root`` (the run's ``data-root``) and,
when they are missing, raises :class:`DatasetNotFound` saying what to put where, in which format,
where it comes from and under which licence. Every loader returns an ``ArrayDataset`` with images
float32 ``(N, C, H, W)`` in [0, 1] and int64 labels; a dataset's official train and test files are
concatenated (train first), since the project makes its own test split.

| name            | files below ``root``                                     | classes | x       | licence          |
|-----------------|----------------------------------------------------------|---------|---------|------------------|
| animal-mnist    | pip ``animal-mnist==0.4``; cache ``animal-mnist/*.npz``  | 10      | 1x28x28 | MIT              |
| fashion-mnist   | ``fashion-mnist/{train,t10k}-*-ubyte[.gz]`` (idx) [3]    | 10      | 1x28x28 | MIT              |
| cifar10         | ``cifar-10-batches-py/{data_batch_1..5,test_batch}``     | 10      | 3x32x32 | none stated [1]  |
| cifar100        | ``cifar-100-python/{train,test}``                        | 100     | 3x32x32 | none stated [1]  |
| cifar100-coarse | same; y = 20 superclasses, ``fine`` = 100 fine labels    | 20      | 3x32x32 | none stated [1]  |
| femnist         | ``femnist/{train,test}/*.json`` (LEAF); groups = writer  | 62      | 1x28x28 | NIST SD19 [2]    |
| femnist40       | same, labels < 40 only (digits, A-Z, a-d)                | 40      | 1x28x28 | NIST SD19 [2]    |
| celeba-smiling  | ``celeba/{train,test}/*.json`` + ``img_align_celeba/``   | 2       | 3xSxS   | non-commercial   |
| isic2019        | ``isic2019/ISIC_2019_Training_{Input/,GroundTruth.csv}`` | 8       | 3xSxS   | CC BY-NC 4.0     |
| imagefolder:DIR | ``DIR/<class>/**/<image>``, classes = sorted folders     | #folders| 3xSxS   | that of the data |

[1] cite Krizhevsky 2009. [2] LEAF's scripts are BSD-2-Clause. CelebA: non-commercial research only.
[3] or below a :data:`SYSTEM_ROOTS` folder: Debian's ``dataset-fashion-mnist`` installs them in
``/usr/share/datasets/fashion-mnist/`` (``make data``).
S is :data:`IMAGE_SIZE` (32 by default). Notes:

* FEMNIST (LEAF) pixels are kept as LEAF stores them: in [0, 1] with 1.0 = white background and dark
  ink (the inverse of MNIST). Its labels are 0-9 digits, 10-35 upper case, 36-61 lower case.
* LEAF CelebA stores the Smiling label as 0.0 / 1.0 floats (``(attr + 1) / 2``); they are read as int.
* Sample order: LEAF files ``train/*.json`` then ``test/*.json``, each sorted by file name, users in the
  file's ``users`` order; ``groups`` indexes the sorted user names (a user in both train and test keeps
  one id).
* CIFAR files are Python pickles: only load files from a trusted source.
"""

from __future__ import annotations

import csv
import gzip
import importlib.metadata
import importlib.util
import json
import os
import pickle
import struct
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

# Side of the square images that decoded-image datasets (CelebA, ISIC, image folders) are resized to.
# 32 keeps a 200K-image CelebA at 2.4 GB float32 and lets the project's CNNs train on CPU; LEAF uses 84.
# One constant for all of them, so that server OOD data (imagefolder) matches the client images.
IMAGE_SIZE: int = 32
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp"})


# Where distributions install datasets (Debian's dataset-* packages), looked in after the data root.
SYSTEM_ROOTS: tuple[Path, ...] = (Path("/usr/share/datasets"),)


class DatasetNotFound(FileNotFoundError):
    """A dataset's files are not where the loader looks; the message says what to put where."""


def class_ids(text: str) -> tuple[int, ...]:
    """``"7, 8,9"`` -> (7, 8, 9); ``""`` -> (); ValueError for anything else."""
    ids = tuple(int(part) for part in text.split(",") if part.strip()) if text.strip() else ()
    if any(i < 0 for i in ids):
        raise ValueError(f"negative class id in {text!r}")
    return ids


@dataclass(frozen=True)
class ArrayDataset:
    """Images ``x`` (N, C, H, W) float32 in [0, 1] and labels ``y`` (N,) int64.

    ``groups`` (optional): a natural owner per sample (LEAF writer, celebrity) for natural-id
    partitions. ``fine`` (optional): finer labels to partition by when the model predicts coarser
    ones (CIFAR-100: 100 fine classes partitioned, 20 superclasses predicted, as in Feddle).
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    groups: np.ndarray | None = None
    fine: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx: np.ndarray) -> ArrayDataset:
        pick = lambda a: None if a is None else a[idx]
        return ArrayDataset(self.x[idx], self.y[idx], self.num_classes, pick(self.groups), pick(self.fine))

    @property
    def partition_labels(self) -> np.ndarray:
        """The labels label-skew partitioners split by."""
        return self.y if self.fine is None else self.fine


@dataclass(frozen=True)
class _Source:
    title: str
    fmt: str
    origin: str
    licence: str

    def missing(self, *paths: Path | str) -> DatasetNotFound:
        where = "\n".join(f"  {p}" for p in paths)
        return DatasetNotFound(f"{self.title} not found. Expected:\n{where}\nFormat: {self.fmt}\n"
                               f"Get it: {self.origin}\nLicence: {self.licence}")

    def require(self, *paths: Path) -> None:
        if not all(p.exists() for p in paths):
            raise self.missing(*paths)


_ANIMAL = _Source("Animal-MNIST 0.4", "gzip'd pickles of a uint8 array (10000, 28, 28) and of 10000 labels",
                  "pip install --no-deps animal-mnist==0.4 (https://pypi.org/project/animal-mnist/)",
                  "MIT, Copyright (c) 2025 SinaSR-6")
_FASHION = _Source("Fashion-MNIST", "the original idx files (gzip'd or not)",
                   "`make data` (runs `apt-get install dataset-fashion-mnist`, Debian/Ubuntu, as root: it puts them "
                   "in /usr/share/datasets/fashion-mnist/), or download them from "
                   "https://github.com/zalandoresearch/fashion-mnist (data/fashion) into the first folder above",
                   "MIT, Copyright (c) 2017 Zalando SE")
_CIFAR10 = _Source("CIFAR-10", "the CIFAR-10 python version (pickled dicts with b'data', b'labels')",
                   "download cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html and extract it "
                   "into the data root (it creates cifar-10-batches-py/)",
                   "no licence stated by the authors; cite Krizhevsky, Learning Multiple Layers of Features from "
                   "Tiny Images, 2009")
_CIFAR100 = _Source("CIFAR-100", "the CIFAR-100 python version (pickled dicts with b'data', b'fine_labels', "
                    "b'coarse_labels')", "download cifar-100-python.tar.gz from "
                    "https://www.cs.toronto.edu/~kriz/cifar.html and extract it into the data root (it creates "
                    "cifar-100-python/)", _CIFAR10.licence)
_LEAF = ("generate it with LEAF (https://github.com/TalwalkarLab/leaf, data/{0}: ./preprocess.sh -s niid "
         "--sf 1.0 -k {1} -t sample) and copy data/{0}/data/train and data/{0}/data/test into the folder above")
_FEMNIST = _Source("FEMNIST (LEAF)", 'LEAF JSON {"users", "num_samples", "user_data": {user: {"x": [[784 floats]], '
                   '"y": [int]}}}', _LEAF.format("femnist", 0),
                   "NIST Special Database 19 terms (the source images); LEAF scripts BSD-2-Clause")
_CELEBA = _Source("CelebA Smiling (LEAF)", 'LEAF JSON {"users", "num_samples", "user_data": {celebrity: {"x": '
                  '[image file names], "y": [0/1 Smiling]}}} and the aligned JPEGs of CelebA',
                  _LEAF.format("celeba", 5) + "; img_align_celeba/ is CelebA's 'Align&Cropped Images' "
                  "(https://mmlab.ie.cuhk.edu.hk/projects/CelebA.html)",
                  "CelebA agreement: non-commercial research purposes only")
_ISIC = _Source("ISIC 2019", "ISIC_2019_Training_Input/<image>.jpg and ISIC_2019_Training_GroundTruth.csv "
                "(image,MEL,NV,BCC,AK,BKL,DF,VASC,SCC,UNK, one-hot)",
                "https://challenge.isic-archive.com/data/#2019 (Training Data and Training Ground Truth)",
                "CC BY-NC 4.0")


def _dataset(x: np.ndarray, y: np.ndarray, num_classes: int, groups: np.ndarray | None = None,
             fine: np.ndarray | None = None) -> ArrayDataset:
    as_int = lambda a: None if a is None else np.asarray(a, dtype=np.int64)
    return ArrayDataset(np.ascontiguousarray(x, dtype=np.float32), as_int(y), num_classes, as_int(groups),
                        as_int(fine))


def _unit(x: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in [0, 1]."""
    out = x.astype(np.float32)
    out /= 255.0
    return out


def _read_bytes(path: Path) -> bytes:
    """A file's bytes, gunzipped when it is gzip (by its magic bytes, whatever its name)."""
    raw = path.read_bytes()
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw


def _unpickle(path: Path) -> Any:
    return pickle.loads(_read_bytes(path), encoding="bytes")


def _image(path: Path, size: int) -> np.ndarray:
    """An image file as uint8 RGB (3, size, size); plain resize (no crop), as LEAF does."""
    from PIL import Image

    with Image.open(path) as im:
        im.draft("RGB", (size, size))  # JPEG: decode at a reduced scale when that is still >= size
        rgb = im.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


def _images(paths: Sequence[Path], size: int) -> np.ndarray:
    return np.stack([_image(p, size) for p in paths]) if paths else np.zeros((0, 3, size, size), np.uint8)


# ---------------------------------------------------------------------------------------------- Animal-MNIST
_ANIMAL_FILES = ("animal_data_version_3.gz", "animal_label_version_3.gz")


def _animal_mnist_dir() -> Path | None:
    """The installed package's data folder, found without importing the package (it imports tensorflow)."""
    try:
        base = Path(str(importlib.metadata.distribution("animal-mnist").locate_file("animal_mnist")))
    except importlib.metadata.PackageNotFoundError:
        spec = importlib.util.find_spec("animal_mnist")  # a top-level name: located, not imported
        if spec is None or not spec.submodule_search_locations:
            return None
        base = Path(next(iter(spec.submodule_search_locations)))
    folder = base / "data" / "Animal_MNIST"
    return folder if all((folder / f).is_file() for f in _ANIMAL_FILES) else None


def animal_mnist(root: Path) -> ArrayDataset:
    """Animal-MNIST 0.4 (10 animal silhouettes, 1000 each, in class order), cached as .npz below root."""
    cache = Path(root) / "animal-mnist" / "animal_mnist_v3.npz"
    if not cache.is_file():
        folder = _animal_mnist_dir()
        if folder is None:
            raise _ANIMAL.missing(*(f"<site-packages>/animal_mnist/data/Animal_MNIST/{f}" for f in _ANIMAL_FILES),
                                  f"(or the cache {cache})")
        x, y = (np.asarray(_unpickle(folder / f)) for f in _ANIMAL_FILES)
        if x.shape != (len(y), 28, 28) or x.dtype != np.uint8:
            raise ValueError(f"unexpected Animal-MNIST arrays in {folder}: x {x.shape} {x.dtype}, y {y.shape}")
        cache.parent.mkdir(parents=True, exist_ok=True)
        # Written to a temporary file and renamed: processes loading at once never see half a cache.
        fd, tmp = tempfile.mkstemp(dir=cache.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, x=x, y=y.astype(np.int64))
            os.replace(tmp, cache)
        finally:
            Path(tmp).unlink(missing_ok=True)
    with np.load(cache) as z:
        x, y = z["x"], z["y"]
    return _dataset(_unit(x)[:, None], y, 10)


# --------------------------------------------------------------------------------------------- Fashion-MNIST
def _read_idx(path: Path, magic: int) -> np.ndarray:
    """An idx file of unsigned bytes: big-endian magic (0x0000 08 <ndim>), ndim big-endian uint32 sizes, data."""
    raw = _read_bytes(path)
    (got,) = struct.unpack(">I", raw[:4])
    if got != magic:
        raise ValueError(f"{path}: idx magic {got}, expected {magic}")
    ndim = magic & 0xFF
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: {data.size} bytes of data for sizes {dims}")
    return data.reshape(dims)


def fashion_mnist(root: Path) -> ArrayDataset:
    """Fashion-MNIST: 60000 train then 10000 test images, from ``root`` or else a :data:`SYSTEM_ROOTS` folder."""
    names = [f"{s}-{kind}-ubyte" for s in ("train", "t10k") for kind in ("images-idx3", "labels-idx1")]
    folders = [Path(base) / "fashion-mnist" for base in (root, *SYSTEM_ROOTS)]
    for folder in folders:
        found = [next((p for p in (folder / f"{n}.gz", folder / n) if p.is_file()), None) for n in names]
        if None not in found:
            break
    else:
        raise _FASHION.missing(*(folder / f"{n}[.gz]" for folder in folders for n in names))
    xs = [_read_idx(p, 2051) for p in found[0::2]]
    ys = [_read_idx(p, 2049) for p in found[1::2]]
    x, y = np.concatenate(xs), np.concatenate(ys)
    if len(x) != len(y):
        raise ValueError(f"Fashion-MNIST: {len(x)} images but {len(y)} labels")
    return _dataset(_unit(x)[:, None], y, 10)


# --------------------------------------------------------------------------------------------------- CIFAR
# The 20 CIFAR-100 superclasses (coarse label = index; names alphabetical, as in the dataset's meta file).
CIFAR100_SUPERCLASSES = (
    "aquatic_mammals", "fish", "flowers", "food_containers", "fruit_and_vegetables", "household_electrical_devices",
    "household_furniture", "insects", "large_carnivores", "large_man-made_outdoor_things",
    "large_natural_outdoor_scenes", "large_omnivores_and_herbivores", "medium_mammals", "non-insect_invertebrates",
    "people", "reptiles", "small_mammals", "trees", "vehicles_1", "vehicles_2",
)
# Fine label (alphabetical class names, as commented) -> superclass, the dataset's official grouping.
CIFAR100_COARSE_OF_FINE = np.array([
    4, 1, 14, 8, 0,       #  0- 4: apple aquarium_fish baby bear beaver
    6, 7, 7, 18, 3,       #  5- 9: bed bee beetle bicycle bottle
    3, 14, 9, 18, 7,      # 10-14: bowl boy bridge bus butterfly
    11, 3, 9, 7, 11,      # 15-19: camel can castle caterpillar cattle
    6, 11, 5, 10, 7,      # 20-24: chair chimpanzee clock cloud cockroach
    6, 13, 15, 3, 15,     # 25-29: couch crab crocodile cup dinosaur
    0, 11, 1, 10, 12,     # 30-34: dolphin elephant flatfish forest fox
    14, 16, 9, 11, 5,     # 35-39: girl hamster house kangaroo keyboard
    5, 19, 8, 8, 15,      # 40-44: lamp lawn_mower leopard lion lizard
    13, 14, 17, 18, 10,   # 45-49: lobster man maple_tree motorcycle mountain
    16, 4, 17, 4, 2,      # 50-54: mouse mushroom oak_tree orange orchid
    0, 17, 4, 18, 17,     # 55-59: otter palm_tree pear pickup_truck pine_tree
    10, 3, 2, 12, 12,     # 60-64: plain plate poppy porcupine possum
    16, 12, 1, 9, 19,     # 65-69: rabbit raccoon ray road rocket
    2, 10, 0, 1, 16,      # 70-74: rose sea seal shark shrew
    12, 9, 13, 15, 13,    # 75-79: skunk skyscraper snail snake spider
    16, 19, 2, 4, 6,      # 80-84: squirrel streetcar sunflower sweet_pepper table
    19, 5, 5, 8, 19,      # 85-89: tank telephone television tiger tractor
    18, 1, 2, 15, 6,      # 90-94: train trout tulip turtle wardrobe
    0, 17, 8, 14, 13,     # 95-99: whale willow_tree wolf woman worm
], dtype=np.int64)


def _cifar(folder: Path, files: Sequence[str], source: _Source, keys: Sequence[bytes]) -> list[np.ndarray]:
    """[x uint8 (N, 3, 32, 32), one int64 array per label key] from CIFAR python-version pickles, in file order."""
    paths = [folder / f for f in files]
    source.require(*paths)
    batches = [_unpickle(p) for p in paths]
    x = np.concatenate([np.asarray(b[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32) for b in batches])
    return [x, *(np.concatenate([np.asarray(b[k], dtype=np.int64) for b in batches]) for k in keys)]


def cifar10(root: Path) -> ArrayDataset:
    """CIFAR-10: 50000 train then 10000 test images."""
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    x, y = _cifar(Path(root) / "cifar-10-batches-py", files, _CIFAR10, [b"labels"])
    return _dataset(_unit(x), y, 10)


def _cifar100(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, fine, coarse = _cifar(Path(root) / "cifar-100-python", ["train", "test"], _CIFAR100,
                             [b"fine_labels", b"coarse_labels"])
    bad = np.flatnonzero(CIFAR100_COARSE_OF_FINE[fine] != coarse)
    if bad.size:
        i = bad[0]
        raise ValueError(f"CIFAR-100: {bad.size} samples' coarse labels disagree with the superclass table "
                         f"(first: sample {i}, fine {fine[i]}, coarse {coarse[i]}, expected "
                         f"{CIFAR100_COARSE_OF_FINE[fine[i]]})")
    return _unit(x), fine, coarse


def cifar100(root: Path) -> ArrayDataset:
    """CIFAR-100 with its 100 fine labels: 50000 train then 10000 test images."""
    x, fine, _ = _cifar100(root)
    return _dataset(x, fine, 100)


def cifar100_coarse(root: Path) -> ArrayDataset:
    """CIFAR-100 predicting the 20 superclasses, partitioned by the 100 fine labels (``fine``), as in Feddle."""
    x, fine, coarse = _cifar100(root)
    return _dataset(x, coarse, 20, fine=fine)


# ---------------------------------------------------------------------------------------------------- LEAF
def _read_leaf(base: Path, source: _Source,
               convert: Callable[[list[Any]], np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, groups) from LEAF JSON files base/{train,test}/*.json; `convert` makes one user's x list an array."""
    files = [f for split in ("train", "test") for f in sorted((base / split).glob("*.json"))]
    if not files:
        raise source.missing(base / "train" / "*.json", base / "test" / "*.json")
    xs, ys, owners = [], [], []
    for f in files:
        with f.open() as fh:
            data = json.load(fh)
        for user in data["users"]:
            ud = data["user_data"][user]
            if len(ud["x"]) != len(ud["y"]):
                raise ValueError(f"{f}: user {user} has {len(ud['x'])} x but {len(ud['y'])} y")
            if ud["y"]:
                xs.append(convert(ud["x"]))
                ys.append(np.asarray(ud["y"], dtype=np.float64))
                owners += [user] * len(ud["y"])
    if not ys:
        raise ValueError(f"{source.title}: the JSON files in {base} hold no samples")
    y = np.concatenate(ys)
    if not np.array_equal(y, np.round(y)):
        raise ValueError(f"{source.title}: non-integer labels in {base}")
    _, groups = np.unique(np.asarray(owners, dtype=str), return_inverse=True)  # ids of the sorted user names
    return np.concatenate(xs), y.astype(np.int64), groups


def femnist(root: Path) -> ArrayDataset:
    """LEAF FEMNIST, 62 classes, ``groups`` = writer. Pixels as LEAF stores them (1.0 = white background)."""
    to_images = lambda rows: np.asarray(rows, dtype=np.float32).reshape(-1, 1, 28, 28)
    x, y, groups = _read_leaf(Path(root) / "femnist", _FEMNIST, to_images)
    return _dataset(x, y, 62, groups)


def femnist40(root: Path) -> ArrayDataset:
    """FEMNIST restricted to its first 40 classes (the papers' setting); writer ids renumbered 0..W-1."""
    d = femnist(root)
    keep = d.y < 40
    return _dataset(d.x[keep], d.y[keep], 40, np.unique(d.groups[keep], return_inverse=True)[1])


def celeba_smiling(root: Path) -> ArrayDataset:
    """LEAF CelebA, binary Smiling, ``groups`` = celebrity; images resized to IMAGE_SIZE (plain resize, as LEAF)."""
    base = Path(root) / "celeba"
    img_dir = base / "img_align_celeba"
    if not img_dir.is_dir():
        raise _CELEBA.missing(base / "train" / "*.json", base / "test" / "*.json", img_dir / "<image>.jpg")
    x, y, groups = _read_leaf(base, _CELEBA, lambda names: _images([img_dir / n for n in names], IMAGE_SIZE))
    return _dataset(_unit(x), y, 2, groups)


# ------------------------------------------------------------------------------------------ decoded images
ISIC2019_CLASSES = ("MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC")  # UNK has no training images


def isic2019(root: Path) -> ArrayDataset:
    """ISIC 2019 training set (25331 dermoscopic images, 8 classes), in the ground-truth CSV's order."""
    base = Path(root) / "isic2019"
    img_dir, truth = base / "ISIC_2019_Training_Input", base / "ISIC_2019_Training_GroundTruth.csv"
    _ISIC.require(img_dir, truth)
    names, labels = [], []
    with truth.open(newline="") as fh:
        for row in csv.DictReader(fh):
            onehot = np.array([float(row[c]) for c in (*ISIC2019_CLASSES, "UNK")])
            if sorted(onehot) != [0.0] * 8 + [1.0] or onehot[-1] == 1.0:
                raise ValueError(f"{truth}: row {row['image']} is not one-hot over {ISIC2019_CLASSES}")
            names.append(img_dir / f"{row['image']}.jpg")
            labels.append(int(onehot.argmax()))
    return _dataset(_unit(_images(names, IMAGE_SIZE)), np.array(labels), len(ISIC2019_CLASSES))


def image_folder(root: Path) -> ArrayDataset:
    """Images in class sub-folders of `root` (torchvision ImageFolder layout): classes = sorted sub-folder names,
    files found recursively and sorted within each class, resized to IMAGE_SIZE RGB."""
    root = Path(root)
    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    if not classes:
        raise _Source(f"Image folder {root.name!r}", "one sub-folder per class holding image files "
                      f"({' '.join(sorted(IMAGE_EXTENSIONS))})", "any labelled image set arranged by class "
                      "(e.g. an ImageNet subset, ISIC by diagnosis)", "that of the images you put there"
                      ).missing(root / "<class>" / "<image>")
    paths, labels = [], []
    for label, folder in enumerate(classes):
        found = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not found:
            raise ValueError(f"class folder {folder} holds no images")
        paths += found
        labels += [label] * len(found)
    return _dataset(_unit(_images(paths, IMAGE_SIZE)), np.array(labels), len(classes))


def imagefolder(subdir: str) -> Callable[[Path], ArrayDataset]:
    """The loader of dataset ``imagefolder:<subdir>``: image_folder(root / subdir)."""
    parts = PurePosixPath(subdir).parts
    if not subdir or PurePosixPath(subdir).is_absolute() or ".." in parts or "\\" in subdir:
        raise ValueError(f"imagefolder:<subdir> needs a relative folder below the data root, got {subdir!r}")

    def load(root: Path) -> ArrayDataset:
        return image_folder(Path(root).joinpath(*parts))

    load.__name__ = load.__qualname__ = f"imagefolder:{subdir}"
    return load
