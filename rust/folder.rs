//! The plan of a folder run: what it converts, copies and rewrites of a source folder, and
//! whether it may, decided before anything is written (`PlanTask`). Above `run` (the walk,
//! the JSON texts, the index checks) and `task` (each file's inspection), which it uses.
//!
//! The folder is walked (`run::walk`), its indexes read and checked against one another
//! before any shard is opened (`check::read_index`: no shard two indexes name), its configs
//! read (their new texts: `json::config_text`), then each weight file planned as a lone
//! file's inspection plans it (`InspectTask`), one file a step, so that a caller can stop
//! between them. Then each index must list exactly the tensors its shards hold.
//!
//! A quantized checkpoint: the configs decide whether it is dequantized (an FP8 or packed
//! scheme stcast reads, `dequantizes`), and a config under a scheme stcast does not read
//! refuses the files whose FP8 weights have scales (`ConfigProblem::Unread`). Without such a
//! config the files decide, as a lone file's do; a folder dequantized is dequantized whole
//! (`dequantize_problem`). An FP8 target's weights that no model config describes get a
//! `quantization_config.json` beside them (`side_configs`).
//!
//! `verify_folder`: whether a destination folder holds what a folder run writes of its source.
//! A dry run of a folder run (`inspect`) answers from the same walk or plan, each weight file
//! inspected as the run would convert it.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::convert::Tuning;
pub use crate::error::nothing_to_convert;
use crate::error::{ConfigProblem, Error, Fp8Problem, Result, WalkProblem, Warning};
use crate::given::{Given, Settings};
use crate::naming::split_rel;
use crate::quant::companion_roles;
use crate::run::beside::FOLDER_SIDE_CONFIG;
use crate::run::check::{self, read_json_text, ReadIndex};
use crate::run::json::{self, Node, Value, QUANTIZATION_KEYS};
use crate::run::walk::{self, File, Overrides, CONFIG_NAME, EXCLUDED, SUPERSEDED, TRAINER};
use crate::task::{InspectTask, Inspection, Task};
use crate::text::{esc, format_bytes};
use crate::vocab::{
    is_quantized_dtype, Fp8Skip, InputFormat, ReasonCode, Target, Unmatched, WarningKind,
};

/// Files a loader reads first to decide that a folder is a checkpoint: copied last.
const PUBLISH_LAST: [&[u8]; 2] = [CONFIG_NAME, b"model_index.json"];

/// What the plan found of one weight file.
#[derive(Debug)]
pub struct Planned {
    /// Its inspection's report (`task::InspectRows`) without the per-tensor rows: a file may
    /// hold hundreds of thousands of tensors.
    pub info: serde_json::Value,
    /// The bytes of its output's tensors.
    pub out_data: u64,
    /// Its fingerprint (`fingerprint`), which `--resume` compares.
    pub header_sha256: String,
    /// FP8 targets: its weights that hold NaN or inf, found by reading them (they stay BF16),
    /// so that the conversion does not read them again. None for other targets.
    pub unquantized: Option<Vec<String>>,
}

