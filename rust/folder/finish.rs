//! The end of a folder run: the publish phase (`Publish`: the copies, then a loader's cues,
//! configs and indexes, last), the folder's report (`FolderReport`), and `finalize`
//! (`FinalizeTask`: a folder completed once its shard runs are done).
//!
//! The publish phase is stepped, a bounded slice of a copy or one file's write a step, so that
//! a front end hears Ctrl-C and tells progress in between; it composes into a larger task (a
//! folder run puts it after its units, `finalize` after its check of the shard runs' work).
//! An interrupted run never leaves what a loader takes for a checkpoint: the indexes and
//! configs come after every weight and copy, and are withdrawn again when the final re-check
//! finds a file this run wrote changed.

use std::collections::{HashSet, VecDeque};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::work::{CheckedIndex, Cut, Judged, Work, WorkTask};
use crate::convert::Report;
use crate::error::{Error, Result, Warning};
use crate::given::{Given, Settings};
use crate::kernels::Isa;
use crate::numerics::{DequantizedTensor, Numerics};
use crate::output;
use crate::plan::KeptTensor;
use crate::quant::QuantizedTensor;
use crate::run::json::{Node, Str, Value};
use crate::run::manifest::{self, Manifest};
use crate::run::place::{self, SourceKind};
use crate::run::publish::{WeightMap, Writer};
use crate::run::survey::{self, Planned};
use crate::run::walk::File;
use crate::task::Task;
use crate::vocab::{OnOverflow, Target};

/// Hit the failpoint `name` (`failpoint`), as an error naming it.
pub fn failpoint(name: &str) -> Result<()> {
    crate::failpoint::hit(name).map_err(|e| Error::io(Path::new(name), "failpoint", e))
}

/// One file of a folder run, as its report lists it (`stcast.FileReport`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct FileRow {
    /// Relative to both folders (a PyTorch file's output: its safetensors name).
    #[serde(skip)]
    pub path: OsString,
    pub kind: &'static str,
    pub action: &'static str,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub tensors_converted: usize,
    pub tensors_copied: usize,
    pub seconds: f64,
    /// Each with the path it names.
    #[serde(skip)]
    pub warnings: Vec<(Warning, Option<OsString>)>,
    pub tensors_kept: usize,
    pub bytes_kept: u64,
    /// Its path in the source, when not `path` (a PyTorch file renamed).
    #[serde(skip)]
    pub source: Option<OsString>,
}

impl FileRow {
    fn new(path: &OsStr, kind: &'static str, action: &'static str, bytes: (u64, u64)) -> FileRow {
        FileRow {
            path: path.to_os_string(),
            kind,
            action,
            bytes_in: bytes.0,
            bytes_out: bytes.1,
            tensors_converted: 0,
            tensors_copied: 0,
            seconds: 0.0,
            warnings: Vec::new(),
            tensors_kept: 0,
            bytes_kept: 0,
            source: None,
        }
    }

    /// Unit `i` of `work`'s line when this run did not convert it (`action`: skipped,
    /// checked), its output `bytes_out` long.
    pub fn unit(work: &Work, i: usize, action: &'static str, bytes_out: u64) -> FileRow {
        let u = &work.units[i];
        let mut row = FileRow::new(&u.rel, "weights", action, (u.input_bytes, bytes_out));
        // A whole file renamed (a PyTorch file) names its input.
        row.source = (u.whole)
            .then(|| work.plan.weights[u.inputs[0]].src_rel.clone())
            .flatten();
        row
    }

    /// Unit `i` of `work`'s line once this run converted it.
    pub fn converted(work: &Work, i: usize, c: &Converted) -> FileRow {
        let r = &c.report;
        FileRow {
            tensors_converted: r.tensors_converted,
            tensors_copied: r.tensors_copied,
            seconds: r.seconds,
            warnings: c.warnings.clone(),
            tensors_kept: r.tensors_kept,
            bytes_kept: r.bytes_kept,
            ..FileRow::unit(work, i, "converted", r.bytes_out)
        }
    }
}

