//! Verify of a folder: does DST hold what convert writes of SRC? (`FolderVerify`)
//!
//! Files are paired by relative path. Weight files are verified one by one (`Verifier`:
//! each tensor bit for bit, under the same precision options as convert); copies must hold
//! SRC's bytes, configs SRC's text with only the dtype values changed, indexes SRC's weight
//! map with the total size of DST's shards (`run::check`). A checkpoint DST holds sharded
//! differently (`max_shard_size`) is paired by tensor name instead, through the indexes
//! (`shard::resharded`); SRC may then be a single file (or a DCP folder). The first
//! difference is the report's mismatch, naming the file; refusals (DST missing, SRC and DST
//! the same folder, `name` given for several checkpoints) are errors.
//!
//! How SRC was read and what DST copies of it (`name`, `key`, `strip_prefix`, `include`,
//! `exclude`) and the target are as given, else as DST's record says (`recorded_source`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{common_prefix_warnings, unread_quantization};
use super::{dequantizes, is_model_config, quantization_of, read_json, side_configs};
use crate::convert::Tuning;
use crate::error::{Error, PlaceProblem, Result, Warning};
use crate::given::{Given, Settings};
use crate::kernels::Isa;
use crate::output::{self, Replace};
use crate::run::beside::FOLDER_SIDE_CONFIG;
use crate::run::check::{self, why, Companions, SrcConfig};
use crate::run::json::{self, Value};
use crate::run::place;
use crate::run::walk::{self, File, Overrides, CONFIG_NAME, INDEX_SUFFIX, WEIGHTS_SUFFIX};
use crate::shard::resharded::{self as rverify, GroupCheck, GroupVerify, Indexed, Member, Pair};
use crate::task::Task;
use crate::text::{esc, esc_path};
use crate::verify::{Mismatch, Verifier, VerifyReport};
use crate::vocab::{ErrorKind, OptionName, Target, Unmatched};

/// What a folder's verification found: the sums of its files' reports, the first
/// mismatch (with the file, relative to DST), and each file's report (its numerics);
/// serialized without its paths, mismatch and parts, which a front end adds as it holds
/// them.
#[derive(Debug, serde::Serialize)]
pub struct FolderReport {
    /// SRC as read (a Hugging Face cache repo's snapshot), and DST as given.
    #[serde(skip)]
    pub src: PathBuf,
    #[serde(skip)]
    pub dst: PathBuf,
    pub loose: bool,
    pub tensors_converted: usize,
    pub tensors_identical: usize,
    pub bytes_compared: u64,
    pub seconds: f64,
    /// The first file's (0 and None when no file was compared).
    pub threads: usize,
    pub isa: Option<Isa>,
    /// The first difference, and the file of DST it is in ("." for the folder).
    #[serde(skip)]
    pub mismatch: Option<(PathBuf, Mismatch)>,
    /// The target DST was converted to, when known.
    pub to: Option<Target>,
    /// The files compared, every one paired by path or by group.
    pub files: usize,
    /// Each DST weight file compared (relative to DST), with its report.
    #[serde(skip)]
    pub parts: Vec<(PathBuf, VerifyReport)>,
}

impl FolderReport {
    pub fn is_ok(&self) -> bool {
        self.mismatch.is_none()
    }
}

/// Where the verification is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// SRC's groups DST holds with the same files: each checked as a re-sharding first.
    Same,
    /// SRC's weight files, each against DST's of the same path.
    Files,
    /// The re-sharded groups.
    Groups,
    /// The warnings judged over every file (a prefix to strip that no name starts with).
    Heard,
    /// The files beside the weights.
    Companions,
    Done,
}

/// The verification in progress of one file or one group.
enum Current {
    File(Box<Verifier>),
    Group(Box<GroupVerify>),
}

