//! The walk of a source folder: every file under it, classified (weights, indexes, configs,
//! other files, folders) and checked before anything is read or written.
//!
//! PyTorch weight files and indexes of the Hugging Face layouts are weights and indexes
//! too, under the safetensors names they get (`torch_name`), unless their folder holds the
//! safetensors version of the same model (`model*.safetensors` beside `pytorch_model*.bin`):
//! then those win, and the PyTorch files are left out (`SUPERSEDED`). Trainer state
//! (`optimizer.pt`, `rng_state.pth`, ...) is left out unread (`TRAINER`).
//!
//! The user overrides that policy (`Overrides`): `include` globs bring back what was left
//! out (copied as it is: a folder of training state whole), `exclude` globs leave out files
//! that would be copied or rewritten (`EXCLUDED`; never a weight file or an index). A glob
//! matches a path in the source folder, or a folder above it (`a/b/c`: `a`, `a/b`, `a/b/c`,
//! each also with a trailing `/`), as fnmatch does (`*` crosses `/`).
//!
//! A symlink is followed only where it stays within what was asked for (the one link
//! policy, `input::folder::link_stays`): into the source folder itself, or into the `blobs/`
//! folder of a Hugging Face cache repo (cache snapshots and older `hf download --local-dir`
//! folders are made of such links). Any other link is refused, naming it, unless
//! `follow_links`: a folder converted and then uploaded must not carry a copy of
//! `/etc/shadow`. Links to folders outside the source are followed only with
//! `follow_links`, and never round a loop; a link to a folder inside it is refused either
//! way (its files would be written twice). Special files are refused. Folders are told by
//! device and inode (`output::folder_chain`), never by path strings.
//!
//! Names are bytes (`OsString`): a file name that is not UTF-8 is walked as any other.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, WalkProblem, Warning};
use crate::input::folder::{digits, is_trainer_state, link_stays};
use crate::naming::{split_rel, split_shard};
use crate::output::folder_chain;
use crate::pattern::{compile_globs, glob_matches};
use crate::text::name_list;
use crate::vocab::{OptionName, WarningKind};

/// stcast's own files (manifests, temporary files): never taken from a source folder, never
/// listed in a destination.
pub const BOOKKEEPING_PREFIX: &[u8] = b".stcast-";
/// The model config, whose dtype a conversion rewrites.
pub const CONFIG_NAME: &[u8] = b"config.json";
pub(crate) const WEIGHTS_SUFFIX: &[u8] = b".safetensors";
pub(crate) const INDEX_SUFFIX: &[u8] = b".safetensors.index.json";
/// The Hugging Face layouts' PyTorch weight stems (transformers, diffusers, PEFT), and the
/// stems the libraries load instead: `pytorch_model.bin` -> `model.safetensors`,
/// `pytorch_model-00001-of-00002.bin` -> `model-00001-of-00002.safetensors`,
/// `pytorch_model.bin.index.json` -> `model.safetensors.index.json`.
const TORCH_STEMS: [(&[u8], &[u8]); 3] = [
    (b"pytorch_model", b"model"),
    (b"diffusion_pytorch_model", b"diffusion_pytorch_model"),
    (b"adapter_model", b"adapter_model"),
];
/// Largest shard count whose missing shards are looked for (`check_complete`).
const MAX_SHARDS: u64 = 99_999;

/// A regular file of the source folder (possibly reached through a symlink).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct File {
    /// Where it goes in the destination, `/`-separated.
    pub rel: OsString,
    /// The file in the source folder.
    pub path: PathBuf,
    pub size: u64,
    pub mtime_ns: i64,
    /// Its relative path in the source, when not `rel` (a PyTorch file, renamed).
    pub src_rel: Option<OsString>,
}

/// The modification time `m` gives, in nanoseconds since the epoch (`File::mtime_ns`).
pub(crate) fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    m.mtime() * 1_000_000_000 + m.mtime_nsec()
}

impl File {
    /// Its relative path in the source folder.
    pub fn source_rel(&self) -> &OsStr {
        self.src_rel.as_deref().unwrap_or(&self.rel)
    }
}