/// A unit this run converted: its output's rel, its conversion's report, and the warnings
/// it tells (each with the path it names).
#[derive(Debug)]
pub struct Converted {
    pub rel: OsString,
    pub report: Report,
    pub warnings: Vec<(Warning, Option<OsString>)>,
    /// Its numerics were measured.
    pub measured: bool,
}

/// An entry of a folder's report that names the file it is about (`{"file": rel, ...}`).
#[derive(Debug, serde::Serialize)]
pub struct InFile<T> {
    pub file: String,
    #[serde(flatten)]
    pub item: T,
}

/// A folder run's report (`stcast.ConvertReport` with `folder=True`): the totals of the units
/// converted by this run, their kept, quantized and dequantized tensors (each entry naming
/// its file), and every file's line.
#[derive(Debug, serde::Serialize)]
pub struct FolderReport {
    #[serde(skip)]
    pub src: PathBuf,
    #[serde(skip)]
    pub dst: PathBuf,
    pub to: Target,
    pub tensors_converted: usize,
    pub tensors_copied: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub seconds: f64,
    /// The last conversion's (None: nothing converted).
    pub threads: Option<usize>,
    pub isa: Option<Isa>,
    /// The units' warnings, each with the path it names, after `first` (`FolderReport::new`).
    #[serde(skip)]
    pub warnings: Vec<(Warning, Option<OsString>)>,
    pub tensors_kept: usize,
    pub bytes_kept: u64,
    pub kept: Vec<InFile<KeptTensor>>,
    pub on_overflow: OnOverflow,
    /// The units' numerics totals merged (None: none converted, or one not measured).
    #[serde(skip)]
    pub numerics: Option<Numerics>,
    pub folder: bool,
    #[serde(skip)]
    pub files: Vec<FileRow>,
    pub shard: Option<Vec<u64>>,
    pub complete: bool,
    /// A shard run's (not `complete`): SRC and DST as `finalize` takes them, absolute, so
    /// that it may run from anywhere.
    #[serde(skip)]
    pub finalize: Option<(PathBuf, PathBuf)>,
    /// A re-sharding's output shard size.
    pub max_shard_size: Option<u64>,
    pub tensors_quantized: usize,
    pub quantized: Vec<InFile<QuantizedTensor>>,
    pub unquantized: Vec<String>,
    pub dequantized: Vec<InFile<DequantizedTensor>>,
    pub tensors_dropped: usize,
}

/// What a folder's report says besides its files and units.
#[derive(Debug, Clone)]
pub struct Said {
    pub src: PathBuf,
    pub dst: PathBuf,
    pub to: Target,
    pub started: Instant,
    pub shard: Option<manifest::Shard>,
    pub complete: bool,
    pub on_overflow: OnOverflow,
    pub max_shard_size: Option<u64>,
    /// The run's own warnings, told before the units'.
    pub first: Vec<(Warning, Option<OsString>)>,
}

