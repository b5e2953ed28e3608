//! Where a folder run reads and writes: the source (a Hugging Face cache repo root read as
//! its snapshot), the destination named by default, and the destination's place against
//! the source, by device and inode: path strings never decide.
//!
//! A destination reached through a bind mount, a symlink or `..` is the same folder as the
//! source when their identities agree, and it is inside the source when the source is one
//! of its ancestors, found by walking `..` from the folder itself (`output::folder_chain`:
//! the kernel's parent chain, not the path's).

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::io::{self, Read};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Inapplicable, PlaceProblem, Result};
use crate::input::folder::check_folder;
use crate::output::{folder_chain, names_a_folder};
use crate::run::walk::{mtime_ns, torch_name, File, WEIGHTS_SUFFIX};
use crate::vocab::{OptionName, Target};

/// A file's or folder's identity: device and inode.
pub type Ident = (u64, u64);

/// The Hugging Face cache's repo folders: `models--org--name`, and so on.
const HUB_KINDS: [&[u8]; 3] = [b"models--", b"datasets--", b"spaces--"];

/// The folders of one tree looked at for their identities: more than any checkpoint has.
const MAX_FOLDERS: usize = 1_000_000;

fn refused(path: &Path, problem: PlaceProblem) -> Error {
    Error::Place {
        path: path.to_path_buf(),
        problem,
    }
}

/// A file's identity: its device and inode.
pub fn ident(m: &std::fs::Metadata) -> Ident {
    (m.dev(), m.ino())
}

/// `path`'s metadata, not following a link; None if nothing is there.
pub fn lstat(path: &Path) -> Result<Option<std::fs::Metadata>> {
    match std::fs::symlink_metadata(path) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, "cannot stat", e)),
    }
}

fn io_error(path: &Path, what: &'static str, source: io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// Is `path` a folder of files (a Hugging Face folder), rather than one checkpoint (a DCP or
/// ZeRO folder, read as one source, as a file is)? One stcast cannot read is refused.
pub fn is_tree(path: &Path) -> Result<bool> {
    Ok(path.is_dir() && !check_folder(path, false)?)
}

/// What a run's SRC is: the first thing each command decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// Nothing there: the run's own read says so, naming it.
    Missing,
    /// A file (anything that is not a folder: a link to nowhere too).
    File,
    /// One checkpoint in a folder (DCP, ZeRO), read as one source, as a file is.
    Checkpoint,
    /// A folder of files (a Hugging Face folder): a folder run.
    Tree,
}

impl SourceKind {
    /// The name the Python package reads (`None` for `Missing`).
    pub fn name(self) -> Option<&'static str> {
        match self {
            SourceKind::Missing => None,
            SourceKind::File => Some("file"),
            SourceKind::Checkpoint => Some("checkpoint"),
            SourceKind::Tree => Some("tree"),
        }
    }
}

/// What `src` is. With `check`, a folder holding a distributed checkpoint stcast cannot read
/// is refused, naming it, and so is a path that is not there but reads like a Hugging Face
/// Hub repo id or URL, with the command that downloads it (`hub_repo`); without, such a
/// folder is one checkpoint and such a path is missing.
pub fn source(src: &Path, check: bool) -> Result<SourceKind> {
    if std::fs::symlink_metadata(src).is_err() {
        return match hub_repo(src).filter(|_| check) {
            Some(repo) => Err(refused(src, PlaceProblem::HubRepo { repo })),
            None => Ok(SourceKind::Missing),
        };
    }
    if !src.is_dir() {
        return Ok(SourceKind::File);
    }
    match check_folder(src, false) {
        Ok(false) => Ok(SourceKind::Tree),
        Ok(true) => Ok(SourceKind::Checkpoint),
        Err(_) if !check => Ok(SourceKind::Checkpoint),
        Err(e) => Err(e),
    }
}

