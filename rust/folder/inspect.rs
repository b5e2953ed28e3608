//! A dry run of a folder run, answered whole (`InspectTask` over a folder): what the run
//! would convert, copy, rewrite and leave out, each weight file's inspection, and the totals.
//!
//! Without a destination the folder is only described: walked (`walk::walk`, its configs
//! read and an FP8 target's model config judged), and every config and index counted as
//! rewritten. With one, the caller has made the run's checks, and the folder is planned as
//! the run plans it (`PlanTask`): what it rewrites is what the plan writes anew. Then each
//! weight file is inspected with the run's options, one file after another, stepped; a scan
//! (`scan`, or overflow kept, or refused with a destination) counts its bytes over every
//! file, known from the headers first.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::{is_model_config, read_json, skipped_notes, PlanTask};
use crate::convert::{Options, Tuning};
use crate::error::{unmatched_message, ConfigProblem, Error, Result, WalkProblem, Warning};
use crate::given::Settings;
use crate::run::beside::FOLDER_SIDE_CONFIG;
use crate::run::json::{self, Value};
use crate::run::walk::{self, File, Overrides, CONFIG_NAME};
use crate::source::Source;
use crate::task::{InspectTask, Inspection, Task};
use crate::vocab::{OnOverflow, Target, Unmatched, WarningKind};

/// A warning and the file it is about (a weight file's, by its relative path in the source).
pub use crate::task::Said;

/// The first part of a folder's dry run: the folder walked, or planned as the run plans it
/// (a weight file a step: `Task`). `InspectFolderTask::new` takes it on.
pub struct Planning {
    /// The run's plan, and whether it re-shards.
    plan: Option<(Box<PlanTask>, bool)>,
    /// The walk's answer (without a destination).
    walked: Option<Known>,
    /// The run's options, from which each file's inspection options are made once the
    /// folder is known.
    given: Settings,
    tuning: Tuning,
    scan: bool,
    checked: bool,
}