/// What a folder run does, from a source folder that passed every check.
#[derive(Debug, Default)]
pub struct FolderPlan {
    pub weights: Vec<File>,
    /// One per weight file, in the same order.
    pub planned: Vec<Planned>,
    pub indexes: Vec<ReadIndex>,
    /// Each config and its new text (None: copied as it is); last, the FP8 side configs.
    pub configs: Vec<(File, Option<String>)>,
    /// Copied before the configs and indexes.
    pub copies: Vec<File>,
    /// Copied with them (`model_index.json`).
    pub late_copies: Vec<File>,
    pub dirs: Vec<OsString>,
    /// Left out, and why (`walk::TRAINER`, ...).
    pub skipped: Vec<(File, &'static str)>,
    /// The `keep` patterns that match a tensor in no file.
    pub keep_unmatched: Vec<String>,
    /// Why the run is refused when no file converts a tensor or changes format (the output
    /// would be a copy of the folder; `on_overflow` keep may still write it): None when one
    /// does.
    pub nothing_to_convert: Option<String>,
    /// A quantized checkpoint dequantized: its indexes lose the scales.
    pub dequantize: bool,
    /// The prefixes to strip that no file's names start with: one warning each.
    pub unmatched_prefixes: Vec<Warning>,
    /// What the walk said.
    pub walk_warnings: Vec<Warning>,
    /// FP8 targets: the top folder's model config, by whose sizes every file's fused MoE
    /// experts are split (`experts`). None otherwise.
    pub model_config: Option<PathBuf>,
}

impl FolderPlan {
    /// Every file of the source the plan reads or leaves out (no output may be one).
    pub fn sources(&self) -> Vec<PathBuf> {
        let configs = self.configs.iter().map(|(f, _)| f);
        let indexes = self.indexes.iter().map(|(f, _, _)| f);
        let skipped = self.skipped.iter().map(|(f, _)| f);
        let copies = self.copies.iter().chain(&self.late_copies);
        let all = self
            .weights
            .iter()
            .chain(copies)
            .chain(configs)
            .chain(indexes);
        all.chain(skipped).map(|f| f.path.clone()).collect()
    }
}

/// The plan of a folder run, one weight file a step (`Task`); `finish` gives it.
pub struct PlanTask {
    /// The run's options as given, as each file's inspection reads them.
    given: Settings,
    tuning: Tuning,
    to: Target,
    /// The engine's quantized policy: a quantized checkpoint is refused unless allowed.
    check_quantized: bool,
    walked: walk::Walked,
    indexes: Vec<ReadIndex>,
    configs: Vec<(File, Option<String>)>,
    /// The configs that describe the quantized weights dequantized: each packed weight is
    /// checked against the nearest above it.
    described: Vec<File>,
    quantization_config: Option<PathBuf>,
    dequantize: bool,
    model_config: Option<PathBuf>,
    /// The shards the indexes name.
    indexed: HashSet<OsString>,
    current: Option<InspectTask>,
    planned: Vec<Planned>,
    /// The source's names of the tensors of each shard an index names.
    names: HashMap<OsString, HashSet<String>>,
    unmatched: Vec<String>,
    /// The files whose weights an FP8 target quantizes (indexes into `weights`).
    quantizes: Vec<usize>,
    files_dequantize: bool,
    /// Some file converts a tensor, or changes format (a PyTorch file's).
    converts: bool,
    problem: Option<Error>,
    said: Vec<Vec<Warning>>,
    /// Each file's `quantized` warning (a quantized checkpoint converted anyway), its path
    /// before it: the conversion of a folder's file is not told of the folder's config.
    quantized: Vec<Warning>,
}

impl PlanTask {
    /// Walk `src` and check what needs no weight file opened: the indexes, the configs.
    /// `given` holds the run's options (`to`, the precision options, `follow_links`,
    /// `include`, `exclude`, `strip_prefix`); with `check_quantized` a quantized checkpoint
    /// is refused, as a lone file is.
    pub fn new(
        src: &Path,
        given: &Settings,
        tuning: Tuning,
        check_quantized: bool,
    ) -> Result<PlanTask> {
        let to = given.target()?;
        let overrides = Overrides::new(&given.include, &given.exclude)?;
        let walked = walk::walk(src, given.follow_links, &overrides)?;
        if walked.weights.is_empty() {
            return Err(Error::Walk {
                path: src.to_path_buf(),
                problem: WalkProblem::NoWeights,
            });
        }
        let indexes = check::read_indexes(&walked, &given.strip_prefix)?;
        index_owners(&indexes)?;
        let mut given = given.clone();
        // Each file's inspection: overflow only measured, unmatched patterns judged over
        // the folder; read as a lone file (links were judged by the walk).
        given.on_overflow = Some(Given {
            text: Some("warn".into()),
            whole: None,
            repr: "'warn'".into(),
        });
        given.keep_unmatched = Unmatched::Ignore;
        given.follow_links = false;
        let mut task = PlanTask {
            unmatched: given.keep.clone(),
            given,
            tuning,
            to,
            check_quantized,
            indexed: indexes
                .iter()
                .flat_map(|(_, _, map)| map.iter().map(|(_, s)| OsString::from(s)))
                .collect(),
            indexes,
            configs: Vec::new(),
            described: Vec::new(),
            quantization_config: None,
            dequantize: false,
            model_config: None,
            current: None,
            planned: Vec::new(),
            names: HashMap::new(),
            quantizes: Vec::new(),
            files_dequantize: false,
            converts: false,
            problem: None,
            said: Vec::new(),
            quantized: Vec::new(),
            walked,
        };
        task.read_configs()?;
        Ok(task)
    }

