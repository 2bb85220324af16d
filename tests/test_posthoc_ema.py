"""Post-hoc EMA (docs/ema.md): the profiles, their snapshots through resumes and kills, the reconstruction, and
every bad input as one line."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_face
from test_eval_inloop import digits, digits_ref, eval_config, records  # noqa: F401 (digits_ref: a fixture)
from test_sharded_checkpoint import fsdp
from test_train import Pixels, tiny_config
from test_train_cli import image_folder  # noqa: F401 (a fixture)
from torch import nn

from dit.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, model_weights, verify_checkpoint
from dit.checkpoint.posthoc import coefficients, gamma_of, list_snapshots, reconstruct
from dit.io.errors import UserError
from dit.model.config import DiTConfig
from dit.model.dit import DiT
from dit.train import train
from dit.train.ema import EMA

CLI = "dit/checkpoint/__main__.py"
ROOT = Path(__file__).resolve().parents[1]

# The largest error of a profile rebuilt from the others' snapshots, as a fraction of the weights' largest magnitude:
# measured 6.5e-5 to 7.3e-5 over seeds 0-4 of the walk below (docs/ema.md), so 3e-4 leaves a 4x margin.
TOLERANCE = 3e-4


def test_the_power_profile_gamma_is_the_papers():
    """EDM2's eq. between gamma and sigma_rel, and its two reference points (gamma 6.94 and 16.97)."""
    for sigma in (0.05, 0.1, 0.2, 12**-0.5):
        g = gamma_of(sigma)
        assert ((g + 1) / ((g + 2) ** 2 * (g + 3))) ** 0.5 == pytest.approx(sigma, rel=1e-9)
    assert gamma_of(0.1) == pytest.approx(6.94, abs=0.01) and gamma_of(0.05) == pytest.approx(16.97, abs=0.01)


def test_a_profile_rebuilt_from_the_other_profiles_snapshots_is_the_tracked_one():
    """Three profiles tracked on a random walk of the weights (as training drifts them); the middle one rebuilt
    from the other two's snapshots alone matches it, far closer than the neighbouring profile is."""
    g = torch.Generator().manual_seed(0)
    model = nn.Linear(64, 64)
    ema = EMA(model, 0.999, profiles=(0.05, 0.1, 0.15))
    snaps = []
    for t in range(1, 401):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        ema.update(model, apply=torch.tensor(1.0))
        if t % 20 == 0:
            snaps += [(t, k, {n: v.clone() for n, v in ema.profiles[k].model.state_dict().items()})
                      for k in ("0.05", "0.15")]  # fmt: skip
    x, residual = coefficients(
        [s for s, _, _ in snaps], [gamma_of(float(k)) for _, k, _ in snaps], 400, gamma_of(0.1)
    )
    rebuilt = {n: sum(c * w[n].double() for c, (_, _, w) in zip(x, snaps)) for n in snaps[0][2]}
    tracked = ema.profiles["0.1"].model.state_dict()
    neighbour = ema.profiles["0.05"].model.state_dict()
    error = max((rebuilt[n] - tracked[n].double()).abs().max().item() for n in tracked)
    scale = max(v.abs().max().item() for v in tracked.values())
    spread = max((tracked[n] - neighbour[n]).abs().max().item() for n in tracked)
    print(f"max error {error:.3e}, {error / scale:.2e} of the largest weight; profile residual {residual:.4f}")
    assert error <= TOLERANCE * scale
    assert spread > 100 * error  # the test could tell 0.1 from 0.05


def _weights_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_snapshots_survive_a_resume_bit_for_bit_and_rebuild_the_tracked_profile(tmp_path, capsys):
    kw = dict(ema_profiles=[0.05, 0.1], ema_snapshot_every=2)
    train(tiny_config(tmp_path / "a", max_steps=6, **kw), Pixels())
    train(tiny_config(tmp_path / "b", max_steps=3, **kw), Pixels())
    train(tiny_config(tmp_path / "b", max_steps=6, resume="auto", **kw), Pixels())
    a, b = (tmp_path / x / "run" / "checkpoints" for x in "ab")
    assert [s for s, _ in list_snapshots(a)] == [2, 4, 6]
    assert [s for s, _ in list_snapshots(b)] == [2, 3, 4, 6]  # 3: the end of the first segment
    for (_, pa), (_, pb) in zip(list_snapshots(a), [x for x in list_snapshots(b) if x[0] != 3]):
        assert verify_checkpoint(pa) and verify_checkpoint(pb)
        sa, sb = load_checkpoint(pa)["ema_profiles"], load_checkpoint(pb)["ema_profiles"]
        assert sa.keys() == sb.keys() == {"0.05", "0.1"}
        for k in sa:
            _weights_equal(sa[k], sb[k])
    last = load_checkpoint(latest_checkpoint(a))
    assert not torch.equal(last["ema_profiles"]["0.05"]["final_layer.linear.weight"],
                           last["ema_profiles"]["0.1"]["final_layer.linear.weight"])  # fmt: skip
    # the tracked profile, rebuilt from the snapshots, is itself (measured: no difference at all)
    out = tmp_path / "ema.pt"
    capsys.readouterr()
    code, printed, err = run_face(CLI, ["ema", str(a.parent), "--sigma-rel", "0.1", "--out", str(out)], capsys)
    assert code == 0, err
    rebuilt = load_checkpoint(out)
    weights, kind = model_weights(rebuilt)
    assert kind == "ema" and rebuilt["step"] == 6
    for k, v in last["ema_profiles"]["0.1"].items():
        torch.testing.assert_close(weights[k], v, rtol=0, atol=1e-6)
    DiT(DiTConfig(**rebuilt["model_config"])).load_state_dict(weights)  # what sample.py builds and loads


