//! How a folder run writes into its destination: where each file goes and what it may
//! replace there, its claim in the run's manifest before it has a name and its record once
//! it has; the old indexes and configs withdrawn before anything changes, the rollback of a
//! failed run, the re-check before the run declares success, the shards of another cut and
//! the manifests removed at its end.
//!
//! Every file goes through the one atomic write path (`output`): a hidden, locked temp,
//! fsync, then the name. A name that exists is replaced only as `Writer::replace_for`
//! allows: a file a manifest records this source's runs wrote (its identity unchanged), or
//! under `force` a file the plan writes that the survey found there (also unchanged: not a
//! rival run's written since). Nothing is removed that this run cannot prove stcast wrote.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use indexmap::IndexMap;

use crate::error::{Error, ManifestProblem, PlaceProblem, Result, Warning};
use crate::output::{self, Published, Replace, Sealed};
use crate::run::json::{self, Str, Value};
use crate::run::manifest::Manifest;
use crate::run::place::{self, lstat, Ident};
use crate::vocab::ErrorKind;

/// An index's weight map: tensor name -> shard, relative to the destination.
pub type WeightMap = BTreeMap<String, String>;

/// One run's writing into its destination: its manifest, and what it may replace there.
#[derive(Debug)]
pub struct Writer {
    pub record: Manifest,
    /// Files stcast wrote (recorded by a manifest, adopted by `--resume`, or published by
    /// this run): rel -> the identity they must still have to be replaced, in the order
    /// found or published.
    ours: IndexMap<OsString, Ident>,
    /// Under `force`: the files the survey found (rel -> identity), which it may replace.
    found: HashMap<OsString, Ident>,
    /// Under `force`: the files found that it claims for a `--resume` of it (and a shard
    /// run's `finalize`) to replace: those the plan writes (`Writer::new`: this run's own).
    pub writes: HashSet<OsString>,
    force: bool,
    /// The folders this run makes that were not there (`make_folders`), deepest first.
    made: Vec<PathBuf>,
    /// What DST held before this run wrote anything (`begin`), and whether its manifest
    /// name was taken: a failed run removes only what it added.
    before: HashSet<OsString>,
    had_manifest: bool,
    /// The files recorded done before the run began (`--resume`: this run's weights
    /// converted already).
    done_before: Vec<OsString>,
}

/// What `unlink_if` found at a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unlinked {
    Removed,
    /// A folder, or a file that is no longer the one proven: it stays.
    Left,
    Nothing,
}

impl Writer {
    /// A run about to write with `record` (not saved yet); `ours` and, under `force`,
    /// `found` as the survey answered.
    pub fn new(
        record: Manifest,
        ours: Vec<(OsString, Ident)>,
        found: Vec<(OsString, Ident)>,
        force: bool,
    ) -> Writer {
        let writes = record.planned.iter().cloned().collect();
        Writer {
            record,
            writes,
            ours: ours.into_iter().collect(),
            found: found.into_iter().collect(),
            force,
            made: Vec::new(),
            before: HashSet::new(),
            had_manifest: false,
            done_before: Vec::new(),
        }
    }

    pub fn dst(&self) -> &Path {
        &self.record.dst
    }

    /// The identity a file already at `rel` must have for publishing to replace it: the
    /// file stcast wrote there, or under `force` the one the survey found (if none was
    /// there, none is replaced: a file that appeared since is a rival run's).
    pub fn replace_for(&self, rel: &OsStr) -> Option<Ident> {
        let found = || self.force.then(|| self.found.get(rel).copied()).flatten();
        self.ours.get(rel).copied().or_else(found)
    }

    fn replace(&self, rel: &OsStr) -> Replace {
        match self.replace_for(rel) {
            None => Replace::No,
            Some((dev, ino)) => Replace::Same { dev, ino },
        }
    }

    /// The mark of this run's hidden files (a shard run's own).
    fn tag(&self) -> String {
        match self.record.shard {
            None => String::new(),
            Some((i, n)) => format!("s{i}of{n}"),
        }
    }

