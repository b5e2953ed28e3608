"""Every `stcast ...` line the documentation shows works as written.

The lines are extracted, not copied: the examples of every command's `--help` (its epilog),
and each line that starts with `stcast ` inside a fenced block of README.md, docs/guide.md
and docs/reference.md. Each runs through the CLI's `main`, in a folder of its own that holds
tiny stand-ins named as the line names them: a safetensors file for `*.safetensors`, a
PyTorch checkpoint for `*.bin`, `*.pt`, `*.pth`, `*.ckpt` (its dict at `--key`, its names
under the `--strip-prefix` prefixes), a DCP folder for `step-*`, a DeepSpeed ZeRO checkpoint
for `ds_ckpt/...` (its tag the `global_step*` part named), a sharded Hugging Face folder for
any other SRC. What a line needs from an earlier line is made first: `verify SRC DST` gets DST from
`convert SRC DST` with the same precision options, `finalize SRC DST` from
`convert SRC DST --shard 1/1`.

Rules:
- an absolute path (`/data/...`) is placed under the line's folder (`data/...`);
- a pipe or a redirection ends the command: what comes before it runs, and must print;
- SKIPPED lines are excepted by rule, each rule named; PENDING lines wait for an option
  another change adds (listed here so that they are un-skipped once it lands).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import main_in_process, write_safetensors
from torchfile import StateDict, write_zip

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/guide.md", "docs/reference.md"]

# Excepted by rule: (the rule, does it apply to this line).
SKIPPED = [
    (
        "SLURM lines run on a real cluster in tests/test_slurm.py",
        lambda line: "SLURM" in line or "sbatch" in line,
    ),
    (
        "`stcast demo` writes and converts ~1 GiB (tests/test_cli.py runs it small)",
        lambda line: line.split()[:2] == ["stcast", "demo"],
    ),
    ("benchmark lines need the benchmark setup", lambda line: "bench" in line),
]

# Lines that need `--name STEM` (re-sharding under a new stem), which another change adds:
# un-skip them when it lands.
PENDING: set[str] = set()


def doc_lines() -> list[tuple[str, str]]:
    """(where, line) for every `stcast ...` line of the help and the docs."""
    from stcast import cli

    found = []
    commands = cli.build_parser().commands  # type: ignore[attr-defined]
    for name, sub in commands.items():
        for line in (sub.epilog or "").splitlines():
            if line.strip().startswith("stcast "):
                found.append((f"stcast {name} --help", line.strip()))
    for doc in DOCS:
        fenced = False
        for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
            elif fenced and line.strip().startswith("stcast "):
                found.append((f"{doc}:{n}", line.strip()))
    return found


LINES = doc_lines()


def test_the_lines_are_found():
    where = {w.split(":")[0] for w, _ in LINES}
    assert {"README.md", "docs/guide.md", "stcast convert --help", "stcast verify --help"} <= where
    assert len(LINES) > 40


def test_the_slurm_lines_are_those_test_slurm_submits():
    """The SLURM rule skips only the `stcast` lines of the guide's batch script: the recipe
    tests/test_slurm.py reads from the guide and submits to a cluster."""
    skipped = {line for _, line in LINES if SKIPPED[0][1](line)}
    guide = (ROOT / "docs" / "guide.md").read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```$", guide, re.M | re.S)
    script = next(b for b in blocks if "#SBATCH --array" in b)
    submitted = {ln.strip() for ln in script.splitlines() if ln.startswith("stcast ")}
    assert skipped == submitted and submitted, (skipped, submitted)


def _skip_reason(line: str) -> str | None:
    for rule, applies in SKIPPED:
        if applies(line):
            return rule
    return "pending: needs --name" if line in PENDING else None


def _command(line: str) -> list[str]:
    """The line's arguments after `stcast`, up to a pipe or a redirection; absolute paths
    made relative."""
    tokens = shlex.split(line, comments=True)
    assert tokens[0] == "stcast", line
    args = []
    for t in tokens[1:]:
        if t in ("|", ">", ">>") or t.startswith((">", "|")):
            break
        args.append(t[1:] if t.startswith("/") else t)
    return args


def _positionals(args: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The positional arguments and the options (each with its values) of `args`."""
    from stcast import cli

    sub = cli.build_parser().commands[args[0]]  # type: ignore[attr-defined]
    takes = {s for a in sub._actions if a.nargs != 0 for s in a.option_strings}
    positionals, options = [], {}
    it = iter(args[1:])
    for a in it:
        if a.startswith("-"):
            name, eq, value = a.partition("=")
            values = options.setdefault(name, [])
            if eq:
                values.append(value)
            elif name in takes:
                values.append(next(it))
        else:
            positionals.append(a)
    return positionals, options