impl FolderReport {
    /// The report of a run that wrote `files`, converting `converted`.
    pub fn new(said: Said, files: Vec<FileRow>, converted: &[Converted]) -> FolderReport {
        let reports = || converted.iter().map(|c| &c.report);
        let sum = |f: fn(&Report) -> usize| reports().map(f).sum::<usize>();
        let bytes = |f: fn(&Report) -> u64| reports().map(f).sum::<u64>();
        let mut unquantized: Vec<String> = reports().flat_map(|r| r.unquantized.clone()).collect();
        unquantized.sort();
        unquantized.dedup();
        let measured = !converted.is_empty() && converted.iter().all(|c| c.measured);
        let numerics = measured.then(|| {
            let mut total = Numerics::default();
            reports().for_each(|r| total.merge(&r.numerics_total));
            total
        });
        let last = converted.last().map(|c| &c.report);
        let mut warnings = said.first;
        warnings.extend(converted.iter().flat_map(|c| c.warnings.iter().cloned()));
        let absolute = || (place::absolute(&said.src), place::absolute(&said.dst));
        let finalize = (!said.complete).then(absolute);
        FolderReport {
            src: said.src,
            dst: said.dst,
            to: said.to,
            tensors_converted: sum(|r| r.tensors_converted),
            tensors_copied: sum(|r| r.tensors_copied),
            bytes_in: bytes(|r| r.bytes_in),
            bytes_out: bytes(|r| r.bytes_out),
            seconds: said.started.elapsed().as_secs_f64(),
            threads: last.map(|r| r.threads),
            isa: last.map(|r| r.isa),
            warnings,
            tensors_kept: sum(|r| r.tensors_kept),
            bytes_kept: bytes(|r| r.bytes_kept),
            kept: in_file(converted, |r| &r.kept),
            on_overflow: said.on_overflow,
            numerics,
            folder: true,
            files,
            shard: said.shard.map(|(i, n)| vec![i, n]),
            complete: said.complete,
            finalize,
            max_shard_size: said.max_shard_size,
            tensors_quantized: sum(|r| r.tensors_quantized),
            quantized: in_file(converted, |r| &r.quantized),
            unquantized,
            dequantized: in_file(converted, |r| &r.dequantized),
            tensors_dropped: sum(|r| r.tensors_dropped),
        }
    }
}

/// Each of `items` of each report of `converted`, naming the unit's file.
fn in_file<T: Clone>(
    converted: &[Converted],
    items: impl Fn(&Report) -> &Vec<T>,
) -> Vec<InFile<T>> {
    let named = converted.iter().flat_map(|c| {
        let file = c.rel.to_string_lossy().into_owned();
        let items = items(&c.report).iter().cloned();
        items.map(move |item| InFile {
            file: file.clone(),
            item,
        })
    });
    named.collect()
}

/// The stages of the publish phase, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Begin,
    Copies(usize),
    /// Every file written is still the one written; the indexes agree with the shards.
    Check,
    LateCopies(usize),
    Configs(usize),
    Indexes(usize),
    /// The final re-check, withdrawing the cues on failure.
    Recheck,
    Done,
}

/// The most small copies sealed and claimed together.
const BATCH: usize = 64;

/// How many small copies to seal together: each holds a file open until it is published,
/// so at most half the descriptors this process may still open (`RLIMIT_NOFILE`, less those
/// open now), and `BATCH`; one at least.
fn batch_size() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    let known = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    let free = if known {
        limit.rlim_cur.saturating_sub(open)
    } else {
        BATCH as u64
    };
    (free / 2).clamp(1, BATCH as u64) as usize
}

/// A file being written, a step at a time.
enum Out {
    /// A copy of this source file, to start.
    Start(PathBuf),
    Copying(output::Copy),
    /// Copied to its end: to seal and claim.
    Copied(output::Copy),
    /// This text, to seal and claim.
    Text(Vec<u8>),
    /// Sealed and claimed: to publish and record.
    Sealed(output::TempOutput),
}

struct Writing {
    row: FileRow,
    out: Out,
    /// Its planned size, when its progress is told (the copies).
    metered: Option<u64>,
}

/// The publish phase of a folder run, stepped (`step`): the failpoint `folder-publish`, the
/// run's folders, the copies (each in bounded steps, its progress told), the re-check, the
/// indexes checked against the shards written, the late copies (`model_index.json`), the
/// configs (the engine's text, or copied), the indexes, then the final re-check, which
/// withdraws the loader's cues this run published (indexes, configs, late copies) if a file
/// this run wrote changed. `rows` are the files' lines.
pub struct Publish {
    stage: Stage,
    copies: Vec<File>,
    late_copies: Vec<File>,
    configs: Vec<File>,
    dirs: Vec<OsString>,
    indexes: Vec<CheckedIndex>,
    writing: Option<Writing>,
    /// Small copies sealed and claimed together (`seal_batch`), published one a step.
    sealed: VecDeque<Writing>,
    pub rows: Vec<FileRow>,
    /// The copies' bytes, done and in all (the phase's progress).
    done: u64,
    total: u64,
    /// The copy told last: (rel, done, total).
    file: Option<(OsString, u64, u64)>,
}

