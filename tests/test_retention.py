"""--keep-last: after every save exactly the newest min(n, K) checkpoints of the line followed remain, with
their checksums; across a resume, a rollback branch and a requeue (issue 31, item 1). --keep-every N: and every
checkpoint whose step is a multiple of N, for good, in both forms and across a resume (issue 41, item 7)."""

from pathlib import Path

import pytest
import torch
from helpers import make_image_folder, run_face

from dit.checkpoint import checksum_path, list_checkpoints, save_training_checkpoint
from dit.checkpoint.lineage import begin_segment, follow, plan_segment


def steps_in(folder: Path) -> list[int]:
    """The steps saved in ``folder``, after checking that every checkpoint has its checksum and no checksum
    outlived its checkpoint."""
    found = [s for s, _ in list_checkpoints(folder)]
    sums = sorted(p.name.removesuffix(".sha256") for p in folder.glob("*.pt.sha256"))
    assert sums == [f"{s:07d}.pt" for s in found]
    return found


def newest(steps, keep: int, every: int = 0) -> list[int]:
    """What retention keeps of ``steps``: the newest ``keep`` (0: all) and the multiples of ``every``."""
    steps = list(steps)
    recent = steps if keep == 0 else steps[max(0, len(steps) - keep) :]
    return [s for s in steps if s in recent or (every and s % every == 0)]


class Segment:
    """One run segment as the trainer runs it: its lineage planned from the checkpoint it resumes (None: a
    fresh run), the checkpoints off its line set aside, then saves that carry its lineage."""

    def __init__(self, folder: Path, resume_from: Path | None, keep_last: int, keep_every: int = 0):
        ckpt = None if resume_from is None else torch.load(resume_from, weights_only=True)
        self.line, off = plan_segment(folder, resume_from, ckpt)
        begin_segment(folder, self.line, off)
        self.folder, self.retention = folder, (keep_last, keep_every)

    def save(self, step: int) -> None:
        payload = {"model": {"w": torch.full((2,), float(step))}, "lineage": self.line}
        save_training_checkpoint(self.folder, step, payload, *self.retention)


@pytest.mark.parametrize("keep", range(7))
def test_keep_last_keeps_the_newest_k_after_every_save(tmp_path, keep):
    folder = tmp_path / "checkpoints"
    for n in range(1, 13):
        save_training_checkpoint(folder, n, {"model": {}}, keep)
        assert steps_in(folder) == newest(range(1, n + 1), keep), f"after save {n}"


@pytest.mark.parametrize("keep", range(7))
def test_keep_last_across_a_resume(tmp_path, keep):
    folder = tmp_path / "checkpoints"
    first = Segment(folder, None, keep)
    for n in range(1, 7):
        first.save(n)
    resumed, _ = follow(folder)
    assert resumed.name == "0000006.pt"
    again = Segment(folder, resumed, keep)
    for n in range(7, 13):
        again.save(n)
        assert steps_in(folder) == newest(range(1, n + 1), keep), f"after save {n}"


@pytest.mark.parametrize(("before", "after"), [(5, 2), (2, 5), (0, 3), (3, 0)])
def test_a_resume_with_another_keep_last(tmp_path, before, after):
    folder = tmp_path / "checkpoints"
    first = Segment(folder, None, before)
    for n in range(1, 7):
        first.save(n)
    again = Segment(folder, follow(folder)[0], after)
    for n in range(7, 10):
        again.save(n)
        kept = [s for s in range(1, n + 1) if s in newest(range(1, 7), before) or s > 6]
        assert steps_in(folder) == newest(kept, after), f"after save {n}"


