"""dit.data.images: ADM crop, folder scanning and its reports, the two image datasets."""

import os

import numpy as np
import pytest
import torch
from helpers import make_image_folder
from PIL import Image

from dit.data.images import (
    ArrayImageDataset,
    ImageFolderDataset,
    center_crop_arr,
    read_image,
    scan_image_folder,
)
from dit.io.errors import UserError


def test_center_crop_keeps_the_centre_and_resizes_the_short_side():
    pixels = np.zeros((64, 128, 3), dtype=np.uint8)  # H x W: black quarters left and right, white centre
    pixels[:, 32:96] = 255
    out = center_crop_arr(Image.fromarray(pixels), 32)
    assert out.size == (32, 32) and out.mode == "RGB"
    assert np.asarray(out).min() >= 250  # the crop saw only the white centre
    small = center_crop_arr(Image.fromarray(np.zeros((10, 20), dtype=np.uint8)), 32)
    assert small.size == (32, 32) and small.mode == "L"


def test_center_crop_box_halves_while_the_short_side_is_at_least_twice_the_target(monkeypatch):
    calls, resize = [], Image.Image.resize
    monkeypatch.setattr(
        Image.Image,
        "resize",
        lambda im, size, resample: calls.append((size, resample)) or resize(im, size, resample),
    )
    center_crop_arr(Image.new("RGB", (300, 257)), 32)
    assert calls == [  # short side 257 -> 128 -> 64 -> 32 by box halving, then bicubic to exactly 32
        ((150, 128), Image.BOX),
        ((75, 64), Image.BOX),
        ((37, 32), Image.BOX),
        ((37, 32), Image.BICUBIC),
    ]


def test_scan_orders_labels_by_sorted_class_names_and_reports_problems(tmp_path):
    root = make_image_folder(tmp_path)
    (tmp_path / "stray.png").write_bytes(b"")
    scan = scan_image_folder(root)
    assert scan.classes == ["a_cat", "b_dog", "c_empty"]
    assert [label for _, label in scan.samples] == [0] * 5 + [1] * 3  # broken.jpg counts as a candidate
    assert scan.samples[0] == (os.path.join("a_cat", "broken.jpg"), 0)
    assert sorted(scan.skipped) == [
        (os.path.join("a_cat", "notes.txt"), "not an image file"),
        ("c_empty", "empty class folder"),
        ("stray.png", "not inside a class folder"),
    ]


