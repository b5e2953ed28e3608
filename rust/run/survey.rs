//! What a folder run writes into its destination, and whether it may: the whole question,
//! answered before anything is written.
//!
//! Given the plan's outputs (`Planned`) and the destination, `survey` reads the manifests
//! there (`run::manifest::survey`), sorts every file the destination holds into stcast's
//! own (proven by a manifest, or under `--resume` shown to be exactly what the plan writes:
//! adopted), a sibling shard run's, or foreign, and refuses a foreign file where the run
//! would write, or any foreign file unless `--resume` or `--force`. With a `Room` (a
//! conversion, not `finalize`), it then tells which of this run's weights are done
//! (`--resume` skips them), refuses a destination whose file system cannot hold the rest,
//! and refuses files that a loader would take for the output but the run does not write
//! (leftovers of another cut, another run's output under this name).
//!
//! What only the caller knows about its plan (what a weights file must hold, what a config
//! it rewrites will say, whether a manifest entry still matches the inputs) it answers
//! through `Judge`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, SurveyProblem};
use crate::naming::{self, split_rel};
use crate::output;
use crate::run::check;
use crate::run::json::Node;
use crate::run::manifest::{self, Asked};
use crate::run::place::{self, Ident};

/// What a planned output is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A weights file: a converted file, or an output shard.
    Weights,
    /// A file copied byte for byte.
    Copy,
    /// A config the run copies or rewrites.
    Config,
    /// A weights index.
    Index,
}

/// One file the whole run writes: where, what, and how many bytes.
#[derive(Debug, Clone)]
pub struct Planned {
    pub rel: OsString,
    pub kind: Kind,
    pub size: u64,
}

/// What a file there must be to be the plan's output (`Judge::proof`).
#[derive(Debug, Clone)]
pub enum Proof {
    /// Exactly these bytes.
    Bytes(Vec<u8>),
    /// The bytes of this file (a source file copied as it is).
    SameAs(PathBuf),
    /// The caller's own answer (a weights file it verified against its inputs).
    Known(bool),
}

