"""Verify a converted folder: every file of the source has its counterpart in the
destination, exactly what `convert` makes of it.

Files are paired by relative path. Weight files are verified by the engine (each tensor bit
for bit, under the same precision options as `convert`); copies must hold the source's
bytes; configs the source's text with only the dtype values changed; indexes the source's
weight map, with `total_size` that of the shards in the destination. The first difference
is reported, naming the file.

A checkpoint that DST holds sharded differently (`max_shard_size`) is paired by tensor name
instead, through the indexes, by the engine (rust/shard/resharded.rs). SRC may then be a single
file.
"""

from __future__ import annotations

import os
import stat
import time
from typing import TYPE_CHECKING, Any, cast

from .. import _core, _engine
from ..errors import Refused, StcastError
from ..reports import Mismatch, Notice, VerifyReport, _build, merged_numerics, numeric_parts
from .common import (
    INDEX_SUFFIX,
    WEIGHTS_SUFFIX,
    File,
)
from .fp8 import (
    SIDE_CONFIG_NAME,
    dequantizes,
    is_model_config,
    quantization_of,
    side_configs,
    unread_quantization,
)
from .reshard import groups_of, named, single_file
from .walk import (
    common_prefix_notices,
    dequantizes_any,
    experts_config,
    listing,
    read_index,
    read_json,
    walk,
)
from .work import nothing_to_convert

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Callable

    from .._engine import Progress
    from .._options import Options
    from .._types import Target

    # A group of files as the engine gives it (`shard::resharded::Group`): its folder, stem,
    # files (rel, path) and index (rel, path).
    Group = tuple[str, str, list[tuple[str, str]], "tuple[str, str] | None"]
    # A group's outcome: each DST file's (rel, engine report), the first failure (rel,
    # template, tensor).
    GroupCheck = tuple[list[tuple[str, Any]], "tuple[str, str, str | None] | None"]

_esc = _core.escape