def test_layouts_a_walker_gets_wrong(tmp_path):
    """Hidden entries (.ipynb_checkpoints at the root became class 0 and shifted every label), a link back
    to a folder already walked (one image was listed 41 times, to ELOOP), a dangling link, nested folders and
    upper-case extensions: the labels are the visible class folders', each image listed once."""
    root = tmp_path / "data"
    for cls in ("cat", "dog"):
        (root / cls / "nested").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(root / cls / "a.PNG")
        Image.new("RGB", (8, 8)).save(root / cls / "nested" / "b.jpg")
    (root / ".ipynb_checkpoints").mkdir()
    Image.new("RGB", (8, 8)).save(root / ".ipynb_checkpoints" / "c.png")
    (root / "cat" / ".DS_Store").write_bytes(b"\0")
    (root / "cat" / ".thumbs").mkdir()
    os.symlink(root / "cat", root / "cat" / "nested" / "loop")  # a loop back to the class folder
    os.symlink(root / "gone", root / "dog" / "dangling")
    scan = scan_image_folder(str(root))
    assert scan.classes == ["cat", "dog"]
    assert scan.samples == [
        ("cat/a.PNG", 0), ("cat/nested/b.jpg", 0), ("dog/a.PNG", 1), ("dog/nested/b.jpg", 1)
    ]  # fmt: skip
    reasons = dict(scan.skipped)
    assert reasons[".ipynb_checkpoints"].startswith("hidden") and reasons["cat/.DS_Store"].startswith("hidden")
    assert reasons["cat/nested/loop"] == "a link to a folder already walked"
    assert "dog/dangling" in reasons
    clean = tmp_path / "clean"
    (clean / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(clean / "cat" / "a.png")
    (clean / "cat" / ".DS_Store").write_bytes(b"\0")
    assert len(ImageFolderDataset(str(clean), 8, strict=True)) == 1  # hidden files are not data: --strict passes


def test_dataset_returns_model_range_tensors_and_flips_half_the_time(tmp_path):
    root = make_image_folder(tmp_path)
    data = ImageFolderDataset(root, 32, flip=True)
    assert data.classes == ["a_cat", "b_dog", "c_empty"] and len(data) == 8
    assert {reason for _, reason in data.skipped} == {"not an image file", "empty class folder"}
    index = [i for i, (path, _) in enumerate(data.samples) if path.endswith("img0.png")][0]
    x, label = data[index]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and label == 0
    assert -1 <= x.min() < x.max() <= 1
    plain = ImageFolderDataset(root, 32, flip=False)[index][0]
    torch.testing.assert_close(
        plain, read_image(os.path.join(root, data.samples[index][0]), 32).float() / 127.5 - 1
    )
    torch.manual_seed(0)
    flipped = sum(torch.equal(data[index][0], plain.flip(-1)) for _ in range(400))
    assert 160 < flipped < 240  # Binomial(400, 0.5): this band is > 5 sigma wide
    assert all(torch.equal(ImageFolderDataset(root, 32, flip=False)[index][0], plain) for _ in range(5))


def test_corrupt_image_raises_a_user_error_naming_it(tmp_path):
    data = ImageFolderDataset(make_image_folder(tmp_path), 32)
    broken = [i for i, (path, _) in enumerate(data.samples) if path.endswith("broken.jpg")][0]
    with pytest.raises(UserError, match=r"cannot decode image .*broken\.jpg.*Remove or replace"):
        data[broken]


def test_grey_and_rgba_files_become_rgb(tmp_path):
    os.makedirs(tmp_path / "k")
    Image.fromarray(np.full((40, 40), 7, dtype=np.uint8)).save(tmp_path / "k" / "grey.png")
    Image.fromarray(np.full((40, 40, 4), 9, dtype=np.uint8)).save(tmp_path / "k" / "rgba.png")
    data = ImageFolderDataset(str(tmp_path), 32, flip=False)
    assert [data.load_uint8(i).shape for i in range(2)] == [(3, 32, 32)] * 2


def test_strict_refuses_folders_with_problems(tmp_path):
    root = make_image_folder(tmp_path)
    with pytest.raises(UserError, match=r"2 unusable entries.*notes\.txt \(not an image file\).*without --strict"):
        ImageFolderDataset(root, 32, strict=True)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: p, "has no class sub-folders"),
        (lambda p: (p / "only").mkdir() or p, "no image files"),
    ],
)
def test_bad_data_folders_are_user_errors(tmp_path, setup, message):
    with pytest.raises(UserError, match=message):
        ImageFolderDataset(str(setup(tmp_path)), 32)


def test_array_dataset_crops_once_and_keeps_channels():
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (10, 28, 28), dtype=np.uint8)
    data = ArrayImageDataset(grey, np.arange(10) % 3, 32, flip=False)
    x, label = data[4]
    assert x.shape == (1, 32, 32) and x.dtype == torch.float32 and label == 1 and len(data) == 10
    assert data.classes == ["0", "1", "2"]
    expected = np.asarray(center_crop_arr(Image.fromarray(grey[4]), 32)).astype(np.float32) / 127.5 - 1
    torch.testing.assert_close(x[0], torch.from_numpy(expected))
    rgb = ArrayImageDataset(rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8), [0, 1], 32)
    assert rgb[1][0].shape == (3, 32, 32)
    with pytest.raises(UserError, match="uint8"):
        ArrayImageDataset(grey.astype(np.float32), np.arange(10), 32)


def test_class_folders_named_alike_in_two_unicode_forms_are_reported(tmp_path):
    """'café' as NFC and as NFD print alike but were two classes, silently: both keep their label (the sorted
    names', so a store or checkpoint made before reads the same labels), the second is reported as hidden
    entries are, and --strict refuses the folder."""
    import unicodedata

    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    root = tmp_path / "data"
    for name in (nfc, nfd, "cafz", "dog"):  # "cafz" sorts between the two forms of "café"
        (root / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(root / name / "a.png")
    scan = scan_image_folder(str(root))
    assert scan.classes == sorted([nfc, nfd, "cafz", "dog"]) and len({label for _, label in scan.samples}) == 4
    reasons = dict(scan.skipped)
    assert list(reasons) == [nfc] and f"class folder {nfd}" in reasons[nfc] and "rename one" in reasons[nfc]
    assert "NFC, that one NFD" in reasons[nfc]
    with pytest.raises(UserError, match="Unicode form"):
        ImageFolderDataset(str(root), 8, strict=True)