/// The verification of a folder DST against SRC, step by step (`Task`): the walk, the
/// record and the pairing are done when made; each weight file or re-sharded group is
/// verified in steps; then the files beside them. `finish` gives the report.
pub struct FolderVerify {
    src: PathBuf,
    dst: PathBuf,
    /// The options every file's verification starts from.
    base: Settings,
    tuning: Tuning,
    loose: bool,
    /// SRC is one checkpoint (a file, a DCP folder) re-sharded into DST.
    single: bool,
    to: Option<Target>,
    /// FP8 targets: SRC's top model config (`packed_config`).
    model_config: Option<PathBuf>,
    /// A re-sharding's stem was given, or recorded.
    named: bool,
    /// The prefixes to strip were given (not DST's record's): a prefix no name starts with
    /// is said.
    strip_given: bool,
    /// SRC's weight files, all, and those verified by path.
    all_weights: Vec<File>,
    weights: Vec<File>,
    indexes: Vec<check::ReadIndex>,
    configs: Vec<File>,
    others: Vec<File>,
    skipped: Vec<File>,
    found: BTreeSet<OsString>,
    dst_weights: bool,
    first_error: Option<(PathBuf, String)>,
    pairs: Vec<Pair>,
    same: Vec<Pair>,
    /// The outcome of each pair checked before (by its position in `pairs`).
    checked: HashMap<usize, GroupCheck>,
    /// DST files of the pairs (not paired by path).
    theirs: BTreeSet<OsString>,
    expected: BTreeMap<OsString, File>,
    sides: Vec<OsString>,
    beside: BTreeSet<OsString>,
    from_pytorch: bool,
    stage: Stage,
    next: usize,
    current: Option<Current>,
    parts: Vec<(PathBuf, VerifyReport)>,
    mismatch: Option<(PathBuf, Mismatch)>,
    heard: Vec<Vec<Warning>>,
    warnings: Vec<Warning>,
    done: u64,
    total: u64,
    report: Option<(PathBuf, Replace)>,
    numerics: bool,
    started: Instant,
}

/// A target as an option's value.
fn given_target(to: Target) -> Given {
    Given {
        text: Some(to.name().into()),
        whole: None,
        repr: format!("'{}'", to.name()),
    }
}

/// A mismatch of a whole file (no element): its template and tensor.
fn failure(template: String, tensor: Option<String>) -> Mismatch {
    Mismatch {
        message: template,
        tensor,
        index: None,
        source_bits: None,
        source_value: None,
        expected_bits: None,
        found_bits: None,
    }
}

/// May a verification go on past this error, as a finding (not a stop request or an
/// operating-system failure)?
fn finding(e: &Error) -> bool {
    !matches!(e.kind(), ErrorKind::Io | ErrorKind::Cancelled)
}

/// Does a weight file or an index of SRC (`walked`) hold the record text `text`: DST's is
/// then SRC's own, as a `no_record` run leaves it?
fn srcs_own_record(walked: &walk::Walked, text: &str) -> bool {
    let mut files = walked.weights.iter().chain(&walked.indexes);
    files.any(|f| {
        let found = crate::verify::record_at(&f.path).ok().flatten();
        found.is_some_and(|r| r.map_or_else(|(t, _)| t == text, |r| r.text() == text))
    })
}

/// The relative paths of a group's files and index.
fn rels(g: &rverify::Group) -> impl Iterator<Item = OsString> + '_ {
    let index = g.index.iter().map(|f| f.rel.clone().into_os_string());
    g.inputs
        .iter()
        .map(|f| f.rel.clone().into_os_string())
        .chain(index)
}

/// The data section's size of a safetensors file (its size less the header; a PyTorch
/// checkpoint's, its size), 0 when it cannot be read: progress only counts it.
fn data_bytes(path: &Path) -> u64 {
    let Ok(meta) = std::fs::metadata(path) else {
        return 0;
    };
    match crate::source::read_header(path) {
        Ok((header_len, ..)) => meta.len().saturating_sub(8 + header_len),
        Err(_) => meta.len(),
    }
}

/// The file `src` as the only weight file of a folder: its name kept, but a PyTorch
/// checkpoint's made a safetensors name; a DCP folder's is `model.safetensors`. (Verify
/// reads neither its size nor its mtime.)
fn single_file(src: &Path, dir: bool) -> File {
    let name = src.file_name().unwrap_or_default().to_os_string();
    let (rel, src_rel) = match dir {
        true => ("model.safetensors".into(), Some(".".into())),
        false => {
            let rel = safetensors_name(&name);
            let renamed = (rel != name).then_some(name);
            (rel, renamed)
        }
    };
    File {
        rel,
        path: src.to_path_buf(),
        size: 0,
        mtime_ns: 0,
        src_rel,
    }
}

/// The safetensors name of a weight file: a Hugging Face PyTorch name renamed as in a
/// folder, any other its stem with `.safetensors`.
fn safetensors_name(name: &OsStr) -> OsString {
    if name.as_bytes().ends_with(WEIGHTS_SUFFIX) {
        return name.to_os_string();
    }
    if let Some(renamed) = walk::torch_name(name) {
        return renamed;
    }
    let stem = Path::new(name).file_stem().unwrap_or(name);
    let mut out = stem.to_os_string();
    out.push(OsStr::from_bytes(WEIGHTS_SUFFIX));
    out
}