/// The Hub repo (`org/name`; `ORG/NAME` for a URL that names none) a path that is not there
/// was meant to be: a repo id or a Hub URL. A path under a folder that is here, or naming a
/// checkpoint's file (`ckpt/ckpt.json`, a typo of a local path), is none.
fn hub_repo(src: &Path) -> Option<String> {
    // Bytes that are not UTF-8 match no word character (a URL of them still gets the hint).
    let path = src.to_string_lossy();
    let url = ["http://", "https://", "hf://"]
        .iter()
        .any(|p| path.starts_with(p));
    // A word character is a letter, a number or `_` (Python's `\w`, as the hint always read
    // it; the regex crate's `\w` also takes combining marks and connectors, not `²`).
    let hub = regex::Regex::new(
        r"^(?:https?://(?:www\.)?huggingface\.co/|hf://(?:models/)?)?([\p{L}\p{N}_.-]+/[\p{L}\p{N}_.-]+)(?:/(?:tree|blob|resolve)/.*)?/?$",
    )
    .expect("a valid pattern");
    let repo = hub.captures(&path).map(|c| c[1].to_string());
    if let (Some(repo), false) = (&repo, url) {
        let (org, name) = repo.split_once('/').unwrap_or_default();
        let local = regex::Regex::new(r"(?i)\.(json|safetensors|bin|pt|pth|ckpt|distcp|index)$")
            .expect("a valid pattern");
        if Path::new(org).is_dir() || local.is_match(name) {
            return None;
        }
    }
    match repo {
        Some(repo) => Some(repo),
        None if url => Some("ORG/NAME".into()),
        None => None,
    }
}

/// The file a one-file run given `dst` writes: `dst` as users type it. A DST that names a
/// folder (one that exists, or a path ending with `/`) gets the name `default_dst` gives
/// the output inside it, as `cp` does; so does, for one checkpoint in a folder (DCP), a DST
/// not named `*.safetensors`: the Hugging Face folder that holds it.
pub fn file_dst(src: &Path, dst: &Path, target: Target) -> Result<PathBuf> {
    const EXT: &[u8] = b".safetensors";
    let typed = dst.as_os_str().as_bytes();
    let trimmed = &typed[..typed.len() - typed.iter().rev().take_while(|&&c| c == b'/').count()];
    let named = trimmed.len() >= EXT.len()
        && trimmed[trimmed.len() - EXT.len()..].eq_ignore_ascii_case(EXT);
    if names_a_folder(dst) || dst.is_dir() || (src.is_dir() && !named) {
        let default = default_dst(src, target, false)?;
        return Ok(path_of(join(
            typed,
            basename(default.as_os_str().as_bytes()),
        )));
    }
    Ok(dst.to_path_buf())
}

/// What `verify` compares: the output file (`false`) or folder (`true`) it pairs with SRC.
/// - A DST folder that is a checkpoint to convert (DCP, ZeRO) is refused: SRC and DST
///   were swapped.
/// - For a one-file SRC (not `named`: no re-sharded stem given), a DST that names a folder
///   means the file `convert` writes into it by default (for `target`; without one, for
///   any target: two there is a usage error), if it is there (`verified_file`).
/// - A folder of files SRC, or a DST folder holding no such file, is a folder verify.
/// - `named` with any other DST is a usage error of `name`: it names a folder's files.
pub fn verify_route(
    src: &Path,
    dst: &Path,
    target: Option<Target>,
    named: bool,
) -> Result<(PathBuf, bool)> {
    if dst.is_dir() {
        check_folder(dst, true)?;
    }
    let tree = is_tree(src)?;
    let dst = if tree || named {
        dst.to_path_buf()
    } else {
        verified_file(src, dst, target)?
    };
    let folder = tree || dst.is_dir();
    if named && !folder {
        return Err(Error::NotApplicable {
            option: OptionName::Name,
            src: src.to_path_buf(),
            why: Inapplicable::FileDst,
        });
    }
    Ok((dst, folder))
}

/// The file `verify` compares a one-file SRC with, when DST names a folder: the one
/// `convert` writes into it by default, for `target`, else for any target, whichever is
/// there. A folder holding none is itself (a re-sharded one); a folder to be is the file
/// `file_dst` names in it (which then is not there, as the read says).
fn verified_file(src: &Path, dst: &Path, target: Option<Target>) -> Result<PathBuf> {
    if !(names_a_folder(dst) || dst.is_dir()) {
        return Ok(dst.to_path_buf());
    }
    let targets = target.as_ref().map_or(Target::ALL, std::slice::from_ref);
    let mut names: Vec<PathBuf> = Vec::new();
    for t in targets {
        let name = file_dst(src, dst, *t)?;
        if !names.contains(&name) {
            names.push(name); // one checkpoint in a folder: one name for several
        }
    }
    let found: Vec<&PathBuf> = names.iter().filter(|n| n.is_file()).collect();
    let name = |p: &Path| p.file_name().unwrap_or_default().to_os_string();
    match found[..] {
        [first, second, ..] => Err(refused(
            dst,
            PlaceProblem::HoldsBoth {
                first: name(first),
                second: name(second),
            },
        )),
        [one] => Ok(one.clone()),
        [] if dst.is_dir() => Ok(dst.to_path_buf()),
        [] => Ok(names.swap_remove(0)),
    }
}