def _safetensors(path: Path) -> None:
    x = np.linspace(-2, 2, 32, dtype=np.float32)
    write_safetensors(
        path,
        {
            # As large as `--keep-min-size 4096` converts:
            "model.layers.0.mlp.weight": ("F32", [64, 64], np.resize(x, 4096)),
            "model.layers.0.mlp.router.weight": ("F32", [8], x[:8]),
            "model.layers.0.mlp.gate.weight": ("F32", [8], x[8:16]),
            "model.norm.weight": ("F32", [8], x[16:24]),
            "position_ids": ("I64", [2], np.arange(2, dtype=np.int64)),
        },
        metadata={"format": "pt"},
    )


def _torch(path: Path, options: dict[str, list[str]]) -> None:
    prefixes = options.get("--strip-prefix") or [""]
    x = np.linspace(-2, 2, 32, dtype=np.float32)
    names = ["layers.0.weight", "layers.1.weight", "norm.weight"]
    sizes = [4096, 4096, 8]  # as large as `--keep-min-size 4096` converts, and a norm
    arrays = {
        f"{prefixes[i % len(prefixes)]}{n}": np.resize(x, size)
        for i, (n, size) in enumerate(zip(names, sizes))
    }
    objs, storages = StateDict(arrays).pickled()
    obj: object = objs
    for key in reversed(options.get("--key", [])[0].split(".") if "--key" in options else []):
        obj = {key: obj, "epoch": 3}
    write_zip(path, obj, storages)