impl FolderVerify {
    /// Check SRC and DST, read DST's record, walk SRC and pair its files and groups with
    /// DST's. `given` holds the call's options (`to`, the precision options, `loose`,
    /// `name`, `key`, `strip_prefix`, `include`, `exclude`, `report`, `force`, `threads`).
    pub fn new(src: &Path, dst: &Path, given: &Settings, tuning: Tuning) -> Result<FolderVerify> {
        let started = Instant::now();
        let mut source = Vec::new();
        if given.key.is_some() {
            source.push(OptionName::Key);
        }
        if !given.strip_prefix.is_empty() {
            source.push(OptionName::StripPrefix);
        }
        crate::given::check_applies(src, &source)?;
        let src = place::place(src, Some(dst), Target::Bf16, false, false)?.src;
        let place_error = |path: &Path, problem| Error::Place {
            path: path.to_path_buf(),
            problem,
        };
        if std::fs::symlink_metadata(dst).is_err() {
            return Err(place_error(dst, PlaceProblem::Missing { folder: true }));
        }
        let dst_meta = std::fs::metadata(dst).ok().filter(|m| m.is_dir());
        let Some(dst_meta) = dst_meta else {
            let src = src.clone();
            return Err(place_error(dst, PlaceProblem::VerifyDstNotAFolder { src }));
        };
        let src_meta = std::fs::metadata(&src).map_err(|e| Error::io(&src, "cannot read", e))?;
        let id = |m: &std::fs::Metadata| {
            use std::os::unix::fs::MetadataExt;
            (m.dev(), m.ino())
        };
        if id(&src_meta) == id(&dst_meta) {
            return Err(place_error(dst, PlaceProblem::SameFolder));
        }
        // A file (or a DCP folder) re-sharded into DST.
        let single = !src_meta.is_dir() || crate::input::folder::check_folder(&src, false)?;
        if single && !src_meta.is_file() && !src_meta.is_dir() {
            return Err(place_error(&src, PlaceProblem::NotAFolder { file: true }));
        }
        let report = match &given.report {
            Some(path) => {
                let replace = output::check_report_path(path, given.force, &src, dst)?;
                Some((path.clone(), replace))
            }
            None => None,
        };
        let listing = walk::listing(dst)?;
        let found: BTreeSet<OsString> = listing.iter().cloned().collect();
        // A re-sharding's stem, how SRC was read and what DST copies of it, and the
        // target: as given, else as DST's record says. A folder output's index holds the
        // record (a top one first), then its shards (an older stcast's output records it
        // there only): each fills what is not given yet.
        let mut to = given.to.as_ref().map(Given::target).transpose()?;
        let mut recorded = (
            given.name.clone(),
            given.key.clone(),
            given.strip_prefix.clone(),
            given.include.clone(),
            given.exclude.clone(),
            to.map(|t| t.name().to_string()),
        );
        // A record of DST that is none convert writes (`record_at`): DST's file, its text,
        // why.
        let mut bad_record: Option<(OsString, String, String)> = None;
        let ends = |r: &OsString, s: &[u8]| r.as_bytes().ends_with(s);
        let shards: Vec<&OsString> = found.iter().filter(|r| ends(r, WEIGHTS_SUFFIX)).collect();
        if let Some(&first) = shards.first() {
            let mut indexed: Vec<(usize, &OsString)> = found
                .iter()
                .filter(|r| ends(r, INDEX_SUFFIX))
                .map(|r| (r.as_bytes().iter().filter(|&&c| c == b'/').count(), r))
                .collect();
            indexed.sort();
            for rel in indexed.iter().take(1).map(|(_, r)| *r).chain([first]) {
                match crate::verify::record_at(&dst.join(rel))? {
                    Some(Ok(r)) => recorded = crate::verify::recorded_source(r, recorded),
                    // Said once SRC is walked, unless it is SRC's own (the shard's, where both are).
                    Some(Err((text, why))) => bad_record = Some((rel.clone(), text, why)),
                    None => {}
                }
            }
            // The whole output's target (a file without FP8 weights does not tell fp8
            // from bf16).
            to = recorded.5.as_deref().and_then(Target::from_name);
        }
        let (name, _, strip_prefix, include, exclude, _) = recorded;
        let mut base = given.clone();
        (base.report, base.force, base.name, base.lone) = (None, false, None, false);
        base.follow_links = single;
        let walked = match single {
            true => walk::Walked {
                weights: vec![single_file(&src, src_meta.is_dir())],
                ..walk::Walked::default()
            },
            false => walk::walk(&src, true, &Overrides::new(&include, &exclude)?)?,
        };
        if to.is_none() {
            // An FP8 output's strategy is its config's: a weight's scale can fit both.
            for f in walked.configs.iter().filter(|f| found.contains(&f.rel)) {
                to = configured(dst, f)?;
                if to.is_some() {
                    break;
                }
            }
        }
        let dst_weights = !shards.is_empty();
        // Checkpoints DST holds sharded differently are paired by tensor name, not by path.
        let indexes = check::read_indexes(&walked, &strip_prefix)?;
        let members: Vec<Member> = walked.weights.iter().map(Member::from).collect();
        let indexed: Vec<Indexed> = indexes
            .iter()
            .map(|(f, _, map)| (f.into(), map.clone()))
            .collect();
        // Several groups under one name: refused, as convert refuses them.
        rverify::named_groups(&members, &indexed, name.is_some())?;
        let (mut pairs, mut same, mut first_error) = (Vec::new(), Vec::new(), None);
        let name = name.map(OsString::from);
        match rverify::pairs(dst, &members, &indexed, &listing, name.as_deref()) {
            Ok(p) => (pairs, same) = (p.pairs, p.same),
            // An index of DST that names no file of DST: the mismatch names the file.
            Err(e) if finding(&e) => {
                let path = e.path().map(Path::to_path_buf).unwrap_or_default();
                let rel = path.strip_prefix(dst).unwrap_or(&path).to_path_buf();
                let rel = if rel.as_os_str().is_empty() {
                    ".".into()
                } else {
                    rel
                };
                first_error = Some((rel, why(&e)));
            }
            Err(e) => return Err(e),
        }
        // The pairing read SRC without what a record convert does not write would say (a
        // prefix to strip, a stem): that record is the difference, as a lone file's is,
        // unless it is SRC's own (an output of `no_record`: DST's metadata is SRC's).
        if let Some((rel, text, why)) = bad_record {
            if !srcs_own_record(&walked, &text) {
                let template = crate::verify::not_a_record(Path::new(&rel), &text, &why);
                first_error = Some((rel.into(), template));
            }
        }
        // FP8 outputs: SRC's model config splits fused experts where DST records no sizes
        // (an output written with `no_record`); a record's sizes come first (the engine's).
        let top = walked
            .configs
            .iter()
            .find(|f| f.rel.as_bytes() == CONFIG_NAME);
        let model_config = top
            .filter(|_| to.is_some_and(|t| t.strategy().is_some()))
            .map(|f| f.path.clone());
        let from_pytorch = walked.weights.iter().any(|w| w.src_rel.is_some());
        let mut task = FolderVerify {
            src,
            dst: dst.to_path_buf(),
            loose: given.loose,
            named: name.is_some(),
            strip_given: !given.strip_prefix.is_empty(),
            numerics: given.numerics,
            base,
            tuning,
            single,
            to,
            model_config,
            all_weights: walked.weights.clone(),
            weights: walked.weights,
            indexes,
            configs: walked.configs,
            others: walked.others,
            skipped: walked.skipped.into_iter().map(|(f, _)| f).collect(),
            found,
            dst_weights,
            same,
            first_error,
            pairs,
            checked: HashMap::new(),
            theirs: BTreeSet::new(),
            expected: BTreeMap::new(),
            sides: Vec::new(),
            beside: BTreeSet::new(),
            from_pytorch,
            stage: Stage::Same,
            next: 0,
            current: None,
            parts: Vec::new(),
            mismatch: None,
            heard: Vec::new(),
            warnings: Vec::new(),
            done: 0,
            total: 0,
            report,
            started,
        };
        task.total = task.data_total(&task.pairs);
        Ok(task)
    }

