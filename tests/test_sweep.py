"""The reliability sweep (docs/reliability.md, item 9): each class of bad input tried on every face it can reach,
so that a new flag, face or file reader is covered the day it appears. Every case must end in one ``error:``
line that names what is wrong, exit status 2, and no traceback."""

from __future__ import annotations

import os
import subprocess
import typing

import pytest
from helpers import faces

from dit.io.cli import run_cli
from dit.io.config import _REQUIRED, _hints, _unwrap
from dit.io.errors import UserError

# ---- helpers -------------------------------------------------------------------------------------------


def _commands():
    """(name, subcommand or None, its Face) of every command line; dit-cost is the same Face as dit.cost."""
    for name, face in faces().items():
        if name == "dit-cost":
            continue
        for sub, f in face.commands.items() or [(None, face)]:
            yield name, sub, f


def _field_type(f, flat):
    """(element type, is a tuple, the field) of option ``flat``: ``tuple[int, ...]`` -> (int, True, field)."""
    attr, field = f.fields[flat]
    hint, _ = _unwrap(_hints(f.sections[attr][0])[field.name])
    many = typing.get_origin(hint) is tuple
    return (typing.get_args(hint)[0] if many else hint), many, field


def _argv(f, sub, tmp_path, flat=None, value=None, extra=(), given=None):
    """A command line with every required option filled (a harmless value), ``flat`` set to ``value`` and the
    options in ``given`` to theirs (as a flag or in its place as a positional argument)."""
    flags, positional, given = [], [], {**(given or {}), **({flat: value} if flat else {})}
    for name in f.fields:
        tp, _, field = _field_type(f, name)
        if field.default is not _REQUIRED and name not in given:
            continue
        choices = field.metadata.get("choices")
        fill = given.get(name, choices[0] if choices else "1" if tp is float else str(tmp_path / name))
        if field.metadata.get("positional"):
            positional.append(fill)
        else:
            flags.append(f"{f.flag(name)}={fill}")  # --lr=-inf: not read as a flag of its own
    return ([sub] if sub else []) + flags + list(extra) + positional


def _one_error_line(capsys, face, argv) -> str:
    code = run_cli(face.parse, argv)
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


def _every_option():
    for name, sub, f in _commands():
        for flat in f.fields:
            yield pytest.param(name, sub, flat, id=f"{name}{' ' + sub if sub else ''} {f.flag(flat)}")


# ---- a. non-finite and wrongly typed values, as flags and as preset keys ----------------------------

FLAG_VALUES = {int: ["nan", "inf", "-inf", "abc", "1.5"], float: ["nan", "inf", "-inf", "abc"], bool: ["nan"],
               float | str: ["nan", "inf", "-inf", "abc", "0"]}  # fmt: skip
PRESET_VALUES = {
    int: [".nan", ".inf", "-.inf", "abc", "1.5", "true"],
    float: [".nan", ".inf", "-.inf", "abc", "true"],
    bool: [".nan", "abc", "1"],
    str: [".nan", "1.5", "[a, b]"],
    float | str: [".nan", ".inf", "-.inf", "abc", "true", "[a, b]"],  # a number or a word (--time-shift auto)
}


@pytest.mark.parametrize("name,sub,flat", list(_every_option()))
def test_a_bad_flag_value_is_one_line_naming_the_flag(name, sub, flat, tmp_path, capsys):
    face, f = _face(name, sub)
    tp, _, field = _field_type(f, flat)
    values = ["nan"] if tp is str and field.metadata.get("choices") else FLAG_VALUES.get(tp)
    if not values:
        pytest.skip("a free string (a path, a model or device name): any text is a value of the right type")
    for value in values:
        line = _one_error_line(capsys, face, _argv(f, sub, tmp_path, flat, value))
        assert f.flag(flat) in line or "invalid choice" in line and value in line, (value, line)


@pytest.mark.parametrize("name,sub,flat", list(_every_option()))
def test_a_bad_preset_value_is_one_line_naming_the_key(name, sub, flat, tmp_path, capsys):
    face, f = _face(name, sub)
    tp, many, field = _field_type(f, flat)
    if field.default is _REQUIRED or field.metadata.get("positional"):
        pytest.skip("a required option is asked of the command line itself (argparse), never of a preset")
    preset = tmp_path / "preset.yaml"
    for value in PRESET_VALUES[tp]:
        if many and value.startswith("["):
            continue  # a list is a tuple option's own type
        preset.write_text(f"{flat}: {value}\n")
        line = _one_error_line(capsys, face, _argv(f, sub, tmp_path, extra=["--config", str(preset)]))
        assert f"{preset}: {flat}" in line, (value, line)