/// Why a file was left out of a folder's conversion: trainer state, not weights (never
/// read); PyTorch weights beside their safetensors version.
pub const TRAINER: &str = "trainer";
pub const SUPERSEDED: &str = "superseded";
/// An `exclude` glob matched it (`Overrides`).
pub const EXCLUDED: &str = "excluded";

/// The user's overrides of what a folder's output copies: `include` and `exclude` globs on
/// paths in the source folder (see the module's comment).
#[derive(Debug, Default)]
pub struct Overrides {
    include: Vec<glob::Pattern>,
    exclude: Vec<glob::Pattern>,
    /// The globs as given, for the warning that one matches nothing (`unmatched`).
    given: Vec<(OptionName, String)>,
}

impl Overrides {
    /// The overrides of these globs; a bad one is its option's error.
    pub fn new(include: &[String], exclude: &[String]) -> Result<Overrides> {
        let given = [
            (OptionName::Include, include),
            (OptionName::Exclude, exclude),
        ];
        Ok(Overrides {
            include: compile_globs(include, OptionName::Include)?,
            exclude: compile_globs(exclude, OptionName::Exclude)?,
            given: given
                .into_iter()
                .flat_map(|(o, globs)| globs.iter().map(move |g| (o, g.clone())))
                .collect(),
        })
    }

    /// One warning for each glob that matches no file (nor folder) of the walked folder
    /// `w`, whatever the policy does with it: a typo, as a `keep` pattern that matches no
    /// tensor (`WarningKind::UnmatchedPattern`).
    fn unmatched(&self, w: &Walked) -> Vec<Warning> {
        let files = [&w.weights, &w.indexes, &w.configs, &w.others]
            .into_iter()
            .flatten()
            .chain(w.skipped.iter().map(|(f, _)| f));
        let rels: Vec<&[u8]> = files
            .flat_map(|f| [f.rel.as_bytes(), f.source_rel().as_bytes()])
            .chain(w.dirs.iter().map(|d| d.as_bytes()))
            .collect();
        let patterns = self.include.iter().chain(&self.exclude);
        patterns
            .zip(&self.given)
            .filter(|(p, _)| !rels.iter().any(|r| hits(std::slice::from_ref(*p), r)))
            .map(|(_, (option, glob))| {
                Warning::new(
                    WarningKind::UnmatchedPattern,
                    format!(
                        "{{{}}} glob {} matches no file of the folder (a typo?)",
                        option.name(),
                        name_list([glob.as_str()], 1)
                    ),
                )
            })
            .collect()
    }

    /// Is `rel` (a file, or a folder) brought back by an `include` glob?
    pub fn included(&self, rel: &[u8]) -> bool {
        hits(&self.include, rel)
    }

    /// Is `rel` left out by an `exclude` glob?
    pub fn excluded(&self, rel: &[u8]) -> bool {
        hits(&self.exclude, rel)
    }
}

/// Does a glob of `patterns` match `rel` or a folder above it, each with or without a
/// trailing `/`?
fn hits(patterns: &[glob::Pattern], rel: &[u8]) -> bool {
    if patterns.is_empty() {
        return false;
    }
    let rel = rel.strip_suffix(b"/").unwrap_or(rel);
    let ends = rel
        .iter()
        .enumerate()
        .filter(|&(_, &c)| c == b'/')
        .map(|(i, _)| i)
        .chain([rel.len()]);
    for end in ends {
        let path = String::from_utf8_lossy(&rel[..end]);
        let folder = format!("{path}/");
        if patterns
            .iter()
            .any(|p| glob_matches(p, &path) || glob_matches(p, &folder))
        {
            return true;
        }
    }
    false
}