/// What only the caller of `survey` can tell about its plan.
pub trait Judge {
    /// Under `--resume`, of a regular file at a planned output's name that no manifest
    /// proves stcast's: what it must be to be taken over as this plan's output.
    fn proof(&mut self, rel: &OsStr, kind: Kind) -> Result<Proof>;
    /// Is the weights file at `rel`, proven stcast's, this run's output as one of
    /// `entries` (its manifest entries made with this run's options) records it?
    fn done(&mut self, rel: &OsStr, entries: &[Node<'static>]) -> Result<bool>;
}

/// What a conversion (not `finalize`) asks besides: the source `src` and every file of it
/// (`sources`: no output may be one), the weights this run writes (all, or its shard's),
/// the input weight files (never leftovers: a folder converted into itself), and the stems
/// a group had before `name` renamed its output (`(folder, stem)`).
#[derive(Debug, Clone, Default)]
pub struct Room {
    pub src: PathBuf,
    pub sources: Vec<PathBuf>,
    pub mine: Vec<OsString>,
    pub inputs: Vec<PathBuf>,
    pub renamed: Vec<(OsString, OsString)>,
}

/// The question: the run (`asked`), everything the whole run writes, and for a conversion
/// its `Room`.
#[derive(Debug, Clone)]
pub struct Question<'a> {
    pub asked: Asked<'a>,
    pub outputs: Vec<Planned>,
    pub room: Option<Room>,
}

/// The answer: what the destination holds for this run, and what the run writes.
#[derive(Debug, Default)]
pub struct Answer {
    /// The manifests' survey; its `ours` also holds the adopted files, in the folder's order.
    pub manifests: manifest::Survey,
    /// The outputs `--resume` took over without a manifest (exactly what the plan writes).
    pub adopted: Vec<OsString>,
    /// Files an earlier run of this source wrote (a manifest proves it) that this plan does
    /// not write: shards cut at another size, removed once the new indexes are written.
    pub stale: Vec<(OsString, Ident)>,
    /// This run's weights that are done already (`--resume` skips them).
    pub skipped: Vec<OsString>,
    /// The bytes the run writes.
    pub need: u64,
    /// The model configs this run replaces that would describe its weights wrongly
    /// (another target's): withdrawn before the first weights are replaced, so that a run
    /// stopped before its configs are written leaves none that misleads a loader.
    pub withdraw: Vec<OsString>,
}

const WEIGHTS: &[u8] = b".safetensors";
const INDEX: &[u8] = b".safetensors.index.json";

/// Is `planned` a weights file of the whole run that this shard run does not write, in a
/// destination that holds shard runs of this source (`s`: their manifests)? A destination
/// without any is refused for it as for any file stcast did not write.
fn others_unit(q: &Question<'_>, s: &manifest::Survey, planned: &Planned) -> bool {
    let Some(room) = q.room.as_ref().filter(|_| q.asked.shard.is_some()) else {
        return false;
    };
    let runs = s.own.is_some() || !s.siblings.is_empty();
    runs && planned.kind == Kind::Weights && !room.mine.contains(&planned.rel)
}

/// Answer `q` about `dst` (see the module's text), refusing before anything is written.
pub fn survey(dst: &Path, q: &Question<'_>, judge: &mut dyn Judge) -> Result<Answer> {
    let asked = &q.asked;
    if let Some(room) = &q.room {
        // Every name the plan may write (its manifest too), against every file of the
        // source, by identity: the engine's own check comes per file, after others were written.
        let mut rels: Vec<OsString> = q.outputs.iter().map(|o| o.rel.clone()).collect();
        rels.sort();
        rels.push(manifest::file_name(asked.shard).into());
        place::check_outputs(&room.src, dst, &rels, &room.sources)?;
    }
    not_files(dst, q)?;
    let mut s = manifest::survey(dst, asked)?;
    let kinds: HashMap<&OsStr, &Planned> = q.outputs.iter().map(|o| (&*o.rel, o)).collect();
    let stale = s
        .ours
        .iter()
        .filter(|(rel, _)| !kinds.contains_key(&**rel))
        .cloned()
        .collect();
    let proven: HashSet<OsString> = s.ours.iter().map(|(rel, _)| rel.clone()).collect();
    let planned_by_runs: HashSet<&OsString> = s.planned.iter().collect();
    let mut ours: HashMap<OsString, Ident> = s.ours.iter().cloned().collect();
    let (mut adopted, mut foreign_planned, mut foreign_other) = (vec![], vec![], vec![]);
    for rel in &s.present {
        if proven.contains(rel) {
            continue;
        }
        if planned_by_runs.contains(rel) && !asked.force && !asked.resume {
            continue; // a sibling run's file, in progress: not ours to touch
        }
        match kinds.get(&**rel) {
            // Another shard run's unit: that run replaces it (or refuses it), and `finalize`
            // proves it; neither refused nor taken over here.
            Some(&planned) if others_unit(q, &s, planned) => {}
            Some(&planned) => match adoptable(dst, planned, asked.resume, judge)? {
                Some(id) => {
                    ours.insert(rel.clone(), id);
                    adopted.push(rel.clone());
                }
                None => foreign_planned.push(rel.clone()),
            },
            None => foreign_other.push(rel.clone()),
        }
    }
    // In the folder's order, as the manifest claims them.
    s.ours = s
        .present
        .iter()
        .filter_map(|rel| Some((rel.clone(), *ours.get(rel)?)))
        .collect();
    let mut answer = Answer {
        manifests: s,
        adopted,
        stale,
        ..Answer::default()
    };
    let mut written: HashSet<&OsStr> = kinds.keys().copied().collect();
    written.extend(answer.stale.iter().map(|(rel, _)| &**rel));
    if asked.force {
        // `force` replaces what the plan writes, whoever wrote it, and deletes nothing else.
    } else if let Some(first) = foreign_planned.first() {
        return Err(refused(
            dst,
            dst.join(first),
            SurveyProblem::Unproven {
                listed: foreign_planned,
                resume: asked.resume,
                // (Only `finalize` asks without room: it writes no weights.)
                finalize: q.room.is_none(),
            },
        ));
    }
    if let Some(room) = &q.room {
        // Refused whatever the flags: before the refusal of foreign files, whose hint
        // points to `force`.
        let left = leftovers(dst, &stems(q, room), &room.inputs, &written);
        if let Some(first) = left.first() {
            let at = dst.join(first);
            return Err(refused(dst, at, SurveyProblem::Leftovers { listed: left }));
        }
    }
    if !asked.force && !asked.resume && !foreign_other.is_empty() {
        let listed = foreign_other;
        return Err(refused(dst, dst.into(), SurveyProblem::Foreign { listed }));
    }
    if let Some(room) = &q.room {
        answer.skipped = done(&answer, asked, room, judge)?;
        answer.need = check_space(dst, q, room, &answer.skipped)?;
        let stems = stems(q, room);
        let to = recorded_target(asked);
        wrong_config(dst, to, &stems, &written)?;
        answer.withdraw = withdrawn(dst, to, &kinds);
        answer
            .withdraw
            .extend(side_configs(dst, to, &stems, &written)?);
    }
    Ok(answer)
}

/// The FP8 side configs (`beside::FOLDER_SIDE_CONFIG`) beside the weights a dense run
/// writes that the run does not write again, withdrawn (`Answer::withdraw`; a lone
/// output's are so too, `convert`) when each is the one stcast wrote beside the weights
/// there (an earlier FP8 run's: `beside::stale_side`). Another is refused when it would
/// describe the new weights wrongly, else left as it is.
fn side_configs(
    dst: &Path,
    to: Option<crate::vocab::Target>,
    stems: &BTreeMap<OsString, BTreeSet<OsString>>,
    written: &HashSet<&OsStr>,
) -> Result<Vec<OsString>> {
    use crate::run::beside::StaleSide;
    let Some(to) = to.filter(|&t| crate::run::beside::Weights::dense(t)) else {
        return Ok(Vec::new());
    };
    let name = crate::run::beside::FOLDER_SIDE_CONFIG.as_bytes();
    let mut out = Vec::new();
    for folder in stems.keys() {
        let rel = match folder.is_empty() {
            true => os(name),
            false => os(&[folder.as_bytes(), b"/", name].concat()),
        };
        let path = dst.join(&rel);
        if written.contains(&*rel) || !path.is_file() {
            continue;
        }
        // The weights there now: the earlier output's, which the side config describes.
        let here = dst.join(folder);
        let mut weights: Vec<PathBuf> = std::fs::read_dir(&here)
            .map_err(|e| Error::io(&here, "cannot list", e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.as_os_str().as_bytes().ends_with(WEIGHTS) && p.is_file())
            .collect();
        weights.sort();
        match crate::run::beside::stale_side(&path, &weights, to) {
            StaleSide::Withdraw => out.push(rel),
            StaleSide::Refuse(why) => {
                return Err(Error::WrongConfig {
                    path,
                    why,
                    folder: true,
                })
            }
            StaleSide::Leave => {}
        }
    }
    Ok(out)
}

/// A planned output (or the run's manifest) whose path is a folder, a FIFO, socket or device
/// (or a link to one): no run replaces it, `force`d or not, so it is refused before the first
/// byte rather than met when the run publishes there.
fn not_files(dst: &Path, q: &Question<'_>) -> Result<()> {
    let record = manifest::file_name(q.asked.shard);
    let rels = q.outputs.iter().map(|o| &*o.rel);
    for rel in rels.chain([OsStr::new(&record)]) {
        let path = dst.join(rel);
        match output::at_path(&path) {
            output::AtPath::Folder => return Err(Error::DestinationIsFolder { path }),
            output::AtPath::Special => return Err(Error::DestinationIsSpecial { path }),
            output::AtPath::Nothing | output::AtPath::File { .. } => {}
        }
    }
    Ok(())
}

/// The target the run records (`to` of its options).
fn recorded_target(asked: &Asked<'_>) -> Option<crate::vocab::Target> {
    match asked.options.get("to").map(|n| &n.value) {
        Some(crate::run::json::Value::Str(crate::run::json::Str::Text(t))) => {
            crate::vocab::Target::parse(t)
        }
        _ => None,
    }
}

/// The model configs (`config.json`) the plan writes over (`kinds`) that describe the
/// weights of `to` wrongly, as they are now (`Answer::withdraw`).
fn withdrawn(
    dst: &Path,
    to: Option<crate::vocab::Target>,
    kinds: &HashMap<&OsStr, &Planned>,
) -> Vec<OsString> {
    let Some(weights) = to.and_then(crate::run::beside::Weights::planned) else {
        return Vec::new();
    };
    let mut out: Vec<OsString> = kinds
        .iter()
        .filter(|(rel, planned)| {
            planned.kind == Kind::Config && split_rel(rel.as_bytes()).1 == b"config.json"
        })
        .filter(|(rel, _)| {
            let text = check::read_bounded(&dst.join(rel));
            text.is_ok_and(|t| {
                let t = String::from_utf8_lossy(&t);
                crate::run::beside::problem(&t, weights, false).is_some()
            })
        })
        .map(|(rel, _)| rel.to_os_string())
        .collect();
    out.sort();
    out
}

/// Refuse a model config (`config.json`) beside weights this run writes that the run
/// leaves as it is (SRC has none there, or `--exclude` leaves it out) and that would
/// describe them wrongly (`beside::problem`): an earlier run's, of another target.
fn wrong_config(
    dst: &Path,
    to: Option<crate::vocab::Target>,
    stems: &BTreeMap<OsString, BTreeSet<OsString>>,
    written: &HashSet<&OsStr>,
) -> Result<()> {
    let Some(weights) = to.and_then(crate::run::beside::Weights::planned) else {
        return Ok(());
    };
    for folder in stems.keys() {
        let rel = match folder.is_empty() {
            true => OsString::from("config.json"),
            false => os(&[folder.as_bytes(), b"/config.json"].concat()),
        };
        let path = dst.join(&rel);
        if written.contains(&*rel) || !path.is_file() {
            continue;
        }
        crate::run::beside::refuse_wrong_config(path, weights, true)?;
    }
    Ok(())
}

fn refused(dst: &Path, path: PathBuf, problem: SurveyProblem) -> Error {
    let dst = dst.to_path_buf();
    Error::Survey { dst, path, problem }
}

/// Under `resume`, the identity of the file at `rel` if it is exactly what the plan writes
/// there, without a manifest to say so (a finished run removes its manifest): nothing short
/// of its content proves it (a fine-tune of the same base has the same header, and another
/// folder may hold a config of the same name).
fn adoptable(
    dst: &Path,
    planned: &Planned,
    resume: bool,
    judge: &mut dyn Judge,
) -> Result<Option<Ident>> {
    if !resume {
        return Ok(None);
    }
    let (rel, kind) = (&*planned.rel, planned.kind);
    let path = dst.join(rel);
    let meta = match std::fs::symlink_metadata(&path) {
        Ok(m) if m.is_file() => m,
        Ok(_) => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, "cannot stat", e)),
    };
    // Weights are planned to the byte: a file of another size is not this plan's.
    if kind == Kind::Weights && meta.len() != planned.size {
        return Ok(None);
    }
    let same = match judge.proof(rel, kind)? {
        Proof::Known(same) => same,
        Proof::Bytes(want) => {
            meta.len() == want.len() as u64 && read(&path)?.is_some_and(|got| got == want)
        }
        Proof::SameAs(source) => check::same_bytes(&source, &path),
    };
    Ok(same.then(|| (meta.dev(), meta.ino())))
}