    /// Remove the named temps of killed runs (`output::remove_stale_temps`) from DST and the
    /// folders of `rels` in it, once every check has passed: a run that converts nothing
    /// there (a `--resume` with every unit done, `finalize`) leaves none behind either. One
    /// note per file removed.
    pub fn remove_stale_temps(&self, rels: &[OsString]) -> Vec<Warning> {
        let dst = self.dst();
        let dirs = rels.iter().map(|r| output::parent_dir(&dst.join(r)));
        let dirs: BTreeSet<PathBuf> = dirs.chain([dst.to_path_buf()]).collect();
        dirs.iter()
            .flat_map(|d| output::remove_stale_temps(d))
            .collect()
    }

    /// Before the first byte: note the folders the run may make (DST, the folders above
    /// it, those below it that `rels` lie in) that do not exist yet, then make DST. A
    /// failed run removes them again, once empty (`roll_back`).
    pub fn make_folders(&mut self, rels: &[OsString]) -> Result<()> {
        let dst = self.dst().to_path_buf();
        let mut wanted = BTreeSet::from([dst.clone()]);
        for rel in rels {
            let mut dir = dst.clone();
            let parts: Vec<_> = Path::new(rel).components().collect();
            for part in &parts[..parts.len().saturating_sub(1)] {
                dir.push(part);
                wanted.insert(dir.clone());
            }
        }
        // The folders above DST that are missing too (`mkdir -p`).
        let mut up = place::absolute(&dst);
        while let Some(parent) = up.parent().map(Path::to_path_buf) {
            if parent.parent().is_none() || std::fs::symlink_metadata(&parent).is_ok() {
                break;
            }
            wanted.insert(parent.clone());
            up = parent;
        }
        let mut missing = Vec::new();
        let lexists = |d: &Path| std::fs::symlink_metadata(d).is_ok();
        for d in wanted {
            if !lexists(&d) {
                missing.push(d);
            }
        }
        missing.sort_by_key(|d| std::cmp::Reverse(place::absolute(d).components().count()));
        self.made = missing;
        std::fs::create_dir_all(&dst).map_err(|e| Error::io(&dst, "cannot create the folder", e))
    }

    /// Save the manifest before any output: the other runs sharing this folder know it is
    /// this run's. A manifest at its name that another run saved after this one checked the
    /// folder refuses the run, the folders it made removed again. Each file stcast wrote
    /// here that the manifest does not record as done is claimed in it (`Manifest::carry`):
    /// it replaces the manifests that proved them; under `force`, so is each file found.
    ///
    /// `before`: the files DST holds (not stcast's bookkeeping); `had_manifest`: a manifest
    /// is at this run's name. `roll_back` keeps both.
    pub fn begin(&mut self, before: HashSet<OsString>, had_manifest: bool) -> Result<()> {
        (self.before, self.had_manifest) = (before, had_manifest);
        self.done_before = self.record.written();
        self.record.carry(&self.ours)?;
        if self.force {
            // What `force` lets this run replace (`writes`), it lets `--resume` of this run,
            // and a shard run's `finalize`, replace too: a stopped `--force` over an earlier
            // output is continued, not refused for the files it was about to replace (each
            // still the file the survey found). Only those: a file the plan does not write
            // is never this run's to remove.
            let mut found: Vec<_> = (self.found.iter())
                .filter(|(rel, _)| self.writes.contains(*rel))
                .map(|(rel, id)| (rel.clone(), *id))
                .collect();
            found.sort();
            self.record.carry(found.iter().map(|(rel, id)| (rel, id)))?;
        }
        match self.record.save() {
            Err(Error::DestinationExists { .. }) => {
                self.remove_made();
                let (path, dst) = (self.record.path(), self.dst().to_path_buf());
                let problem = ManifestProblem::StartedMeanwhile { dst };
                Err(Error::Manifest { path, problem })
            }
            r => r,
        }
    }

    fn remove_made(&self) {
        for folder in &self.made {
            // Not empty (or not there): not only this run's.
            let _ = std::fs::remove_dir(folder);
        }
    }