    /// The configs' new texts, and what they decide: whether the checkpoint is dequantized,
    /// the config that makes every file quantized, the model config of an FP8 target.
    fn read_configs(&mut self) -> Result<()> {
        let to = self.to;
        // FP8 configs: their checkpoint is dequantized when its files hold FP8 weights
        // with scales, and the config loses its quantization keys.
        let mut dequantized: HashMap<OsString, String> = HashMap::new();
        let mut unread: Option<(PathBuf, ConfigProblem)> = None;
        let mut quantization_config = None;
        for f in &self.walked.configs {
            let text = read_json(&f.path)?;
            let doc = json::parse(&text).map_err(|e| not_json(&f.path, e))?;
            let is_object = matches!(doc.value, Value::Object(_));
            if to.strategy().is_some() && is_model_config(&f.rel) && !is_object {
                return Err(Error::FolderConfig {
                    path: f.path.clone(),
                    problem: ConfigProblem::NotAnObject,
                });
            }
            if unread.is_none() {
                unread = unread_quantization(&doc, to).map(|p| (f.path.clone(), p));
            }
            // `keep` changes no dtype: the config is copied as it is.
            let content =
                json::config_text(&text, to, false, None).map_err(|e| not_json(&f.path, e))?;
            if dequantizes(&doc, to) {
                let text = json::config_text(&text, to, true, None)
                    .map_err(|e| not_json(&f.path, e))?
                    .unwrap_or(text.clone());
                dequantized.insert(f.rel.clone(), text);
                self.described.push(f.clone());
            }
            if quantization_config.is_none() && has_quantization(&doc) {
                quantization_config = Some(f.path.clone());
            }
            self.configs.push((f.clone(), content));
        }
        let mut any = None;
        if !dequantized.is_empty() && self.dequantizes_any(&mut any)? {
            self.dequantize = true;
            quantization_config = None;
            for (f, content) in &mut self.configs {
                if let Some(text) = dequantized.remove(&f.rel) {
                    *content = Some(text);
                }
            }
        }
        // A config decides before the first byte whether its checkpoint is dequantized:
        // FP8 weights with scales under a scheme stcast does not read are refused here.
        if let Some((path, problem)) = unread {
            if self.dequantizes_any(&mut any)? {
                return Err(Error::FolderConfig { path, problem });
            }
        }
        self.quantization_config = quantization_config;
        if to.strategy().is_some() {
            let top = self
                .walked
                .configs
                .iter()
                .find(|f| f.rel.as_bytes() == CONFIG_NAME);
            self.model_config = top.map(|f| f.path.clone());
        }
        Ok(())
    }

    /// Does any weight file hold a quantized weight with its scale, which the target
    /// dequantizes? (`known`: the answer, once found.)
    fn dequantizes_any(&self, known: &mut Option<bool>) -> Result<bool> {
        if known.is_none() {
            *known = Some(dequantizes_any(
                &self.walked.weights,
                &self.given,
                &self.tuning,
            )?);
        }
        Ok(known == &Some(true))
    }

    /// The inspection of weight file `w`, as the run converts it.
    fn inspect(&self, w: &File) -> Result<InspectTask> {
        let mut s = self.given.clone();
        s.allow_quantized = Some(!self.check_quantized);
        s.quantization_config = self.quantization_config.clone();
        s.packed_config = nearest(w, &self.described).or_else(|| self.model_config.clone());
        let opts = s.inspect(self.tuning.clone(), false)?;
        InspectTask::new(&w.path, false, &opts, None)
    }

    /// What the plan keeps of weight file `i`'s inspection.
    fn absorb(&mut self, i: usize, found: Inspection) -> Result<()> {
        let w = &self.walked.weights[i];
        let mut rows = found.rows();
        // Without a quantization_config the files decide, as for a lone file: a folder
        // whose files hold quantized weights with their scales is dequantized, and whole.
        if self.dequantize || self.quantization_config.is_none() {
            let tensors = &rows.tensors;
            self.files_dequantize |= tensors.iter().any(|t| t.reason == ReasonCode::Dequantized);
            if self.problem.is_none() {
                self.problem = dequantize_problem(&w.path, &rows);
            }
        }
        self.unmatched.retain(|p| rows.keep_unmatched.contains(p));
        self.converts |= rows.tensors_converted > 0 || rows.format != InputFormat::Safetensors;
        if self.indexed.contains(&w.rel) {
            // The source's names: a fused tensor split per expert is one.
            let names = rows.tensors.iter().map(|t| t.split_from.unwrap_or(t.name));
            self.names
                .insert(w.rel.clone(), names.map(str::to_string).collect());
        }
        let out_data = rows.tensors.iter().map(|t| t.target_bytes).sum();
        let unquantized = self.to.strategy().map(|_| {
            let nonfinite =
                |t: &&crate::task::TensorRow<'_>| t.not_quantized == Some(Fp8Skip::NonFinite);
            rows.tensors
                .iter()
                .filter(nonfinite)
                .map(|t| t.name.to_string())
                .collect()
        });
        if rows
            .tensors
            .iter()
            .any(|t| t.reason == ReasonCode::Quantized)
        {
            self.quantizes.push(i);
        }
        // (Without a quantization_config the conversion of the file warns itself.)
        let declared = self.quantization_config.is_some();
        let quantized = rows
            .warnings
            .iter()
            .filter(|x| x.kind == WarningKind::Quantized);
        self.quantized
            .extend(quantized.filter(|_| declared).map(|x| {
                let text = format!("{}: {}", esc(&w.rel.to_string_lossy()), x.text);
                Warning::new(WarningKind::Quantized, text)
            }));
        self.said.push(rows.warnings.to_vec());
        rows.tensors = Vec::new();
        let info = serde_json::to_value(&rows)
            .map_err(|e| Error::io(&w.path, "cannot report", e.into()))?;
        self.planned.push(Planned {
            info,
            out_data,
            header_sha256: fingerprint(&w.path)?,
            unquantized,
        });
        Ok(())
    }