    /// The options of a file's (or a group's) verification: the call's, with the target
    /// known so far and the model config.
    fn settings(&self) -> Settings {
        Settings {
            to: self.to.map(given_target),
            packed_config: self.model_config.clone(),
            ..self.base.clone()
        }
    }

    /// A group's verification, under the options known so far.
    fn group(&self, (s, d): &Pair) -> Result<GroupVerify> {
        let settings = self.settings();
        let input = settings.input()?;
        let opts = settings.shard_verify(self.tuning.clone())?;
        GroupVerify::new(&self.dst, s, d, &input, &opts)
    }

    /// The data bytes of both files of each pair by path, and of each group of `pairs`:
    /// what the verification compares, about.
    fn data_total(&self, pairs: &[Pair]) -> u64 {
        let moved: HashSet<OsString> = pairs.iter().flat_map(|(g, _)| rels(g)).collect();
        let theirs: HashSet<OsString> = pairs.iter().flat_map(|(_, d)| rels(d)).collect();
        let files = self.weights.iter().filter(|w| !moved.contains(&w.rel));
        let files = files.filter(|w| self.found.contains(&w.rel) && !theirs.contains(&w.rel));
        let by_path: u64 = files
            .map(|w| data_bytes(&w.path) + data_bytes(&self.dst.join(&w.rel)))
            .sum();
        let grouped = pairs
            .iter()
            .flat_map(|(g, d)| g.inputs.iter().chain(&d.inputs));
        by_path + grouped.map(|f| data_bytes(&f.path)).sum::<u64>()
    }

