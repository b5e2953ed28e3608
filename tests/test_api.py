"""The Python API's contract: names from the engine, exception classes, report fields, types."""

from __future__ import annotations

import dataclasses
import errno
import json
import pickle
import re
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import stcast
from conftest import write_safetensors
from stcast import _core, _types, reports
from stcast.errors import render

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "literal, exported",
    [
        (_types.Target, _core.TARGETS),
        (_types.Reason, _core.REASONS),
        (_types.OnOverflow, _core.ON_OVERFLOW),
        (_types.ErrorKind, _core.ERROR_KINDS),
        (_types.WarningKind, _core.WARNING_KINDS),
        (_types.ReadAdvice, _core.READ_ADVICE),
        (_types.InputFormat, _core.INPUT_FORMATS),
    ],
    ids=["Target", "Reason", "OnOverflow", "ErrorKind", "WarningKind", "ReadAdvice", "InputFormat"],
)
def test_literals_are_the_engine_names(literal, exported):
    assert typing.get_args(literal) == exported


def test_target_aliases_are_the_engine_aliases():
    aliases = set(typing.get_args(_types.TargetAlias))
    assert aliases == set(_core.TARGET_ALIASES) - set(_core.TARGETS)


# The Python type of each kind of option in the engine's table (rust/options.rs `Kind`).
_KIND_TYPES = {
    "flag": "bool",
    "int": "int",
    "size": "int | str",
    "text": "str",
    "texts": "Iterable[str]",
    "path": "StrPath",
    "choice": "OnOverflow",
    "target": "Target | TargetAlias",
    "part": "tuple[int, int]",
    "stem": "str",
    "tuning": "Tuning",
}


@pytest.mark.parametrize(
    "command, typed",
    [
        ("convert", _types.ConvertOptions),
        ("inspect", _types.InspectOptions),
        ("verify", _types.VerifyOptions),
    ],
)
def test_option_types_are_the_engine_table(command, typed):
    """Each API function's keywords (its TypedDict) are the options the engine's table gives
    it, with the type of each one's kind (`| None` where the default is None), both ways."""
    annotations = {
        name: getattr(t, "__forward_arg__", t) for name, t in typed.__annotations__.items()
    }
    table = {}
    for row in _core.OPTIONS:
        if row["command"] == command and row["front"] != "cli":
            absent = row["default"] is None and row["kind"] not in ("flag", "texts")
            table[row["name"]] = _KIND_TYPES[row["kind"]] + (" | None" if absent else "")
    assert annotations == table
    assert set(typed.__optional_keys__) == set(table)  # every keyword may be left out
    # The function's keywords are that TypedDict (`**options: Unpack[...]`).
    options = inspect_signature(getattr(stcast, command))["options"]
    assert options.annotation == f"Unpack[{typed.__name__}]"


def test_finalize_takes_no_options_and_the_cli_only_are_not_api_keywords():
    api = {r["name"] for r in _core.OPTIONS if r["front"] != "cli"}
    assert not any(r["front"] != "cli" for r in _core.OPTIONS if r["command"] == "finalize")
    assert {"json", "quiet", "dry_run"}.isdisjoint(api)