/// `p` as an absolute path, `..` taken back lexically (`os.path.abspath`).
pub(crate) fn absolute(p: &Path) -> PathBuf {
    let p = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    PathBuf::from(OsStr::from_bytes(&normpath(p.as_os_str().as_bytes())))
}

/// `os.path.normpath`: `.` and empty parts dropped, `..` taken back lexically where it can be.
pub(crate) fn normpath(path: &[u8]) -> Vec<u8> {
    if path.is_empty() {
        return b".".to_vec();
    }
    let root: &[u8] = match path {
        [b'/', b'/'] => b"//",
        [b'/', b'/', c, ..] if *c != b'/' => b"//",
        [b'/', ..] => b"/",
        _ => b"",
    };
    let mut parts: Vec<&[u8]> = Vec::new();
    for part in path.split(|&c| c == b'/') {
        match part {
            b"" | b"." => {}
            b".." if !parts.is_empty() && parts.last() != Some(&&b".."[..]) => {
                parts.pop();
            }
            b".." if !root.is_empty() => {}
            _ => parts.push(part),
        }
    }
    let mut out = root.to_vec();
    out.extend(parts.join(&b'/'));
    if out.is_empty() {
        out.push(b'.');
    }
    out
}

/// The last part of a path as `os.path.basename` gives it (after the last `/`).
fn basename(path: &[u8]) -> &[u8] {
    path.rsplit(|&c| c == b'/').next().unwrap_or_default()
}

/// `path` without its last `/`-part (`os.path.dirname`).
fn dirname(path: &[u8]) -> &[u8] {
    match path.iter().rposition(|&c| c == b'/') {
        Some(0) => b"/",
        Some(at) => &path[..at],
        None => b"",
    }
}

/// `path` without its extension, as `os.path.splitext` cuts it: a name's leading dots are
/// not an extension's.
fn strip_ext(path: &[u8]) -> &[u8] {
    let name = basename(path);
    let start = path.len() - name.len();
    let first = name.iter().position(|&c| c != b'.');
    match (first, name.iter().rposition(|&c| c == b'.')) {
        (Some(f), Some(dot)) if dot > f => &path[..start + dot],
        _ => path,
    }
}

fn path_of(bytes: Vec<u8>) -> PathBuf {
    PathBuf::from(OsString::from_vec(bytes))
}

fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut out = dir.to_vec();
    if !(out.is_empty() || out.ends_with(b"/")) {
        out.push(b'/');
    }
    out.extend_from_slice(name);
    out
}

/// `src` as a name to put a destination beside: `.` and `..` become the folder's own name,
/// as `..` reaches it (relative stays relative: `stcast convert .` writes `../NAME-bf16`).
fn named_base(src: &Path) -> Vec<u8> {
    let base = normpath(src.as_os_str().as_bytes());
    if !matches!(basename(&base), b"" | b"." | b"..") {
        return base;
    }
    let real = std::fs::canonicalize(src).unwrap_or_default();
    let name = basename(real.as_os_str().as_bytes());
    if name.is_empty() {
        return base;
    }
    normpath(&join(&join(&base, b".."), name))
}

/// What follows the last `--` of a name, as Python's `name.split("--")[-1]` finds it
/// (left to right: `a---x` gives `-x`).
fn last_part(name: &[u8]) -> &[u8] {
    let mut at = 0;
    let mut i = 0;
    while i + 1 < name.len() {
        if &name[i..i + 2] == b"--" {
            i += 2;
            at = i;
        } else {
            i += 1;
        }
    }
    &name[at..]
}

fn is_hub_name(name: &[u8]) -> bool {
    HUB_KINDS.iter().any(|k| name.starts_with(k))
}