/// A source folder's files, classified, each list sorted by `rel`.
#[derive(Debug, Default)]
pub struct Walked {
    pub weights: Vec<File>,
    pub indexes: Vec<File>,
    pub configs: Vec<File>,
    pub others: Vec<File>,
    /// Its folders (and links to folders followed), relative, sorted.
    pub dirs: Vec<OsString>,
    /// Files left out, and why, sorted by their relative path in the source.
    pub skipped: Vec<(File, &'static str)>,
    /// What the walk has to say: an `include` or `exclude` glob that matches no file.
    pub warnings: Vec<Warning>,
}

type Id = (u64, u64);

fn id(meta: &std::fs::Metadata) -> Id {
    (meta.dev(), meta.ino())
}

fn walk_error(path: &Path, problem: WalkProblem) -> Error {
    Error::Walk {
        path: path.to_path_buf(),
        problem,
    }
}

/// `dir/name`, or `name` at the top.
fn join_rel(dir: &[u8], name: &[u8]) -> OsString {
    if dir.is_empty() {
        return OsStr::from_bytes(name).to_os_string();
    }
    let mut out = dir.to_vec();
    out.push(b'/');
    out.extend_from_slice(name);
    OsString::from_vec(out)
}

/// The sorted entries of folder `dir`.
fn entries(dir: &Path) -> Result<Vec<std::fs::DirEntry>> {
    let listed = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "cannot list the folder", e))?;
    let mut out = listed
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| Error::io(dir, "cannot list the folder", e))?;
    out.sort_by_key(std::fs::DirEntry::file_name);
    Ok(out)
}