impl Publish {
    /// The publish phase of `work`'s plan.
    pub fn new(work: &Work) -> Publish {
        let p = &work.plan;
        Publish {
            stage: Stage::Begin,
            copies: p.copies.clone(),
            late_copies: p.late_copies.clone(),
            configs: p.configs.iter().map(|(f, _)| f.clone()).collect(),
            dirs: p.dirs.clone(),
            indexes: Vec::new(),
            writing: None,
            sealed: VecDeque::new(),
            rows: Vec::new(),
            done: 0,
            total: p.copies.iter().map(|f| f.size).sum(),
            file: None,
        }
    }

    /// The copies' bytes done (as far as told) and in all.
    pub fn progress(&self) -> (u64, u64) {
        let current = match (&self.writing, &self.file) {
            (
                Some(Writing {
                    metered: Some(_), ..
                }),
                Some((_, done, _)),
            ) => *done,
            _ => 0,
        };
        ((self.done + current).min(self.total), self.total)
    }

    /// The copy in progress, or the last one: (rel, bytes done, bytes in all).
    pub fn file(&self) -> Option<(&OsStr, u64, u64)> {
        let (rel, done, total) = self.file.as_ref()?;
        Some((rel, *done, *total))
    }

    /// Do the next step into `w`'s destination, a copy at most `budget` bytes of it. Returns
    /// true when the phase is done.
    pub fn step(&mut self, work: &Work, w: &mut Writer, budget: u64) -> Result<bool> {
        if let Some(writing) = self.writing.take() {
            // (As the run sees a failure: another run may have got there first.)
            return self
                .write(writing, w, budget)
                .map_err(|e| w.rival(e))
                .map(|_| false);
        }
        if let Some(writing) = self.sealed.pop_front() {
            // A copy of a batch is told as it starts (none of its bytes), then published.
            let row = &writing.row;
            self.file = Some((row.path.clone(), 0, row.bytes_in));
            self.writing = Some(writing);
            return Ok(false);
        }
        let file = |f: &File, kind, metered: bool| Writing {
            row: FileRow::new(&f.rel, kind, "copied", (f.size, f.size)),
            out: Out::Start(f.path.clone()),
            metered: metered.then_some(f.size),
        };
        let next = match self.stage {
            Stage::Begin => {
                failpoint("folder-publish")?;
                w.record.check_still_ours()?;
                w.folders(&self.dirs)?;
                Stage::Copies(0)
            }
            Stage::Copies(i) => match self.copies.get(i) {
                Some(f) if f.size < budget => {
                    let n = self.seal_batch(i, w, budget).map_err(|e| w.rival(e))?;
                    Stage::Copies(i + n)
                }
                Some(f) => {
                    self.file = Some((f.rel.clone(), 0, f.size));
                    self.writing = Some(file(f, "copy", true));
                    Stage::Copies(i + 1)
                }
                None => Stage::Check,
            },
            Stage::Check => {
                // Before a loader's cues appear: every file written is still the one written,
                // and the indexes agree with the shards as written (what a loader will find).
                w.recheck(&[])?;
                w.record.check_still_ours()?;
                self.indexes = work.checked_indexes(w.dst())?;
                Stage::LateCopies(0)
            }
            Stage::LateCopies(i) => match self.late_copies.get(i) {
                Some(f) => {
                    self.writing = Some(file(f, "copy", false));
                    Stage::LateCopies(i + 1)
                }
                None => Stage::Configs(0),
            },
            Stage::Configs(i) => match self.configs.get(i) {
                // (An FP8 target's quantization_config lists what the shards written hold
                // unquantized.)
                Some(f) => {
                    self.writing = Some(match work.config_text(w.dst(), &f.rel)? {
                        None => file(f, "config", false),
                        Some(text) => Writing {
                            row: FileRow::new(&f.rel, "config", "rewritten", (f.size, len(&text))),
                            out: Out::Text(text.into_bytes()),
                            metered: None,
                        },
                    });
                    Stage::Configs(i + 1)
                }
                None => Stage::Indexes(0),
            },
            Stage::Indexes(i) => match self.indexes.get(i) {
                Some((rel, text, size, source)) => {
                    let action = if size.is_some() {
                        "rewritten"
                    } else {
                        "written"
                    };
                    let bytes = (size.unwrap_or(0), len(text));
                    let mut row = FileRow::new(rel, "index", action, bytes);
                    row.source = source.clone();
                    let out = Out::Text(text.clone().into_bytes());
                    self.writing = Some(Writing {
                        row,
                        out,
                        metered: None,
                    });
                    Stage::Indexes(i + 1)
                }
                None => Stage::Recheck,
            },
            Stage::Recheck => {
                let indexes = work.index_maps().into_iter().map(|(rel, _, _)| rel);
                let configs = self.configs.iter().map(|f| f.rel.as_os_str());
                let late = self.late_copies.iter().map(|f| f.rel.as_os_str());
                let cues: Vec<OsString> = indexes
                    .chain(configs)
                    .chain(late)
                    .map(OsStr::to_os_string)
                    .collect();
                w.recheck(&cues)?;
                Stage::Done
            }
            Stage::Done => return Ok(true),
        };
        self.stage = next;
        Ok(false)
    }