/// The whole content of `path` (None: it is gone).
fn read(path: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(data) => Ok(Some(data)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, "cannot read", e)),
    }
}

/// This run's weights that are done (`--resume`, never `--force`): stcast's, and adopted or
/// recorded by an entry the caller still finds true.
fn done(
    answer: &Answer,
    asked: &Asked<'_>,
    room: &Room,
    judge: &mut dyn Judge,
) -> Result<Vec<OsString>> {
    if asked.force {
        return Ok(vec![]);
    }
    let ours: HashSet<&OsString> = answer.manifests.ours.iter().map(|(r, _)| r).collect();
    let entries: HashMap<&OsString, &Vec<Node<'static>>> = answer
        .manifests
        .entries
        .iter()
        .map(|(r, e)| (r, e))
        .collect();
    let mut skipped = vec![];
    for rel in room.mine.iter().filter(|rel| ours.contains(rel)) {
        let recorded = match entries.get(rel) {
            Some(e) => judge.done(rel, e)?,
            None => false,
        };
        if recorded || answer.adopted.contains(rel) {
            skipped.push(rel.clone());
        }
    }
    Ok(skipped)
}

/// The bytes the run writes, refused when the destination's file system cannot hold them:
/// this run's weights not done and, for a whole run (not a shard's), everything else, each
/// file in the whole blocks it takes there (`output::block_size`: 700 one-byte files take
/// 700 blocks, an empty one a block too).
fn check_space(dst: &Path, q: &Question<'_>, room: &Room, skipped: &[OsString]) -> Result<u64> {
    let whole = q.asked.shard.is_none();
    let mine: HashSet<&OsString> = room.mine.iter().collect();
    let skipped: HashSet<&OsString> = skipped.iter().collect();
    let dir = output::nearest_dir(dst);
    let block = output::block_size(&dir);
    let need: u64 = q
        .outputs
        .iter()
        .filter(|o| match o.kind {
            Kind::Weights => mine.contains(&o.rel) && !skipped.contains(&o.rel),
            _ => whole,
        })
        .map(|o| o.size.div_ceil(block).max(1).saturating_mul(block))
        .sum();
    let have = output::free_space(&dir).map_err(|e| Error::io(&dir, "statvfs", e))?;
    if need > have {
        return Err(Error::NoSpace {
            dir,
            need,
            have,
            folder: true,
        });
    }
    Ok(need)
}