def verify_folder(src: str, dst: str, given: Options, *, progress: Progress | None) -> VerifyReport:
    """Verify the folder `dst` against the folder `src` (or the file `src` re-sharded into
    it: then `key` and `strip_prefix` say how a PyTorch checkpoint was read); see
    `stcast.verify`. With `name`, SRC's one group was re-sharded under that stem."""
    started = time.monotonic()
    loose, to, report, name = given.loose, given.to, given.report, given.name
    src = _core.run_place(src, dst, resharding=False, check=False)[0]
    if not os.path.lexists(dst):
        raise Refused(f"{_esc(dst)}: no such folder", path=dst)
    if not os.path.isdir(dst):
        raise Refused(f"{_esc(dst)}: not a folder, while {_esc(src)} is one", path=dst)
    if os.path.samefile(src, dst):
        raise Refused(f"{_esc(dst)}: SRC and DST are the same folder", path=dst)
    single = not _engine.is_tree(src)  # a file (or a DCP folder) re-sharded into DST
    # How SRC is read as given (`key`, `strip_prefix`): the engine takes what is not given
    # from DST's record.
    source: dict[str, Any] = dict(given.source)
    if single:
        if not stat.S_ISREG(os.stat(src).st_mode) and not os.path.isdir(src):
            raise Refused(f"{_esc(src)}: not a regular file", path=src)
        # Read as `convert` read it, links followed: verify writes nothing of the source.
        source = {**given.source, "follow_links": True}
    replace = None
    if report is not None:
        replace = _core.check_side_output(
            report, "report", given.force, [(src, "input"), (dst, "output")]
        )
    if single:
        weights = [single_file(src)]
        indexes: list[File] = []
        configs: list[File] = []
        others: list[File] = []
        skipped: list[tuple[File, str]] = []
    found = set(listing(dst))
    strip_prefix: list[str] = list(given.strip_prefix)
    shards = sorted(r for r in found if r.endswith(WEIGHTS_SUFFIX))
    include, exclude = list(given.include), list(given.exclude)
    if shards:
        # A re-sharding's stem, how SRC was read and what DST copies of it: as given, else
        # as DST's record says.
        # A folder output's index holds the record (a top one first), then its shards (an
        # older stcast's output records it there only): each fills what is not given yet.
        indexed = sorted((r.count("/"), r) for r in found if r.endswith(INDEX_SUFFIX))
        recorded = (name, given.key, list(given.strip_prefix), include, exclude, to)
        for rel in [r for _, r in indexed[:1]] + shards[:1]:
            recorded = _core.recorded_source(os.path.join(dst, rel), recorded)
        # How SRC was read (`key`, `strip_prefix`): the engine takes it from DST's record
        # where not given (SRC unreadable so is DST's fault, not the caller's options).
        name, include, exclude = recorded[0], recorded[3], recorded[4]
        # The whole output's target (a file without FP8 weights does not tell fp8 from bf16).
        to = cast("Target | None", recorded[5])
        # A folder's indexes lose the prefixes as its files' tensors do.
        strip_prefix = recorded[2]
    if not single:
        weights, indexes, configs, others, _, skipped, _ = walk(src, True, include, exclude)
    if to is None:
        # An FP8 output's strategy is its config's: a weight's scale can fit both.
        to = next(filter(None, (_configured(dst, f) for f in configs if f.rel in found)), None)
    dst_weights = any(r.endswith(WEIGHTS_SUFFIX) for r in found)
    # Checkpoints DST holds sharded differently are paired by tensor name, not by path.
    names = {w.rel for w in weights}
    parsed = [(f, *read_index(f, names, strip_prefix)) for f in indexes]
    named(groups_of(weights, parsed), name)  # one group, or a usage error
    pairs: list[tuple[Group, Group]] = []
    same: list[tuple[Group, Group]] = []
    first_error = None
    try:
        pairs, same = _core.resharded_pairs(
            dst,
            [(w.rel, w.path) for w in weights],
            [((f.rel, f.path), [*m.items()]) for f, _, m in parsed],
            list(found),
            name,
        )
    except StcastError as e:  # an index of DST that names no file of DST
        rel = os.path.relpath(e.path, dst) if e.path else "."
        # The mismatch names the file: the template need not (it starts with its path).
        first_error = (rel, e.template.removeprefix(f"{_esc(e.path or '')}: "))
    group_options = given.engine()
    # FP8 outputs: SRC's model config splits fused experts where DST records no sizes (an
    # output written with `no_record`); a record's sizes come first (the engine's).
    model_config = experts_config(configs, to) if to is not None else None
    if model_config is not None:
        group_options["packed_config"] = model_config
    # A group whose files have SRC's names is still a re-sharding when --max-shard-size cut
    # where SRC was cut (its index and shard metadata are then a re-sharding's): checked as
    # one first (the index first, headers only). It is one when that passes, or fails on a
    # tensor (past the index, names and metadata); else it is checked file by file.
    checked: dict[int, GroupCheck] = {}
    for g, d in same if first_error is None else []:
        try:
            opts = group_options | {"to": to, "loose": loose, **source}
            check = _verify_group(dst, g, d, opts, None)
        except StcastError:
            continue
        if check[1] is None or check[1][2] is not None:
            checked[len(pairs)] = check
            pairs.append((g, d))
    moved = {rel for g, _ in pairs for rel in _rels(g)}
    theirs = {rel for _, d in pairs for rel in _rels(d)}
    from_pytorch = any(w.src_rel is not None for w in weights)
    weights = [w for w in weights if w.rel not in moved]
    indexes = [f for f in indexes if f.rel not in moved]
    found -= theirs
    expected = {f.rel: f for f in [*weights, *indexes, *configs, *others]}
    reports: list[VerifyReport] = []
    # Progress counts the data bytes of both files of each pair, as `bytes_compared` does.
    total = sum(
        _data_bytes(w.path) + _data_bytes(os.path.join(dst, w.rel))
        for w in weights
        if w.rel in found
    )
    total += sum(_data_bytes(path) for g, d in pairs for _, path in [*g[2], *d[2]])
    done = 0
    first: VerifyReport | None = None
    mismatch: Mismatch | None = None

    def fail(rel: str, template: str, tensor: str | None = None) -> Mismatch:
        return Mismatch(
            Notice("mismatch", template, rel),
            tensor,
            None,
            None,
            None,
            None,
            None,
            rel,
        )

    missing = sorted(set(expected) - found)
    # Beside a lone checkpoint's re-sharding: the model config given (`config`), or an FP8
    # target's quantization_config alone (checked below with the shards they describe).
    # In a folder's: an FP8 target's quantization_config beside weights no model config
    # describes (`side_configs`).
    sides = [SIDE_CONFIG_NAME] if single else side_configs(sorted(names), list(expected))
    beside = {"config.json", *sides} if single else set(sides) - set(expected)
    extra = sorted(found - set(expected) - beside)
    # SRC's files the companion policy leaves out, which DST holds: an earlier run's copies
    # (a run over its output deletes nothing it does not write; convert warns of them).
    left_out = {f.source_rel for f, _ in skipped}
    if first_error is not None:
        mismatch = fail(*first_error)
    elif single and not dst_weights:
        mismatch = fail(
            ".",
            "a folder without .safetensors files, while SRC is a file (a file's DST folder is "
            "the one it was re-sharded into)",
        )
    elif missing:
        # Re-sharded under another stem (convert --name, not recorded): the name that finds it.
        stems = [r[: -len(INDEX_SUFFIX)] for r in sorted(found) if r.endswith(INDEX_SUFFIX)]
        hint = ""
        if name is None and len(stems) == 1 and "/" not in stems[0]:
            hint = f" (DST holds the index of {_esc(stems[0])}: {{name={_esc(stems[0])}}}?)"
        # A file of SRC under its own name, else what DST should hold of SRC's file (a
        # PyTorch checkpoint's, a DCP folder's consolidated output): named as it is.
        f = expected[missing[0]]
        what = "is in SRC" if f.src_rel is None else f"is the output of {_esc(f.path)}"
        mismatch = fail(missing[0], f"{what} but not in DST{hint}")
    else:
        # Extra files are ignored (loose), but not an index: loaders read it to find the
        # tensors, so it must name DST's shards as they are, and the output's tensors where
        # the output holds them; nor a model config that says unquantized weights beside it
        # are quantized (one SRC's run left out, or copied in).
        output = [w.rel for w in weights] + [rel for _, d in pairs for rel, _ in d[2]]
        configs_ = [r for r in extra if is_model_config(r)]
        stray = configs_ if not loose else [r for r in extra if r.endswith(INDEX_SUFFIX)] + configs_
        problem = _core.check_companions(dst, to, stray=stray, output=output) if stray else None
        if problem is not None:
            mismatch = fail(*problem)
        elif extra and not loose:
            why = (
                "is in SRC, but left out by this run's companion policy ({include} copies it): "
                "an earlier run's copy? ({loose} ignores extra files)"
                if extra[0] in left_out
                else "is in DST but not in SRC ({loose} ignores extra files)"
            )
            mismatch = fail(extra[0], why)
    # What each file (or group) said of the prefixes given to strip: judged over them all
    # (the record's were said by convert).
    heard: list[list[Notice]] = []

    def hearing() -> Callable[[str, str], None]:
        heard.append([])
        return lambda kind, template: heard[-1].append(Notice(kind, template))

    for w in weights if mismatch is None else []:

        def step(d: int, t: int, base: int = done) -> None:
            if progress is not None:
                progress(base + d, total)

        r = _engine.verify_file(
            w.path,
            os.path.join(dst, w.rel),
            given,
            to=to,
            loose=loose,
            progress=step if progress is not None else None,
            warn=hearing(),
            packed_config=model_config,
            allow_copy=True,  # one file of a folder may convert nothing
            **source,
        )
        done += r.bytes_compared
        reports.append(r)
        first = first or r
        if to is None and r.to is not None:
            to = r.to  # every file with the target the first converted one has
        if r.mismatch is not None:
            m = r.mismatch
            mismatch = Mismatch(
                Notice("mismatch", m.message.template, w.rel),
                m.tensor,
                m.index,
                m.source_bits,
                m.source_value,
                m.expected_bits,
                m.found_bits,
                w.rel,
            )
            break
    if mismatch is None and reports and all(r.copy for r in reports) and not (pairs or single):
        # Each file a copy of SRC's: convert refuses to write such a folder (not a re-sharding:
        # a file's, or groups', never a copy).
        mismatch = fail(".", "convert refuses these options: " + nothing_to_convert(to or "bf16"))
    rels = [w.rel for w in weights][: len(reports)]
    for k, (g, d) in enumerate(pairs if mismatch is None else []):

        def group_step(d_: int, t: int, base: int = done) -> None:
            if progress is not None:
                progress(base + d_, total)

        check = checked.get(k) or _verify_group(
            dst,
            g,
            d,
            group_options | {"to": to, "loose": loose, **source},
            group_step if progress is not None else None,
            hearing(),
        )
        group_reports, failure = check
        for rel, r in group_reports:
            report_ = _engine_report(r)
            done += report_.bytes_compared
            reports.append(report_)
            rels.append(rel)
            first = first or report_
            if to is None and report_.to is not None:
                to = report_.to
        if failure is not None:
            rel, template, tensor = failure
            last = group_reports[-1][1]["mismatch"] if group_reports else None
            found_m = _engine_report(group_reports[-1][1]).mismatch if group_reports else None
            if last is not None and found_m is not None and group_reports[-1][0] == rel:
                mismatch = Mismatch(
                    Notice("mismatch", found_m.message.template, rel),
                    found_m.tensor,
                    found_m.index,
                    found_m.source_bits,
                    found_m.source_value,
                    found_m.expected_bits,
                    found_m.found_bits,
                    rel,
                )
            else:
                mismatch = fail(rel, template, tensor)
            break
    if given.strip_prefix:
        for notice in common_prefix_notices(heard):
            _engine.issue(notice.kind, notice.template, None)
    if to is None and from_pytorch and not any(r.tensors_converted for r in reports):
        to = "keep"  # PyTorch weights converted with no tensor changing dtype
    if mismatch is None:
        # Loose ignores extra files, but not a model config beside FP8 shards (one copied in
        # after a DCP or single-file source was re-sharded): a loader trusts it.
        added = [r for r in sorted(found - set(expected)) if is_model_config(r)]
        # Where convert writes a side config, DST's or not (strict fails one missing).
        side = [r for r in sides if r in beside]
        companions = (indexes, configs, others, added, side)
        mismatch = _check_others(src, dst, to or "bf16", companions, fail, loose, strip_prefix)
    ok = mismatch is None
    numerics = merged_numerics([(rel, r.numerics) for rel, r in zip(rels, reports)]) if ok else None
    if ok and report is not None and numerics is not None:
        _core.write_numeric_report(report, src, dst, to, numeric_parts(numerics), replace=replace)
    threads_used = first.threads if first is not None else 0
    return VerifyReport(
        src=src,
        dst=dst,
        ok=ok,
        loose=loose,
        tensors_converted=sum(r.tensors_converted for r in reports),
        tensors_identical=sum(r.tensors_identical for r in reports),
        bytes_compared=sum(r.bytes_compared for r in reports),
        seconds=time.monotonic() - started,
        threads=threads_used,
        isa=first.isa if first is not None else "",
        mismatch=mismatch,
        to=to,
        numerics=numerics,
        folder=True,
        files=len(expected) + len(theirs),
    )