    /// The small copies from the `i`th on (each smaller than `budget`, at most `budget` bytes
    /// and `BATCH` files in all), each copied whole and sealed, then claimed with one save of
    /// the manifest, to publish one by one: a manifest saved per file made a folder of many
    /// small files quadratic (3,000 took 17 s). Returns how many.
    fn seal_batch(&mut self, i: usize, w: &mut Writer, budget: u64) -> Result<usize> {
        let (mut bytes, mut batch) = (0u64, Vec::new());
        for f in self.copies[i..].iter().take(batch_size()) {
            bytes += f.size;
            if bytes > budget && !batch.is_empty() {
                break;
            }
            let mut copy = w.start_copy(&f.rel, &f.path)?;
            while !copy.step(budget)? {}
            let row = FileRow::new(&f.rel, "copy", "copied", (f.size, f.size));
            batch.push((row, copy.seal()?));
        }
        w.claim_all(batch.iter().map(|(row, out)| (&*row.path, out)))?;
        let n = batch.len();
        self.sealed
            .extend(batch.into_iter().map(|(row, out)| Writing {
                metered: Some(row.bytes_in),
                row,
                out: Out::Sealed(out),
            }));
        Ok(n)
    }

    /// A step of the file being written: start, copy, seal and claim, publish and record.
    fn write(&mut self, mut writing: Writing, w: &mut Writer, budget: u64) -> Result<()> {
        let rel = writing.row.path.clone();
        writing.out = match writing.out {
            Out::Start(src) => {
                let copy = w.start_copy(&rel, &src)?;
                if writing.metered.is_some() {
                    self.file = Some((rel.clone(), 0, copy.progress().1));
                }
                Out::Copying(copy)
            }
            Out::Copying(mut copy) => {
                let finished = copy.step(budget)?;
                if writing.metered.is_some() {
                    let (done, total) = copy.progress();
                    self.file = Some((rel.clone(), done, total));
                }
                match finished {
                    true => Out::Copied(copy),
                    false => Out::Copying(copy),
                }
            }
            Out::Copied(copy) => {
                let out = copy.seal()?;
                w.claim(&rel, &out)?;
                Out::Sealed(out)
            }
            Out::Text(text) => {
                let out = w.seal_text(&rel, &text)?;
                w.claim(&rel, &out)?;
                Out::Sealed(out)
            }
            Out::Sealed(out) => {
                // (A batch's claims were saved together: another run may have taken the
                // folder over since.)
                w.record.check_still_there()?;
                let done = out.publish()?;
                w.published(&rel, writing.row.kind, Some(done.into()), None)?;
                if let Some(size) = writing.metered {
                    self.file = Some((rel, size, size));
                    self.done += size;
                }
                self.rows.push(writing.row);
                return Ok(());
            }
        };
        self.writing = Some(writing);
        Ok(())
    }
}