/// Every file under `src`, classified and checked, the user's `overrides` applied (see the
/// module's comment).
pub fn walk(src: &Path, follow_links: bool, overrides: &Overrides) -> Result<Walked> {
    let src_id = id(&std::fs::metadata(src).map_err(|e| Error::io(src, "cannot open", e))?);
    let mut w = Walked::default();
    let mut torch_files = Vec::new();
    let mut fsdp_files = Vec::new();
    let mut pending: Vec<OsString> = vec![OsString::new()];
    let mut seen_dirs = HashSet::from([src_id]);
    while let Some(rel_dir) = pending.pop() {
        let top = rel_dir.is_empty();
        let dir = if top {
            src.to_path_buf()
        } else {
            src.join(&rel_dir)
        };
        // DeepSpeed's `latest` and the tag folder it names (`global_step100` by default),
        // when that folder holds DeepSpeed's states (else `latest` is an ordinary file, and
        // the folder it names is walked as any other: `ema/` may hold weights).
        let tag = crate::input::folder::latest_tag(&dir)
            .filter(|t| crate::input::folder::is_zero_tag(&dir.join(t)));
        for e in entries(&dir)? {
            let name = e.file_name();
            let name = name.as_bytes();
            let rel = join_rel(rel_dir.as_bytes(), name);
            let path = e.path();
            if name.starts_with(BOOKKEEPING_PREFIX) {
                continue;
            }
            let kind = e
                .file_type()
                .map_err(|err| Error::io(&path, "cannot read", err))?;
            let tagged = tag.as_deref().is_some_and(|t| t.as_bytes() == name);
            let trainer_dir = tagged || is_trainer_folder(name);
            if kind.is_dir() && trainer_dir && !overrides.included(rel.as_bytes()) {
                let meta = e
                    .metadata()
                    .map_err(|err| Error::io(&path, "cannot read", err))?;
                let mtime_ns = mtime_ns(&meta);
                let size = folder_bytes(&path);
                let mut shown = rel.clone();
                shown.push("/");
                let f = File {
                    rel: shown,
                    path,
                    size,
                    mtime_ns,
                    src_rel: None,
                };
                w.skipped.push((f, TRAINER));
                continue;
            }
            if kind.is_dir() {
                // A git clone keeps a second copy of every LFS file under .git/, and
                // `hf download --local-dir` its download metadata (hashes of the original
                // files) under .cache/huggingface/: neither is worth copying.
                if !(name == b".git" || top && name == b".cache") {
                    let meta = e
                        .metadata()
                        .map_err(|err| Error::io(&path, "cannot read", err))?;
                    seen_dirs.insert(id(&meta));
                    w.dirs.push(rel.clone());
                    pending.push(rel);
                }
                continue;
            }
            // What the entry leads to (a link followed; stat once).
            let followed = std::fs::metadata(&path);
            if !kind.is_file()
                && !followed.as_ref().is_ok_and(|m| m.is_dir())
                && excludable(name)
                && overrides.excluded(rel.as_bytes())
            {
                // A link to a file (broken, or leading out) or a special file `exclude` leaves
                // out is never read: no reason to refuse the run for it. (A link to a folder
                // is walked as a folder is, or refused: what it holds may be weights.)
                let meta = followed.ok().filter(|m| m.is_file());
                let f = File {
                    rel,
                    path,
                    size: meta.as_ref().map_or(0, |m| m.len()),
                    mtime_ns: meta.as_ref().map_or(0, mtime_ns),
                    src_rel: None,
                };
                w.skipped.push((f, EXCLUDED));
                continue;
            }
            let link = kind.is_symlink();
            let meta = match followed {
                Ok(m) => m,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                    return Err(walk_error(&path, WalkProblem::BrokenLink));
                }
                Err(err) => return Err(Error::io(&path, "cannot read", err)),
            };
            let is_dir = meta.is_dir();
            if link && (is_dir || !follow_links) {
                let target = std::fs::canonicalize(&path)
                    .map_err(|err| Error::io(&path, "cannot read", err))?;
                let parent = target.parent().unwrap_or(&target);
                if is_dir && folder_chain(parent).contains(&src_id) {
                    // Followed or not, no correct output: the walk converts and copies every
                    // file, so the folder's would be written twice, once under each name.
                    return Err(walk_error(&path, WalkProblem::LinkInside { target }));
                }
                if !follow_links && (is_dir || !link_stays(&target, false, src_id)) {
                    return Err(Error::LinkOutside {
                        link: path,
                        target,
                        folder: is_dir,
                    });
                }
            }
            if is_dir {
                if !seen_dirs.insert(id(&meta)) || folder_chain(&path).contains(&src_id) {
                    return Err(walk_error(&path, WalkProblem::Loop));
                }
                w.dirs.push(rel.clone());
                pending.push(rel);
                continue;
            }
            if !meta.is_file() {
                return Err(walk_error(&path, WalkProblem::NotRegular));
            }
            let mtime_ns = mtime_ns(&meta);
            let f = File {
                rel,
                path,
                size: meta.len(),
                mtime_ns,
                src_rel: None,
            };
            if let Some(new) = torch_name(OsStr::from_bytes(name)) {
                torch_files.push(File {
                    src_rel: Some(f.rel.clone()),
                    rel: join_rel(rel_dir.as_bytes(), new.as_bytes()),
                    ..f
                });
            } else if name == FSDP_WEIGHTS {
                fsdp_files.push(File {
                    src_rel: Some(f.rel.clone()),
                    rel: join_rel(rel_dir.as_bytes(), b"model.safetensors"),
                    ..f
                });
            } else if (is_trainer_state(name) || tag.is_some() && name == b"latest")
                && !overrides.included(f.rel.as_bytes())
            {
                w.skipped.push((f, TRAINER));
            } else if name.ends_with(INDEX_SUFFIX) {
                w.indexes.push(f);
            } else if name.ends_with(WEIGHTS_SUFFIX) {
                w.weights.push(f);
            } else if name == CONFIG_NAME {
                w.configs.push(f);
            } else {
                w.others.push(f);
            }
        }
    }
    // Where a folder holds a model in both formats, the safetensors files win.
    let families: HashSet<_> = w
        .weights
        .iter()
        .map(|f| {
            let (folder, stem) = family(&f.rel);
            (folder.to_vec(), stem.to_vec())
        })
        .collect();
    // What the policy leaves out but an `include` glob brings back: copied as it is.
    let as_is = |f: File| File {
        rel: f.source_rel().to_os_string(),
        src_rel: None,
        ..f
    };
    for f in torch_files {
        let (folder, stem) = family(&f.rel);
        if families.contains(&(folder.to_vec(), stem.to_vec())) {
            if overrides.included(f.source_rel().as_bytes()) {
                w.others.push(as_is(f));
            } else {
                w.skipped.push((f, SUPERSEDED));
            }
        } else if f.rel.as_bytes().ends_with(INDEX_SUFFIX) {
            w.indexes.push(f);
        } else {
            w.weights.push(f);
        }
    }
    // accelerate's whole FSDP weights: training state beside other weights, else the weights.
    for f in fsdp_files {
        let folder = split_rel(f.rel.as_bytes()).0;
        if w.weights
            .iter()
            .any(|o| split_rel(o.rel.as_bytes()).0 == folder)
        {
            if overrides.included(f.source_rel().as_bytes()) {
                w.others.push(as_is(f));
            } else {
                w.skipped.push((f, TRAINER));
            }
        } else {
            w.weights.push(f);
        }
    }
    check_complete(&w.weights, &w.indexes, &w.skipped)?;
    exclude(&mut w, overrides);
    let mut taken: HashMap<&OsStr, &Path> = HashMap::new();
    for f in [&w.weights, &w.indexes, &w.configs, &w.others]
        .into_iter()
        .flatten()
    {
        if let Some(other) = taken.insert(&f.rel, &f.path) {
            let problem = WalkProblem::SameName {
                rel: PathBuf::from(&f.rel),
                other: other.to_path_buf(),
            };
            return Err(walk_error(&f.path, problem));
        }
    }
    for list in [
        &mut w.weights,
        &mut w.indexes,
        &mut w.configs,
        &mut w.others,
    ] {
        list.sort_by(|a, b| a.rel.cmp(&b.rel));
    }
    w.dirs.sort();
    w.skipped
        .sort_by(|(a, _), (b, _)| a.source_rel().cmp(b.source_rel()));
    w.warnings = overrides.unmatched(&w);
    Ok(w)
}