    /// The plan, once every file is planned: its side configs, the indexes checked against
    /// the shards.
    pub fn finish(mut self) -> Result<FolderPlan> {
        let w = std::mem::take(&mut self.walked);
        let dequantize = self.dequantize || self.files_dequantize;
        // FP8 weights no model config describes: their quantization_config goes beside them.
        let taken: Vec<&OsStr> = w
            .configs
            .iter()
            .chain(&w.others)
            .map(|f| f.rel.as_os_str())
            .collect();
        let quantized: Vec<&File> = self.quantizes.iter().map(|&i| &w.weights[i]).collect();
        for rel in side_configs(&quantized, &taken) {
            if let Some(f) = w.others.iter().find(|f| f.rel == rel) {
                return Err(Error::FolderConfig {
                    path: f.path.clone(),
                    problem: crate::error::ConfigProblem::SideTaken {
                        rel: rel.to_string_lossy().into_owned(),
                    },
                });
            }
            if taken.contains(&rel.as_os_str()) {
                continue; // a config of SRC's, judged as any model config
            }
            let dir = split_rel(rel.as_bytes()).0;
            let first = quantized
                .iter()
                .find(|q| split_rel(q.rel.as_bytes()).0 == dir);
            let file = File {
                rel,
                path: first.map(|q| q.path.clone()).unwrap_or_default(),
                size: 0,
                mtime_ns: 0,
                src_rel: None,
            };
            self.configs.push((file, Some("{}".into())));
        }
        if let (true, Some(problem)) = (dequantize, self.problem) {
            return Err(problem);
        }
        for (f, _, map) in &self.indexes {
            check_index(&f.path, map, &self.names)?;
        }
        let last = |f: &File| PUBLISH_LAST.contains(&split_rel(f.rel.as_bytes()).1);
        let (late_copies, copies) = w.others.into_iter().partition(last);
        Ok(FolderPlan {
            weights: w.weights,
            planned: self.planned,
            indexes: self.indexes,
            configs: self.configs,
            copies,
            late_copies,
            dirs: w.dirs,
            skipped: w.skipped,
            keep_unmatched: self.unmatched,
            nothing_to_convert: (!self.converts).then(|| nothing_to_convert(self.to)),
            dequantize,
            unmatched_prefixes: common_prefix_warnings(&self.said),
            walk_warnings: w.warnings.into_iter().chain(self.quantized).collect(),
            model_config: self.model_config,
        })
    }
}

impl Task for PlanTask {
    /// Plan the next weight file (its inspection stepped `budget` bytes at a time).
    fn step(&mut self, budget: u64) -> Result<bool> {
        if let Some(task) = &mut self.current {
            if !task.step(budget)? {
                return Ok(false);
            }
            let found = self.current.take().map(InspectTask::finish).transpose()?;
            if let Some(found) = found {
                self.absorb(self.planned.len(), found)?;
            }
        }
        let Some(w) = self.walked.weights.get(self.planned.len()) else {
            return Ok(true);
        };
        self.current = Some(self.inspect(w)?);
        Ok(false)
    }