    /// `dst/rel_dir`, created as needed; an existing link or file on the way is refused,
    /// so that nothing is written outside DST, whatever a previous occupant left.
    pub fn folder(&self, rel_dir: &Path) -> Result<PathBuf> {
        let mut path = self.dst().to_path_buf();
        for part in rel_dir.components() {
            path.push(part);
            match std::fs::create_dir(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if !lstat(&path)?.is_some_and(|m| m.is_dir()) {
                        let problem = PlaceProblem::InTheWay;
                        return Err(Error::Place { path, problem });
                    }
                }
                Err(e) => return Err(Error::io(&path, "cannot create the folder", e)),
            }
        }
        Ok(path)
    }

    /// `folder` of each of `dirs`.
    pub fn folders(&self, dirs: &[OsString]) -> Result<()> {
        dirs.iter()
            .try_for_each(|d| self.folder(Path::new(d)).map(drop))
    }

    /// Where `rel` goes in DST, its folders created.
    pub fn out_path(&self, rel: &OsStr) -> Result<PathBuf> {
        let rel = Path::new(rel);
        let dir = self.folder(rel.parent().unwrap_or(Path::new("")))?;
        Ok(dir.join(rel.file_name().unwrap_or(rel.as_os_str())))
    }

    /// The hidden file of `content` for `rel`, sealed: only its name is missing.
    pub fn seal_text(&self, rel: &OsStr, content: &[u8]) -> Result<output::TempOutput> {
        let path = self.out_path(rel)?;
        output::sealed_file(&path, content, self.replace(rel), &self.tag())
    }

    /// The copy of the regular file `src` as `rel`, to be stepped to its end.
    pub fn start_copy(&self, rel: &OsStr, src: &Path) -> Result<output::Copy> {
        let path = self.out_path(rel)?;
        output::Copy::new(src, &path, self.replace(rel), &self.tag())
    }

    /// Before the sealed `out` has its name: this run's manifest claims it as `rel`, so
    /// that a run killed just after publishing it still proves it wrote it. The claim
    /// names the header written (the engine read it back), not a plan's.
    pub fn claim(&mut self, rel: &OsStr, out: &impl Sealed) -> Result<()> {
        self.claim_as(rel, out.identity()?, out.header_sha256())
    }

    /// `claim` of each of several sealed outputs, with one save of the manifest.
    pub fn claim_all<'a, S: Sealed + 'a>(
        &mut self,
        outs: impl IntoIterator<Item = (&'a OsStr, &'a S)>,
    ) -> Result<()> {
        for (rel, out) in outs {
            let (id, header) = (out.identity()?, out.header_sha256().unwrap_or_default());
            self.record.claim(rel, (id.dev, id.ino, id.size), &header);
        }
        self.record.save_claims()
    }

    /// `claim` of the sealed output `id` with the header hash `header`.
    pub fn claim_as(&mut self, rel: &OsStr, id: Published, header: Option<String>) -> Result<()> {
        let header = header.unwrap_or_default();
        self.record.claim(rel, (id.dev, id.ino, id.size), &header);
        self.record.save_claims()
    }

    /// Record `rel` as published (`id` None: the file there now) with `entry` (what
    /// `--resume` needs to trust it), and as this run's from now on.
    pub fn published(
        &mut self,
        rel: &OsStr,
        kind: &str,
        id: Option<(u64, u64, u64)>,
        entry: Option<&json::Node<'_>>,
    ) -> Result<(u64, u64, u64)> {
        let id = match id {
            Some(id) => id,
            None => self.record.identity(rel)?,
        };
        self.record.record(rel, kind, id, entry);
        self.ours.insert(rel.to_os_string(), (id.0, id.1));
        Ok(id)
    }

    /// What a failure to publish says: another run took this folder over, or wrote the file
    /// after this run's survey (where none was, or under `force` another than the survey
    /// found). Any other failure is told as it is.
    pub fn rival(&self, e: Error) -> Error {
        if !matches!(e.kind(), ErrorKind::DestinationExists | ErrorKind::Refused) {
            return e;
        }
        if let Err(taken) = self.record.check_still_ours() {
            return taken;
        }
        match e {
            Error::DestinationExists { path } => self.rival_at(path),
            Error::NotOurs { path } if self.force => self.rival_at(path),
            e => e,
        }
    }

    fn rival_at(&self, path: PathBuf) -> Error {
        let dst = self.dst().to_path_buf();
        Error::Manifest {
            path,
            problem: ManifestProblem::Rival { dst },
        }
    }

    /// Unlink `rel` of DST if it is not a folder and, given `id`, still that file.
    fn unlink_if(&self, rel: &OsStr, id: Option<Ident>) -> Result<Unlinked> {
        let path = self.dst().join(rel);
        let Some(m) = lstat(&path)? else {
            return Ok(Unlinked::Nothing);
        };
        if m.is_dir() || id.is_some_and(|id| (m.dev(), m.ino()) != id) {
            return Ok(Unlinked::Left);
        }
        std::fs::remove_file(&path).map_err(|e| Error::io(&path, "cannot remove", e))?;
        Ok(Unlinked::Removed)
    }

    fn drop_ours(&mut self, rel: &OsStr) {
        self.ours.shift_remove(rel);
        self.record.forget(rel);
    }

    /// Before anything in DST changes: withdraw the old indexes this run would make
    /// inconsistent, and only those, and the old model configs `configs` that would describe
    /// its weights wrongly (the survey's `withdraw`).
    ///
    /// The old configs and indexes stay until the new ones replace them at publish (the
    /// atomic write path renames over them), so that a run that fails or is interrupted
    /// leaves an earlier output loadable: its index names shards that are still there, or
    /// that this run replaced by shards of the same names and tensors. An old index that
    /// maps a tensor to another file than the new one (`indexes`: each index's new map)
    /// does, and names a file this run replaces (`writes`), would point a loader at the
    /// wrong shard: it goes first. Only files stcast may replace are removed.
    pub fn unpublish(
        &mut self,
        indexes: &[(OsString, WeightMap)],
        writes: &HashSet<OsString>,
        configs: &[OsString],
    ) -> Result<()> {
        for (rel, new_map) in indexes {
            let Some(id) = self.replace_for(rel) else {
                continue; // the survey refused what may not be replaced
            };
            let Some(old_map) = old_weight_map(self.dst(), rel) else {
                continue; // nothing a loader reads
            };
            let stale = old_map.values().any(|v| writes.contains(OsStr::new(v)));
            if old_map == *new_map || !stale {
                continue; // still consistent whenever the run stops
            }
            if self.unlink_if(rel, Some(id))? == Unlinked::Removed {
                self.drop_ours(rel);
            }
        }
        for rel in configs {
            if let Some(id) = self.replace_for(rel) {
                if self.unlink_if(rel, Some(id))? == Unlinked::Removed {
                    self.drop_ours(rel);
                }
            }
        }
        Ok(())
    }

    /// The conversion of one of this run's weights failed with `e` (as `rival` tells it).
    /// A run a rival's file stopped (a run that started meanwhile) keeps what it finished
    /// for `--resume`; having written nothing, it takes its manifest back. A file changed
    /// in DST since the survey keeps what is done for `--resume` too. A folder another run
    /// took over is that run's now (told instead of `e`). Any other refusal or bad input
    /// (a value that overflows under `on_overflow=error`, an input that is not what its
    /// header says, or that changed while read) would fail `--resume` again: the run is
    /// rolled back. Returns the error to tell.
    pub fn failed(&mut self, e: Error) -> Error {
        let not_ours = |e: &Error| match e {
            Error::AfterCommit { source, .. } => matches!(**source, Error::NotOurs { .. }),
            e => matches!(e, Error::NotOurs { .. }),
        };
        match e.kind() {
            ErrorKind::DestinationExists => {
                let done = &self.done_before;
                if self.record.written().iter().all(|r| done.contains(r)) {
                    self.roll_back();
                }
            }
            ErrorKind::Refused | ErrorKind::InvalidInput | ErrorKind::InputChanged
                if !not_ours(&e) =>
            {
                if let Err(taken) = self.failed_input() {
                    return taken;
                }
            }
            _ => {}
        }
        e
    }

    /// The files of one of this run's weights are not what the plan read (bad input, or a
    /// refusal reading them), found as its conversion began or while it ran: `--resume`
    /// would fail again, so the run is rolled back, unless another run took this folder
    /// over (its error, to tell instead).
    pub fn failed_input(&mut self) -> Result<()> {
        self.record.check_still_ours()?;
        self.roll_back();
        Ok(())
    }

    /// Undo what a failed run added: the files it wrote where nothing was (each still the
    /// one it wrote), its manifest if there was none, and the folders it made, once empty.
    /// Nothing that was there before is removed (those `force` replaced neither: their old
    /// bytes are gone, their names still hold a conversion); an older manifest of this
    /// run's name stays, saved without the files removed.
    pub fn roll_back(&mut self) {
        let removed = self.record.roll_back(&self.before, self.had_manifest);
        self.ours.retain(|r, _| !removed.contains(r));
        self.remove_made();
    }

    /// Remove what an earlier run of this source wrote and this plan does not (`stale`:
    /// the shards of another cut, under `--resume` or `force`): left there, they would sit
    /// beside the new shards, named by no index. Only files still the ones a manifest
    /// recorded are removed, the indexes first: whenever this stops, no index names a shard
    /// that is gone.
    pub fn remove_stale(&mut self, stale: &[(OsString, Ident)]) -> Result<()> {
        let mut stale = stale.to_vec();
        stale.sort_by_key(|(rel, _)| !rel.as_bytes().ends_with(b".json"));
        for (rel, id) in stale {
            if self.unlink_if(&rel, Some(id))? != Unlinked::Nothing {
                self.drop_ours(&rel);
            }
        }
        Ok(())
    }

    /// Before declaring success (and before a loader's cues appear), every file this run
    /// wrote is still the one it wrote; if not, the loader's cues this run published
    /// (`cues`: indexes, configs, late copies) are withdrawn, so that the folder does not
    /// look complete (only files still the ones this run wrote).
    pub fn recheck(&self, cues: &[OsString]) -> Result<()> {
        match self.record.recheck() {
            Err(e) if e.kind() == ErrorKind::Refused => {
                self.record.unlink_written(cues)?;
                Err(e)
            }
            r => r,
        }
    }

    /// At completion: the manifests go (this run's and `others`, the other runs' of this
    /// source), so that the folder holds no stcast files.
    pub fn remove_own(&self, others: &[Manifest]) -> Result<()> {
        self.record.remove()?;
        others.iter().try_for_each(Manifest::remove)
    }
}