    /// Once the groups of the same files are checked: which files are paired by path, what
    /// DST should hold, and the first thing found missing or extra.
    fn pair_files(&mut self) -> Result<()> {
        self.total = self.data_total(&self.pairs);
        let moved: HashSet<OsString> = self.pairs.iter().flat_map(|(g, _)| rels(g)).collect();
        self.theirs = self.pairs.iter().flat_map(|(_, d)| rels(d)).collect();
        self.weights.retain(|w| !moved.contains(&w.rel));
        self.indexes.retain(|(f, _, _)| !moved.contains(&f.rel));
        for r in &self.theirs {
            self.found.remove(r);
        }
        let listed = self
            .weights
            .iter()
            .chain(self.indexes.iter().map(|(f, ..)| f));
        let listed = listed.chain(&self.configs).chain(&self.others);
        self.expected = listed.map(|f| (f.rel.clone(), f.clone())).collect();
        let expected = &self.expected;
        let missing = expected.keys().find(|r| !self.found.contains(*r));
        // Beside a lone checkpoint's re-sharding: the model config given, or an FP8
        // target's quantization_config alone (checked with the shards they describe). In a
        // folder's: an FP8 target's quantization_config beside weights no model config
        // describes.
        let all: Vec<&File> = self.all_weights.iter().collect();
        let taken: Vec<&OsStr> = expected.keys().map(OsString::as_os_str).collect();
        self.sides = match self.single {
            true => vec![FOLDER_SIDE_CONFIG.into()],
            false => side_configs(&all, &taken),
        };
        self.beside = match self.single {
            true => [OsString::from("config.json")]
                .into_iter()
                .chain(self.sides.iter().cloned())
                .collect(),
            false => self
                .sides
                .iter()
                .filter(|r| !expected.contains_key(*r))
                .cloned()
                .collect(),
        };
        let extra: Vec<&OsString> = self
            .found
            .iter()
            .filter(|r| !expected.contains_key(*r) && !self.beside.contains(*r))
            .collect();
        let fail =
            |rel: &OsStr, template: String| Some((PathBuf::from(rel), failure(template, None)));
        if let Some((rel, template)) = &self.first_error {
            self.mismatch = fail(rel.as_os_str(), template.clone());
        } else if self.single && !self.dst_weights {
            let why = "a folder without .safetensors files, while SRC is a file (a file's DST \
                       folder is the one it was re-sharded into)";
            self.mismatch = fail(OsStr::new("."), why.into());
        } else if let Some(rel) = missing {
            // Re-sharded under another stem (convert --name, not recorded): the name that
            // finds it.
            let stems: Vec<&[u8]> = self
                .found
                .iter()
                .filter_map(|r| r.as_bytes().strip_suffix(INDEX_SUFFIX))
                .collect();
            let mut hint = String::new();
            if let ([stem], false) = (&stems[..], self.named) {
                if !stem.contains(&b'/') {
                    let stem = esc(&String::from_utf8_lossy(stem)).into_owned();
                    hint = format!(" (DST holds the index of {stem}: {{name={stem}}}?)");
                }
            }
            // A file of SRC under its own name, else what DST should hold of SRC's file (a
            // PyTorch checkpoint's, a DCP folder's consolidated output): named as it is.
            let f = &expected[rel];
            let what = match f.src_rel {
                None => "is in SRC".to_string(),
                Some(_) => format!("is the output of {}", esc_path(&f.path)),
            };
            self.mismatch = fail(rel, format!("{what} but not in DST{hint}"));
        } else {
            // Extra files are ignored (loose), but not an index: loaders read it to find
            // the tensors, so it must name DST's shards as they are, and the output's
            // tensors where the output holds them; nor a model config that says
            // unquantized weights beside it are quantized (one SRC's run left out, or
            // copied in).
            let grouped = self.pairs.iter().flat_map(|(_, d)| &d.inputs);
            let output = self.weights.iter().map(|w| PathBuf::from(&w.rel));
            let output = output.chain(grouped.map(|f| f.rel.clone())).collect();
            let model_configs = extra.iter().filter(|r| is_model_config(r.as_os_str()));
            let indexes = extra
                .iter()
                .filter(|r| r.as_bytes().ends_with(INDEX_SUFFIX));
            let stray: Vec<PathBuf> = match self.loose {
                false => model_configs.map(PathBuf::from).collect(),
                true => indexes.chain(model_configs).map(PathBuf::from).collect(),
            };
            let c = Companions {
                stray,
                output,
                ..Companions::default()
            };
            let problem = match c.stray.is_empty() {
                true => None,
                false => check::check(&self.dst, self.to, false, &c)?,
            };
            if let Some((rel, template)) = problem {
                self.mismatch = fail(&rel, template);
            } else if let (Some(rel), false) = (extra.first(), self.loose) {
                let left_out = self
                    .skipped
                    .iter()
                    .any(|f| f.source_rel() == rel.as_os_str());
                let why = match left_out {
                    true => {
                        "is in SRC, but left out by this run's companion policy ({include} \
                             copies it): an earlier run's copy? ({loose} ignores extra files)"
                    }
                    false => "is in DST but not in SRC ({loose} ignores extra files)",
                };
                self.mismatch = fail(rel, why.into());
            }
        }
        Ok(())
    }