/// A folder's files, as the walk or the plan found them.
struct Known {
    weights: Vec<File>,
    /// Every other file the run writes, and whether it is rewritten (rather than copied).
    others: Vec<(File, bool)>,
    left_out: Vec<(File, &'static str)>,
    /// What the walk or the plan said.
    said: Vec<Warning>,
    /// FP8 targets: the model config by whose sizes fused experts are split.
    model_config: Option<PathBuf>,
}

/// The rest of a folder's dry run: each weight file inspected, one after another, stepped
/// (`Task`); `finish` gives the answer.
pub struct InspectFolderTask {
    given: Settings,
    checked: bool,
    folder: Folder,
}

/// What the dry run knows of the folder once it is walked or planned.
struct Folder {
    /// Each weight file's inspection options: the run's, with patterns judged over the
    /// folder and an FP8 target's model config.
    opts: Options,
    /// The file reads its data (a scan).
    scanning: bool,
    scan: bool,
    weights: Vec<File>,
    /// Every other file the run writes, and whether it is rewritten (rather than copied).
    others: Vec<(File, bool)>,
    left_out: Vec<(File, &'static str)>,
    /// What the walk or the plan said, before the files' warnings.
    said: Vec<Warning>,
    /// Each weight file's data bytes, read from its header first when scanning.
    sizes: Vec<u64>,
    current: Option<InspectTask>,
    done: Vec<Inspection>,
}

/// A folder's dry run, as reports show it: each weight file's inspection (its relative path
/// in the source, and what it found), the totals, and the files and warnings it names.
pub struct FolderInspection {
    pub files: Vec<(OsString, Inspection)>,
    pub rows: FolderRows,
    pub named: Named,
}

/// What a folder's dry run names, paths as the file system gives them: the other files
/// (path, bytes, "copied" or "rewritten") by path, the files left out (path in the source,
/// bytes, why), and the warnings (kind, template, file): the unmatched `keep` patterns
/// first, then what the walk or the plan said, then each file's.
pub type Named = (
    Vec<(OsString, u64, &'static str)>,
    Vec<(OsString, u64, &'static str)>,
    Vec<(&'static str, String, Option<OsString>)>,
);

/// The rest of a `FolderInspection`, serialized.
#[derive(serde::Serialize)]
pub struct FolderRows {
    pub to: Target,
    pub header_bytes: u64,
    pub data_bytes: u64,
    pub file_bytes: u64,
    pub output_bytes: u64,
    pub tensors_converted: usize,
    pub tensors_copied: usize,
    pub tensors_kept: usize,
    pub bytes_kept: u64,
    pub tensors_dequantized: usize,
    pub tensors_dropped: usize,
    /// The `keep` patterns that match a tensor in no file.
    pub keep_unmatched: Vec<String>,
    pub scanned: bool,
    /// Bytes of the files copied or rewritten.
    pub other_bytes: u64,
}

impl Planning {
    /// The dry run of a folder run from `src` with the options `given` (`to`, the
    /// precision options, `include`, `exclude`, `key`, `strip_prefix`, `follow_links`,
    /// `config`); with `scan`, the tensors converted are read. `checked`: the run's checks
    /// were made (a destination is given), so the folder is planned as the run plans it, a
    /// quantized checkpoint refused unless `given` allows it. `resharding`: the run
    /// re-shards, writing indexes of its own, and `src` may be one checkpoint (a file, a
    /// DCP folder: `lone`).
    pub fn new(
        src: &Path,
        given: &Settings,
        tuning: Tuning,
        scan: bool,
        checked: bool,
        resharding: bool,
    ) -> Result<Planning> {
        let (mut plan, mut walked) = (None, None);
        let tree = src.is_dir() && !crate::input::folder::check_folder(src, false)?;
        if resharding && !tree {
            walked = Some(lone(src, given, checked)?);
        } else if checked {
            let mut s = given.clone();
            s.key = None; // (the plan reads the files as a folder's)
            let check_quantized = given.allow_quantized != Some(true);
            let task = PlanTask::new(src, &s, tuning.clone(), check_quantized)?;
            plan = Some((Box::new(task), resharding));
        } else {
            walked = Some(describe(src, given)?);
        }
        Ok(Planning {
            plan,
            walked,
            given: given.clone(),
            tuning,
            scan,
            checked,
        })
    }
}

impl Task for Planning {
    fn step(&mut self, budget: u64) -> Result<bool> {
        match &mut self.plan {
            Some((plan, _)) => plan.step(budget),
            None => Ok(true),
        }
    }

    fn progress(&self) -> (u64, u64) {
        self.plan.as_ref().map_or((0, 0), |(p, _)| p.progress())
    }
}

/// The folder walked, its configs judged as a run judges them before any weight is read.
fn describe(src: &Path, given: &Settings) -> Result<Known> {
    let overrides = Overrides::new(&given.include, &given.exclude)?;
    let walked = walk::walk(src, given.follow_links, &overrides)?;
    let fp8 = given.target()?.strategy().is_some();
    for f in &walked.configs {
        let text = read_json(&f.path)?;
        let doc = json::parse(&text).map_err(|e| super::not_json(&f.path, e))?;
        if fp8 && is_model_config(&f.rel) && !matches!(doc.value, Value::Object(_)) {
            return Err(Error::FolderConfig {
                path: f.path.clone(),
                problem: ConfigProblem::NotAnObject,
            });
        }
    }
    let top = walked
        .configs
        .iter()
        .find(|f| f.rel.as_encoded_bytes() == CONFIG_NAME);
    let model_config = top.filter(|_| fp8).map(|f| f.path.clone());
    if walked.weights.is_empty() {
        return Err(Error::Walk {
            path: src.to_path_buf(),
            problem: WalkProblem::NoWeights,
        });
    }
    let mut said = skipped_notes(&walked.skipped);
    said.extend(walked.warnings);
    let mut others: Vec<(File, bool)> = Vec::new();
    others.extend(walked.indexes.into_iter().map(|f| (f, true)));
    others.extend(walked.configs.into_iter().map(|f| (f, true)));
    others.extend(walked.others.into_iter().map(|f| (f, false)));
    Ok(Known {
        weights: walked.weights,
        others,
        left_out: walked.skipped,
        said,
        model_config,
    })
}

/// One checkpoint re-sharded into a folder: its one weight file, named in reports by its
/// name (a DCP folder: `.`), and with `checked` the config the run writes beside it: the
/// model's `config` (its dtype set), or an FP8 target's `quantization_config.json`.
fn lone(src: &Path, given: &Settings, checked: bool) -> Result<Known> {
    let fp8 = given.target()?.strategy().is_some();
    if let Some(config) = &given.config {
        let text = read_json(config)?;
        let doc = json::parse(&text).map_err(|e| super::not_json(config, e))?;
        if fp8 && !matches!(doc.value, Value::Object(_)) {
            return Err(Error::FolderConfig {
                path: config.clone(),
                problem: ConfigProblem::NotAnObject,
            });
        }
    }
    let named = |rel: &str, path: &Path, src_rel: Option<OsString>| File {
        rel: rel.into(),
        path: path.to_path_buf(),
        size: 0,
        mtime_ns: 0,
        src_rel,
    };
    let name = match src.is_dir() {
        true => OsString::from("."),
        false => src.file_name().unwrap_or(src.as_os_str()).to_os_string(),
    };
    let mut others = Vec::new();
    if checked {
        match &given.config {
            Some(config) => others.push((named("config.json", config, None), true)),
            None if fp8 => others.push((named(FOLDER_SIDE_CONFIG, src, None), true)),
            None => {}
        }
    }
    Ok(Known {
        weights: vec![named("", src, Some(name))],
        others,
        left_out: Vec::new(),
        said: Vec::new(),
        model_config: given.config.clone().filter(|_| fp8),
    })
}

/// The folder as the run plans it (`resharding`: its indexes are the run's own).
fn planned(plan: PlanTask, resharding: bool) -> Result<Known> {
    let plan = plan.finish()?;
    let mut others: Vec<(File, bool)> = Vec::new();
    others.extend(plan.copies.into_iter().map(|f| (f, false)));
    others.extend(plan.late_copies.into_iter().map(|f| (f, false)));
    others.extend(plan.configs.into_iter().map(|(f, c)| (f, c.is_some())));
    if !resharding {
        others.extend(plan.indexes.into_iter().map(|(f, _, _)| (f, true)));
    }
    Ok(Known {
        weights: plan.weights,
        others,
        left_out: plan.skipped,
        // The patterns that match nothing are said here (the run's checks said the rest of
        // the plan's warnings: the caller's `checked`).
        said: plan
            .walk_warnings
            .into_iter()
            .filter(|w| w.kind == WarningKind::UnmatchedPattern)
            .collect(),
        model_config: plan.model_config,
    })
}

impl InspectFolderTask {
    /// The inspection of each file of the folder `planning` found, with the run's options;
    /// a scan's bytes read from the headers first (one progress over every file).
    pub fn new(planning: Planning) -> Result<InspectFolderTask> {
        let Planning {
            plan,
            walked,
            given,
            tuning,
            scan,
            checked,
        } = planning;
        let known = match (plan, walked) {
            (Some((plan, resharding)), _) => planned(*plan, resharding)?,
            (None, Some(walked)) => walked,
            (None, None) => unreachable!("a folder is walked or planned"),
        };
        let mut s = given.clone();
        s.keep_unmatched = Unmatched::Ignore;
        s.packed_config = known.model_config;
        s.allow_quantized = None;
        s.config = None;
        let opts = s.inspect(tuning, false)?;
        // Keeping what would overflow reads the data; so does refusing it, one of the
        // checks of a dry run with a destination.
        let scan = scan || (checked && opts.on_overflow == OnOverflow::Error);
        let scanning = scan || opts.on_overflow == OnOverflow::Keep;
        let mut sizes = Vec::new();
        if scanning {
            for w in &known.weights {
                let source = Source::open_any(&w.path, &opts.input)?;
                sizes.push(source.header.data_len());
            }
        }
        let folder = Folder {
            opts,
            scanning,
            scan,
            weights: known.weights,
            others: known.others,
            left_out: known.left_out,
            said: known.said,
            sizes,
            current: None,
            done: Vec::new(),
        };
        Ok(InspectFolderTask {
            given,
            checked,
            folder,
        })
    }

    /// The answer, once every file is inspected.
    pub fn finish(self) -> Result<FolderInspection> {
        let f = self.folder;
        let to = f.opts.plan.target;
        let mut unmatched = self.given.keep.clone();
        let mut warnings: Vec<Said> = Vec::new();
        let mut said_by_file = Vec::new();
        let mut files = Vec::new();
        let mut rows = FolderRows {
            to,
            header_bytes: 0,
            data_bytes: 0,
            file_bytes: 0,
            output_bytes: 0,
            tensors_converted: 0,
            tensors_copied: 0,
            tensors_kept: 0,
            bytes_kept: 0,
            tensors_dequantized: 0,
            tensors_dropped: 0,
            keep_unmatched: Vec::new(),
            scanned: f.scanning,
            other_bytes: f.others.iter().map(|(o, _)| o.size).sum(),
        };
        for (w, found) in f.weights.iter().zip(f.done) {
            let r = found.rows();
            unmatched.retain(|p| r.keep_unmatched.contains(p));
            rows.header_bytes += r.header_bytes;
            rows.data_bytes += r.data_bytes;
            rows.file_bytes += r.file_bytes;
            rows.output_bytes += r.output_bytes;
            rows.tensors_converted += r.tensors_converted;
            rows.tensors_copied += r.tensors_copied;
            rows.tensors_kept += r.tensors_kept;
            rows.bytes_kept += r.bytes_kept;
            rows.tensors_dequantized += r.tensors_dequantized;
            rows.tensors_dropped += r.tensors_dropped;
            said_by_file.push(r.warnings.to_vec());
            drop(r);
            files.push((w.source_rel().to_os_string(), found));
        }
        rows.output_bytes += rows.other_bytes;
        if !unmatched.is_empty() {
            let text = unmatched_message(&unmatched);
            warnings.push((Warning::new(WarningKind::UnmatchedPattern, text), None));
        }
        warnings.extend(f.said.into_iter().map(|w| (w, None)));
        // A prefix to strip is judged over every file (with a destination, the run's
        // checks said it).
        if !self.checked {
            let common = super::common_prefix_warnings(&said_by_file);
            warnings.extend(common.into_iter().map(|w| (w, None)));
        }
        for ((rel, _), said) in files.iter().zip(said_by_file) {
            let own = said
                .into_iter()
                .filter(|w| w.kind != WarningKind::UnmatchedPrefix);
            warnings.extend(own.map(|w| (w, Some(rel.clone()))));
        }
        rows.keep_unmatched = unmatched;
        let mut others = f.others;
        others.sort_by(|a, b| a.0.rel.cmp(&b.0.rel));
        let other_files = others
            .into_iter()
            .map(|(o, rewritten)| {
                let action = if rewritten { "rewritten" } else { "copied" };
                (o.rel, o.size, action)
            })
            .collect();
        let left_out = f
            .left_out
            .into_iter()
            .map(|(o, why)| (o.source_rel().to_os_string(), o.size, why))
            .collect();
        let warnings = warnings
            .into_iter()
            .map(|(w, path)| (w.kind.name(), w.text, path))
            .collect();
        Ok(FolderInspection {
            files,
            rows,
            named: (other_files, left_out, warnings),
        })
    }
}

impl Task for InspectFolderTask {
    /// Inspect the next weight file (its scan stepped `budget` bytes at a time).
    fn step(&mut self, budget: u64) -> Result<bool> {
        let f = &mut self.folder;
        if let Some(task) = &mut f.current {
            if !task.step(budget)? {
                return Ok(false);
            }
            let mut found = f.current.take().expect("current").finish()?;
            found.close();
            f.done.push(found);
        }
        let Some(w) = f.weights.get(f.done.len()) else {
            return Ok(true);
        };
        f.current = Some(InspectTask::new(&w.path, f.scan, &f.opts, None)?);
        Ok(false)
    }

    fn progress(&self) -> (u64, u64) {
        let f = &self.folder;
        let total: u64 = f.sizes.iter().sum();
        let base: u64 = f.sizes.iter().take(f.done.len()).sum();
        let size = f.sizes.get(f.done.len()).copied().unwrap_or(0);
        // A scan reads the tensors it measures, not every data byte: its end counts the
        // whole file, so that the last file's end is (total, total).
        let now = match f.current.as_ref().map(Task::progress) {
            Some((d, t)) if d < t => d.min(size),
            Some(_) => size,
            None => 0,
        };
        (base + now, total)
    }
}

#[cfg(test)]
mod tests;