def _folder(root: Path, files: int = 8) -> None:
    """A Hugging Face folder of `files` shards (enough for `--shard 2/8`)."""
    import json

    root.mkdir(parents=True)
    weight_map = {}
    for k in range(files):
        name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        x = np.linspace(-k, k + 1, 32, dtype=np.float32)
        tensors = {f"layers.{k}.weight": ("F32", [64, 64], np.resize(x, 4096))}
        tensors[f"layers.{k}.input_norm.weight"] = ("F32", [8], x[:8])
        write_safetensors(root / name, tensors, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (root / "config.json").write_text('{\n  "torch_dtype": "float32"\n}\n')


def _zero(root: Path, tag: str) -> None:
    """A DeepSpeed ZeRO-3 checkpoint folder (`latest` naming `tag`) of 2 ranks."""
    from zerofile import write_zero

    x = np.linspace(-2, 2, 32, dtype=np.float32)
    params = {"layers.0.weight": np.resize(x, (64, 64)), "norm.weight": x[:8].copy()}
    write_zero(root, [params], stage=3, ranks=2, tag=tag)


def _dcp(root: Path, options: dict[str, list[str]]) -> None:
    """A DCP folder (`step-1000/`): a model under `--key`'s path, and an optimizer beside."""
    from dcpfile import Tensor, rows, write_dcp

    key = tuple(options.get("--key", ["model"])[0].split("."))
    x = np.resize(np.linspace(-2, 2, 32, dtype=np.float32), 4096).reshape(64, 64)
    norm = np.linspace(-1, 1, 8, dtype=np.float32)
    tensors = {
        ".".join((*key, "layers.0.weight")): Tensor(
            x, rows(x, [0, 20, 41]), (*key, "layers.0.weight")
        ),
        ".".join((*key, "norm.weight")): Tensor(norm, rows(norm, [0, 5]), (*key, "norm.weight")),
        "optim.state.norm.weight.exp_avg": Tensor(
            norm, rows(norm, [0, 5]), ("optim", "state", "norm.weight", "exp_avg")
        ),
    }
    write_dcp(root, tensors, ranks=3)


def _stand_in(folder: Path, name: str, options: dict[str, list[str]]) -> None:
    path = folder / name
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = Path(name.rstrip("/")).suffix
    parts = Path(name).parts
    if parts[0] == "ds_ckpt":
        # A DeepSpeed checkpoint, its tag the `global_step*` part named, if one is.
        _zero(
            folder / parts[0],
            next((p for p in parts if p.startswith("global_step")), "global_step1"),
        )
    elif name.startswith("step-"):
        _dcp(path, options)
    elif name.endswith("/") or not suffix:
        _folder(path)
    elif suffix == ".safetensors":
        _safetensors(path)
    elif suffix in (".bin", ".pt", ".pth", ".ckpt"):
        _torch(path, options)
    else:
        raise AssertionError(f"no stand-in for {name}")


# The options of a verify line that convert shares (how DST was converted).
_CONVERT_OPTIONS = (
    "--to",
    "--keep",
    "--keep-min-size",
    "--from-bf16",
    "--key",
    "--strip-prefix",
    "--name",
    "--max-shard-size",
)


def _run(folder: Path, *args: str) -> tuple[int, str, str]:
    return main_in_process(*args, cwd=folder)


@pytest.mark.parametrize(("where", "line"), LINES, ids=[f"{w}: {ln}" for w, ln in LINES])
def test_doc_line_works_as_written(tmp_path, where, line):
    reason = _skip_reason(line)
    if reason is not None:
        pytest.skip(reason)
    args = _command(line)
    command = args[0]
    positionals, options = _positionals(args)
    if command in ("convert", "inspect", "verify", "finalize"):
        _stand_in(tmp_path, positionals[0], options)
    if command == "verify":
        before = ["convert", *positionals[:2]]
        for o in _CONVERT_OPTIONS:
            for v in options.get(o, []):
                before += [o, v]
            if o in options and not options[o]:
                before.append(o)
        if "--name" in options and "--max-shard-size" not in options:
            before += ["--max-shard-size", "5GB"]  # --name names re-sharded output
        rc, _, err = _run(tmp_path, *before)
        assert rc == 0, (before, err)
    elif command == "finalize":
        rc, _, err = _run(tmp_path, "convert", *positionals[:2], "--shard", "1/1")
        assert rc == 0, err
    rc, out, err = _run(tmp_path, *args)
    assert rc == 0, f"{where}: `{line}` exited {rc}: {err}"
    assert not re.search(r"^stcast: error", err, re.M), err
    if command in ("completion", "manpage"):
        assert out.strip(), line


# Convert lines whose output `verify SRC DST` cannot check on its own, each with why.
_NO_PLAIN_VERIFY: list[tuple[str, Callable[[list[str]], bool]]] = [
    ("a shard of a run: finalize writes the output", lambda a: "--shard" in a),
    ("a dry run writes nothing", lambda a: "--dry-run" in a),
]


def _convert_lines() -> list[tuple[str, str]]:
    return [
        (w, ln)
        for w, ln in LINES
        if _command(ln)[0] == "convert" and _skip_reason(ln) is None and w[0] != "s"
    ]


@pytest.mark.parametrize(
    ("where", "line"), _convert_lines(), ids=[f"{w}: {ln}" for w, ln in _convert_lines()]
)
def test_verify_without_options_passes_on_each_convert_line(tmp_path, where, line):
    """Issue 33: `stcast verify SRC DST` with no options passes on the output of every
    `convert` line of the README and the guide (convert records its options in DST), and
    fails once DST is tampered with."""
    from stcast import _core

    args = _command(line)
    for why, applies in _NO_PLAIN_VERIFY:
        if applies(args):
            pytest.skip(why)
    positionals, options = _positionals(args)
    _stand_in(tmp_path, positionals[0], options)
    rc, _, err = _run(tmp_path, *args, "--force")
    assert rc == 0, err
    src = positionals[0]
    if len(positionals) > 1:
        dst = positionals[1]
    else:
        to = _core.check_option("to", options.get("--to", ["bf16"])[0])
        dst = _core.default_dst(str(tmp_path / src), to, folder="--max-shard-size" in options)
    rc, _, err = _run(tmp_path, "verify", src, dst)
    assert rc == 0, f"{where}: verify after `{line}` exited {rc}: {err}"