/// The stems of the weights and indexes the plan writes, by folder (`model` for
/// `model.safetensors`, `model-00001-of-00003.safetensors` and
/// `model.safetensors.index.json`), with each group's stem before `name` renamed it.
fn stems(q: &Question<'_>, room: &Room) -> BTreeMap<OsString, BTreeSet<OsString>> {
    let mut stems: BTreeMap<OsString, BTreeSet<OsString>> = BTreeMap::new();
    for o in &q.outputs {
        let (folder, name) = split_rel(o.rel.as_bytes());
        let stem = match o.kind {
            Kind::Index => name.strip_suffix(INDEX),
            Kind::Weights if name != WEIGHTS => name.strip_suffix(WEIGHTS).map(stem_of),
            _ => None,
        };
        if let Some(stem) = stem {
            let folder = OsString::from_vec(folder.to_vec());
            stems.entry(folder).or_default().insert(os(stem));
        }
    }
    for (folder, stem) in &room.renamed {
        stems
            .entry(folder.clone())
            .or_default()
            .insert(stem.clone());
    }
    stems
}

fn os(b: &[u8]) -> OsString {
    OsString::from_vec(b.to_vec())
}

/// The stem of a weights file's name without its extension: `model` for `model` and
/// `model-00001-of-00003`.
fn stem_of(base: &[u8]) -> &[u8] {
    match naming::split_shard(base) {
        Some((stem, _, _)) if !stem.is_empty() => stem,
        _ => base,
    }
}