fn len(text: &str) -> u64 {
    text.len() as u64
}

/// The options a manifest records, as the engine's settings: the target, the options that
/// change the output and how the source is read, and `name`.
fn recorded(options: &Node<'_>) -> Settings {
    let mut s = Settings::default();
    let text = |v: &Node<'_>| match &v.value {
        Value::Str(Str::Text(t)) => Some(t.to_string()),
        _ => None,
    };
    let texts = |v: &Node<'_>| match &v.value {
        Value::Array(items) => items.iter().filter_map(text).collect(),
        _ => Vec::new(),
    };
    let given = |v: &Node<'_>| match &v.value {
        Value::Number(n) => Given {
            text: None,
            whole: n.parse().ok(),
            repr: n.to_string(),
        },
        _ => Given {
            text: text(v),
            whole: None,
            repr: text(v).map_or_else(String::new, |t| format!("'{t}'")),
        },
    };
    let flag = |v: &Node<'_>| matches!(v.value, Value::Literal("true"));
    for (k, v) in options.dict().unwrap_or_default() {
        let Str::Text(k) = k else { continue };
        match k.as_ref() {
            "to" => s.to = Some(given(v)),
            "keep" => s.keep = texts(v),
            "keep_min_size" => s.keep_min_size = Some(given(v)),
            "from_bf16" => s.from_bf16 = flag(v),
            "on_overflow" => s.on_overflow = Some(given(v)),
            "include" => s.include = texts(v),
            "exclude" => s.exclude = texts(v),
            "no_record" => s.no_record = flag(v),
            "key" => s.key = text(v),
            "strip_prefix" => s.strip_prefix = texts(v),
            "name" => s.name = text(v),
            _ => {}
        }
    }
    s
}

/// The stages of a `FinalizeTask`.
enum Finalizing {
    /// The plan of the source, as the shard runs planned it.
    Plan(Box<WorkTask>),
    /// Each unit's output as a shard run wrote it, one a step.
    Units(usize),
    Publish,
    Done,
}

/// `finalize`: complete the folder DST once a shard run (`--shard i/N`) ran for every i.
/// Every unit must be there as a finished shard run's manifest records it, with the options
/// they all agree on; then the other files are copied and the configs and indexes written
/// (last), as a whole run writes them, and the manifests go.
pub struct FinalizeTask {
    src: PathBuf,
    dst: PathBuf,
    src_id: place::Ident,
    started: Instant,
    to: Target,
    finished: manifest::Finished,
    stage: Finalizing,
    work: Option<Work>,
    writer: Option<Writer>,
    /// Each unit's shard run, when the manifests agree on one count: (owners, count).
    owner: Option<(Vec<usize>, usize)>,
    rows: Vec<FileRow>,
    publish: Option<Publish>,
    /// Warnings not taken yet (`take_warnings`): the stale temps removed.
    notes: Vec<Warning>,
}

