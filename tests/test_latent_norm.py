"""--latent-norm channel: a store's per-channel statistics (at extraction, and by extract_features.py --stats
for an older store), training on (z - mean_c) / std_c, checkpoints that carry the statistics, samplers that
undo them; scalar stays today's rule."""

import os
from pathlib import Path

import pytest
import torch
from helpers import face, make_image_folder, run_face
from test_train import Pixels, tiny_config

from dit.checkpoint import latest_checkpoint, load_checkpoint
from dit.data.reader import LatentStoreDataset
from dit.data.stats import latent_stats
from dit.data.store import read_manifest, shard_file, verify_store, write_manifest, write_moments_store
from dit.data.vae import ChannelNorm, decode, load_vae
from dit.io.errors import UserError
from dit.sample.generate import to_images
from dit.sample.loading import load_sampling_model
from dit.train import train

MEANS, SPREADS = torch.tensor([0.5, -1.0, 2.0, 0.0]), torch.tensor([1.0, 2.0, 3.0, 0.5])


def moments(n=24, size=4, seed=0):
    """[n, 2 views, (mean, std), 4, size, size]: channels of distinct offsets and spreads, small posterior std."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, 2, 1, 4, size, size, generator=g) * SPREADS.view(4, 1, 1) + MEANS.view(4, 1, 1)
    std = 0.05 + 0.1 * torch.rand(n, 2, 1, 4, size, size, generator=g)
    return torch.cat([mean, std], dim=2)


def store_without_stats(folder, source="in-memory moments", **kw):
    """A finished store as one made before stores recorded their statistics: the manifest without them."""
    write_moments_store(str(folder), moments(), torch.arange(24) % 3, num_classes=3, source=source, **kw)
    manifest = {
        k: v for k, v in read_manifest(str(folder)).items() if k not in ("latent_stats", "manifest_sha256")
    }
    write_manifest(str(folder), manifest)
    return str(folder)


def files(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


# ---- the statistics --------------------------------------------------------------------------------------


def test_the_statistics_are_the_exact_moments_of_the_posterior_draws(tmp_path):
    m = moments()
    write_moments_store(str(tmp_path), m, torch.arange(24) % 3, 3, storage_dtype="fp32", shard_size=5)
    stats = read_manifest(str(tmp_path))["latent_stats"]
    mean, std = m[:, :, 0].double(), m[:, :, 1].double()
    expected_mean = mean.mean((0, 1, 3, 4))
    expected_var = (mean**2 + std**2).mean((0, 1, 3, 4)) - expected_mean**2
    assert stats["values"] == 24 * 2 * 16
    assert torch.allclose(torch.tensor(stats["mean"], dtype=torch.float64), expected_mean, rtol=1e-12, atol=1e-12)
    assert torch.allclose(torch.tensor(stats["std"], dtype=torch.float64), expected_var.sqrt(), rtol=1e-12)
    # and the reader's draws, normalised with them, have about zero mean and unit variance per channel
    ds = LatentStoreDataset(str(tmp_path), latent_norm="channel")
    torch.manual_seed(0)
    draws = torch.stack([x for _ in range(20) for x, _ in ds.__getitems__(range(24))])
    assert draws.mean((0, 2, 3)).abs().max() < 0.05 and (draws.std((0, 2, 3)) - 1).abs().max() < 0.05


def test_extraction_records_the_statistics_the_command_writes(tmp_path, vae_dir, capsys):
    """A real extraction records them; an older store (its manifest without them) gets the same numbers from
    extract_features.py --stats, and its manifest stays checksummed and verifiable."""
    images = make_image_folder(tmp_path / "images", {"a": 3, "b": 3})
    store = str(tmp_path / "store")
    argv = ["--data-path", images, "--feature-path", store, "--vae", vae_dir, "--image-size", "32", "--shard-size",
            "4", "--num-workers", "0", "--no-progress"]  # fmt: skip
    code, _, err = run_face("extract_features.py", argv, capsys)
    assert code == 0, err
    extracted = read_manifest(store)["latent_stats"]
    assert len(extracted["mean"]) == 4 and all(s > 0 for s in extracted["std"])
    old = {k: v for k, v in read_manifest(store).items() if k not in ("latent_stats", "manifest_sha256")}
    write_manifest(store, old)
    code, out, err = run_face("extract_features.py", ["--feature-path", store, "--stats"], capsys)
    assert code == 0 and err == "" and "sha256 OK" in out, err
    assert read_manifest(store)["latent_stats"] == extracted  # bit for bit: the same sums in the same order
    assert verify_store(store)["latent_stats"] == extracted


# ---- the normalisation -----------------------------------------------------------------------------------


def test_the_round_trip_is_exact_where_float32_allows_and_within_its_rounding_elsewhere():
    """Bit for bit when each std is a power of two and z - mean is exact (dyadic values); otherwise the one
    division and the one multiplication each round, so z comes back within a few float32 ulps."""
    g = torch.Generator().manual_seed(0)
    dyadic = torch.randint(-4096, 4096, (8, 4, 6, 6), generator=g).float() / 256
    exact = ChannelNorm((0.5, -1.25, 3.0, 0.0), (1.0, 4.0, 0.25, 2.0))
    assert torch.equal(exact.undo(exact.normalize(dyadic)), dyadic)
    z = torch.randn(8, 4, 6, 6, generator=g) * SPREADS.view(4, 1, 1) + MEANS.view(4, 1, 1)
    norm = ChannelNorm(tuple(MEANS.tolist()), (1.1, 2.3, 2.9, 0.7))
    back = norm.undo(norm.normalize(z))
    mean = MEANS.view(4, 1, 1)
    assert ((back - z).abs() <= 4 * 2**-24 * ((z - mean).abs() + z.abs())).all()
    assert not torch.equal(norm.normalize(z), z)


def test_scalar_is_todays_rule_bit_for_bit(tmp_path, vae_dir):
    """The reader's draw and the decode under the default (scalar) are the formulas of the tree before
    --latent-norm: (mean + std eps - shift) x scale from the same generator, and latents / scale + shift."""
    m = moments()
    write_moments_store(str(tmp_path), m, torch.arange(24) % 3, 3, scale=0.37, storage_dtype="fp32")
    for ds in (LatentStoreDataset(str(tmp_path), flip=False), LatentStoreDataset(str(tmp_path), False, latent_norm="scalar")):  # fmt: skip
        torch.manual_seed(5)
        got = torch.stack([x for x, _ in ds.__getitems__(range(24))])
        torch.manual_seed(5)
        eps = torch.randn(24, 4, 4, 4)
        assert torch.equal(got, (eps * m[:, 0, 1] + m[:, 0, 0] - 0.0) * 0.37)
    vae = load_vae(vae_dir)
    z = torch.randn(2, 4, 4, 4)
    expected = vae.decode(z / float(vae.config.scaling_factor) + 0.0).sample.clamp(-1, 1)
    assert torch.equal(decode(vae, z), expected)


# ---- training and sampling ---------------------------------------------------------------------------------


def store_config(store, out, **kw):
    base = dict(image_size=32, num_classes=3, feature_path=store, max_steps=2, log_every=1)
    return tiny_config(out, **{**base, "results_dir": str(out), **kw})


def test_a_channel_run_records_its_statistics_and_samples_with_them_undone(tmp_path, vae_dir):
    store = str(tmp_path / "store")
    write_moments_store(store, moments(), torch.arange(24) % 3, 3, source=vae_dir)  # decodable by the tiny VAE
    stats = read_manifest(store)["latent_stats"]
    train(store_config(store, tmp_path / "run", latent_norm="channel"))
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    ckpt = load_checkpoint(path)
    assert ckpt["latent_norm"] == {"kind": "channel", "mean": stats["mean"], "std": stats["std"]}
    assert ckpt["config"]["data"]["latent_norm"] == "channel"
    assert "latents normalised per channel" in (tmp_path / "run" / "log.txt").read_text()
    sm = load_sampling_model(path, device="cpu")  # the checkpoint alone: the store is not read
    assert sm.latent_norm == ChannelNorm.of(stats)
    z = torch.randn(2, 4, 4, 4)
    undone = z * torch.tensor(stats["std"]).view(4, 1, 1) + torch.tensor(stats["mean"]).view(4, 1, 1)
    images = to_images(sm, z)
    assert torch.allclose(images, sm.vae.decode(undone).sample.clamp(-1, 1), atol=1e-6)
    assert not torch.allclose(images, decode(sm.vae, z), atol=1e-3)  # the scalar rule would decode otherwise


def test_a_resume_may_change_the_normalisation_only_when_allowed(tmp_path, capsys):
    store = str(tmp_path / "store")
    write_moments_store(store, moments(), torch.arange(24) % 3, 3)
    out = tmp_path / "run"
    train(store_config(store, out))
    capsys.readouterr()
    before = files(out / "checkpoints")
    code, _, err = run_face("train.py", ["--results-dir", str(out), "--resume", "auto", "--max-steps", "3",
                                         "--latent-norm", "channel"], capsys)  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "latent_norm: 'scalar'" in err, err
    assert files(out / "checkpoints") == before
    cfg = store_config(
        store, out, max_steps=3, resume="auto", latent_norm="channel", allow_changes=["latent_norm"]
    )
    assert train(cfg)["step"] == 3
    assert "latent_norm" in load_checkpoint(latest_checkpoint(out / "checkpoints"))


# ---- bad input: one line, exit 2, nothing written ---------------------------------------------------------


def test_a_store_without_statistics_names_the_command_that_writes_them(tmp_path, capsys):
    store = store_without_stats(tmp_path / "store")
    out = tmp_path / "run"
    argv = ["--feature-path", store, "--results-dir", str(out), "--latent-norm", "channel", "--model", "DiT-S/2",
            "--depth", "2", "--hidden-size", "32", "--num-heads", "2", "--global-batch-size", "8", "--num-workers",
            "0", "--precision", "fp32"]  # fmt: skip
    code, _, err = run_face("train.py", argv, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert f"python extract_features.py --feature-path {store} --stats" in err
    assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()


def test_channel_needs_a_store(tmp_path, capsys, vae_dir):
    """Pixel space (the digits quick start among it) has no latents: refused at the flag, before anything is
    read or written. Latents encoded on the fly have no statistics: refused before the run writes anything."""
    images = make_image_folder(tmp_path / "images", {"a": 2, "b": 2})
    out = tmp_path / "run"
    argv = ["--data-path", images, "--results-dir", str(out), "--latent-norm", "channel", "--image-size", "32"]
    code, _, err = run_face("train.py", [*argv, "--vae", "none"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--latent-norm channel normalises a latent store's" in err, err
    assert not out.exists()
    with pytest.raises(UserError, match="--vae none"):  # the library's callers too
        tiny_config(tmp_path, latent_norm="channel")
    code, _, err = run_face("train.py", [*argv, "--vae", vae_dir], capsys)
    assert code == 2 and err.count("\n") == 1 and "latents encoded on the fly" in err, err
    assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()
    with pytest.raises(UserError, match="encoded on the fly"):  # a data set given to train(), as the quick start
        train(tiny_config(tmp_path, vae="ema", feature_path=None, latent_norm="channel"), Pixels())


@pytest.mark.parametrize("damage", ["no store", "incomplete", "corrupt shard"])
def test_bad_stores_are_one_line_and_left_as_they_were(tmp_path, capsys, damage):
    store = str(tmp_path / "store")
    if damage == "no store":
        os.makedirs(store)
    else:
        store_without_stats(tmp_path / "store", storage_dtype="fp32", shard_size=8)
    if damage == "incomplete":
        write_manifest(store, {**read_manifest(store), "complete": False})
    if damage == "corrupt shard":
        data = bytearray(Path(store, shard_file(1)).read_bytes())
        data[-1] ^= 1
        Path(store, shard_file(1)).write_bytes(bytes(data))
    before = files(store)
    code, out, err = run_face("extract_features.py", ["--feature-path", store, "--stats"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    after = files(store)
    assert after.pop(".lock", b"") == b"" and after == before  # at most the store's lock, released (empty)


def test_a_constant_channel_is_refused_for_channel(tmp_path):
    m = moments()
    m[:, :, 0, 2], m[:, :, 1, 2] = 1.5, 0.0
    write_moments_store(str(tmp_path), m, torch.arange(24) % 3, 3)
    assert read_manifest(str(tmp_path))["latent_stats"]["std"][2] == 0.0
    with pytest.raises(UserError, match="std 0"):
        LatentStoreDataset(str(tmp_path), latent_norm="channel")


def test_a_channel_checkpoint_without_its_statistics_or_exported_to_diffusers_is_refused(
    tmp_path, vae_dir, capsys
):
    store = str(tmp_path / "store")
    write_moments_store(store, moments(), torch.arange(24) % 3, 3, source=vae_dir)
    train(store_config(store, tmp_path / "run", latent_norm="channel"))
    capsys.readouterr()
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    out = tmp_path / "pipeline"
    code, _, err = run_face("scripts/export_diffusers.py", ["--ckpt", str(path), "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1 and "DiTPipeline undoes only the VAE's one scaling" in err, err
    assert not out.exists()
    ckpt = load_checkpoint(path)
    del ckpt["latent_norm"]
    torch.save(ckpt, tmp_path / "edited.pt")
    with pytest.raises(UserError, match="holds no per-channel statistics"):
        load_sampling_model(tmp_path / "edited.pt")


def test_the_faces_show_the_options():
    text = " ".join(face("train.py").FACE.parser().format_help().split())
    assert (
        "--latent-norm LATENT_NORM how latents are scaled for the model: scalar" in text and "or channel" in text
    )
    assert "--stats" in face("extract_features.py").FACE.parser().format_help()
    assert latent_stats([], 4) is None