/// The weight map of the index at `dst/rel` with its shards relative to DST; None if there
/// is none a loader could read.
fn old_weight_map(dst: &Path, rel: &OsStr) -> Option<WeightMap> {
    let path = dst.join(rel);
    if !lstat(&path).ok()??.is_file() {
        return None;
    }
    let bytes = crate::run::check::read_bounded(&path).ok()?;
    let text = std::str::from_utf8(&bytes).ok()?;
    let doc = json::parse(text).ok()?;
    let members = doc.get("weight_map")?.dict()?;
    let folder = Path::new(rel).parent().unwrap_or(Path::new(""));
    let lossy = |s: &Str<'_>| match s {
        Str::Text(t) => t.to_string(),
        Str::Wide(w) => w
            .iter()
            .map(|&p| char::from_u32(p).unwrap_or('\u{fffd}'))
            .collect(),
    };
    let mut map = WeightMap::new();
    for (k, v) in members {
        let shard = match &v.value {
            Value::Str(s) => {
                let joined = folder.join(lossy(s));
                let normal = place::normpath(joined.as_os_str().as_bytes());
                String::from_utf8_lossy(&normal).into_owned()
            }
            _ => String::new(),
        };
        map.insert(lossy(k), shard);
    }
    Some(map)
}

#[cfg(test)]
mod tests;