def _rels(g: Group) -> list[str]:
    """The files of a group (`_core.resharded_pairs`) and its index, relative paths."""
    return [rel for rel, _ in g[2]] + ([g[3][0]] if g[3] is not None else [])


def _verify_group(
    dst: str,
    s: Group,
    d: Group,
    options: dict[str, Any],
    progress: Progress | None,
    warn: Callable[[str, str], None] | None = None,
) -> GroupCheck:
    """Verify DST's group `d` as the re-sharding of SRC's group `s` (the engine's
    `shard::resharded::GroupVerify`): every tensor of `s` in exactly one file of `d`, each file
    exactly what `convert` writes for the tensors it holds, the index listing them; `warn`
    hears what reading SRC's group found (a prefix to strip that no name starts with)."""
    with _engine.gc_paused():
        reports, failure = _core.verify_group(dst, s, d, progress=progress, warn=warn, **options)
    return reports, failure


def _configured(dst: str, f: File) -> Target | None:
    """The FP8 target DST's model config `f` describes, if it is one and SRC's config is
    not quantized (an FP8 input is dequantized, never quantized again)."""
    if not is_model_config(f.rel):
        return None
    src_doc = read_json(f)[1]
    if not isinstance(src_doc, dict) or quantization_of(src_doc) is not None:
        return None
    return _core.configured_target(dst, f.rel)


