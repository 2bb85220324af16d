"""Evaluation inputs (docs/reliability.md row 20): references and sample sets are checked completely when they
are opened, before any image is embedded; damaged, truncated, empty or inconsistent files and float images
outside [-1, 1] are one line; ADM's float16 precision/recall distances are an option."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dit.data.digits import digit_split, load_mnist_5k
from dit.eval import Evaluator, load_feature_net, load_reference
from dit.eval import evaluator as evaluator_module
from dit.eval.__main__ import main
from dit.eval.metrics import knn_radii, precision_recall
from dit.eval.reference import checksum
from dit.io.cli import run_cli
from dit.io.errors import UserError


def cli(argv, capsys) -> tuple[int, str, str]:
    code = run_cli(main, [str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    """A 300-digit sample set and statistics of 400 training digits under the digit network."""
    folder = tmp_path_factory.mktemp("inputs")
    images, labels = load_mnist_5k()
    train, held_out = digit_split(labels)
    np.savez(folder / "samples.npz", images[held_out[:300]][..., None])
    np.savez(folder / "train.npz", images[train[:400]][..., None])
    ref = folder / "ref.npz"
    assert (
        run_cli(main, ["ref", "--npz", str(folder / "train.npz"), "--feature-net", "mnist", "--out", str(ref)])
        == 0
    )
    return {"samples": folder / "samples.npz", "ref": ref}


def ours_with(path: Path, source: Path, edit) -> Path:
    """Our statistics file with ``edit(arrays, meta)`` applied and the checksum made to match again, so that
    only the validation (not the checksum) can catch the problem."""
    with np.load(source) as f:
        arrays = {k: f[k] for k in f.files if k != "meta"}
        meta = json.loads(str(f["meta"]))
    edit(arrays, meta)
    meta["sha256"] = checksum(arrays)
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


def flip_payload_byte(path: Path, member: str) -> None:
    """Flip one byte inside a stored member's data (not its header): only its CRC-32 can tell."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(member)
    data = bytearray(path.read_bytes())
    name_len, extra_len = (
        int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.file_size - 10] ^= 0xFF
    path.write_bytes(bytes(data))