/// The destination a run writes when none is given.
/// - A Hugging Face folder: the folder `<src>-bf16` beside it; beside a cache repo root
///   `models--org--name`, `name-bf16` (a name the cache would not take for one of its repos).
/// - One checkpoint in a folder (DCP, ZeRO): the folder `<folder>-bf16` (`-safetensors` for
///   `keep`), holding `model.safetensors` unless `folder` (re-sharded).
/// - A file: `<stem>-bf16.safetensors` beside it (`keep`: `<stem>.safetensors` for a
///   PyTorch file); re-sharded (`folder`), the folder `<stem>-bf16`.
pub fn default_dst(src: &Path, target: Target, folder: bool) -> Result<PathBuf> {
    let to = target.name().as_bytes();
    if is_tree(src)? {
        let mut base = named_base(src);
        let name = basename(&base).to_vec();
        if is_hub_name(&name) && path_of(join(&base, b"snapshots")).is_dir() {
            base = join(dirname(&base), last_part(&name));
        }
        return Ok(path_of([&base[..], b"-", to].concat()));
    }
    if src.is_dir() {
        let suffix: &[u8] = if target == Target::Keep {
            b"safetensors"
        } else {
            to
        };
        let dir = [&named_base(src)[..], b"-", suffix].concat();
        return Ok(path_of(if folder {
            dir
        } else {
            join(&dir, b"model.safetensors")
        }));
    }
    let src = src.as_os_str().as_bytes();
    let stem = strip_ext(src);
    Ok(path_of(if folder {
        [stem, b"-", to].concat()
    } else if target == Target::Keep && !src[stem.len()..].eq(b".safetensors") {
        [stem, b".safetensors"].concat()
    } else {
        [stem, b"-", to, b".safetensors"].concat()
    }))
}

/// Python's `str.strip()` over ASCII text: its whitespace includes the separators 0x1c-0x1f.
fn strip(s: &str) -> &str {
    s.trim_matches(|c: char| {
        c.is_ascii_whitespace() || ('\x1c'..='\x1f').contains(&c) || c == '\x0b'
    })
}

/// The folder to read when `src` is a Hugging Face cache repo root (`.../models--org--name/`,
/// holding `blobs/`, `refs/` and `snapshots/`): the snapshot `refs/main` names, or the only
/// snapshot there is. Several snapshots and no `refs/main` is refused, listing them; `blobs/`
/// is never walked. Any other folder is itself.
pub fn source_folder(src: &Path) -> Result<PathBuf> {
    let bytes = src.as_os_str().as_bytes();
    let snapshots = path_of(join(bytes, b"snapshots"));
    if !is_hub_name(basename(&normpath(bytes))) || !snapshots.is_dir() {
        return Ok(src.to_path_buf());
    }
    let reference = path_of(join(bytes, b"refs/main"));
    if reference.is_file() {
        let mut head = Vec::with_capacity(256);
        std::fs::File::open(&reference)
            .and_then(|f| f.take(256).read_to_end(&mut head))
            .map_err(|e| io_error(&reference, "cannot read", e))?;
        let text: String = head
            .iter()
            .map(|&b| if b.is_ascii() { b as char } else { '\u{fffd}' })
            .collect();
        let commit = strip(&text);
        let chosen = snapshots.join(commit);
        // A name of snapshots/ itself: never "..", a path or an empty ref.
        if !matches!(commit, "" | "." | "..") && !commit.contains('/') && chosen.is_dir() {
            return Ok(chosen);
        }
        return Err(refused(
            &reference,
            PlaceProblem::NoSnapshot {
                commit: commit.into(),
                snapshots,
            },
        ));
    }
    let mut found: Vec<OsString> = std::fs::read_dir(&snapshots)
        .map_err(|e| io_error(&snapshots, "cannot list", e))?
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name())
        .collect();
    found.sort();
    if let [one] = &found[..] {
        return Ok(snapshots.join(one));
    }
    Err(refused(src, PlaceProblem::Snapshots { found, snapshots }))
}

/// Where a folder run reads and writes.
#[derive(Debug)]
pub struct Place {
    /// The folder (or, re-sharded, the file) read: a cache repo root's snapshot.
    pub src: PathBuf,
    /// The destination folder: the one given, or the default one.
    pub dst: PathBuf,
    /// The source's identity.
    pub id: Ident,
}

