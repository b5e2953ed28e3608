//! What verify decides about a checkpoint that DST holds sharded differently (re-sharded,
//! `max_shard_size`): SRC's groups paired with DST's by folder and stem (`pairs`), and each
//! pair verified by tensor name (`GroupVerify`): every tensor of SRC's group in exactly one
//! file of DST's, each file what convert writes for the tensors it holds, the index
//! listing them.
//!
//! A group is the set of weight files one index names; every other weight file is a group
//! of its own.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result, Warning};
use crate::input::InputOptions;
use crate::quant::{companion_suffixes, BLOCKS_SUFFIX, PACKED_SUFFIX, SCALES_SUFFIX};
use crate::run::check::{self, index_total, read_bounded, read_index, why};
use crate::run::json;
use crate::run::walk::{File, INDEX_SUFFIX, WEIGHTS_SUFFIX};
use crate::shard;
use crate::source::Source;
use crate::task::Task;
use crate::text::{esc, esc_path};
use crate::verify::{VerifyOptions, VerifyReport};
use crate::vocab::WarningKind;

/// A file of a group: its path relative to its top folder, and where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub rel: PathBuf,
    pub path: PathBuf,
}

/// A file the walk found (`run::walk`), as a member of a group.
impl From<&File> for Member {
    fn from(f: &File) -> Member {
        Member {
            rel: f.rel.clone().into(),
            path: f.path.clone(),
        }
    }
}

/// An index and its weight map (tensor, shard relative to the top folder), as read.
pub type Indexed = (Member, Vec<(String, String)>);

/// Input files that make one output: an index's shards, or a lone weight file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// The relative folder ("" at the top).
    pub dir: PathBuf,
    /// Of the index, or of the file (the `name` option's, when given).
    pub stem: OsString,
    /// In input order.
    pub inputs: Vec<Member>,
    pub index: Option<Member>,
}

impl Group {
    /// What messages call SRC's group: its index, else its file, as SRC names it (a DCP
    /// folder, a PyTorch checkpoint: its path, not the name its output takes).
    fn shown_in_src(&self) -> &Path {
        let f = self.index.as_ref().unwrap_or(&self.inputs[0]);
        match f.path.ends_with(&f.rel) {
            true => &f.rel,
            false => &f.path,
        }
    }
}

/// A group of SRC paired with DST's of the same folder and stem.
pub type Pair = (Group, Group);

/// `name` without `suffix` (bytes), if it ends so.
fn strip(name: &OsStr, suffix: &[u8]) -> Option<OsString> {
    let b = name.as_bytes();
    b.ends_with(suffix)
        .then(|| OsString::from_vec(b[..b.len() - suffix.len()].to_vec()))
}

/// The file name of a path.
fn base(rel: &Path) -> &OsStr {
    rel.file_name().unwrap_or_default()
}

/// `groups_of`, where a name given to the output (`named`) allows one group only: each
/// would be written under it.
pub fn named_groups(weights: &[Member], indexes: &[Indexed], named: bool) -> Result<Vec<Group>> {
    let groups = groups_of(weights, indexes)?;
    if named && groups.len() > 1 {
        let shown = groups.iter().take(3);
        let shown = shown.map(|g| g.index.as_ref().unwrap_or(&g.inputs[0]).rel.clone());
        return Err(Error::NamedMany {
            count: groups.len(),
            shown: shown.collect(),
        });
    }
    Ok(groups)
}