def damaged_references(tmp: Path, ref: Path) -> dict[str, tuple[Path, str]]:
    """Each broken reference and a phrase its one line must hold."""
    whole = ref.read_bytes()
    (tmp / "empty.npz").write_bytes(b"")
    (tmp / "truncated.npz").write_bytes(whole[: len(whole) // 2])
    crc = tmp / "crc.npz"
    crc.write_bytes(whole)
    flip_payload_byte(crc, "sigma.npy")
    np.savez(tmp / "not_json.npz", meta=np.array("{not json"), mu=np.zeros(64), sigma=np.eye(64))
    nan_mu = np.zeros(64)
    nan_mu[3] = np.nan
    np.savez(tmp / "adm_nan_mu.npz", mu=nan_mu, sigma=np.eye(64))
    np.savez(tmp / "adm_sigma_s_missing.npz", mu=np.zeros(64), sigma=np.eye(64), mu_s=np.zeros(8))
    return {
        "empty": (tmp / "empty.npz", "damaged or not an .npz"),
        "truncated": (tmp / "truncated.npz", "damaged or not an .npz"),
        "bad CRC": (crc, "damaged or not an .npz"),
        "meta not JSON": (tmp / "not_json.npz", "meta record is not JSON"),
        "meta lacks keys": (
            ours_with(tmp / "no_keys.npz", ref, lambda a, m: m.pop("feature_network")),
            "lacks or mistypes feature_network",
        ),
        "no sigma": (ours_with(tmp / "no_sigma.npz", ref, lambda a, m: a.pop("sigma")), "has no sigma"),
        "NaN in sigma": (
            ours_with(tmp / "nan_sigma.npz", ref, lambda a, m: a["sigma"].__setitem__((slice(None), 5), np.nan)),
            "sigma holds 64 non-finite values",
        ),
        "sigma of the wrong shape": (
            ours_with(tmp / "short_sigma.npz", ref, lambda a, m: a.__setitem__("sigma", a["sigma"][:10, :10])),
            "do not fit",
        ),
        "NaN in mu (ADM layout)": (tmp / "adm_nan_mu.npz", "mu holds 1 non-finite values"),
        "mu_s without sigma_s (ADM layout)": (tmp / "adm_sigma_s_missing.npz", "mu_s without sigma_s"),
    }


def test_damaged_references_are_one_line_before_any_image_is_embedded(sets, tmp_path, capsys, monkeypatch):
    embedded = []
    original = evaluator_module.extract_features
    monkeypatch.setattr(
        evaluator_module, "extract_features", lambda *a, **k: embedded.append(1) or original(*a, **k)
    )
    for case, (path, phrase) in damaged_references(tmp_path, sets["ref"]).items():
        code, _, err = cli(["--samples", sets["samples"], "--ref", path], capsys)
        line = one_line_error(err)
        assert code == 2 and phrase in line, (case, line)
        with pytest.raises(UserError, match="python -m dit.eval ref|copy it again"):
            load_reference(str(path))
    assert embedded == []  # every case was refused at start-up
    code, out, err = cli(["--samples", sets["samples"], "--ref", sets["ref"]], capsys)
    assert code == 0 and "FID" in out, err  # the good file still scores


def test_a_reference_of_another_size_is_refused_when_the_evaluator_is_built(sets, tmp_path):
    """An ADM-layout 2048-d reference against the 64-d digit network: refused at construction (it was a shape
    error after every sample had been embedded)."""
    np.savez(tmp_path / "wide.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    reference = load_reference(str(tmp_path / "wide.npz"))
    reference.feature_network = load_feature_net("mnist").name  # only the sizes differ
    with pytest.raises(UserError, match=r"mu 2048 \(the network's: 64\)"):
        Evaluator(load_feature_net("mnist"), reference)


def test_damaged_sample_sets_are_one_line_at_opening(sets, tmp_path, capsys):
    whole = sets["samples"].read_bytes()
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "truncated.npz").write_bytes(whole[: len(whole) // 2])
    crc = tmp_path / "crc.npz"
    crc.write_bytes(whole)
    flip_payload_byte(crc, "arr_0.npy")
    short = tmp_path / "short.npz"  # a header that promises more images than the member holds
    with np.load(sets["samples"]) as f:
        images = f["arr_0"]
    with zipfile.ZipFile(short, "w") as z:
        with z.open("arr_0.npy", "w") as member:
            np.lib.format.write_array_header_1_0(
                member, {"descr": "|u1", "fortran_order": False, "shape": (400, 28, 28, 1)}
            )
            member.write(images.tobytes())
    cases = {
        "empty": (tmp_path / "empty.npz", "not a readable .npz"),
        "truncated": (tmp_path / "truncated.npz", "not a readable .npz"),
        "bad CRC": (crc, "is damaged"),
        "header longer than the data": (short, "cut short or damaged"),
    }
    for case, (path, phrase) in cases.items():
        code, _, err = cli(["--samples", path, "--ref", sets["ref"]], capsys)
        assert code == 2 and phrase in one_line_error(err), (case, err)


def test_float_images_outside_minus_one_one_are_refused(sets):
    evaluator = Evaluator(load_feature_net("mnist"), load_reference(str(sets["ref"])), metrics=["fid"])
    with np.load(sets["samples"]) as f:
        uint8 = torch.from_numpy(f["arr_0"]).permute(0, 3, 1, 2)
    for scaled, phrase in ((uint8.float(), r"values in \[0, 255\]"), (uint8.float() / 255, r"\[0, 1\]\?")):
        with pytest.raises(UserError, match=phrase):
            evaluator.evaluate([scaled])
    good = evaluator.evaluate([uint8.float() / 127.5 - 1])["fid"]
    assert good == pytest.approx(evaluator.evaluate([uint8])["fid"], rel=1e-12)  # [-1, 1] is the uint8 set


def test_float16_distances_follow_adm_and_fall_back_where_not_finite():
    """float16 moves points near a ball's edge (a small difference, not none); where a block overflows
    float16 (features ~1e3, squares ~1e6 > 65,504) ADM falls back to float32, so the results are float32's."""
    g = torch.Generator().manual_seed(0)
    ref, samples = torch.rand(600, 256, generator=g), torch.rand(600, 256, generator=g) * 1.02
    results = {}
    for distances in ("float32", "float16"):
        r_radii, s_radii = (knn_radii(x, 3, 256, distances) for x in (ref, samples))
        results[distances] = precision_recall(ref, r_radii, samples, s_radii, 256, distances)
    assert results["float16"] != results["float32"]
    assert all(abs(a - b) < 0.1 for a, b in zip(results["float16"], results["float32"]))
    big_ref, big_samples = ref * 1000, samples * 1000
    both = [
        precision_recall(
            big_ref, knn_radii(big_ref, 3, 256, d), big_samples, knn_radii(big_samples, 3, 256, d), 256, d
        )
        for d in ("float32", "float16")
    ]
    assert both[0] == both[1]


def test_the_command_line_offers_adm_float16_distances(sets, capsys):
    outs = {}
    for distances in ("float32", "float16"):
        code, out, err = cli(
            [
                "--samples",
                sets["samples"],
                "--ref",
                sets["ref"],
                "--json",
                "--metrics",
                "pr",
                "--pr-distances",
                distances,
            ],
            capsys,
        )
        assert code == 0, err
        outs[distances] = json.loads(out)
    for key in ("precision", "recall"):
        assert abs(outs["float16"][key] - outs["float32"][key]) < 0.05
    code, _, err = cli(["--samples", sets["samples"], "--ref", sets["ref"], "--pr-distances", "bf16"], capsys)
    assert code == 2 and "--pr-distances" in one_line_error(err)