/// Where a folder run (`resharding`: or a file or checkpoint folder re-sharded) reads and
/// writes: the destination named by default when `dst` is None (from `src` as given: beside
/// a cache repo root), the source read (`source_folder`), and, with `check`, the source
/// checked against the destination (`check_source`).
pub fn place(
    src: &Path,
    dst: Option<&Path>,
    target: Target,
    resharding: bool,
    check: bool,
) -> Result<Place> {
    let dst = match dst {
        Some(dst) => dst.to_path_buf(),
        None => default_dst(src, target, true)?,
    };
    let src = source_folder(src)?;
    let id = if check {
        check_dst_name(&dst, resharding)?;
        check_source(&src, &dst, resharding)?
    } else {
        ident(&std::fs::metadata(&src).map_err(|e| io_error(&src, "cannot open", e))?)
    };
    Ok(Place { src, dst, id })
}

/// A folder run writes a folder: a destination named like a file (`out.safetensors`, in any
/// case) that is not a folder already would become a folder no loader opens as a file. Refused
/// as a usage error naming the folder to give instead (`out/`), before anything is created.
fn check_dst_name(dst: &Path, resharding: bool) -> Result<()> {
    const EXT: &[u8] = b".safetensors";
    let Some(name) = dst.file_name().map(OsStr::as_bytes) else {
        return Ok(());
    };
    let file_like =
        name.len() >= EXT.len() && name[name.len() - EXT.len()..].eq_ignore_ascii_case(EXT);
    if !file_like || dst.is_dir() {
        return Ok(());
    }
    let stem = &name[..name.len() - EXT.len()];
    let stem = if stem.is_empty() {
        b"out".as_slice()
    } else {
        stem
    };
    Err(refused(
        dst,
        PlaceProblem::DstLikeFile {
            resharding,
            folder: dst.with_file_name(OsStr::from_bytes(stem)),
        },
    ))
}

/// The identities of `root` and of every folder below it (symlinks not followed).
fn folder_ids(root: &Path) -> Result<HashSet<Ident>> {
    let m = std::fs::metadata(root).map_err(|e| io_error(root, "cannot open", e))?;
    let mut ids = HashSet::from([ident(&m)]);
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() && ids.len() < MAX_FOLDERS => {
                    ids.insert(ident(&m));
                    todo.push(e.path());
                }
                _ => {}
            }
        }
    }
    Ok(ids)
}

fn meets(chain: &[Ident], ids: &HashSet<Ident>) -> bool {
    chain.iter().any(|i| ids.contains(i))
}

/// The source of a folder run writing into the folder `dst`, checked before anything is
/// written; its identity.
/// - A folder of files: refused when `dst` is it, lies inside it or contains it.
/// - Re-sharded (`resharding`), a file or one checkpoint in a folder (DCP, ZeRO): refused when
///   `dst` lies inside that folder or a folder one of its entries links to (a ZeRO tag
///   folder): what is written there would become part of the checkpoint.
///
/// Either way a `dst` that exists must be a folder.
pub fn check_source(src: &Path, dst: &Path, resharding: bool) -> Result<Ident> {
    let file = resharding && src.exists() && !is_tree(src)?;
    let m = match std::fs::metadata(src) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(refused(src, PlaceProblem::Missing { folder: !file }));
        }
        Err(e) => return Err(io_error(src, "cannot open", e)),
    };
    if !m.is_dir() && (!file || !m.is_file()) {
        return Err(refused(src, PlaceProblem::NotAFolder { file }));
    }
    let chain = folder_chain(dst);
    if file && m.is_dir() && meets(&chain, &checkpoint_ids(src, &m)) {
        return Err(refused(
            dst,
            PlaceProblem::DstInCheckpoint {
                src: src.to_path_buf(),
            },
        ));
    }
    let dst_dir = dst.is_dir();
    if !dst_dir && std::fs::symlink_metadata(dst).is_ok() {
        return Err(refused(
            dst,
            PlaceProblem::DstNotAFolder { resharding: file },
        ));
    }
    if file {
        return Ok(ident(&m));
    }
    // By identity, not by name: `..` from DST may leave a bind mount of a folder inside SRC
    // at its mount point, so DST's chain is compared with every folder of SRC's tree.
    if meets(&chain, &folder_ids(src)?) {
        return Err(refused(dst, PlaceProblem::DstInSource));
    }
    if dst_dir && meets(&folder_chain(src), &folder_ids(dst)?) {
        return Err(refused(dst, PlaceProblem::DstHoldsSource));
    }
    Ok(ident(&m))
}