    /// Take in a file's (or a group file's) report.
    fn absorb(&mut self, rel: PathBuf, r: VerifyReport) {
        self.done += r.bytes_compared;
        // Every file with the target the first converted one has.
        self.to = self.to.or(r.to);
        self.parts.push((rel, r));
    }

    /// Step the verification of the next weight file by path; true when none is left.
    fn step_file(&mut self, budget: u64) -> Result<bool> {
        let Some(w) = self.weights.get(self.next) else {
            return Ok(true);
        };
        let v = match &mut self.current {
            Some(Current::File(v)) => v,
            _ => {
                let mut s = self.settings();
                s.allow_copy = true; // one file of a folder may convert nothing
                let opts = s.verify(self.tuning.clone())?;
                let v = Verifier::open(&w.path, &self.dst.join(&w.rel), &opts)?;
                self.current = Some(Current::File(Box::new(v)));
                return Ok(false);
            }
        };
        if !v.step(budget)? {
            return Ok(false);
        }
        let Some(Current::File(mut v)) = self.current.take() else {
            unreachable!("a file's verification")
        };
        self.heard.push(v.take_warnings());
        let r = v.finish()?;
        let rel = PathBuf::from(&w.rel);
        if let Some(m) = &r.mismatch {
            self.mismatch = Some((rel.clone(), m.clone()));
        }
        self.absorb(rel, r);
        self.next += 1;
        Ok(self.mismatch.is_some())
    }

    /// Step the verification of the next re-sharded group; true when none is left.
    fn step_group(&mut self, budget: u64) -> Result<bool> {
        if self.next >= self.pairs.len() {
            return Ok(true);
        }
        let check = match self.checked.remove(&self.next) {
            Some(check) => check,
            None => {
                let task = match &mut self.current {
                    Some(Current::Group(task)) => task,
                    _ => {
                        let task = self.group(&self.pairs[self.next])?;
                        self.current = Some(Current::Group(Box::new(task)));
                        return Ok(false);
                    }
                };
                if !task.step(budget)? {
                    return Ok(false);
                }
                let Some(Current::Group(mut task)) = self.current.take() else {
                    unreachable!("a group's verification")
                };
                self.heard.push(task.take_warnings());
                task.finish()
            }
        };
        let last = check
            .reports
            .last()
            .map(|(rel, r)| (rel.clone(), r.mismatch.clone()));
        for (rel, r) in check.reports {
            self.absorb(rel, r);
        }
        if let Some(f) = check.failure {
            self.mismatch = Some(match last {
                Some((rel, Some(m))) if rel == f.rel => (rel, m),
                _ => (f.rel, failure(f.template, f.tensor)),
            });
        }
        self.next += 1;
        Ok(self.mismatch.is_some())
    }