    fn progress(&self) -> (u64, u64) {
        (self.planned.len() as u64, self.walked.weights.len() as u64)
    }
}

/// How many files a note names before "and N more".
const SHOWN: usize = 8;

/// The notes that name the files left out, by reason, with their sizes.
pub fn skipped_notes(skipped: &[(File, &'static str)]) -> Vec<Warning> {
    let mut notes = Vec::new();
    for (why, text) in [
        (
            TRAINER,
            "left out: training state, not weights (never read)",
        ),
        (
            SUPERSEDED,
            "left out: PyTorch weights beside their safetensors version (the safetensors \
             files are converted)",
        ),
        (EXCLUDED, "left out by {exclude}"),
    ] {
        let files: Vec<&File> = skipped
            .iter()
            .filter(|(_, w)| *w == why)
            .map(|(f, _)| f)
            .collect();
        if files.is_empty() {
            continue;
        }
        let sized: Vec<String> = files
            .iter()
            .take(SHOWN)
            .map(|f| {
                let rel = f.source_rel().to_string_lossy();
                format!("`{}` ({})", esc(&rel), format_bytes(f.size))
            })
            .collect();
        let mut more = String::new();
        if files.len() > SHOWN {
            let rest: u64 = files[SHOWN..].iter().map(|f| f.size).sum();
            let n = files.len() - SHOWN;
            more = format!(" and {n} more ({})", format_bytes(rest));
        }
        let text = format!("{text}: {}{more}", sized.join(", "));
        notes.push(Warning::new(WarningKind::SkippedFiles, text));
    }
    notes
}

/// Does any of `weights` hold a quantized weight with its scale, which the target of
/// `given` dequantizes? Each file is read as a lone file's inspection reads it, quantized
/// weights allowed and no prefix stripped.
fn dequantizes_any(weights: &[File], given: &Settings, tuning: &Tuning) -> Result<bool> {
    let mut s = given.clone();
    s.allow_quantized = Some(true);
    s.strip_prefix = Vec::new();
    let opts = s.inspect(tuning.clone(), false)?;
    for w in weights {
        let mut task = InspectTask::new(&w.path, false, &opts, None)?;
        crate::task::run(&mut task)?;
        let found = task.finish()?;
        let rows = found.rows();
        if rows
            .tensors
            .iter()
            .any(|t| t.reason == ReasonCode::Dequantized)
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The text of a JSON file of a run (a config, an index), bounded (`check::read_bounded`),
/// UTF-8; not JSON, or nested deeper than `json::MAX_DEPTH`, refused.
pub fn read_json(path: &Path) -> Result<String> {
    let text = read_json_text(path)?;
    if let Err(e) = json::parse(&text) {
        return Err(not_json(path, e));
    }
    if json::depth(&text) > json::MAX_DEPTH {
        let why = format!("JSON nested deeper than {} levels", json::MAX_DEPTH);
        return Err(bad_json(path, why));
    }
    Ok(text)
}

fn bad_json(path: &Path, why: String) -> Error {
    Error::BadIndex {
        path: path.to_path_buf(),
        why,
        refused: false,
    }
}

fn not_json(path: &Path, e: json::NotJson) -> Error {
    bad_json(path, format!("not valid JSON (at byte {})", e.0))
}

/// Each shard an index names belongs to that index alone: one that two name is refused
/// (which checkpoint it belongs to, and which index a loader should read, is anyone's
/// guess).
fn index_owners(indexes: &[ReadIndex]) -> Result<()> {
    let mut owner: HashMap<&str, &OsStr> = HashMap::new();
    for (f, _, map) in indexes {
        let mut rels: Vec<&str> = map.iter().map(|(_, s)| s.as_str()).collect();
        rels.sort_unstable();
        rels.dedup();
        for rel in rels {
            if let Some(other) = owner.insert(rel, &f.rel) {
                return Err(check::named_twice(&f.path, rel, Path::new(other)));
            }
        }
    }
    Ok(())
}

/// The index at `path` and the shards it names list the same tensors (`names`: each
/// shard's).
fn check_index(
    path: &Path,
    map: &[(String, String)],
    names: &HashMap<OsString, HashSet<String>>,
) -> Result<()> {
    let held = |rel: &str| &names[OsStr::new(rel)];
    let short = |rel: &str| esc(rel.rsplit('/').next().unwrap_or(rel)).into_owned();
    for (tensor, rel) in map {
        if !held(rel).contains(tensor) {
            let why = format!(
                "tensor `{}` is listed for `{}` but that shard does not hold it",
                esc(tensor),
                short(rel)
            );
            return Err(bad_json(path, why));
        }
    }
    let at: HashMap<&str, &str> = map.iter().map(|(t, s)| (t.as_str(), s.as_str())).collect();
    let mut rels: Vec<&str> = map.iter().map(|(_, s)| s.as_str()).collect();
    rels.sort_unstable();
    rels.dedup();
    for rel in rels {
        let mut tensors: Vec<&String> = held(rel).iter().collect();
        tensors.sort_unstable();
        for tensor in tensors {
            let said = match at.get(tensor.as_str()) {
                Some(&r) if r == rel => continue,
                Some(r) => format!("is listed for `{}`", esc(r)),
                None => "is absent from the index".into(),
            };
            let why = format!("tensor `{}` of shard `{}` {said}", esc(tensor), short(rel));
            return Err(bad_json(path, why));
        }
    }
    Ok(())
}

/// Why a dequantized folder's file `path` cannot be dequantized whole, if it cannot: a
/// quantized tensor left as it is (a weight whose scale another file holds, or none), a
/// weight's scale, zero point, global scale or shape left without its weight.
fn dequantize_problem(path: &Path, rows: &crate::task::InspectRows<'_>) -> Option<Error> {
    let roles = companion_roles();
    for t in &rows.tensors {
        let used = matches!(t.reason, ReasonCode::Dequantized | ReasonCode::Dropped);
        let role = (t.reason != ReasonCode::Dropped)
            .then(|| roles.iter().find(|(s, _)| t.name.ends_with(s.as_str())))
            .flatten();
        let problem = match role {
            Some(&(_, role)) => Fp8Problem::NoWeight {
                role,
                dtype: t.dtype.0.to_string(),
            },
            None if is_quantized_dtype(*t.dtype.0) && !used => Fp8Problem::NoScaleHere,
            None => continue,
        };
        return Some(Error::Fp8Unpaired {
            path: path.to_path_buf(),
            tensor: t.name.to_string(),
            problem: Box::new(problem),
        });
    }
    None
}

/// The config among `configs` in `w`'s folder or the nearest above it.
fn nearest(w: &File, configs: &[File]) -> Option<PathBuf> {
    let folder = split_rel(w.rel.as_bytes()).0;
    let mut best: Option<(usize, &Path)> = None;
    for f in configs {
        let d = split_rel(f.rel.as_bytes()).0;
        let inside = d.is_empty()
            || folder == d
            || (folder.starts_with(d) && folder.get(d.len()) == Some(&b'/'));
        if inside && best.is_none_or(|(n, _)| d.len() > n) {
            best = Some((d.len(), &f.path));
        }
    }
    best.map(|(_, p)| p.to_path_buf())
}

/// Is this the model's config (`config.json`), which gets the quantization_config?
fn is_model_config(rel: &OsStr) -> bool {
    split_rel(rel.as_bytes()).1 == CONFIG_NAME
}

/// Where an FP8 folder run writes the quantization_config of weights no model config
/// describes: `quantization_config.json` in each folder of `weights` that holds no model
/// config among `taken` (the folder's configs and other files), sorted, as a lone file's
/// run writes it beside its output.
fn side_configs(weights: &[&File], taken: &[&OsStr]) -> Vec<OsString> {
    let described: HashSet<&[u8]> = taken
        .iter()
        .filter(|r| is_model_config(r))
        .map(|r| split_rel(r.as_bytes()).0)
        .collect();
    let mut folders: Vec<&[u8]> = weights
        .iter()
        .map(|w| split_rel(w.rel.as_bytes()).0)
        .filter(|d| !described.contains(d))
        .collect();
    folders.sort_unstable();
    folders.dedup();
    let side = FOLDER_SIDE_CONFIG.as_bytes();
    let rels = folders.into_iter().map(|d| match d.is_empty() {
        true => side.to_vec(),
        false => [d, b"/", side].concat(),
    });
    let rels: Vec<OsString> = rels.map(|r| OsStr::from_bytes(&r).to_os_string()).collect();
    let mut out = rels;
    out.sort();
    out
}

/// Of the warnings each file gave, those that a prefix to strip matches no tensor name that
/// every one gave: a prefix is judged over the whole input, and said once.
fn common_prefix_warnings(said: &[Vec<Warning>]) -> Vec<Warning> {
    let prefix = |ws: &[Warning]| -> HashSet<String> {
        let unmatched = ws.iter().filter(|w| w.kind == WarningKind::UnmatchedPrefix);
        unmatched.map(|w| w.text.clone()).collect()
    };
    let Some(first) = said.first() else {
        return Vec::new();
    };
    let sets: Vec<HashSet<String>> = said.iter().map(|ws| prefix(ws)).collect();
    first
        .iter()
        .filter(|w| w.kind == WarningKind::UnmatchedPrefix)
        .filter(|w| sets.iter().all(|s| s.contains(&w.text)))
        .cloned()
        .collect()
}

/// The first quantization key a config sets (not null), and its value.
fn quantization_of<'n, 'a>(doc: &'n Node<'a>) -> Option<(&'static str, &'n Node<'a>)> {
    QUANTIZATION_KEYS.iter().find_map(|&k| {
        let v = doc.get(k)?;
        (v.value != Value::Literal("null")).then_some((k, v))
    })
}

/// Does a config set a quantization key anywhere in it?
fn has_quantization(doc: &Node<'_>) -> bool {
    match &doc.value {
        Value::Object(_) => {
            quantization_of(doc).is_some()
                || doc
                    .dict()
                    .unwrap_or_default()
                    .iter()
                    .any(|(_, v)| has_quantization(v))
        }
        Value::Array(items) => items.iter().any(has_quantization),
        _ => false,
    }
}

/// Does a config say its checkpoint is quantized in a scheme `to` (bf16, fp16) dequantizes:
/// compressed-tensors' float 8-bit or packed weights, gpt-oss mxfp4, DeepSeek's `fp8` e4m3?
fn dequantizes(doc: &Node<'_>, to: Target) -> bool {
    if !matches!(to, Target::Bf16 | Target::F16) {
        return false;
    }
    let q = quantization_of(doc).map(|(_, q)| q);
    q.is_some_and(|q| matches!(q.value, Value::Object(_)) && unread(q).is_none())
}

/// Why a config's quantization cannot be dequantized to `to` (bf16, fp16): it sets a
/// quantization key under a scheme stcast does not read. Such a checkpoint's quantized
/// weights are not dequantized: the scheme may scale them otherwise, and the config would
/// still call them quantized. None when there is no such key, or stcast reads it.
fn unread_quantization(doc: &Node<'_>, to: Target) -> Option<ConfigProblem> {
    if !matches!(to, Target::Bf16 | Target::F16) || dequantizes(doc, to) {
        return None;
    }
    let (key, q) = quantization_of(doc)?;
    let object = matches!(q.value, Value::Object(_));
    let method = q
        .get("quant_method")
        .filter(|m| m.value != Value::Literal("null"));
    Some(ConfigProblem::Unread {
        key,
        method: method.map(|m| show(Some(m))),
        detail: if object {
            unread(q).unwrap_or_default()
        } else {
            String::new()
        },
    })
}

/// compressed-tensors formats whose weights the engine unpacks (`quant::Packing`), and the
/// weights each holds: (type, bits).
const PACKED_FORMATS: [(&str, &[(&str, u64)]); 5] = [
    ("nvfp4-pack-quantized", &[("float", 4)]),
    ("mxfp4-pack-quantized", &[("float", 4)]),
    (
        "pack-quantized",
        &[
            ("int", 1),
            ("int", 2),
            ("int", 3),
            ("int", 4),
            ("int", 5),
            ("int", 6),
            ("int", 7),
            ("int", 8),
        ],
    ),
    ("int-quantized", &[("int", 8)]),
    ("naive-quantized", &[("int", 8), ("float", 8)]),
];

/// A config value as text, if it is a string.
fn text<'n>(n: Option<&'n Node<'_>>) -> Option<&'n str> {
    match n.map(|n| &n.value) {
        Some(Value::Str(json::Str::Text(s))) => Some(s),
        _ => None,
    }
}

/// A value as Python compares it with a number (`True == 1`), if it is one.
fn number(n: Option<&Node<'_>>) -> Option<f64> {
    match n.map(|n| &n.value)? {
        Value::Number(s) => s.parse().ok(),
        Value::Literal("true") => Some(1.0),
        Value::Literal("false") => Some(0.0),
        _ => None,
    }
}

/// Is a JSON value falsy, as Python reads it (`or` takes the next)?
fn falsy(n: Option<&Node<'_>>) -> bool {
    match n.map(|n| &n.value) {
        None | Some(Value::Literal("null" | "false")) => true,
        Some(Value::Str(s)) => *s == json::Str::Text("".into()),
        Some(Value::Number(_)) => number(n) == Some(0.0),
        Some(Value::Array(items)) => items.is_empty(),
        Some(Value::Object(m)) => m.is_empty(),
        Some(Value::Literal(_)) => false,
    }
}

/// Why stcast does not dequantize the scheme of quantization config `q` (an object), in
/// words (empty when no detail helps), or None when it does.
fn unread(q: &Node<'_>) -> Option<String> {
    let method = q.get("quant_method");
    match text(method) {
        Some("fp8") => {
            let fmt = q.get("fmt");
            let e4m3 = fmt.is_none() || text(fmt) == Some("e4m3");
            return (!e4m3).then(String::new);
        }
        // gpt-oss: `*_blocks` with `*_scales`, paired by the engine.
        Some("mxfp4") => return None,
        Some("compressed-tensors") => {}
        _ => return Some(String::new()),
    }
    let groups = q
        .get("config_groups")
        .and_then(Node::dict)
        .unwrap_or_default();
    if groups.is_empty() {
        return Some(String::new());
    }
    for (name, g) in groups {
        let name = match name {
            json::Str::Text(t) => esc(t).into_owned(),
            json::Str::Wide(_) => show(Some(&Node {
                value: Value::Str(name.clone()),
                span: (0, 0),
            })),
        };
        let w = g
            .get("weights")
            .filter(|w| matches!(w.value, Value::Object(_)));
        let Some(w) = w.filter(|_| matches!(g.value, Value::Object(_))) else {
            return Some(format!("config group `{name}` has no weights"));
        };
        let fmt = match falsy(g.get("format")) {
            true => q.get("format"),
            false => g.get("format"),
        };
        if !reads(w, fmt) {
            return Some(format!("config group `{name}` {}", weights_problem(w, fmt)));
        }
    }
    None
}

/// Does stcast dequantize a config group's weights `w` (`fmt`: its format): FP8 (E4M3), or
/// a packed format holding the weights it says?
fn reads(w: &Node<'_>, fmt: Option<&Node<'_>>) -> bool {
    let (kind, bits) = (text(w.get("type")), number(w.get("num_bits")));
    let fmt = match fmt.map(|f| &f.value) {
        None | Some(Value::Literal("null")) => None,
        Some(Value::Str(json::Str::Text(s))) => Some(Some(s.as_ref())),
        // Another value is no format name.
        Some(_) => Some(None),
    };
    let packed = |f: &str| {
        PACKED_FORMATS
            .iter()
            .find(|(name, _)| *name == f)
            .map(|(_, held)| *held)
    };
    let fp8_format = !matches!(fmt, Some(Some(f)) if f != "naive-quantized" && packed(f).is_some());
    if kind == Some("float") && bits == Some(8.0) && fp8_format {
        return true;
    }
    let held = fmt.flatten().and_then(packed).unwrap_or_default();
    held.iter()
        .any(|&(k, b)| kind == Some(k) && bits == Some(b as f64))
}

/// What of a config group's weights (format `fmt`) `reads` does not read.
fn weights_problem(w: &Node<'_>, fmt: Option<&Node<'_>>) -> String {
    let (kind, bits) = (w.get("type"), w.get("num_bits"));
    let whole = match bits.map(|b| &b.value) {
        Some(Value::Number(s)) if !s.contains(['.', 'e', 'E']) => s.parse::<i128>().ok(),
        _ => None,
    };
    let (Some(bits), Some(name)) = (whole, text(kind).filter(|k| ["int", "float"].contains(k)))
    else {
        return match whole {
            None => format!("says `num_bits` {}, not a whole number", show(bits)),
            Some(_) => format!("says `type` {}, neither int nor float", show(kind)),
        };
    };
    let held = text(fmt).and_then(|f| PACKED_FORMATS.iter().find(|(n, _)| *n == f));
    let Some((_, held)) = held else {
        return format!("says format {} with {name} {bits}-bit weights", show(fmt));
    };
    let mut names: Vec<String> = held.iter().map(|(k, b)| format!("{k} {b}-bit")).collect();
    names.sort();
    format!(
        "says format {}, which holds {} weights, with {name} {bits}-bit ones",
        show(fmt),
        names.join(" or ")
    )
}

/// A config value as JSON (`json.dumps`, keys sorted), for a message template; `null` for
/// none.
fn show(n: Option<&Node<'_>>) -> String {
    let dump = json::Dump {
        sort_keys: true,
        ..json::Dump::indented(None)
    };
    let null = Node {
        value: Value::Literal("null"),
        span: (0, 0),
    };
    esc(&dump.text(n.unwrap_or(&null))).into_owned()
}

/// A fingerprint of a source weight file that `--resume` compares: a safetensors file's
/// header hash (`source::read_header`); for a PyTorch checkpoint, the SHA-256 of its first
/// 64 KiB and last 1 MiB (a zip's central directory, with every entry's CRC-32, or a legacy
/// file's pickle); for a checkpoint folder (DCP), of each of its files' fingerprints, names,
/// sizes and mtimes.
pub fn fingerprint(path: &Path) -> Result<String> {
    use sha2::Digest;
    let hex = |h: sha2::Sha256| h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if path.is_dir() {
        let mut h = sha2::Sha256::new();
        h.update(b"stcast-folder-fingerprint\0");
        let entries = std::fs::read_dir(path).map_err(|e| Error::io(path, "cannot list", e))?;
        let mut names = Vec::new();
        for entry in entries {
            names.push(
                entry
                    .map_err(|e| Error::io(path, "cannot list", e))?
                    .file_name(),
            );
        }
        names.sort();
        for name in names {
            let f = path.join(&name);
            let Some(meta) = std::fs::metadata(&f).ok().filter(|m| m.is_file()) else {
                continue;
            };
            let mtime_ns = i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec());
            h.update(name.as_bytes());
            h.update(format!("\0{}\0{mtime_ns}\0", meta.len()).as_bytes());
            h.update(fingerprint(&f)?.as_bytes());
        }
        return Ok(hex(h));
    }
    match crate::source::read_header(path) {
        Ok((_, sha256, _, _)) => return Ok(sha256),
        Err(e) if e.kind() == crate::vocab::ErrorKind::InvalidInput => {}
        Err(e) => return Err(e),
    }
    const HEAD: u64 = 64 << 10;
    const TAIL: u64 = 1 << 20;
    let mut h = sha2::Sha256::new();
    h.update(b"stcast-source-fingerprint\0");
    let io = |e| Error::io(path, "cannot read", e);
    let mut file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    // At most HEAD + TAIL bytes, sized by the file's length.
    let mut buf = vec![0; size.min(HEAD) as usize];
    file.read_exact(&mut buf).map_err(io)?;
    h.update(&buf);
    let tail = HEAD.max(size.saturating_sub(TAIL));
    if tail < size {
        file.seek(SeekFrom::Start(tail)).map_err(io)?;
        let mut buf = vec![0; (size - tail) as usize];
        file.read_exact(&mut buf).map_err(io)?;
        h.update(&buf);
    }
    Ok(hex(h))
}

pub mod dry;
pub mod finish;
pub mod inspect;
pub mod prepare;
pub mod run;
pub mod verify_folder;
pub mod work;
pub mod write;

#[cfg(test)]
mod tests;