@pytest.mark.parametrize("keep", [0, 2, 3, 4, 5, 6])
def test_keep_last_across_a_rollback_branch_and_a_requeue(tmp_path, keep):
    """Steps 1-8, a rollback to the oldest checkpoint kept, saves to 12 on the new branch, a requeue to 14:
    keep_last counts the new branch's line alone, and the abandoned branch stays whole."""
    folder = tmp_path / "checkpoints"
    first = Segment(folder, None, keep)
    for n in range(1, 9):
        first.save(n)
    kept = steps_in(folder)
    back = 2 if keep == 0 else kept[0]
    rollback = Segment(folder, folder / f"{back:07d}.pt", keep)
    (aside,) = (folder / "abandoned").iterdir()
    assert steps_in(aside) == [s for s in kept if s > back]
    line = [s for s in kept if s <= back]
    for n in range(back + 1, 13):
        rollback.save(n)
        line.append(n)
        assert steps_in(folder) == newest(line, keep), f"after save {n}"
    requeued, _ = follow(folder)
    assert requeued.name == "0000012.pt"
    requeue = Segment(folder, requeued, keep)
    assert requeue.line["branch"] == rollback.line["branch"]
    for n in (13, 14):
        requeue.save(n)
        line.append(n)
        assert steps_in(folder) == newest(line, keep), f"after save {n}"
    assert steps_in(aside) == [s for s in kept if s > back]  # never counted, never deleted
    assert [p.name for p in (folder / "abandoned").iterdir()] == [aside.name]


def test_checkpoints_newer_than_the_save_are_neither_counted_nor_deleted(tmp_path):
    """A resume that fell back past files failing their checksum saves below them: they are not on its line,
    and counting them would delete the good checkpoints it keeps."""
    folder = tmp_path / "checkpoints"
    for n in range(1, 7):
        save_training_checkpoint(folder, n, {"model": {}}, 0)
    for n in (5, 6):
        path = folder / f"{n:07d}.pt"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # a flipped byte: fails its checksum
        path.write_bytes(bytes(data))
    resumed, bad = follow(folder)
    assert resumed.name == "0000004.pt" and [p.name for p in bad] == ["0000006.pt", "0000005.pt"]
    save_training_checkpoint(folder, 5, {"model": {}}, 3)  # replaces the damaged 5; 6 waits for its step
    assert steps_in(folder) == [3, 4, 5, 6]
    save_training_checkpoint(folder, 6, {"model": {}}, 3)
    assert steps_in(folder) == [4, 5, 6]
    assert checksum_path(folder / "0000006.pt").read_text().split()[1] == "0000006.pt"


def train_argv(tmp_path, *extra) -> list[str]:
    images = tmp_path / "images"
    if not images.exists():
        make_image_folder(images, {"a": 4, "b": 4})
        (images / "a" / "broken.jpg").unlink()  # the helper's undecodable image would stop the run
    return ["--data-path", str(images), "--vae", "none", "--depth", "1", "--hidden-size", "16", "--num-heads", "2",
            "--image-size", "8", "--num-classes", "3", "--global-batch-size", "4", "--ckpt-every", "1",
            "--precision", "fp32", "--num-workers", "0", "--peak-tflops", "0.05", "--device", "cpu",
            "--results-dir", str(tmp_path / "run"), *extra]  # fmt: skip


def test_train_py_keeps_the_default_five(tmp_path, capsys):
    """The issue's case, through train.py: --ckpt-every 1 --max-steps 8 --keep-last 5 kept only steps 7 and 8."""
    code, _, err = run_face("train.py", train_argv(tmp_path, "--max-steps", "8", "--keep-last", "5"), capsys)
    assert code == 0, err
    assert steps_in(tmp_path / "run" / "checkpoints") == [4, 5, 6, 7, 8]


def test_train_py_keeps_every_nth_recorded_and_changeable_on_a_resume(tmp_path, capsys):
    """--keep-every is recorded: a requeue keeps the milestones without the flag, and a resume may change it."""
    folder = tmp_path / "run" / "checkpoints"
    code, _, err = run_face("train.py", train_argv(tmp_path, "--max-steps", "6", "--keep-last", "1",
                                                   "--keep-every", "3"), capsys)  # fmt: skip
    assert code == 0, err
    assert steps_in(folder) == [3, 6]
    assert "keep_every: 3" in (tmp_path / "run" / "config.yaml").read_text()
    code, _, err = run_face("train.py", train_argv(tmp_path, "--max-steps", "8", "--resume", "auto"), capsys)
    assert code == 0, err
    assert steps_in(folder) == [3, 6, 8]
    argv = train_argv(tmp_path, "--max-steps", "10", "--resume", "auto", "--keep-every", "2")
    code, _, err = run_face("train.py", argv, capsys)
    assert code == 0 and "--keep-every 2 (recorded 3)" in err, err
    assert steps_in(folder) == [6, 8, 10]