    /// Check SRC's groups that DST holds with the same files as re-shardings, one a step: a
    /// group is one when that passes, or fails on a tensor (past the index, names and
    /// metadata); else it is checked file by file.
    fn step_same(&mut self, budget: u64) -> Result<bool> {
        let Some(pair) = self.same.get(self.next) else {
            return Ok(true);
        };
        let task = match &mut self.current {
            Some(Current::Group(task)) => task,
            _ => {
                match self.group(pair) {
                    Ok(task) => self.current = Some(Current::Group(Box::new(task))),
                    Err(e) if finding(&e) => self.next += 1,
                    Err(e) => return Err(e),
                }
                return Ok(false);
            }
        };
        match task.step(budget) {
            Ok(false) => return Ok(false),
            Ok(true) => {}
            Err(e) if finding(&e) => {
                self.current = None;
                self.next += 1;
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
        let Some(Current::Group(mut task)) = self.current.take() else {
            unreachable!("a group's verification")
        };
        task.take_warnings();
        let check = task.finish();
        if check.failure.as_ref().is_none_or(|f| f.tensor.is_some()) {
            self.checked.insert(self.pairs.len(), check);
            self.pairs.push(pair.clone());
        }
        self.next += 1;
        Ok(false)
    }

    /// The files beside the weights: copies hold SRC's bytes; configs its text with the
    /// dtype changed (an FP8 output's describing the tensors beside it); indexes its weight
    /// map, with the total size of DST's shards; model configs DST adds to an FP8 output,
    /// and its quantization_config files (`run::check::check`).
    fn companions(&mut self) -> Result<()> {
        let to = self.to.unwrap_or(Target::Bf16);
        let mut configs: Vec<SrcConfig> = Vec::new();
        let mut unread: Option<bool> = None;
        for f in &self.configs {
            let text = read_json(&f.path)?;
            let doc = json::parse(&text).map_err(|e| super::not_json(&f.path, e))?;
            let problem = unread_quantization(&doc, to);
            if problem.is_some() && unread.is_none() {
                // (Read under the target alone, overflow measured, as the plan reads them.)
                let s = Settings {
                    to: Some(given_target(to)),
                    on_overflow: Some(Given {
                        text: Some("warn".into()),
                        whole: None,
                        repr: "'warn'".into(),
                    }),
                    keep_unmatched: Unmatched::Ignore,
                    ..Settings::default()
                };
                unread = Some(super::dequantizes_any(&self.all_weights, &s, &self.tuning)?);
            }
            let refused = problem.filter(|_| unread == Some(true)).map(|problem| {
                why(&Error::FolderConfig {
                    path: f.path.clone(),
                    problem,
                })
            });
            let dequantize = dequantizes(&doc, to);
            configs.push((f.rel.clone().into(), text.clone(), dequantize, refused));
        }
        let sources: HashMap<PathBuf, PathBuf> = match self.indexes.is_empty() {
            true => HashMap::new(),
            false => self
                .all_weights
                .iter()
                .map(|w| (w.rel.clone().into(), w.path.clone()))
                .collect(),
        };
        let expected = &self.expected;
        // Loose ignores extra files, but not a model config beside FP8 shards (one copied
        // in after a DCP or single-file source was re-sharded): a loader trusts it.
        let added = self.found.iter().filter(|r| !expected.contains_key(*r));
        let added = added
            .filter(|r| is_model_config(r.as_os_str()))
            .map(PathBuf::from);
        // Where convert writes a side config, DST's or not (strict fails one missing).
        let sides = self.sides.iter().filter(|r| self.beside.contains(*r));
        let c = Companions {
            copies: self
                .others
                .iter()
                .map(|f| (f.rel.clone().into(), f.path.clone()))
                .collect(),
            configs,
            indexes: self
                .indexes
                .iter()
                .map(|(f, text, map)| (f.rel.clone().into(), text.clone(), map.clone()))
                .collect(),
            sources,
            added: added.collect(),
            sides: sides.map(PathBuf::from).collect(),
            ..Companions::default()
        };
        if let Some((rel, template)) = check::check(&self.dst, Some(to), self.loose, &c)? {
            self.mismatch = Some((rel.into(), failure(template, None)));
        }
        Ok(())
    }

    /// The report, once stepped to its end; the numeric report written (`report`) when DST
    /// verified.
    pub fn finish(self) -> Result<FolderReport> {
        let ok = self.mismatch.is_none();
        let measured = self.numerics && !self.parts.is_empty();
        if let (true, true, Some((path, replace))) = (ok, measured, &self.report) {
            let parts: Vec<_> = self
                .parts
                .iter()
                .map(|(rel, r)| {
                    let rel = rel.to_str();
                    (rel, &r.numerics[..], &r.numerics_total, &r.dequantized[..])
                })
                .collect();
            let bytes = crate::report::files_report(&self.src, &self.dst, self.to, &parts);
            output::write_file(path, &bytes, *replace, "")?;
        }
        let first = self.parts.first().map(|(_, r)| r);
        let sum = |f: fn(&VerifyReport) -> usize| self.parts.iter().map(|(_, r)| f(r)).sum();
        Ok(FolderReport {
            loose: self.loose,
            tensors_converted: sum(|r| r.tensors_converted),
            tensors_identical: sum(|r| r.tensors_identical),
            bytes_compared: self.parts.iter().map(|(_, r)| r.bytes_compared).sum(),
            seconds: self.started.elapsed().as_secs_f64(),
            threads: first.map_or(0, |r| r.threads),
            isa: first.map(|r| r.isa),
            mismatch: self.mismatch,
            to: self.to,
            files: self.expected.len() + self.theirs.len(),
            src: self.src,
            dst: self.dst,
            parts: self.parts,
        })
    }
}

impl Task for FolderVerify {
    fn step(&mut self, budget: u64) -> Result<bool> {
        match self.stage {
            Stage::Same => {
                if self.step_same(budget)? {
                    self.pair_files()?;
                    (self.stage, self.next) = (Stage::Files, 0);
                }
            }
            Stage::Files => {
                if self.mismatch.is_some() || self.step_file(budget)? {
                    let copies = !self.parts.is_empty() && self.parts.iter().all(|(_, r)| r.copy);
                    if self.mismatch.is_none() && copies && self.pairs.is_empty() && !self.single {
                        // Each file a copy of SRC's: convert refuses to write such a folder
                        // (not a re-sharding: a file's, or groups', never a copy).
                        let to = self.to.unwrap_or(Target::Bf16);
                        let why = format!(
                            "convert refuses these options: {}",
                            super::nothing_to_convert(to)
                        );
                        self.mismatch = Some((".".into(), failure(why, None)));
                    }
                    (self.stage, self.next) = (Stage::Groups, 0);
                }
            }
            Stage::Groups => {
                if self.mismatch.is_some() || self.step_group(budget)? {
                    self.stage = Stage::Heard;
                }
            }
            Stage::Heard => {
                // What each file (or group) said of the prefixes given to strip: judged over
                // them all (the record's were said by convert).
                if self.strip_given {
                    self.warnings = common_prefix_warnings(&self.heard);
                }
                if self.to.is_none()
                    && self.from_pytorch
                    && self.parts.iter().all(|(_, r)| r.tensors_converted == 0)
                {
                    self.to = Some(Target::Keep); // PyTorch weights with no dtype changed
                }
                self.stage = Stage::Companions;
            }
            Stage::Companions => {
                if self.mismatch.is_none() {
                    self.companions()?;
                }
                self.stage = Stage::Done;
            }
            Stage::Done => {}
        }
        Ok(self.stage == Stage::Done)
    }

    /// Data bytes of both files of each pair compared so far, and about how many in all.
    fn progress(&self) -> (u64, u64) {
        let now = match &self.current {
            Some(Current::File(v)) => v.progress().0,
            Some(Current::Group(g)) if self.stage == Stage::Groups => g.progress().0,
            _ => 0,
        };
        (self.done + now, self.total)
    }

    fn take_warnings(&mut self) -> Vec<Warning> {
        std::mem::take(&mut self.warnings)
    }
}

/// The FP8 target DST's model config `f` (SRC's) describes, if it is one and SRC's config
/// is not quantized (an FP8 input is dequantized, never quantized again).
fn configured(dst: &Path, f: &File) -> Result<Option<Target>> {
    if !is_model_config(&f.rel) {
        return Ok(None);
    }
    let text = read_json(&f.path)?;
    let doc = json::parse(&text).map_err(|e| super::not_json(&f.path, e))?;
    if !matches!(doc.value, Value::Object(_)) || quantization_of(&doc).is_some() {
        return Ok(None);
    }
    Ok(check::configured(dst, Path::new(&f.rel)))
}

#[cfg(test)]
mod tests;