impl FinalizeTask {
    /// The finalize of `dst`, converted from `src` by shard runs: refused when a run has not
    /// finished, or the manifests disagree (`manifest::finished`).
    pub fn new(src: &Path, dst: &Path) -> Result<FinalizeTask> {
        let started = Instant::now();
        // A folder, or a file (or a checkpoint folder) re-sharded with shard runs.
        let place = place::place(src, Some(dst), Target::Bf16, true, true)?;
        // Every manifest of this source, finished (a run that has not may still write:
        // completing the folder now would race it), and the options they agree on.
        let finished = manifest::finished(dst, place.id)?;
        let recorded = recorded(&finished.options);
        let to = recorded.to.clone().unwrap_or_default().target()?;
        let max_size = finished.options.get("max_shard_size");
        let max_size = max_size.and_then(|n| match &n.value {
            Value::Number(n) => n.parse::<u64>().ok(),
            _ => None,
        });
        let src = place.src;
        let task = match max_size {
            None => {
                // Quantized checkpoints were refused (or allowed) by the shard runs that
                // converted them. What the shard runs copy: their overrides of the folder's
                // companion policy; the indexes name the tensors as the shard runs did, and
                // record their options.
                let companions = Settings {
                    to: recorded.to.clone(),
                    include: recorded.include.clone(),
                    exclude: recorded.exclude.clone(),
                    strip_prefix: recorded.strip_prefix.clone(),
                    ..Settings::default()
                };
                WorkTask::new(&src, &companions, false, false, None, Some(recorded))?
            }
            Some(max_size) => {
                // The shards' cut depends on every option that changes a tensor's size; the
                // shard runs read the source with the same key and prefixes, and judged a
                // checkpoint folder's links.
                let single = place::source(&src, true)? != SourceKind::Tree;
                let cut = Cut {
                    max_size,
                    follow_links: true,
                    ..Cut::default()
                };
                WorkTask::new(&src, &recorded, false, single, Some(cut), None)?
            }
        };
        Ok(FinalizeTask {
            src,
            dst: dst.to_path_buf(),
            src_id: place.id,
            started,
            to,
            finished,
            stage: Finalizing::Plan(Box::new(task)),
            work: None,
            writer: None,
            owner: None,
            rows: Vec::new(),
            publish: None,
            notes: Vec::new(),
        })
    }

    /// Once planned: every file it copies opens, the shard runs' counts checked, what DST
    /// holds surveyed (an interrupted finalize's manifest is the one to replace), this run's
    /// manifest made.
    fn begin(&mut self, work: Work) -> Result<()> {
        work.copies_open()?;
        let f = &self.finished;
        let units = work.units.len();
        let mut counts: Vec<usize> = Vec::new();
        for m in &f.manifests {
            let Some((_, n)) = m.shard else { continue };
            let n = n as usize;
            // A run splits at most into as many shards as there are units.
            if n > units {
                return Err(Error::ShardCount {
                    path: m.path(),
                    says: n,
                    src: self.src.clone(),
                    units,
                    noun: work.noun(),
                });
            }
            if !counts.contains(&n) {
                counts.push(n);
            }
        }
        // With one shard count in the manifests, a missing file can be traced to its shard.
        if let [count] = counts[..] {
            self.owner = (count > 0).then(|| (work.assign_shards(count), count));
        }
        let outputs = work.outputs();
        let mut planned: Vec<OsString> = outputs.iter().map(|(rel, _, _)| rel.clone()).collect();
        planned.sort_by_cached_key(|rel| manifest::name_str(rel));
        let q = survey::Question {
            asked: manifest::Asked {
                src_id: self.src_id,
                shard: None,
                options: &f.options,
                force: false,
                resume: true,
            },
            outputs: (outputs.into_iter())
                .map(|(rel, kind, size)| Planned { rel, kind, size })
                .collect(),
            room: None,
        };
        let mut judge = Judged {
            work: &work,
            dst: &self.dst,
            options: &f.options,
        };
        let a = survey::survey(&self.dst, &q, &mut judge)?;
        let s = a.manifests;
        let options = f.options.clone();
        let mut m = Manifest::new(
            &self.src,
            self.src_id,
            &self.dst,
            options,
            None,
            None,
            planned,
        );
        (m.published, m.finalize) = (s.own.and_then(|m| m.published), true);
        self.writer = Some(Writer::new(m, s.ours, Vec::new(), false));
        self.work = Some(work);
        Ok(())
    }