/// Can an `exclude` glob leave out a file of this name (a copy or a config, not weights,
/// an index or a PyTorch file converted)?
fn excludable(name: &[u8]) -> bool {
    let converted = torch_name(OsStr::from_bytes(name)).is_some() || name == FSDP_WEIGHTS;
    !(converted || name.ends_with(WEIGHTS_SUFFIX) || name.ends_with(INDEX_SUFFIX))
}

/// Leave out the copies and configs an `exclude` glob matches, and the folders they leave
/// empty that a glob matches too.
fn exclude(w: &mut Walked, overrides: &Overrides) {
    if overrides.exclude.is_empty() {
        return;
    }
    for list in [&mut w.configs, &mut w.others] {
        let (out, kept): (Vec<File>, Vec<File>) = std::mem::take(list)
            .into_iter()
            .partition(|f| overrides.excluded(f.rel.as_bytes()));
        *list = kept;
        w.skipped.extend(out.into_iter().map(|f| (f, EXCLUDED)));
    }
    let written: Vec<&[u8]> = [&w.weights, &w.indexes, &w.configs, &w.others]
        .into_iter()
        .flatten()
        .map(|f| f.rel.as_bytes())
        .collect();
    w.dirs.retain(|d| {
        let d = d.as_bytes();
        let under = |r: &&[u8]| r.strip_prefix(d).is_some_and(|r| r.starts_with(b"/"));
        !overrides.excluded(d) || written.iter().any(under)
    });
}

/// Refuse a set of `STEM-0000i-of-0000N` shards with one missing and no index (which would
/// say so itself): converted, it would look like a whole checkpoint (an interrupted
/// download). Where PyTorch shards of the same name stood beside it, say they were not used.
fn check_complete(weights: &[File], indexes: &[File], skipped: &[(File, &str)]) -> Result<()> {
    let indexed: HashSet<&[u8]> = indexes.iter().map(|f| f.rel.as_bytes()).collect();
    // (folder, stem, the count as written) -> the shard numbers present
    type Set<'a> = (&'a [u8], &'a [u8], &'a [u8]);
    let mut sets: BTreeMap<Set<'_>, BTreeSet<u64>> = BTreeMap::new();
    for w in weights {
        let (folder, name) = split_rel(w.rel.as_bytes());
        if let Some((stem, i, n)) = shard_numbers(name) {
            let i = std::str::from_utf8(i).ok().and_then(|i| i.parse().ok());
            sets.entry((folder, stem, n))
                .or_default()
                .insert(i.unwrap_or(u64::MAX));
        }
    }
    for ((folder, stem, total), have) in sets {
        let index = join_rel(folder, &[stem, INDEX_SUFFIX].concat());
        let n: Option<u64> = std::str::from_utf8(total).ok().and_then(|t| t.parse().ok());
        let Some(n) = n.filter(|&n| n <= MAX_SHARDS) else {
            continue;
        };
        if indexed.contains(index.as_bytes()) {
            continue;
        }
        let mut missing = (1..=n).filter(|i| !have.contains(i));
        let Some(first) = missing.next() else {
            continue;
        };
        let total = String::from_utf8_lossy(total).into_owned();
        let name = format!("-{first:0w$}-of-{total}.safetensors", w = total.len());
        let rel = join_rel(folder, &[stem, name.as_bytes()].concat());
        let pytorch = skipped
            .iter()
            .any(|(f, why)| *why == SUPERSEDED && family(&f.rel) == (folder, stem));
        let problem = WalkProblem::Incomplete {
            more: missing.count(),
            stem: String::from_utf8_lossy(stem).into_owned(),
            total,
            pytorch,
        };
        return Err(walk_error(Path::new(&rel), problem));
    }
    Ok(())
}