def _face(name, sub):
    face = faces()[name]
    return face, face.commands[sub] if sub else face


# ---- b. output paths the OS refuses --------------------------------------------------------------------

# the names the faces give what they write
OUTPUT_NAMES = {"out", "plot", "results_dir", "sample_dir", "report", "reference_out"}


def test_every_option_that_names_an_output_is_checked_as_one():
    """A new face's --out is covered by the path checks below only once its Face lists it in ``outputs``."""
    missing = [
        f"{name} {sub or ''} {f.flag(flat)}"
        for name, sub, f in _commands()
        for flat in f.fields
        if flat in OUTPUT_NAMES and flat not in f.outputs
    ]
    assert missing == []
    assert faces()["extract_features.py"].outputs == {"feature_path": "folder"}


def _every_output():
    for name, sub, f in _commands():
        for flat, kind in f.outputs.items():
            yield pytest.param(name, sub, flat, kind, id=f"{name}{' ' + sub if sub else ''} {f.flag(flat)}")


@pytest.mark.parametrize("name,sub,flat,kind", list(_every_output()))
def test_an_output_path_the_os_refuses_is_one_line_before_any_work(
    name, sub, flat, kind, read_only, tmp_path, capsys
):
    face, f = _face(name, sub)
    leaf = "run" if kind == "folder" else "out.json"
    line = _one_error_line(capsys, face, _argv(f, sub, tmp_path, flat, str(read_only / "sub" / leaf)))
    assert f.flag(flat) in line and f"{read_only}" in line and "not a writable folder" in line, line
    line = _one_error_line(capsys, face, _argv(f, sub, tmp_path, flat, str(tmp_path / ("n" * 300) / leaf)))
    assert f.flag(flat) in line and "longer than the file system takes" in line, line
    wrong = tmp_path / "wrong"
    (wrong.mkdir() if kind == "file" else wrong.write_text("a file"))
    line = _one_error_line(capsys, face, _argv(f, sub, tmp_path, flat, str(wrong)))
    assert f.flag(flat) in line and ("is a folder" if kind == "file" else "is a file") in line, line
    assert not os.listdir(read_only)


# The names the faces give what they read from a path; a face that writes declares each in ``inputs``.
INPUT_NAMES = {
    "data_path",
    "feature_path",
    "ckpt",
    "init_from",
    "images",
    "npz",
    "latents",
    "adm",
    "store",
    "vae",
    "class_names",
    "eval_ref",
    "inception_weights",
    "eval_inception_weights",
    "repa_encoder_weights",
}


def test_every_option_that_names_an_input_of_a_writing_face_is_declared():
    missing = [
        f"{name} {sub or ''} {f.flag(flat)}"
        for name, sub, f in _commands()
        for flat in f.fields
        if f.outputs and flat in INPUT_NAMES and flat not in {**f.inputs, **f.outputs}
    ]
    assert missing == []


def _every_output_and_input():
    for name, sub, f in _commands():
        for out, out_kind in f.outputs.items():
            for source, kind in f.inputs.items():
                label = f"{name}{' ' + sub if sub else ''} {f.flag(out)} {f.flag(source)}"
                yield pytest.param(name, sub, out, out_kind, source, kind, id=label)


@pytest.mark.parametrize("name,sub,out,out_kind,source,kind", list(_every_output_and_input()))
def test_an_output_inside_or_on_an_input_is_one_line_before_any_work(
    name, sub, out, out_kind, source, kind, tmp_path, capsys
):
    """A results folder or a latent store inside the image folder became an extra class on its next scan: every
    output of every face is checked against every input it reads, links resolved, before anything is written."""
    face, f = _face(name, sub)
    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    (tmp_path / "link").symlink_to(data)
    if kind == "folder":  # inside a folder read whole, also through a link to it
        for written in (data / "sub" / "x", tmp_path / "link" / "x"):
            argv = _argv(f, sub, tmp_path, out, str(written), given={source: str(data)})
            line = _one_error_line(capsys, face, argv)
            assert f.flag(out) in line and f.flag(source) in line and f"inside {f.flag(source)}" in line, line
    read = tmp_path / ("read" if out_kind == "file" else "read_folder")
    (read.write_bytes(b"x") if out_kind == "file" else read.mkdir())
    line = _one_error_line(capsys, face, _argv(f, sub, tmp_path, out, str(read), given={source: str(read)}))
    assert f.flag(out) in line and f.flag(source) in line and "which this command reads" in line, line
    assert sorted(p.name for p in data.rglob("*")) == ["a"] and read.exists()
    # the other way round: what it reads may lie inside what it writes (never touched there)
    inner = tmp_path / "results" / "in"
    (inner.mkdir(parents=True) if kind == "folder" else (inner.parent.mkdir(), inner.write_bytes(b"x")))
    written = tmp_path / "results" if out_kind == "folder" else tmp_path / "results.json"
    try:  # the other checks may refuse the harmless filler values; this one may not
        f.build({**_filled(f, tmp_path), out: str(written), source: str(inner)})
    except UserError as e:
        assert "which this command reads" not in str(e) and f"inside {f.flag(source)}" not in str(e), e