def test_a_kill_during_a_snapshot_save_leaves_the_earlier_ones_intact(tmp_path):
    """A process killed (SIGKILL, no clean-up) while writing the step-4 snapshot: the step-2 one still verifies
    and rebuilds, the partial file is never listed, and the resumed run finishes with every snapshot."""
    kw = dict(max_steps=6, ema_profiles=[0.05, 0.1], ema_snapshot_every=2, ckpt_every=2)
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import torch
from pathlib import Path
import dit.checkpoint.format as fmt
from test_eval_inloop import digits, digits_ref, eval_config, records  # noqa: F401 (digits_ref: a fixture)
from test_sharded_checkpoint import fsdp
from test_train import Pixels, tiny_config
from test_train_cli import image_folder  # noqa: F401 (a fixture)
from dit.train import train
real = torch.save
def dying(obj, f, *a, **k):
    if "ema_profiles" in obj and "optimizer" not in obj and obj["step"] == 4:
        f.write(b"x" * 1000)
        f.flush()
        os.kill(os.getpid(), 9)
    return real(obj, f, *a, **k)
fmt.torch.save = dying
train(tiny_config(Path({str(tmp_path)!r}), **{kw!r}), Pixels())
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=600)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    ckpts = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in list_snapshots(ckpts)] == [2] and [s for s, _ in list_checkpoints(ckpts)] == [2]
    assert any(".tmp" in p.name for p in (ckpts / "ema").iterdir())  # the cut-short write, under a temp name
    assert verify_checkpoint(ckpts / "ema" / "0000002.pt") and reconstruct(tmp_path / "run", 0.1)["step"] == 2
    train(tiny_config(tmp_path, resume="auto", **kw), Pixels())  # from step 2: step 4's snapshot is made again
    assert [s for s, _ in list_snapshots(ckpts)] == [2, 4, 6]
    assert not any(".tmp" in p.name for p in (ckpts / "ema").iterdir())
    assert all(verify_checkpoint(p) for _, p in list_snapshots(ckpts))


def test_without_profiles_the_checkpoint_is_todays(tmp_path):
    train(tiny_config(tmp_path, max_steps=2), Pixels())
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert "ema_profiles" not in ckpt and not (tmp_path / "run" / "checkpoints" / "ema").exists()
    assert set(ckpt) == {"format", "dit_ledger_version", "step", "model", "ema", "ema_updates", "optimizer", "scaler",
                         "rng", "data_position", "config", "model_config", "lineage"}  # fmt: skip


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("profiled")
    train(tiny_config(tmp, max_steps=4, ema_profiles=[0.05, 0.1], ema_snapshot_every=2), Pixels())
    return tmp / "run"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sigma-rel", "0"], "--sigma-rel must be > 0"),
        (["--sigma-rel", "-0.1"], "--sigma-rel must be > 0"),
        (["--sigma-rel", "0.3"], "wider than any power-function EMA"),
        (["--sigma-rel", "0.005"], "only to within"),  # narrower than 4 steps of snapshots can draw
        (["--sigma-rel", "0.1", "--step", "3"], "no EMA snapshot at step 3"),
    ],
)
def test_a_bad_reconstruction_is_one_line_and_writes_nothing(profiled_run, tmp_path, capsys, args, message):
    out = tmp_path / "out.pt"
    code, _, err = run_face(CLI, ["ema", str(profiled_run), *args, "--out", str(out)], capsys)
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert message in err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_run_without_snapshots_is_one_line(tmp_path, capsys):
    train(tiny_config(tmp_path, max_steps=2), Pixels())
    capsys.readouterr()
    code, _, err = run_face(CLI, ["ema", str(tmp_path / "run"), "--sigma-rel", "0.1"], capsys)
    assert code == 2 and err.startswith("error:") and "no EMA snapshots" in err and "--ema-profiles" in err
    assert not list((tmp_path / "run").glob("ema-*"))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(ema_profiles=[0]), "each sigma_rel must be in"),
        (dict(ema_profiles=[0.5]), "each sigma_rel must be in"),
        (dict(ema_profiles=[0.1, 0.1]), "name each profile once"),
        (dict(ema_profiles=[0.1], eval_sigma_rel=0.05), "pass one of"),
    ],
)
def test_bad_profiles_are_refused_at_the_flags(tmp_path, kw, message):
    with pytest.raises(UserError, match=message):
        tiny_config(tmp_path, **kw)