/// `STEM-i-of-n.safetensors` split into stem, i and n.
fn shard_numbers(name: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    split_shard(name.strip_suffix(WEIGHTS_SUFFIX)?)
}

/// The folder and model a weight file or index belongs to: `("unet",
/// "diffusion_pytorch_model")` for `unet/diffusion_pytorch_model-00001-of-00002.safetensors`.
fn family(rel: &OsStr) -> (&[u8], &[u8]) {
    let (folder, name) = split_rel(rel.as_bytes());
    let name = name
        .strip_suffix(INDEX_SUFFIX)
        .or_else(|| name.strip_suffix(WEIGHTS_SUFFIX))
        .unwrap_or(name);
    (folder, split_shard(name).map_or(name, |(stem, _, _)| stem))
}

/// The safetensors name of a PyTorch weight file or index of the Hugging Face layouts
/// (`pytorch_model-00001-of-00002.bin` -> `model-00001-of-00002.safetensors`), or None if
/// `name` is not one.
pub fn torch_name(name: &OsStr) -> Option<OsString> {
    let name = name.as_bytes();
    let renamed = TORCH_STEMS.iter().find_map(|&(stem, new)| {
        let rest = name.strip_prefix(stem)?;
        if rest == b".bin.index.json" {
            return Some([new, INDEX_SUFFIX].concat());
        }
        let shard = rest.strip_suffix(b".bin")?;
        let sharded = shard.is_empty() || split_shard(shard).is_some_and(|(s, _, _)| s.is_empty());
        sharded.then(|| [new, shard, WEIGHTS_SUFFIX].concat())
    });
    renamed.map(OsString::from_vec)
}

/// A folder of training state: DeepSpeed's `global_stepN/` (ZeRO partitions of the model
/// and optimizer), accelerate's `optimizer_N/` and `pytorch_model_fsdp_N/` (sharded optimizer
/// and FSDP model states, DCP folders).
fn is_trainer_folder(name: &[u8]) -> bool {
    [&b"global_step"[..], b"optimizer_", b"pytorch_model_fsdp_"]
        .iter()
        .any(|p| name.strip_prefix(*p).is_some_and(digits))
}

/// accelerate's FSDP weights saved whole (`FULL_STATE_DICT`): the model's state dict, in
/// fp32; converted as `model.safetensors` where no other weights stand beside it.
const FSDP_WEIGHTS: &[u8] = b"pytorch_model_fsdp.bin";

/// The bytes of the files under `dir` (links not followed; at most `MAX_COUNTED` entries).
fn folder_bytes(dir: &Path) -> u64 {
    const MAX_COUNTED: usize = 1_000_000;
    let (mut total, mut seen, mut todo) = (0, 0, vec![dir.to_path_buf()]);
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            seen += 1;
            if seen > MAX_COUNTED {
                return total;
            }
            match e.metadata() {
                Ok(m) if m.is_dir() => todo.push(e.path()),
                Ok(m) if m.is_file() => total += m.len(),
                _ => {}
            }
        }
    }
    total
}

/// Every file under `dst` but stcast's bookkeeping (manifests, temporary files), as sorted
/// relative paths; links and special files count as files, folders are walked (never a
/// link).
pub fn listing(dst: &Path) -> Result<Vec<OsString>> {
    let mut out = Vec::new();
    let mut pending = vec![OsString::new()];
    while let Some(rel_dir) = pending.pop() {
        let dir = if rel_dir.is_empty() {
            dst.to_path_buf()
        } else {
            dst.join(&rel_dir)
        };
        for e in entries(&dir)? {
            let name = e.file_name();
            if name.as_bytes().starts_with(BOOKKEEPING_PREFIX) {
                continue;
            }
            let rel = join_rel(rel_dir.as_bytes(), name.as_bytes());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                pending.push(rel);
            } else {
                out.push(rel);
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests;