    /// Unit `i`'s output, as a shard run wrote it: recorded as checked, else refused.
    fn check_unit(&mut self, i: usize) -> Result<()> {
        let (Some(work), Some(w)) = (&self.work, &mut self.writer) else {
            return Ok(());
        };
        let u = &work.units[i];
        let out = self.dst.join(&u.rel);
        let entries = self.finished.entries.iter().find(|(rel, _)| *rel == u.rel);
        let entries = entries.map_or(&[][..], |(_, e)| e.as_slice());
        if work
            .find_entry(i, entries, &self.finished.options, &out)?
            .is_none()
        {
            // A whole file named by its input, an output shard by itself.
            let path = match u.whole {
                true => work.plan.weights[u.inputs[0]].path.clone(),
                false => out,
            };
            let shard = (self.owner.as_ref()).map(|(owner, count)| (owner[i], *count));
            let written = !u.whole;
            return Err(Error::UnitMissing {
                path,
                written,
                shard,
            });
        }
        let id = w.record.identity(&u.rel)?;
        w.record.record(&u.rel, "weights", id, None);
        self.rows.push(FileRow::unit(work, i, "checked", id.2));
        Ok(())
    }

    /// The report, once every step is done.
    pub fn finish(mut self) -> FolderReport {
        let max_shard_size = self.work.as_ref().and_then(|w| w.max_size);
        let said = Said {
            src: self.src,
            dst: self.dst,
            to: self.to,
            started: self.started,
            shard: None,
            complete: true,
            on_overflow: OnOverflow::Warn,
            max_shard_size,
            first: Vec::new(),
        };
        let mut files = std::mem::take(&mut self.rows);
        files.extend(self.publish.map(|p| p.rows).unwrap_or_default());
        FolderReport::new(said, files, &[])
    }
}

impl Task for FinalizeTask {
    fn step(&mut self, budget: u64) -> Result<bool> {
        match &mut self.stage {
            Finalizing::Plan(task) => {
                if task.step(budget)? {
                    let Finalizing::Plan(task) =
                        std::mem::replace(&mut self.stage, Finalizing::Units(0))
                    else {
                        unreachable!()
                    };
                    self.begin(task.finish()?)?;
                }
            }
            Finalizing::Units(i) => {
                let i = *i;
                let (Some(work), Some(w)) = (&self.work, &mut self.writer) else {
                    unreachable!("planned before")
                };
                if i < work.units.len() {
                    self.check_unit(i)?;
                    self.stage = Finalizing::Units(i + 1);
                    return Ok(false);
                }
                // Every check passed: the first write.
                let planned = w.record.planned.clone();
                self.notes.extend(w.remove_stale_temps(&planned));
                w.record.save()?;
                let maps: Vec<(OsString, WeightMap)> = (work.index_maps().into_iter())
                    .map(|(rel, _, map)| (rel.to_os_string(), map.iter().cloned().collect()))
                    .collect();
                w.unpublish(&maps, &HashSet::new(), &[])?;
                self.publish = Some(Publish::new(work));
                self.stage = Finalizing::Publish;
            }
            Finalizing::Publish => {
                let (Some(work), Some(w), Some(p)) =
                    (&self.work, &mut self.writer, &mut self.publish)
                else {
                    unreachable!("begun before")
                };
                if p.step(work, w, budget)? {
                    w.remove_own(&self.finished.manifests)?;
                    self.stage = Finalizing::Done;
                }
            }
            Finalizing::Done => return Ok(true),
        }
        Ok(false)
    }

    fn progress(&self) -> (u64, u64) {
        self.publish.as_ref().map_or((0, 0), Publish::progress)
    }

    fn take_warnings(&mut self) -> Vec<Warning> {
        std::mem::take(&mut self.notes)
    }

    fn file_progress(&self) -> Option<(&OsStr, u64, u64)> {
        self.publish.as_ref()?.file()
    }
}

#[cfg(test)]
mod tests;