/// The groups of a folder's weight files and (read) indexes: one per index, and one per
/// weight file no index names; sorted by their first file's path. A file two indexes name
/// is refused.
pub fn groups_of(weights: &[Member], indexes: &[Indexed]) -> Result<Vec<Group>> {
    let by_rel: HashMap<&Path, &Member> = weights.iter().map(|w| (w.rel.as_path(), w)).collect();
    let mut owner: HashMap<PathBuf, &Path> = HashMap::new();
    let mut groups = Vec::new();
    for (f, map) in indexes {
        let mut rels: Vec<&str> = map.iter().map(|(_, s)| s.as_str()).collect();
        rels.sort_unstable();
        rels.dedup();
        for &rel in &rels {
            if let Some(other) = owner.insert(PathBuf::from(rel), &f.rel) {
                return Err(crate::run::check::named_twice(&f.path, rel, other));
            }
        }
        let inputs: Vec<Member> = rels
            .iter()
            .filter_map(|r| by_rel.get(Path::new(r)).map(|&w| w.clone()))
            .collect();
        if let (false, Some(stem)) = (inputs.is_empty(), strip(base(&f.rel), INDEX_SUFFIX)) {
            let dir = f.rel.parent().unwrap_or(Path::new("")).to_path_buf();
            groups.push(Group {
                dir,
                stem,
                inputs,
                index: Some(f.clone()),
            });
        }
    }
    for w in weights.iter().filter(|w| !owner.contains_key(&w.rel)) {
        let stem = strip(base(&w.rel), WEIGHTS_SUFFIX).unwrap_or_default();
        groups.push(Group {
            dir: w.rel.parent().unwrap_or(Path::new("")).to_path_buf(),
            stem,
            inputs: vec![w.clone()],
            index: None,
        });
    }
    groups.sort_by(|a, b| a.inputs[0].rel.as_os_str().cmp(b.inputs[0].rel.as_os_str()));
    Ok(groups)
}

/// SRC's groups that DST holds sharded differently, each with DST's group of the same
/// folder and stem; and (`same`) those whose files and index weight map are the same in
/// both, but that have an index: a re-sharding whose cut fell where SRC's did has the same
/// files, but its index and metadata are a re-sharding's. A group DST lacks is in neither
/// (its files are missing). With `name` (a SRC of one group), DST's group is the one of
/// that stem. `found` is DST's listing.
pub struct Paired {
    pub pairs: Vec<Pair>,
    pub same: Vec<Pair>,
}

/// Pair SRC's groups (its `weights` and read `indexes`) with DST's (see `Paired`). An
/// index of DST that is no index, or names what it may not, is an error naming it.
pub fn pairs(
    dst: &Path,
    weights: &[Member],
    indexes: &[Indexed],
    found: &[OsString],
    name: Option<&OsStr>,
) -> Result<Paired> {
    let mut found: Vec<&OsString> = found.iter().collect();
    found.sort_unstable();
    let member = |rel: &OsString| -> Result<Member> {
        let path = dst.join(rel);
        std::fs::metadata(&path).map_err(|e| Error::io(&path, "cannot read", e))?;
        Ok(Member {
            rel: rel.into(),
            path,
        })
    };
    let ends = |r: &&&OsString, s: &[u8]| r.as_bytes().ends_with(s);
    let dst_weights: Vec<Member> = found
        .iter()
        .filter(|r| ends(r, WEIGHTS_SUFFIX))
        .map(|r| member(r))
        .collect::<Result<_>>()?;
    let names: HashSet<PathBuf> = dst_weights.iter().map(|w| w.rel.clone()).collect();
    let mut dst_indexes = Vec::new();
    for rel in found.iter().filter(|r| ends(r, INDEX_SUFFIX)) {
        let f = member(rel)?;
        let (_, map) = read_index(&f.path, &f.rel, false, &names, &[])?;
        dst_indexes.push((f, map));
    }
    let theirs = groups_of(&dst_weights, &dst_indexes)?;
    let theirs: HashMap<(&Path, &OsStr), &Group> = theirs
        .iter()
        .map(|g| ((g.dir.as_path(), g.stem.as_os_str()), g))
        .collect();
    let maps = |list: &[Indexed]| -> HashMap<PathBuf, Vec<(String, String)>> {
        list.iter()
            .map(|(f, m)| (f.rel.clone(), m.clone()))
            .collect()
    };
    let (src_maps, dst_maps) = (maps(indexes), maps(&dst_indexes));
    let mut out = Paired {
        pairs: Vec::new(),
        same: Vec::new(),
    };
    for mut g in groups_of(weights, indexes)? {
        if let Some(name) = name {
            g.stem = name.to_owned();
        }
        let Some(&d) = theirs.get(&(g.dir.as_path(), g.stem.as_os_str())) else {
            continue;
        };
        let rels = |g: &Group| g.inputs.iter().map(|w| w.rel.clone()).collect::<Vec<_>>();
        let same_files = rels(&g) == rels(d);
        let same_index = match (&g.index, &d.index) {
            (None, None) => true,
            (Some(a), Some(b)) => a.rel == b.rel && same_map(&src_maps[&a.rel], &dst_maps[&b.rel]),
            _ => false,
        };
        if !(same_files && same_index) {
            out.pairs.push((g, d.clone()));
        } else if g.index.is_some() {
            out.same.push((g, d.clone()));
        }
    }
    Ok(out)
}