/// Is `name` the weights (a file or a shard) or the index of one of `stems`?
fn is_output_name(name: &[u8], stems: &BTreeSet<OsString>) -> bool {
    naming::names_output(name, |s| stems.contains(OsStr::from_bytes(s)))
}

/// Files of `dst` named as the weights or index of one of `stems` (by folder) that the run
/// does not write (`written`: its outputs, and the stale files it removes): a loader would
/// take them for the output (an index for it, shards beside it). The input files themselves
/// (a folder converted into itself) are not. The indexes first: they are what a loader reads.
fn leftovers(
    dst: &Path,
    stems: &BTreeMap<OsString, BTreeSet<OsString>>,
    inputs: &[PathBuf],
    written: &HashSet<&OsStr>,
) -> Vec<OsString> {
    let ident = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let ids: HashSet<Ident> = inputs.iter().filter_map(|p| ident(p)).collect();
    let mut left = vec![];
    for (folder_rel, names_of) in stems {
        let folder = dst.join(folder_rel);
        let Ok(entries) = std::fs::read_dir(&folder) else {
            continue;
        };
        let mut names: Vec<OsString> = entries.filter_map(|e| Some(e.ok()?.file_name())).collect();
        names.sort();
        for name in names {
            let rel = if folder_rel.is_empty() {
                name.clone()
            } else {
                os(&[folder_rel.as_bytes(), b"/", name.as_bytes()].concat())
            };
            let named = is_output_name(name.as_bytes(), names_of) && !written.contains(&*rel);
            if named && ident(&folder.join(&name)).is_none_or(|id| !ids.contains(&id)) {
                left.push(rel);
            }
        }
    }
    left.sort_by_key(|rel| !rel.as_bytes().ends_with(INDEX));
    left
}

#[cfg(test)]
mod tests;
