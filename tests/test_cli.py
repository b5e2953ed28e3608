"""The command line: exit codes, one-line errors, --json, -q, --version, progress, warnings."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import (
    assert_json_error_stderr,
    assert_one_error_line,
    listing,
    tensor_bytes,
    write_safetensors,
)
from helpers import cli_env, run_on_pty, run_python
from stcast._console import cli_words as out_words

FIXTURES = Path(__file__).parent / "fixtures"


def write_fixture_model(folder: Path) -> Path:
    """The small checkpoint the JSON fixtures describe."""
    return write_safetensors(
        folder / "model.safetensors",
        {
            "embed.weight": ("F32", [2, 2], np.array([1, 2, 3, 4], np.float32)),
            "position_ids": ("I64", [1], np.int64(7).tobytes()),
            "norm.weight": ("F64", [1], np.float64(1.5).tobytes()),
        },
        metadata={"format": "pt", "note": "fixture"},
    )


def match_fixture(got, want, tmp: Path, where: str = "$") -> None:
    """Compare JSON with a fixture: same keys in the same order, same stable values.

    Placeholders: "<int>", "<number>", "<str>", "<version>"; "{tmp}" in a string stands for
    the test's folder.
    """
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            match_fixture(got[k], want[k], tmp, f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            match_fixture(g, w, tmp, f"{where}[{i}]")
    elif want == "<int>":
        assert isinstance(got, int) and not isinstance(got, bool), f"{where}: {got!r}"
    elif want == "<number>":
        assert isinstance(got, (int, float)) and not isinstance(got, bool), f"{where}: {got!r}"
    elif want == "<str>":
        assert isinstance(got, str) and got, f"{where}: {got!r}"
    elif want == "<version>":
        assert got == stcast.__version__, where
    elif isinstance(want, str):
        assert got == want.replace("{tmp}", str(tmp)), where
    else:
        assert got == want and type(got) is type(want), f"{where}: {got!r} != {want!r}"


def load_fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


# --- success --------------------------------------------------------------------------------


def test_convert_human_summary(tmp_path, run_main):
    src = write_fixture_model(tmp_path)
    rc, out, err = run_main("convert", src)
    assert rc == 0, err
    assert err == ""  # not a TTY: no progress bar, and nothing to warn about
    dst = tmp_path / "model-bf16.safetensors"
    assert out.startswith(f"converted {src} -> {dst}\n")
    assert "2 converted, 1 copied" in out
    assert tensor_bytes(dst)["embed.weight"][0] == "BF16"


def test_convert_json_matches_fixture(tmp_path, run_main):
    src = write_fixture_model(tmp_path)
    rc, out, err = run_main("convert", src, "--json")
    assert rc == 0, err
    assert err == ""
    assert out.count("\n") == 1
    doc = json.loads(out)
    match_fixture(doc, load_fixture("convert.json"), tmp_path)
    dst = Path(doc["result"]["dst"])
    assert doc["result"]["bytes_out"] == dst.stat().st_size


def test_inspect_json_matches_fixture(tmp_path, run_main):
    src = write_fixture_model(tmp_path)
    before = listing(tmp_path)
    rc, out, err = run_main("inspect", src, "--json")
    assert rc == 0, err
    assert err == ""
    doc = json.loads(out)
    match_fixture(doc, load_fixture("inspect.json"), tmp_path)
    assert listing(tmp_path) == before
    rc, out2, _ = run_main("convert", src, "--json")
    assert doc["result"]["output_bytes"] == json.loads(out2)["result"]["bytes_out"]


def test_inspect_json_is_the_whole_document_dumped_at_once(tmp_path, run_main):
    """The tensors array is written a chunk at a time: the text is still exactly `json.dumps`
    of the whole document (names needing escapes, metadata before the tensors, 5,000 rows:
    more than one chunk)."""
    tensors = {f'w"\\{i}\u00e9\U0001f600\x7f': ("F32", [2], bytes(8)) for i in range(5000)}
    src = write_safetensors(tmp_path / "m.safetensors", tensors, {"k": "tensors"})
    rc, out, err = run_main("inspect", src, "--json")
    assert rc == 0, err
    report = stcast.inspect(src)
    result = out_words(report.to_dict())
    doc = {"schema": 1, "command": "inspect", "version": stcast.__version__, "result": result}
    assert out == json.dumps(doc) + "\n"
    assert len(json.loads(out)["result"]["tensors"]) == 5000


def test_inspect_human(tmp_path, run_main):
    src = write_fixture_model(tmp_path)
    rc, out, err = run_main("inspect", src)
    assert rc == 0 and err == ""
    for word in ["embed.weight", "position_ids", "norm.weight", "convert", "copy", "format"]:
        assert word in out
    assert out.index("embed.weight") < out.index("position_ids") < out.index("norm.weight")


def test_quiet(tmp_path, run_main):
    src = write_fixture_model(tmp_path)
    dst = tmp_path / "out.safetensors"
    rc, out, err = run_main("convert", "-q", src, dst)
    assert (rc, out, err) == (0, "", "")
    assert dst.exists()


def test_explicit_destination_force_and_threads(tmp_path, run_main):
    src = write_fixture_model(tmp_path)
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"old")
    rc, _, err = run_main("convert", src, dst, "--force", "--threads", "2", "--json")
    assert rc == 0, err
    assert tensor_bytes(dst)["position_ids"][2] == np.int64(7).tobytes()


def test_fp16_target(tmp_path, run_main):
    src = write_fixture_model(tmp_path)
    rc, out, err = run_main("convert", src, "--to", "fp16", "--json")
    assert rc == 0, err
    dst = Path(json.loads(out)["result"]["dst"])
    assert dst.name == "model-fp16.safetensors"
    assert tensor_bytes(dst)["norm.weight"] == ("F16", [1], np.float16(1.5).tobytes())


# --- errors ---------------------------------------------------------------------------------


def test_error_json_invalid(tmp_path, run_main):
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"\x01\x02")
    rc, out, err = run_main("convert", bad, "--json")
    assert rc == 1
    assert_json_error_stderr(err)
    match_fixture(json.loads(out), load_fixture("error-invalid.json"), tmp_path)
    assert listing(tmp_path) == ["broken.safetensors"]


def test_error_json_destination_exists(tmp_path, run_main):
    write_fixture_model(tmp_path)
    (tmp_path / "model-bf16.safetensors").write_bytes(b"keep")
    rc, out, err = run_main("convert", tmp_path / "model.safetensors", "--json")
    assert rc == 1
    assert_json_error_stderr(err)
    match_fixture(json.loads(out), load_fixture("error-exists.json"), tmp_path)
    assert (tmp_path / "model-bf16.safetensors").read_bytes() == b"keep"


def test_error_json_missing(tmp_path, run_main):
    rc, out, err = run_main("inspect", tmp_path / "missing.safetensors", "--json")
    assert rc == 1
    assert_json_error_stderr(err)
    doc = json.loads(out)
    match_fixture(doc, load_fixture("error-missing.json"), tmp_path)
    assert "No such file" in doc["error"]["message"]


def test_error_is_one_line(tmp_path, run_main):
    rc, out, err = run_main("convert", tmp_path / "missing.safetensors")
    assert rc == 1 and out == ""
    line = assert_one_error_line(err)
    assert str(tmp_path / "missing.safetensors") in line and "No such file" in line
    assert "Errno" not in line


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["convert"],
        ["convert", "a", "b", "c"],
        ["convert", "x.safetensors", "--threads", "1025"],
        ["convert", "x.safetensors", "--keep-min-size", "123456789012345678901"],
        ["convert", "x/", "--shard", "1/1000000000000"],
        ["demo", "--size-gib", "1e300"],
        ["convert", "x.safetensors", "--threads", "two"],
        ["convert", "x.safetensors", "--to", "int8"],
        ["inspect", "x.safetensors", "--bogus"],
        ["demo", "--size-gib", "-1"],
    ],
    ids=lambda a: " ".join(a) or "no-args",
)
def test_usage_errors_exit_2(tmp_path, run_main, args):
    """A usage error is one line with a pointer to the right --help, and exit status 2;
    no arguments at all lists the commands."""
    rc, out, err = run_main(*args, cwd=tmp_path)
    assert rc == 2, (out, err)
    assert "Traceback" not in err
    if not args:
        assert "commands:" in err and "convert" in err and out == ""  # a usage error: stderr
    else:
        line = assert_one_error_line(err)
        assert line.startswith("stcast: error: ") and "--help`)" in line, line
        if args[0] in ("convert", "inspect", "demo"):
            assert f"`stcast {args[0]} --help`" in line, line
    assert listing(tmp_path) == []


def test_help(run_main):
    rc, out, err = run_main("--help")
    assert rc == 0 and "convert" in out and "inspect" in out


def test_help_and_man_page_name_every_target(run_main):
    """The top-level help, convert's help and the man page say FP8 too, not "to bf16 or
    fp16" only (issue 33)."""
    for args in (["--help"], ["convert", "--help"], ["manpage"]):
        rc, out, err = run_main(*args)
        flat = " ".join(out.replace("\\", "").split())
        assert rc == 0 and "FP8" in flat, args
        assert "to bf16 or fp16" not in flat and "to bf16 (or fp16)" not in flat, args