/// The FP8 scale, zero point or activation scale suffixes of a weight's module
/// (`.weight_scale`, ...), each beside `X.weight`.
fn weight_of(name: &str, suffixes: &[String]) -> Option<String> {
    let s = suffixes.iter().find(|s| name.ends_with(s.as_str()))?;
    Some(format!("{}.weight", &name[..name.len() - s.len()]))
}

/// Is `name` an FP8 scale whose weight DST holds (dequantized: the scale is gone), or a
/// packed weight (or gpt-oss scales) DST holds unpacked under its weight's name?
fn dropped_scale(name: &str, suffixes: &[String], held: &HashMap<String, PathBuf>) -> bool {
    if let Some(weight) = weight_of(name, suffixes) {
        return held.contains_key(&weight);
    }
    [PACKED_SUFFIX, BLOCKS_SUFFIX, SCALES_SUFFIX]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .is_some_and(|w| held.contains_key(w))
}

/// Two weight maps of the same files: equal, or equal but for FP8 scales that one has and
/// the other not (a quantization or dequantization), each beside its weight; packed
/// weights are taken under the names they are unpacked to.
pub fn same_map(a: &[(String, String)], b: &[(String, String)]) -> bool {
    let dict = |m: &[(String, String)]| -> HashMap<String, String> { m.iter().cloned().collect() };
    if dict(a) == dict(b) {
        return true;
    }
    let suffixes = companion_suffixes();
    let weight = |name: &str| {
        weight_of(name, &suffixes).or_else(|| name.strip_suffix(SCALES_SUFFIX).map(str::to_string))
    };
    let unpacked = |m: &[(String, String)]| -> HashMap<String, String> {
        let out = |k: &str| {
            let p = [PACKED_SUFFIX, BLOCKS_SUFFIX];
            p.iter()
                .find_map(|p| k.strip_suffix(p))
                .unwrap_or(k)
                .to_string()
        };
        m.iter().map(|(k, v)| (out(k), v.clone())).collect()
    };
    let (a, b) = (unpacked(a), unpacked(b));
    let plain = |m: &HashMap<String, String>, other: &HashMap<String, String>| {
        let mut out = m.clone();
        out.retain(|k, v| {
            let beside = |w: &String| m.get(w) == Some(v) && other.get(w) == Some(v);
            other.contains_key(k) || !weight(k).is_some_and(|w| beside(&w))
        });
        out
    };
    plain(&a, &b) == plain(&b, &a)
}

/// The first file of DST's group a verification found wrong: its path relative to DST,
/// what is wrong (a message template), the tensor at fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub rel: PathBuf,
    pub template: String,
    pub tensor: Option<String>,
}

/// The outcome of verifying one re-sharded group: each DST file's report (in DST order,
/// up to the first mismatch) and the first failure.
#[derive(Debug)]
pub struct GroupCheck {
    pub reports: Vec<(PathBuf, VerifyReport)>,
    pub failure: Option<Failure>,
}