def test_a_resume_with_other_profiles_needs_allow_changes_and_never_adds_one(profiled_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(profiled_run, run)

    def stamps():  # the run folder's lock file aside: every start takes it
        return {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != ".lock"}

    before = stamps()
    with pytest.raises(UserError, match="ema_profiles") as e:
        train(tiny_config(tmp_path, max_steps=6, ema_profiles=[0.05], resume="auto"), Pixels())
    assert "--allow-changes" in str(e.value) and stamps() == before
    allowed = dict(resume="auto", allow_changes=["ema_profiles"])
    with pytest.raises(UserError, match="cannot start on a resume"):  # before anything is written
        train(tiny_config(tmp_path, max_steps=6, ema_profiles=[0.05, 0.1, 0.2], **allowed), Pixels())
    assert stamps() == before
    train(tiny_config(tmp_path, max_steps=6, ema_profiles=[0.05], ema_snapshot_every=2, **allowed), Pixels())
    assert set(load_checkpoint(list_snapshots(run / "checkpoints")[-1][1])["ema_profiles"]) == {"0.05"}


def test_fsdp_snapshots_are_sharded_folders_that_resume_exactly_and_rebuild(image_folder, tmp_path, capsys):  # noqa: F811
    """Two FSDP processes: each snapshot is a sharded folder with its manifest, a resume writes the same shards'
    contents, and the reconstruction reads the folders on one process."""
    extra = ("--ema-profiles", "0.05", "0.1", "--ema-snapshot-every", "2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    fsdp(image_folder, straight, 4, *extra)
    fsdp(image_folder, resumed, 3, *extra)
    fsdp(image_folder, resumed, 4, "--resume", "auto", *extra)
    a, b = (f / "checkpoints" for f in (straight, resumed))
    assert [(s, p.is_dir()) for s, p in list_snapshots(a)] == [(2, True), (4, True)]
    assert all(verify_checkpoint(p) for _, p in list_snapshots(a) + list_snapshots(b))
    sa, sb = (load_checkpoint(f / "ema" / "0000004")["ema_profiles"] for f in (a, b))
    for k in ("0.05", "0.1"):
        _weights_equal(sa[k], sb[k])
    out = tmp_path / "ema.pt"
    code, _, err = run_face(CLI, ["ema", str(straight), "--sigma-rel", "0.1", "--out", str(out)], capsys)
    assert code == 0, err
    for k, v in load_checkpoint(a / "0000004")["ema_profiles"]["0.1"].items():
        torch.testing.assert_close(load_checkpoint(out)["ema"][k], v, rtol=0, atol=1e-6)


def test_the_in_loop_evaluation_scores_the_named_profile(tmp_path, digits_ref):  # noqa: F811
    """--eval-sigma-rel: the record names the profile, and its scores are the profile's, not the classic EMA's."""
    scores = {}
    for name, kw in (("classic", {}), ("profile", {"eval_sigma_rel": 0.1})):
        cfg = eval_config(tmp_path / name, digits_ref, max_steps=2, ema_profiles=[0.05, 0.1], **kw)
        train(cfg, digits())
        (scores[name],) = [r for r in records(tmp_path / name / "run") if r["kind"] == "eval"]
    assert scores["profile"]["ema_sigma_rel"] == 0.1 and "ema_sigma_rel" not in scores["classic"]
    assert scores["profile"]["fid"] != scores["classic"]["fid"]


def test_a_rebuilt_ema_of_a_channel_normalised_run_samples_with_its_statistics(tmp_path, vae_dir, capsys):
    """The snapshots carry the run's latent statistics, and the rebuilt checkpoint hands them to the sampler."""
    from test_latent_norm import moments, store_config

    from dit.data.store import read_manifest, write_moments_store
    from dit.data.vae import ChannelNorm
    from dit.sample.loading import load_sampling_model

    store = str(tmp_path / "store")
    write_moments_store(store, moments(), torch.arange(24) % 3, 3, source=vae_dir)
    cfg = store_config(store, tmp_path / "run", latent_norm="channel", ema_profiles=[0.05, 0.1])
    train(cfg)
    out = tmp_path / "ema.pt"
    capsys.readouterr()
    code, _, err = run_face(CLI, ["ema", str(tmp_path / "run"), "--sigma-rel", "0.08", "--out", str(out)], capsys)
    assert code == 0, err
    sm = load_sampling_model(out, device="cpu")
    assert sm.latent_norm == ChannelNorm.of(read_manifest(store)["latent_stats"])