# --- version and import cost ----------------------------------------------------------------


def test_version(run_main):
    rc, out, err = run_main("--version")
    assert rc == 0
    assert out.strip() == f"stcast {stcast.__version__}"


def test_python_m_stcast_exits_with_the_code_of_main(tmp_path, cli_process):
    """The entry point, in a child: the in-process tests check what main returns."""
    rc, out, err = cli_process("--version")
    assert (rc, out.strip(), err) == (0, f"stcast {stcast.__version__}", "")
    rc, out, err = cli_process("convert", tmp_path / "missing.safetensors")
    assert (rc, out) == (1, "") and "No such file" in assert_one_error_line(err)
    rc, out, err = cli_process(cwd=tmp_path)
    assert rc == 2 and "commands:" in err and out == "" and "Traceback" not in err
    assert listing(tmp_path) == []


def test_version_loads_no_numpy_nor_the_api_or_folder_code():
    proc = run_python(
        "-c",
        "import sys\n"
        "from stcast.cli import main\n"
        "main(['--version'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('numpy', 'ml_dtypes', 'safetensors', 'stcast')), file=sys.stderr)\n",
    )
    assert proc.returncode == 0, proc.stderr
    loaded = proc.stderr.strip().splitlines()[-1]
    assert loaded == (
        "['stcast', 'stcast._console', 'stcast._core', 'stcast.cli', 'stcast.errors']"
    ), proc.stderr
    proc = run_python("-X", "importtime", "-m", "stcast", "--version")
    assert proc.returncode == 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()]
    assert "stcast" in imported
    assert not [m for m in imported if m.split(".")[0] in ("numpy", "ml_dtypes")]