/// The verification of DST's group `d` as the re-sharding of SRC's group `s`, step by
/// step: the names, cut and index are checked when made (headers only), then each file of
/// `d` is verified (`shard::Group::verifier`) in turn.
pub struct GroupVerify {
    src: shard::Group,
    files: Vec<Member>,
    opts: VerifyOptions,
    next: usize,
    current: Option<crate::verify::Verifier>,
    check: GroupCheck,
    /// Data bytes compared by the files verified.
    done: u64,
    /// Data bytes of SRC's and DST's files: about what all of them compare.
    total: u64,
}

impl GroupVerify {
    /// Verify DST's group `d` as the re-sharding of SRC's `s` (read under `input`): every
    /// tensor of `s` in exactly one file of `d`, each file exactly what convert writes for
    /// the tensors it holds (`opts.loose`: any layout, as verify of a file), the index
    /// listing them. Strict mode also wants stcast's names and cut: `<stem>-0000i-of-
    /// 0000N.safetensors` (or one `<stem>.safetensors`), SRC's tensors in order across the
    /// shards.
    pub fn new(
        dst: &Path,
        s: &Group,
        d: &Group,
        input: &InputOptions,
        opts: &VerifyOptions,
    ) -> Result<GroupVerify> {
        let paths: Vec<PathBuf> = s.inputs.iter().map(|w| w.path.clone()).collect();
        // SRC's fused experts split as the record says convert split them.
        let mut input = input.clone();
        let first = &d.inputs[0].path;
        let record = crate::record::own_index_record(&s.inputs[0].path, first)?;
        if let Some(r) = record
            .as_deref()
            .and_then(|r| crate::record::Record::parse(r).ok())
        {
            // (The patterns that leave a fused tensor fused: as given, else the record's.)
            let keep = match opts.keep.is_empty() {
                true => &r.keep,
                false => &opts.keep,
            };
            let experts = r.experts.map(crate::experts::Model::of_sizes);
            input = input.with_experts(experts, keep);
        }
        // Read as DST's record says (`key`, `strip_prefix`) unless told otherwise.
        let recorded = crate::verify::recorded_input(first, &input);
        let src = crate::verify::open_recorded(first, &recorded, &input, |i| {
            shard::Group::open(&paths, i)
        })?;
        let mut total = src.sizes().sum::<u64>();
        let failure = precheck(dst, &src, s, d, opts.loose, &mut total)?;
        Ok(GroupVerify {
            src,
            files: if failure.is_some() {
                Vec::new()
            } else {
                d.inputs.clone()
            },
            opts: opts.clone(),
            next: 0,
            current: None,
            check: GroupCheck {
                reports: Vec::new(),
                failure,
            },
            done: 0,
            total,
        })
    }

    /// Its outcome, once stepped to its end.
    pub fn finish(self) -> GroupCheck {
        self.check
    }
}

impl Task for GroupVerify {
    fn step(&mut self, budget: u64) -> Result<bool> {
        if self.check.failure.is_some() || self.next >= self.files.len() {
            return Ok(true);
        }
        let indexed = self.files.len() > 1;
        let f = &self.files[self.next];
        let v = match &mut self.current {
            Some(v) => v,
            None => {
                let v = self.src.verifier(&f.path, indexed, &self.opts)?;
                self.current.insert(v)
            }
        };
        if !v.step(budget)? {
            return Ok(false);
        }
        let r = self.current.take().expect("a verification").finish()?;
        self.done += r.bytes_compared;
        // Every file with the target the first converted one has: one output, one target.
        self.opts.target = self.opts.target.or(r.to);
        if let Some(m) = &r.mismatch {
            self.check.failure = Some(Failure {
                rel: f.rel.clone(),
                template: m.message.clone(),
                tensor: m.tensor.clone(),
            });
        }
        self.check.reports.push((f.rel.clone(), r));
        self.next += 1;
        Ok(self.check.failure.is_some() || self.next >= self.files.len())
    }