def test_an_unknown_keyword_is_a_type_error(tmp_path):
    src = small(tmp_path)
    for fn, args in [
        (stcast.convert, (src, tmp_path / "o.safetensors")),
        (stcast.inspect, (src,)),
        (stcast.verify, (src, src)),
    ]:
        with pytest.raises(
            TypeError, match=rf"^{fn.__name__}\(\) got an unexpected keyword argument 'typo'$"
        ):
            fn(*args, typo=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'scan'"):
        stcast.convert(src, tmp_path / "o.safetensors", scan=True)  # inspect's only
    assert not (tmp_path / "o.safetensors").exists()


def inspect_signature(fn):
    import inspect

    return inspect.signature(fn).parameters


def test_every_error_kind_has_a_class():
    classes = {
        c.kind
        for c in (
            stcast.InvalidInput,
            stcast.InputChanged,
            stcast.Refused,
            stcast.UsageError,
            stcast.DestinationExists,
            stcast.NoSpace,
            stcast.Cancelled,
        )
    }
    assert classes | {"io"} == set(_core.ERROR_KINDS)


def small(tmp_path: Path) -> Path:
    return write_safetensors(
        tmp_path / "small.safetensors",
        {"w": ("F32", [4], np.float32([1, 2, 3, 4])), "i": ("I64", [1], np.int64([7]))},
    )


def test_report_fields_are_the_engine_fields(tmp_path):
    """A key the adapter adds must be declared in the report types, and the other way round."""
    src = small(tmp_path)
    result = _core.convert(str(src), str(tmp_path / "o.safetensors"))
    python_only = {"files", "shard", "complete", "max_shard_size"}
    fields = {f.name for f in dataclasses.fields(stcast.ConvertReport)}
    assert set(result) == fields - python_only
    result = _core.inspect(str(src))
    fields = {f.name for f in dataclasses.fields(stcast.InspectReport)}
    folder_only = {"files", "other_bytes", "other_files", "left_out"}
    assert set(result) == fields - folder_only - {"max_shard_size", "shards", "indexes"}
    assert set(result["tensors"][0]) == {f.name for f in dataclasses.fields(stcast.TensorInfo)} - {
        "file"
    }
    result = _core.verify(str(src), str(tmp_path / "o.safetensors"))
    assert set(result) == {f.name for f in dataclasses.fields(stcast.VerifyReport)} - {"files"}


@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_an_option_of_the_wrong_type_is_named(tmp_path, folder):
    """A flag given as another type is a TypeError naming it, as a typed argument's is."""
    src = small(tmp_path)
    if folder:
        (tmp_path / "f").mkdir()
        src = src.rename(tmp_path / "f" / "model.safetensors").parent
    for call, option, value in [
        (stcast.convert, "force", "yes"),
        (stcast.convert, "allow_quantized", "no"),
        (stcast.inspect, "scan", 1),
    ]:
        expected = f"argument '{option}': '{type(value).__name__}' object cannot be cast as 'bool'"
        with pytest.raises(TypeError, match=re.escape(expected)):
            call(src, tmp_path / "o", **{option: value})
    assert not (tmp_path / "o").exists()


def test_destination_exists_is_a_file_exists_error(tmp_path):
    src = small(tmp_path)
    dst = tmp_path / "o.safetensors"
    dst.write_bytes(b"keep")
    with pytest.raises(FileExistsError) as info:
        stcast.convert(src, dst)
    e = info.value
    assert isinstance(e, stcast.StcastError) and isinstance(e, ValueError)
    assert (e.errno, e.filename, e.path, e.kind) == (
        errno.EEXIST,
        str(dst),
        str(dst),
        "destination_exists",
    )
    assert str(e) == f"{dst}: destination exists (force=True replaces it)"
    assert e.render("cli") == f"{dst}: destination exists (--force replaces it)"
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is type(e) and str(again) == str(e) and again.path == e.path


def test_no_message_of_the_api_names_a_cli_flag(tmp_path):
    """Every error and warning the API raises speaks in keyword names."""
    src = small(tmp_path)
    dst = tmp_path / "o.safetensors"
    dst.write_bytes(b"x")
    seen = []
    for call in (
        lambda: stcast.convert(src, dst),
        lambda: stcast.convert(src, tmp_path / "a.safetensors", keep=["nope"], strict=True),
        lambda: stcast.convert(src, tmp_path / "b.safetensors", threads=99999),
        lambda: stcast.convert(src, tmp_path / "c.safetensors", keep=["a["]),
        lambda: stcast.convert(src, resume=True),
        lambda: stcast.convert(src, tmp_path / "d.safetensors", to="int4"),
    ):
        with pytest.raises(stcast.StcastError) as info:
            call()
        seen.append(str(info.value))
    with pytest.warns(stcast.StcastWarning) as record:
        stcast.convert(src, tmp_path / "e.safetensors", keep=["nope"])
    seen += [str(w.message) for w in record]
    for text in seen:
        assert not re.search(r"--[a-z]", text), text
    assert "force=True" in seen[0] and "strict=True" in seen[1]


def test_templates_render_in_both_styles():
    t = "use {force} or {on_overflow=keep} or {keep=*scale*} ({shard=2/8}); {{force}} stays"
    assert render(t, "api") == (
        'use force=True or on_overflow="keep" or keep=["*scale*"] (shard=(2, 8)); {force} stays'
    )
    assert render(t, "cli") == (
        "use --force or --on-overflow keep or --keep '*scale*' (--shard 2/8); {force} stays"
    )


def test_usage_errors_name_the_option(tmp_path):
    src = small(tmp_path)
    for kwargs, option in [
        ({"threads": 1025}, "threads"),
        ({"threads": -1}, "threads"),
        ({"keep_min_size": 2**64}, "keep_min_size"),
        ({"on_overflow": "never"}, "on_overflow"),
        ({"to": "f32"}, "to"),
    ]:
        with pytest.raises(stcast.UsageError) as info:
            stcast.convert(src, tmp_path / "o.safetensors", **kwargs)
        assert info.value.option == option and info.value.kind == "usage"
        assert str(info.value).startswith(f"{option}: "), info.value
        assert info.value.render("cli").startswith(f"--{option.replace('_', '-')}: ")


def test_report_repr_is_short(tmp_path):
    src = small(tmp_path)
    r = stcast.convert(src, tmp_path / "o.safetensors")
    assert len(repr(r)) < 300 and "numerics" not in repr(r)
    assert isinstance(r, reports.ConvertReport)


README_API = re.compile(r"```python\n(.*?)```", re.S)


def test_readme_api_lines_pass_mypy_strict(tmp_path):
    pytest.importorskip("mypy")
    blocks = README_API.findall((ROOT / "README.md").read_text())
    assert blocks, "the README shows the API"
    code = tmp_path / "readme_api.py"
    code.write_text("\n\n".join(blocks))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_per_tensor_numerics_are_a_lazy_sequence(tmp_path):
    """A report's per-tensor numerics are built when read (300k tensors cost no dicts
    unless used), and behave as the list of dicts they stand for."""
    from collections.abc import Sequence

    x = np.float32([1, 2, 3, 1e-45])
    tensors = {f"t{i}": ("F32", [4], x * (i + 1)) for i in range(5)}
    src = write_safetensors(tmp_path / "in.safetensors", tensors)
    report = stcast.convert(src, tmp_path / "out.safetensors")
    rows = report.numerics["tensors"]
    assert isinstance(rows, Sequence) and len(rows) == 5
    as_list = [dict(r) for r in rows]
    assert [r["name"] for r in as_list] == [f"t{i}" for i in range(5)]
    assert rows[-1] == as_list[-1] and rows[1:3] == as_list[1:3] and rows[::2] == as_list[::2]
    with pytest.raises(IndexError):
        rows[5]
    assert rows == as_list and rows == report.numerics["tensors"]
    assert report.to_dict()["numerics"]["tensors"] == as_list
    json.dumps(report.to_dict())  # plain data
    again = stcast.verify(src, tmp_path / "out.safetensors")
    assert again.numerics["tensors"] == rows


def test_cancelled_is_a_stcast_error():
    """One `except stcast.StcastError` catches every way a call ends without a result,
    a cancelled one too (issue 23, point 7)."""
    import pickle

    e = stcast.Cancelled()
    assert isinstance(e, stcast.StcastError)
    assert (e.kind, str(e), e.path) == ("cancelled", "conversion cancelled", None)
    again = pickle.loads(pickle.dumps(e))
    assert (type(again), str(again)) == (stcast.Cancelled, "conversion cancelled")


def test_warnings_point_at_the_callers_line(tmp_path):
    """Every warning of the API names the line that called stcast (issue 33), never a line
    of stcast's own, whatever the kind of run found it: a lone file, a folder of files (its
    walk, its shards), a re-sharding."""
    import inspect as _inspect
    import warnings

    from conftest import write_safetensors

    src = write_safetensors(tmp_path / "m.safetensors", {"w": ("F32", [2], np.ones(2, np.float32))})
    folder = tmp_path / "hf"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", {"w": ("F32", [2], np.ones(2, np.float32))})
    runs = [
        lambda: stcast.convert(src, tmp_path / "a.safetensors", strip_prefix=["zz."]),
        lambda: stcast.convert(src, tmp_path / "b.safetensors", keep=["nomatch*"]),
        lambda: stcast.convert(folder, tmp_path / "c", keep=["nomatch*"]),
        lambda: stcast.convert(src, tmp_path / "d", keep=["nomatch*"], max_shard_size="1MB"),
    ]
    for run in runs:
        line = _inspect.getsourcelines(run)[1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        assert caught, line
        assert {(w.filename, w.lineno) for w in caught} == {(__file__, line)}, [
            (w.filename, w.lineno, str(w.message)) for w in caught
        ]