def _engine_report(r: dict[str, Any]) -> VerifyReport:
    """A verify report from the engine's dict (as `_engine.verify_file` builds it)."""
    m = r["mismatch"]
    if m is None:
        return _build(VerifyReport, r, mismatch=None)
    message = Notice("mismatch", m["message"])
    return _build(VerifyReport, r, mismatch=_build(Mismatch, m, message=message))


def _data_bytes(path: str) -> int:
    """The data section's size of a safetensors file (its size less the header; for a
    PyTorch checkpoint, its size), 0 when it cannot be read (the verification then says
    why). Only progress counts it."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return 0
    try:
        header_len = _core.read_header(path)[0]
    except (StcastError, OSError):
        return size
    return size - 8 - header_len


def _check_others(
    src: str,
    dst: str,
    to: Target,
    companions: tuple[list[File], list[File], list[File], list[str], list[str]],
    fail: Callable[[str, str], Mismatch],
    loose: bool = False,
    strip_prefix: Sequence[str] = (),
) -> Mismatch | None:
    """Copies hold the source's bytes; configs its text with the dtype changed (an FP8
    output's describing the tensors beside it); indexes its weight map (its tensors without
    `strip_prefix`), with the total size of the destination's shards; model configs DST
    adds to an FP8 output, and its quantization_config files, the FP8 tensors beside them:
    the engine's check (`run::check::check`), over SRC's configs as the plan reads them."""
    indexes, configs, others, added, sides = companions
    src_configs: list[tuple[str, str, bool, str | None]] = []
    unread: bool | None = None
    for f in configs:
        text, doc = read_json(f)
        why = unread_quantization(doc, to)
        if why is not None and unread is None:
            unread = dequantizes_any(walk(src, follow_links=True)[0], to, {})
        src_configs.append((f.rel, text, dequantizes(doc, to), why if unread else None))
    paths = {w.rel: w.path for w in walk(src, follow_links=True)[0]} if indexes else {}
    read = [(f.rel, *read_index(f, set(paths), strip_prefix)) for f in indexes]
    problem = _core.check_companions(
        dst,
        to,
        loose=loose,
        copies=[(f.rel, f.path) for f in others],
        configs=src_configs,
        indexes=[(rel, t, [*m.items()]) for rel, t, m in read],
        sources=paths,
        added=added,
        sides=sides,
    )
    return None if problem is None else fail(*problem)