def sharded_save(folder: Path, step: int, keep: int, every: int = 0) -> None:
    """A sharded checkpoint as an FSDP run seals one (shards, record, manifest, rename), then its retention."""
    import warnings

    from dit.checkpoint import sharded
    from dit.checkpoint.format import checkpoint_path, retire, stamped

    final = checkpoint_path(folder, step, sharded=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group: one process" note
        sharded.write(sharded.temp_folder(final), {"model": {"w": torch.full((2,), float(step))}})
    sharded.seal(sharded.temp_folder(final), final, step, stamped(step, {"optimizer": {}}), {})
    retire(folder, step, keep, every)


@pytest.mark.parametrize("keep", (1, 2, 3))
def test_keep_last_counts_sharded_folders_and_files_alike(tmp_path, keep):
    """An FSDP run's folders and a one-process run's files in one run folder (a resume on another world size)."""
    folder = tmp_path / "checkpoints"
    for n in range(1, 7):
        if n % 2:
            sharded_save(folder, n, keep)
        else:
            save_training_checkpoint(folder, n, {"model": {}}, keep)
        assert [s for s, _ in list_checkpoints(folder)] == newest(range(1, n + 1), keep), f"after save {n}"
        assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == [
            f"{s:07d}" for s in newest(range(1, n + 1), keep) if s % 2
        ]


RETENTIONS = [(keep, every) for keep in (0, 1, 2, 3, 5) for every in (1, 3, 4, 7, 25)]


@pytest.mark.parametrize(("keep", "every"), RETENTIONS)
def test_keep_every_keeps_the_milestones_beside_the_newest_k(tmp_path, keep, every):
    """Over 24 saves: after each, the newest K and every multiple of N saved so far, nothing else."""
    folder = tmp_path / "checkpoints"
    for n in range(1, 25):
        save_training_checkpoint(folder, n, {"model": {}}, keep, every)
        assert steps_in(folder) == newest(range(1, n + 1), keep, every), f"after save {n}"


@pytest.mark.parametrize(("keep", "every"), RETENTIONS)
def test_keep_every_across_a_resume(tmp_path, keep, every):
    folder = tmp_path / "checkpoints"
    first = Segment(folder, None, keep, every)
    for n in range(1, 11):
        first.save(n)
    again = Segment(folder, follow(folder)[0], keep, every)
    for n in range(11, 25):
        again.save(n)
        assert steps_in(folder) == newest(range(1, n + 1), keep, every), f"after save {n}"


@pytest.mark.parametrize(("before", "after"), [(0, 3), (3, 0), (3, 4)])
def test_a_resume_with_another_keep_every_applies_it_from_its_first_save(tmp_path, before, after):
    """Retention is the rule in force at each save: a milestone of the old N left alone by the new one goes once
    it falls out of the newest K."""
    folder = tmp_path / "checkpoints"
    first = Segment(folder, None, 2, before)
    for n in range(1, 11):
        first.save(n)
    kept = newest(range(1, 11), 2, before)
    again = Segment(folder, follow(folder)[0], 2, after)
    for n in range(11, 19):
        again.save(n)
        assert steps_in(folder) == newest([*kept, *range(11, n + 1)], 2, after), f"after save {n}"


def test_keep_every_keeps_sharded_folders_and_files_alike(tmp_path):
    folder = tmp_path / "checkpoints"
    for n in range(1, 10):
        if n % 2:
            sharded_save(folder, n, 2, 3)
        else:
            save_training_checkpoint(folder, n, {"model": {}}, 2, 3)
        assert [s for s, _ in list_checkpoints(folder)] == newest(range(1, n + 1), 2, 3), f"after save {n}"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["0000003", "0000009"]