def test_lazy_package_names():
    proc = run_python(
        "-c",
        "import stcast, sys\n"
        "assert 'stcast._api' not in sys.modules\n"
        "names = set(dir(stcast))\n"
        "missing = [n for n in stcast.__all__ if n not in names]\n"
        "assert not missing, missing\n"
        "from stcast import *\n"
        "assert convert is stcast.convert and InspectReport is stcast.InspectReport\n"
        "assert stcast.ConvertReport.__name__ == 'ConvertReport'\n"
        "try:\n"
        "    stcast.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n",
    )
    assert proc.returncode == 0, proc.stderr


# --- progress bar ---------------------------------------------------------------------------


def write_12mib_model(folder: Path) -> Path:
    """`big.safetensors`: one F32 tensor of 12 MiB, more than one window."""
    x = np.ones((12 << 20) // 4, np.float32)
    return write_safetensors(folder / "big.safetensors", {"x": ("F32", [x.size], x)})


def test_progress_bar_on_tty(tmp_path):
    src = write_12mib_model(tmp_path)
    rc, out, err = run_on_pty(["convert", src, tmp_path / "out.safetensors"])
    assert rc == 0, err
    text = err.decode()
    assert "100%" in text and "\r" in text, text
    assert "converted" in out


def screen_of(stderr: bytes, columns: int) -> list[str]:
    """What a terminal `columns` wide shows after `stderr` (trailing blanks dropped)."""
    import pyte

    screen = pyte.Screen(columns, 50)
    # A pty turns "\n" into "\r\n" (onlcr); pyte's Screen expects the pair.
    pyte.ByteStream(screen).feed(stderr)
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def three_overflowing_files(folder: Path) -> Path:
    """A folder of 3 files of 3 MiB (3 windows each) whose `hot` tensor overflows fp16."""
    folder.mkdir()
    for i in range(3):
        x = np.ones((3 << 20) // 4, np.float32)
        write_safetensors(
            folder / f"model-0000{i + 1}-of-00003.safetensors",
            {"w": ("F32", [x.size], x), "hot": ("F32", [2], np.float32([1e6, 1]))},
        )
    return folder


@pytest.mark.parametrize("columns", [60, 120])
def test_bar_on_a_terminal_leaves_no_stale_lines(tmp_path, columns):
    """Through a pseudo-terminal rendered by pyte: the bar never wraps, each warning
    (one per file, naming it) is printed once on its own lines, and one bar remains at the
    end, at 100%, above nothing but the summary. The steps are deterministic (1 MiB
    windows, a fake clock, every step drawn)."""
    src = three_overflowing_files(tmp_path / "model")
    rc, out, err = run_on_pty(["convert", src, "--to", "fp16"], columns=columns, deterministic=True)
    assert rc == 0, err
    raw = err.decode()
    assert raw.count("\r[") >= 9  # redrawn at every window at least
    lines = screen_of(err, columns)
    bars = [line for line in lines if line.startswith("[")]
    assert len(bars) == 1, lines
    assert bars[0] == lines[-1] and "100%" in bars[0] and "in " in bars[0], lines
    warnings = [line for line in lines if line.startswith("stcast: warning:")]
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert len(warnings) == 3, lines
    # A warning longer than the terminal wraps (once); compare without the spaces.
    text = "".join(lines[:-1]).replace(" ", "")
    for name in names:
        said = f"{name}: 1 finite value in 1 tensor became ±inf in F16".replace(" ", "")
        assert text.count(said) == 1, lines
    # Nothing of a bar is left anywhere else: no figures, no brackets.
    assert not any("ETA" in line or "/s" in line for line in lines[:-1]), lines
    assert out.startswith("converted ") and "6 converted, 0 copied" in out


def test_progress_lines_in_a_log(tmp_path, run_main, monkeypatch):
    """--progress with stderr not a terminal (a SLURM log): plain lines, no carriage
    returns, at most one per 5% (or 10 s), the last at 100%."""
    src = write_12mib_model(tmp_path)
    # 1 MiB windows: 12 steps to log, or not.
    monkeypatch.setattr(
        stcast,
        "convert",
        functools.partial(stcast.convert, tuning={"window_mib": 1, "step_mib": 1}),
    )
    rc, out, err = run_main("convert", src, tmp_path / "out.safetensors", "--progress")
    assert rc == 0, err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) >= 3 and all(line.startswith("stcast: ") for line in lines), lines
    percents = [int(line.split()[1].rstrip("%")) for line in lines]
    assert percents == sorted(percents) and percents[-1] == 100
    assert all(b - a >= 5 for a, b in zip(percents, percents[1:])), percents
    assert "MB / 12.6 MB" in lines[-1]
    # The last line's time is the summary's.
    assert re.search(r"in (\d+\.\d\d) s", lines[-1]).group(1) == (
        re.search(r"time +(\d+\.\d\d) s", out).group(1)
    )
    # Without --progress, a log gets nothing but what went wrong.
    rc, _, err = run_main("convert", src, tmp_path / "o2.safetensors")
    assert (rc, err) == (0, "")


@pytest.mark.parametrize("flag", ["-q", "--json"])
def test_no_progress_bar_with_quiet_or_json(tmp_path, flag):
    src = write_12mib_model(tmp_path)
    rc, out, err = run_on_pty(["convert", flag, src, tmp_path / "out.safetensors"])
    assert rc == 0, err
    assert err == b""


def test_no_progress_bar_on_pipe(tmp_path, cli_process):
    src = write_12mib_model(tmp_path)
    rc, out, err = cli_process("convert", src, tmp_path / "out.safetensors")
    assert rc == 0 and err == ""


# --- warnings -------------------------------------------------------------------------------


def test_nothing_to_convert_is_refused(tmp_path, run_main):
    """A run that would change nothing (a bf16 file) is refused, not copied; the dry run
    without DST says so as a warning, with DST it fails as convert would."""
    src = write_safetensors(
        tmp_path / "in.safetensors",
        {"a": ("BF16", [2], b"\x80\x3f\x00\x40"), "b": ("I8", [1], b"\x01")},
    )
    dst = tmp_path / "out.safetensors"
    rc, out, err = run_main("convert", src, dst)
    assert (rc, out) == (1, "")
    line = assert_one_error_line(err)
    assert "nothing to convert: no tensor becomes BF16" in line and "a copy" in line
    assert not dst.exists()
    rc, out, err = run_main("inspect", src)
    assert rc == 0 and "stcast: warning: nothing to convert" in err
    rc, out, err = run_main("inspect", src, dst)
    assert rc == 1 and "nothing to convert" in assert_one_error_line(err)


def test_in_process_runs_leave_the_warning_state_as_it_was(tmp_path, run_main):
    """main shows warnings itself while a command runs; the test's filters are back after."""
    src = write_safetensors(tmp_path / "in.safetensors", {"a": ("F32", [1], b"\x00\x00\x80\x3f")})
    filters, show = list(warnings.filters), warnings.showwarning
    rc, _, err = run_main("convert", src, tmp_path / "out.safetensors", "--keep", "nope")
    assert rc == 0 and err.startswith("stcast: warning: --keep pattern `nope`"), err
    assert (list(warnings.filters), warnings.showwarning) == (filters, show)
    # This suite's filter still turns a plan warning into an error (conftest.py).
    with pytest.raises(stcast.StcastWarning, match="keep pattern `nope`"):
        stcast.convert(src, tmp_path / "again.safetensors", keep=["nope"])


QUANTIZED = {
    "layer.0.weight": ("F8_E4M3", [4], b"\x01\x02\x03\x04"),
    "layer.0.weight_scale": ("F32", [1], np.float32(0.25).tobytes()),
    "layer.0.input_scale": ("F32", [1], np.float32(0.5).tobytes()),
    "norm.weight": ("F32", [1], np.float32(1).tobytes()),
}


def test_quantized_file_is_refused(tmp_path, run_main):
    """One policy for files and folders (the engine's): refused before anything is written,
    in one line naming the file, what makes it quantized and the scales."""
    src = write_safetensors(tmp_path / "in.safetensors", QUANTIZED)
    dst = tmp_path / "out.safetensors"
    rc, out, err = run_main("convert", src, dst)
    line = assert_one_error_line(err)
    assert rc == 1 and out == "" and not dst.exists()
    assert line.startswith(f"stcast: {src}: quantized checkpoint (it holds F8_E4M3 ")
    assert "`layer.0.weight_scale`" in line and "`layer.0.input_scale`" in line
    assert "`norm.weight`" not in line
    assert "--keep '*scale*'" in line and "--allow-quantized" in line
    # The dry run refuses as convert does; a plain inspect only warns.
    rc, out, err = run_main("inspect", src, dst)
    assert rc == 1 and "quantized checkpoint" in assert_one_error_line(err)
    rc, out, err = run_main("inspect", src)
    assert rc == 0 and "warning: " in err and "quantized checkpoint" in err
    # Kept scales are what the refusal asks for: then nothing is said.
    rc, out, err = run_main("convert", "-q", src, dst, "--keep", "*scale*")
    assert (rc, out, err) == (0, "", "")


def test_quantized_file_allowed_warns(tmp_path, run_main):
    src = write_safetensors(tmp_path / "in.safetensors", QUANTIZED)
    rc, out, err = run_main(
        "convert", src, tmp_path / "out.safetensors", "--json", "--allow-quantized"
    )
    assert rc == 0
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("stcast: warning: "), err
    assert "quantized" in lines[0]
    assert "`layer.0.weight_scale`" in lines[0] and "`layer.0.input_scale`" in lines[0]
    assert "`norm.weight`" not in lines[0]
    assert json.loads(out)["result"]["warnings"] == [lines[0][len("stcast: warning: ") :]]
    # -q silences progress, the summary and warnings too.
    rc, out, err = run_main(
        "convert", "-q", "--allow-quantized", src, tmp_path / "out2.safetensors"
    )
    assert (rc, out, err) == (0, "", "")


# --- unexpected failures ----------------------------------------------------------------------


def test_unexpected_exception_is_one_line(tmp_path, monkeypatch, run_main):
    def boom(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(stcast, "convert", boom)
    rc, out, err = run_main("convert", tmp_path / "x.safetensors")
    assert rc == 1 and out == ""
    line = assert_one_error_line(err)
    assert "RuntimeError" in line and "boom" in line


def test_closed_stdout_is_quiet(tmp_path):
    """`stcast inspect big | head -1`: the closed pipe ends the command quietly."""
    tensors = {f"layer.{i}.weight": ("I8", [1], b"\x01") for i in range(5000)}
    src = write_safetensors(tmp_path / "many.safetensors", tensors)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stcast", "inspect", str(src)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    assert proc.stdout.readline().startswith(b"NAME")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(60) == 0, err
    assert "Traceback" not in err and "Broken pipe" not in err, err


def test_signal_handlers_come_before_any_heavy_import():
    """The entry point installs its handlers after importing only what Python's start-up
    already loaded (and the package's lazy `__init__`): no `enum`, no `signal`, whose ~25 ms
    would be a window where Ctrl-C prints a traceback."""
    proc = run_python(
        "-c",
        "import sys\n"
        "before = set(sys.modules)\n"
        "import stcast.__main__ as m\n"
        "m._install()\n"
        "print(sorted(set(sys.modules) - before))\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['__future__', 'stcast', 'stcast.__main__']"


@pytest.mark.parametrize(
    "header",
    [
        b'{"__metadata__": ["a"]}',
        b'{"__metadata__": {"a": 1}}',
        b'{"w": {"dtype": "F32", "shape": [2]}}',
        b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}',
        b'{"w": {"shape": [2], "data_offsets": [0, 8]}}',
        b'{"w": 5}',
        b"[1]",
        b"[" * 200_000,
        b"{",
    ],
)
def test_the_demo_checks_a_header_it_reads_before_using_it(tmp_path, header):
    """The demo reads the headers it checks itself (not with the engine it checks): one that
    is not a safetensors header is a DemoFailed naming the file (one line from the CLI),
    never an internal error (attack F1 of stop 44)."""
    from stcast import demo

    path = tmp_path / "out.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(demo.DemoFailed, match="not the safetensors file expected"):
        demo.read_header(str(path))
    path.write_bytes((1 << 40).to_bytes(8, "little") + header)  # a length no demo writes
    with pytest.raises(demo.DemoFailed, match="not the safetensors file expected"):
        demo.read_header(str(path))