/// A checkpoint folder and the folders its entries link to.
fn checkpoint_ids(src: &Path, m: &std::fs::Metadata) -> HashSet<Ident> {
    let mut ids = HashSet::from([ident(m)]);
    for e in std::fs::read_dir(src).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_symlink()) {
            if let Some(m) = std::fs::metadata(e.path()).ok().filter(|m| m.is_dir()) {
                ids.insert(ident(&m));
            }
        }
    }
    ids
}

/// Refuse, before anything is written, an output `rels` of `dst` that is a file of the
/// source (`inputs`; a hard link, or a symlink to it; the lone file `src` re-sharded), or that is, or lies in, a folder of
/// the source folder `src` (a bind mount of one under `dst`). Every output is checked here,
/// so that a refusal never comes after a file was replaced.
pub fn check_outputs(src: &Path, dst: &Path, rels: &[OsString], inputs: &[PathBuf]) -> Result<()> {
    let mut by_id: HashMap<Ident, &Path> = HashMap::new();
    for path in inputs {
        if let Ok(m) = std::fs::metadata(path) {
            by_id.entry(ident(&m)).or_insert(path);
        }
    }
    let folders = if src.is_dir() {
        folder_ids(src)?
    } else {
        HashSet::new()
    };
    let mut seen: HashSet<PathBuf> = HashSet::new();
    for rel in rels {
        let path = dst.join(rel);
        // Nothing there (or a dangling link, which is replaced as a link): no input.
        let found = std::fs::metadata(&path).ok();
        if let Some(input) = found.as_ref().and_then(|m| by_id.get(&ident(m))) {
            let problem = match src.is_dir() {
                true => PlaceProblem::OutputIsInput {
                    input: input.to_path_buf(),
                },
                false => PlaceProblem::OutputIsTheFile,
            };
            return Err(refused(&path, problem));
        }
        // The folders the output goes into, below DST (and itself, if a folder).
        let parts: Vec<&[u8]> = rel.as_bytes().split(|&c| c == b'/').collect();
        let last = parts.len() - usize::from(!found.is_some_and(|m| m.is_dir()));
        let mut sub = dst.to_path_buf();
        for part in &parts[..last] {
            sub.push(OsStr::from_bytes(part));
            if !seen.insert(sub.clone()) {
                continue;
            }
            let Ok(m) = std::fs::metadata(&sub) else {
                break;
            };
            if folders.contains(&ident(&m)) {
                return Err(refused(&sub, PlaceProblem::OutputInSource));
            }
        }
    }
    Ok(())
}

/// The file `src` as the only weight file of a folder (a file or one checkpoint in a folder
/// re-sharded): its name kept, but a PyTorch checkpoint's made a safetensors name, as in a
/// folder (`pytorch_model.bin` -> `model.safetensors`; `ema.pt` -> `ema.safetensors`). One
/// checkpoint in a folder (DCP) is `model.safetensors`, of its regular files' total size
/// and its entries' latest mtime.
pub fn single_file(src: &Path) -> Result<File> {
    let m = std::fs::metadata(src).map_err(|e| io_error(src, "cannot open", e))?;
    if m.is_dir() {
        let (mut size, mut newest) = (0, None);
        let entries = std::fs::read_dir(src).map_err(|e| io_error(src, "cannot list", e))?;
        for e in entries {
            let path = e.map_err(|e| io_error(src, "cannot list", e))?.path();
            let f = std::fs::metadata(&path).map_err(|e| io_error(&path, "cannot open", e))?;
            size += if f.is_file() { f.len() } else { 0 };
            newest = newest.max(Some(mtime_ns(&f)));
        }
        return Ok(File {
            rel: "model.safetensors".into(),
            path: src.to_path_buf(),
            size,
            mtime_ns: newest.unwrap_or(mtime_ns(&m)),
            src_rel: Some(".".into()),
        });
    }
    let name = basename(src.as_os_str().as_bytes());
    let rel = if name.ends_with(WEIGHTS_SUFFIX) {
        OsStr::from_bytes(name).to_os_string()
    } else {
        let stem = || OsString::from_vec([strip_ext(name), WEIGHTS_SUFFIX].concat());
        torch_name(OsStr::from_bytes(name)).unwrap_or_else(stem)
    };
    let renamed = rel.as_bytes() != name;
    Ok(File {
        src_rel: renamed.then(|| OsStr::from_bytes(name).to_os_string()),
        rel,
        path: src.to_path_buf(),
        size: m.len(),
        mtime_ns: mtime_ns(&m),
    })
}

#[cfg(test)]
mod tests;