def _filled(f, tmp_path) -> dict:
    """The required options of ``f`` with harmless values, as ``Face.build`` takes them."""
    return {name: str(tmp_path / name) for name in f.fields if _field_type(f, name)[2].default is _REQUIRED}


def test_a_write_the_os_refuses_later_is_one_line_and_leaves_nothing(read_only, tmp_path, capsys):
    """Past the face's check (a folder made read-only meanwhile, a name built by the run): the one write
    point, dit.io.atomic, and for any other open the CLI's printer, say it in one line."""
    from dit.io.atomic import atomic_write_bytes

    def main(argv):
        atomic_write_bytes(argv[0], b"{}")

    for path in (read_only / "a.json", tmp_path / ("n" * 300) / "a.json", tmp_path / ("n" * 300 + ".pt")):
        code = run_cli(main, [str(path)])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: cannot write") and err.count("\n") == 1, err
    assert not os.listdir(read_only) and os.listdir(tmp_path) == []

    def opens(argv):
        open(argv[0], "w")

    assert run_cli(opens, [str(tmp_path / ("n" * 300))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot use") and "File name too long" in err and err.count("\n") == 1, err
    with pytest.raises(FileNotFoundError):  # a path that does not exist is not the OS refusing: a bug's traceback
        run_cli(lambda argv: open(tmp_path / "missing" / "x"), [])


# ---- f. the error line under a progress bar ----------------------------------------------------------


def _on_a_terminal(argv: list[str], timeout: float = 300) -> tuple[int, str]:
    """(exit status, everything written) of ``python argv`` with stdout and stderr on a pseudo-terminal, where
    the progress bars are tqdm's, redrawn with carriage returns."""
    import fcntl
    import pty
    import struct
    import sys
    import termios

    from helpers import ROOT

    leader, follower = pty.openpty()
    fcntl.ioctl(
        follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0)
    )  # tqdm draws nothing in 0 columns
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(timeout), b"".join(chunks).decode(errors="replace")


def test_an_error_while_a_bar_is_drawn_starts_its_own_line(tmp_path, vae_dir):
    """extract_features.py --strict meets the corrupt JPEG while its bar is on the terminal: the error line
    used to be glued onto the bar's ("encoding:  0%| | 0/9 [00:00<?, ?img/s]error: ...")."""
    from helpers import make_image_folder

    images = make_image_folder(tmp_path / "images")
    os.remove(os.path.join(images, "a_cat", "notes.txt"))  # the scan's finds, refused before the bar
    os.rmdir(os.path.join(images, "c_empty"))
    argv = ["extract_features.py", "--data-path", images, "--feature-path", str(tmp_path / "store"),
            "--image-size", "32", "--vae", vae_dir, "--num-workers", "0", "--strict"]  # fmt: skip
    code, text = _on_a_terminal(argv)
    assert code == 2 and "broken.jpg" in text and "Traceback" not in text, text
    assert "%|" in text, f"no bar was drawn: {text!r}"
    (line,) = [s for s in text.replace("\r", "\n").split("\n") if "error:" in s]
    assert line.startswith("error: "), repr(text)


# ---- c. degenerate files wherever a file a user names is read --------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10"
DEGENERATE = {"empty": b"", "truncated": b'{"a": [1, 2', "png": PNG, "folder": None}
# (reader, face, argv with {file}, the file's name: the readers that take a file by its content's format)
READERS = [
    ("preset", "train.py", ["--config", "{file}"], "preset.yaml"),
    ("calibration", "dit.cost", ["train", "--model", "DiT-S/2", "--calibration", "{file}"], "cal.json"),
    ("vae config", "dit.cost", ["train", "--model", "DiT-S/2", "--vae", "{folder}"], "config.json"),
    ("store manifest", "train.py", ["--feature-path", "{folder}", "--results-dir", "{tmp}/run"], "manifest.json"),
]


@pytest.mark.parametrize("reader,face_name,argv,name", READERS, ids=[r[0] for r in READERS])
@pytest.mark.parametrize("kind", list(DEGENERATE))
def test_a_degenerate_file_is_one_line_naming_it(reader, face_name, argv, name, kind, tmp_path, capsys):
    from helpers import face

    from dit.train.config import resolve

    folder = tmp_path / "given"
    folder.mkdir()
    path = folder / name
    if DEGENERATE[kind] is None:
        path.mkdir()
    else:
        path.write_bytes(DEGENERATE[kind])
    argv = [a.format(file=path, folder=folder, tmp=tmp_path) for a in argv]
    main = (lambda a: resolve(a) and 0) if face_name == "train.py" else face("dit/cost/__main__.py")._main
    code = run_cli(main, argv)
    err = capsys.readouterr().err
    if kind == "empty" and reader == "preset":  # an empty preset sets nothing: a run of the defaults
        assert code == 0, err
        return
    named = folder if kind == "folder" and name in ("config.json", "manifest.json") else path  # "no manifest.json"
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and str(named) in err, err


@pytest.mark.parametrize("kind", list(DEGENERATE) + ["not ids"])
def test_a_degenerate_class_names_file_is_one_line(kind, tmp_path):
    from dit.io.errors import UserError
    from dit.sample.export import read_id2label

    path = tmp_path / "names.json"
    if kind == "not ids":
        path.write_text('{"cat": "dog"}')
    elif DEGENERATE[kind] is None:
        path.mkdir()
    else:
        path.write_bytes(DEGENERATE[kind])
    with pytest.raises(UserError) as e:
        read_id2label(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)
    (tmp_path / "names.txt").write_bytes(PNG)
    with pytest.raises(UserError, match="is not a text file"):
        read_id2label(tmp_path / "names.txt")


@pytest.mark.parametrize("kind", ["empty", "truncated", "png", "text"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_degenerate_weights_files_are_one_line(kind, suffix, tmp_path, capsys):
    """The weights files a user names: --repa-encoder-weights (timm's loader: EOFError and SafetensorError
    were tracebacks), --init-from / --ckpt (dit.checkpoint) and a VAE folder's weights (diffusers)."""
    from helpers import build_tiny_vae

    from dit.checkpoint import load_checkpoint
    from dit.data.encoder import WEIGHTS, Encoder
    from dit.data.vae import load_vae

    real = (WEIGHTS / "digits_mae.safetensors").read_bytes()
    content = {"empty": b"", "truncated": real[:1000], "png": PNG + b"0" * 64, "text": b"not weights\n"}[kind]
    path = tmp_path / f"weights{suffix}"
    path.write_bytes(content)
    vae = tmp_path / "vae"
    build_tiny_vae().save_pretrained(vae)
    (vae / "diffusion_pytorch_model.safetensors").write_bytes(content)
    for load in (
        lambda: Encoder("digits-mae", str(path), 28),
        lambda: load_checkpoint(path),
        lambda: load_vae(str(vae), "cpu"),
    ):
        assert run_cli(lambda argv, load=load: load(), []) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err


# ---- e. sampling requests outside what the checkpoint's diffusion allows -------------------------------

SAMPLING_REQUESTS = [
    (["--num-sampling-steps", "2000"], "exceeds the diffusion's 1000 steps"),
    (["--num-sampling-steps", "0"], "--num-sampling-steps must be >= 1"),
    (["--num-sampling-steps", "1"], "--sampler ddpm needs --num-sampling-steps 2 or more"),
    (["--sampler", "ddim", "--num-sampling-steps", "1001"], "exceeds the diffusion's 1000 steps"),
    (["--guidance-scale", "0.5"], "must be >= 1"),
    (["--guidance-scale=-inf"], "must be a finite number"),
    (["--class-labels", "10"], "out of range for a 10-class model"),
    (["--sampler", "ode"], "does not sample a diffusion model"),
    (["--sampling-method", "dopri5"], "--sampling-method is for flow models"),
]


@pytest.mark.parametrize("extra,words", SAMPLING_REQUESTS, ids=[" ".join(r[0]) for r in SAMPLING_REQUESTS])
@pytest.mark.parametrize("script", ["sample.py", "scripts/sample_ddp.py"])
def test_a_sampling_request_the_checkpoint_cannot_serve_is_one_line_before_sampling(
    script, extra, words, our_ckpt, tmp_path, capsys
):
    from helpers import run_face

    if script == "scripts/sample_ddp.py" and extra[0] == "--class-labels":
        pytest.skip("an FID set draws its labels from the seed: sample_ddp.py has no --class-labels")
    out = (
        ["--out", str(tmp_path / "grid.png")] if script == "sample.py" else ["--sample-dir", str(tmp_path / "set")]
    )
    code, _, err = run_face(script, ["--ckpt", str(our_ckpt), "--device", "cpu", *out, *extra], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert not list(tmp_path.iterdir()), "nothing sampled, nothing written"