    /// Data bytes compared so far, and about how many in all (never reached before the
    /// end: a front end hears of the end once).
    fn progress(&self) -> (u64, u64) {
        let now = self.done + self.current.as_ref().map_or(0, |v| v.progress().0);
        let ended = self.check.failure.is_some() || self.next >= self.files.len();
        (now, if ended { now } else { self.total.max(now + 1) })
    }

    /// A prefix to strip that no name of SRC's group starts with (said once: the front
    /// end asks for warnings when the prefixes were given, not read from DST's record).
    fn take_warnings(&mut self) -> Vec<Warning> {
        let all = std::mem::take(&mut self.src.warnings);
        all.into_iter()
            .filter(|w| w.kind == WarningKind::UnmatchedPrefix)
            .collect()
    }
}

/// The tensor names of a safetensors file of DST, in order, and its data bytes.
fn names_of(path: &Path) -> Result<(Vec<String>, u64)> {
    let source = Source::open_any(path, &InputOptions::default())?;
    let names = source.header.tensors.iter().map(|t| t.name.clone());
    Ok((names.collect(), source.header.data_len()))
}

/// What `GroupVerify::new` checks before reading data: the first failure, if any. Adds
/// the data bytes of DST's files to `data`.
fn precheck(
    dst: &Path,
    src: &shard::Group,
    s: &Group,
    d: &Group,
    loose: bool,
    data: &mut u64,
) -> Result<Option<Failure>> {
    let fail = |rel: &Path, template: String, tensor: Option<&str>| {
        Ok(Some(Failure {
            rel: rel.to_path_buf(),
            template,
            tensor: tensor.map(str::to_string),
        }))
    };
    let src_names: Vec<&str> = src.names().collect();
    let mut held: Vec<Vec<String>> = Vec::new();
    // Each tensor's file, in the order found.
    let mut where_: HashMap<String, PathBuf> = HashMap::new();
    let mut listed_order: Vec<(String, String)> = Vec::new();
    for f in &d.inputs {
        let (names, len) = names_of(&f.path)?;
        *data += len;
        for n in &names {
            if let Some(other) = where_.get(n) {
                let why = format!("tensor `{}` is also in {}", esc(n), esc_path(other));
                return fail(&f.rel, why, Some(n));
            }
            where_.insert(n.clone(), f.rel.clone());
            listed_order.push((n.clone(), f.rel.to_string_lossy().into_owned()));
        }
        held.push(names);
    }
    let first = &d.inputs[0].rel;
    let suffixes = companion_suffixes();
    for n in &src_names {
        if !where_.contains_key(*n) && !dropped_scale(n, &suffixes, &where_) {
            let why = format!(
                "tensor `{}` of SRC ({}) is in no DST file",
                esc(n),
                esc_path(s.shown_in_src())
            );
            return fail(first, why, Some(n));
        }
    }
    let n_files = d.inputs.len();
    if !loose {
        for (i, f) in d.inputs.iter().enumerate() {
            let mut want = s.stem.clone().into_vec();
            want.extend(crate::naming::shard_file_name("", i + 1, n_files).into_bytes());
            let want = OsString::from_vec(want);
            if base(&f.rel) != want {
                let why = format!(
                    "stcast names the shard {} of {n_files} `{}` ({{loose}} accepts any names)",
                    i + 1,
                    esc(&want.to_string_lossy())
                );
                return fail(&f.rel, why, None);
            }
        }
        if d.index.is_none() != (n_files == 1) {
            let what = match n_files {
                1 => "an index beside one file".to_string(),
                n => format!("{n} files, no index"),
            };
            let rel = d.index.as_ref().unwrap_or(&d.inputs[0]).rel.as_path();
            let why = format!("{what}: stcast writes an index exactly when there are shards");
            return fail(rel, why, None);
        }
        let position: HashMap<&str, usize> =
            src_names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let order: Vec<usize> = held
            .iter()
            .flat_map(|names| {
                let mut at: Vec<usize> = names
                    .iter()
                    .filter_map(|n| position.get(n.as_str()).copied())
                    .collect();
                at.sort_unstable();
                at
            })
            .collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        if let Some(at) = (0..order.len()).find(|&i| order[i] != sorted[i]) {
            let name = src_names[order[at]];
            let why = format!(
                "the shards do not hold SRC's tensors in input order (at tensor `{}`); stcast \
                 cuts them in order ({{loose}} accepts any cut)",
                esc(name)
            );
            return fail(first, why, Some(name));
        }
    }
    // Every file of one conversion holds its record: a file of another run (other options)
    // verifies alone, but is no part of this output.
    let record = crate::record::own_index_record(&s.inputs[0].path, &d.inputs[0].path)?;
    if let Some(record) = &record {
        let files = d.inputs.iter().map(|f| (f.rel.as_path(), &f.path));
        if let Some((rel, why)) = check::other_record(files, record, &d.inputs[0].rel)? {
            return fail(Path::new(&rel), why, None);
        }
    }
    // The index first (headers only): a loader finds each tensor through it.
    let Some(index) = &d.index else {
        return Ok(None);
    };
    let files: HashSet<PathBuf> = d.inputs.iter().map(|f| f.rel.clone()).collect();
    let read = read_index(&index.path, &index.rel, false, &files, &[])
        .and_then(|(_, listed)| Ok((listed, index_total(dst, &index.rel, &listed_order)?)));
    let (listed, total) = match read {
        Ok(read) => read,
        Err(e) => return fail(&index.rel, why(&e), None),
    };
    let listed: HashMap<String, String> = listed.into_iter().collect();
    let mut names: Vec<&String> = listed.keys().chain(where_.keys()).collect();
    names.sort_unstable();
    names.dedup();
    let held_at = |n: &String| where_.get(n).map(|p| p.to_string_lossy().into_owned());
    if let Some(n) = names
        .into_iter()
        .find(|n| listed.get(*n) != held_at(n).as_ref())
    {
        let said = listed
            .get(n)
            .map_or("nowhere".to_string(), |s| format!("in {}", esc(s)));
        let holder = where_
            .get(n)
            .map_or("no DST file holds it".to_string(), |h| {
                format!("{} holds it", esc_path(h))
            });
        let why = format!("lists tensor `{}` {said}, but {holder}", esc(n));
        return fail(&index.rel, why, Some(n));
    }
    let got = read_bounded(&index.path)?;
    if loose {
        let doc: Option<serde_json::Value> = serde_json::from_slice(&got).ok();
        let size = doc
            .as_ref()
            .and_then(|d| d.get("metadata")?.get("total_size"));
        let same = size.is_some_and(|v| {
            v.as_u64() == Some(total) || v.as_f64().is_some_and(|x| x == total as f64)
        });
        if !same {
            let why = format!(
                "its metadata.total_size is not {total}, the bytes of the tensors of its shards"
            );
            return fail(&index.rel, why, None);
        }
        return Ok(None);
    }
    let by_file: Vec<(String, String)> = listed_order
        .iter()
        .map(|(n, rel)| {
            let name = Path::new(rel).file_name().unwrap_or_default();
            (n.clone(), name.to_string_lossy().into_owned())
        })
        .collect();
    let src_text = match &s.index {
        Some(f) => Some(check::read_json_text(&f.path)?),
        None => None,
    };
    // The record convert put in the shards, it put in their index (an index an earlier
    // stcast wrote holds none).
    let record = record.filter(|_| check::has_record(&got));
    let want = json::index(
        src_text.as_deref(),
        total,
        Some(&by_file),
        true,
        record.as_deref(),
    );
    if want.ok().map(String::into_bytes) != Some(got) {
        let why = "is not the index stcast writes for these shards ({loose} only checks that \
                   it lists them)";
        return fail(&index.rel, why.to_string(), None);
    }
    Ok(None)
}

#[cfg(test)]
mod tests;
