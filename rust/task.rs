//! Engine tasks: units of long work that a front end steps in bounded slices.
//!
//! Each task opens and checks everything when it is made (so every refusal comes before
//! any data is read or written), then does its work `step` by `step`, with one progress
//! count over all its phases and the warnings found so far. A front end only loops:
//! step, report progress and warnings, check for cancellation; then `finish`.

use std::path::{Path, PathBuf};
use std::time::Instant;

pub mod drive;

use crate::convert::{check_outputs, check_something_changes, Job, Options, Report};
use crate::dtype::Action;
use crate::error::{Error, Result, Warning};
use crate::input::Origin;
use crate::numerics::Numerics;
use crate::output::{Published, Sealed};
use crate::plan::Role;
use crate::plan::{self, Plan, PlanOptions};
use crate::report::{Shown, Span};
use crate::scan::{self, Scan, ScanKind, Scanned};
use crate::source::Source;
use crate::verify::Verifier;
use crate::vocab::{Fp8Skip, InputFormat, OnOverflow, ReasonCode, Target};
use safetensors::tensor::Dtype;

/// Long work, done in steps.
pub trait Task {
    /// Do about `budget` bytes of work (whole windows). Returns true when all is done.
    fn step(&mut self, budget: u64) -> Result<bool>;
    /// Bytes done and in all, over every phase.
    fn progress(&self) -> (u64, u64);
    /// Warnings found since the last call (none: a task that finds none, or a folder run's
    /// parts, whose warnings name their paths: `take_said`).
    fn take_warnings(&mut self) -> Vec<Warning> {
        Vec::new()
    }
    /// The file in progress (a folder run's copy), or the last one: (rel, bytes done, bytes
    /// in all). None: the task tells no file's progress (yet).
    fn file_progress(&self) -> Option<(&std::ffi::OsStr, u64, u64)> {
        None
    }
    /// Whether its progress is told now (false: a part that tells none, a dry run's checks).
    fn measured(&self) -> bool {
        true
    }
    /// A folder run's warnings said since the last call, each with the path it names (its
    /// `take_warnings` says none).
    fn take_said(&mut self) -> Vec<Said> {
        Vec::new()
    }
    /// What a failure of the last step says, once the caller has told a stop request that
    /// came meanwhile instead (a folder run's conversion rolls back what it added).
    fn failed(&mut self, e: crate::error::Error) -> crate::error::Error {
        e
    }
}

/// A warning and the path it names (a folder run's: the file it is about).
pub type Said = (Warning, Option<std::ffi::OsString>);

/// Run `task` to its end in one go (for Rust callers and tests).
pub fn run<T: Task>(task: &mut T) -> Result<()> {
    while !task.step(u64::MAX)? {}
    Ok(())
}

/// A conversion: first a scan where the plan depends on the data (`OnOverflow::Keep`: the
/// tensors that would overflow; an FP8 target: the weights holding NaN or inf, which stay
/// BF16), then the conversion of that plan.
pub struct ConvertTask {
    phase: Phase,
    /// Bytes the scan read (0 without one), counted before the conversion's.
    scanned: u64,
    /// The conversion's bytes, known from the header from the start.
    data: u64,
    started: Instant,
}

enum Phase {
    Scan {
        scan: Box<Scan>,
        dst: PathBuf,
        opts: Box<Options>,
    },
    Convert(Box<Job>),
    /// Between phases, or after a failure.
    Empty,
}

/// Does a plan under `opts` need the data first: the tensors that would overflow (`Keep`),
/// or an FP8 target's weights that hold NaN or inf, when not known yet?
fn reads_first(opts: &Options) -> bool {
    opts.scans_for_overflow()
        || (opts.plan.target.strategy().is_some() && opts.plan.unquantized.is_none())
}

impl ConvertTask {
    /// Open `src`, check `dst` and plan; create the hidden output unless a scan comes first.
    pub fn new(src: &Path, dst: &Path, opts: &Options) -> Result<ConvertTask> {
        let started = Instant::now();
        let source = Source::open_any(src, &opts.input)?;
        Self::from_source(source, dst, opts, started)
    }

    /// `new` for a source opened already (another format, a composite of several files).
    pub fn from_source(
        source: Source,
        dst: &Path,
        opts: &Options,
        started: Instant,
    ) -> Result<ConvertTask> {
        let src = source.path.clone();
        let src = src.as_path();
        let data = source.header.data_len();
        // The record says the sizes fused experts were split by (verify splits as this).
        let opts = &Options {
            plan: opts.plan.for_source(&source),
            ..opts.clone()
        };
        if !reads_first(opts) {
            let job = Box::new(Job::new(source, dst, opts, started)?);
            return Ok(ConvertTask {
                phase: Phase::Convert(job),
                scanned: 0,
                data,
                started,
            });
        }
        // Refuse a bad destination, report path or plan before the long read.
        check_outputs(&source, dst, opts)?;
        let plan = plan::plan(src, &source.header, &opts.plan)?;
        let kind = if opts.scans_for_overflow() {
            ScanKind::MaxAbs
        } else {
            // Nothing to convert even with every weight quantized: refused before the read.
            check_something_changes(&source, &plan, opts.allow_copy)?;
            ScanKind::NonFinite
        };
        let scan = Scan::new(source, &plan, kind, opts)?;
        Ok(ConvertTask {
            scanned: scan.progress().1,
            phase: Phase::Scan {
                scan: Box::new(scan),
                dst: dst.to_path_buf(),
                opts: Box::new(opts.clone()),
            },
            data,
            started,
        })
    }

    fn job(&self) -> Option<&Job> {
        match &self.phase {
            Phase::Convert(job) => Some(job),
            _ => None,
        }
    }

    /// After the last step: make everything durable; only the names are missing then.
    pub fn seal(&mut self) -> Result<()> {
        match &mut self.phase {
            Phase::Convert(job) => job.seal(),
            _ => Err(Error::Cancelled),
        }
    }

    /// After `seal`: publish (the commit point).
    pub fn publish(self) -> Result<Report> {
        match self.phase {
            Phase::Convert(job) => job.publish(),
            _ => Err(Error::Cancelled),
        }
    }

    /// `seal` then `publish`.
    pub fn finish(mut self) -> Result<Report> {
        self.seal()?;
        self.publish()
    }
}

/// A conversion after `seal`, known by its output's identity.
impl Sealed for ConvertTask {
    fn identity(&self) -> Result<Published> {
        match self.job() {
            Some(job) => job.sealed(),
            None => Err(Error::Cancelled),
        }
    }
    fn header_sha256(&self) -> Option<String> {
        self.job().map(Job::header_sha256)
    }
}

impl Task for ConvertTask {
    fn step(&mut self, budget: u64) -> Result<bool> {
        match &mut self.phase {
            Phase::Scan { scan, .. } => {
                if !scan.step(budget)? {
                    return Ok(false);
                }
                let Phase::Scan { scan, dst, opts } =
                    std::mem::replace(&mut self.phase, Phase::Empty)
                else {
                    unreachable!()
                };
                let (source, found) = scan.finish();
                let mut opts = *opts;
                if opts.scans_for_overflow() {
                    let (target, on_overflow) = (opts.plan.target, opts.on_overflow);
                    if let Some(e) = scan::refusal(&source.path, target, on_overflow, &found) {
                        return Err(e);
                    }
                    opts.plan.keep_names.extend(scan::overflowing(&found));
                }
                if opts.plan.target.strategy().is_some() && opts.plan.unquantized.is_none() {
                    opts.plan.unquantized = Some(scan::nonfinite(&found));
                }
                let job = Job::new(source, &dst, &opts, self.started)?;
                self.phase = Phase::Convert(Box::new(job));
                Ok(false)
            }
            Phase::Convert(job) => job.step(budget),
            Phase::Empty => Ok(true),
        }
    }

    fn progress(&self) -> (u64, u64) {
        let total = self.scanned + self.data;
        match &self.phase {
            Phase::Scan { scan, .. } => (scan.progress().0, total),
            Phase::Convert(job) => (self.scanned + job.progress().0, total),
            Phase::Empty => (0, total),
        }
    }

    fn take_warnings(&mut self) -> Vec<Warning> {
        match &mut self.phase {
            Phase::Convert(job) => job.take_warnings(),
            _ => Vec::new(),
        }
    }
}

/// A dry run: the plan, and with a scan what the conversion would do to the values.
pub struct InspectTask {
    source: Option<Source>,
    plan: Plan,
    opts: PlanOptions,
    scan: Option<Scan>,
    /// The scan measures the tensors converted (`scan`, or overflow kept or refused), not
    /// only an FP8 target's weights.
    measured: bool,
    keep_overflowing: bool,
    /// `OnOverflow::Error`: an overflow the scan finds fails the dry run as it fails convert.
    refuse_overflow: bool,
    /// A dry run's destination: its free space is checked against the final plan too.
    dst: Option<PathBuf>,
}

/// What `InspectTask` found.
pub struct Inspection {
    pub source: Source,
    pub plan: Plan,
    /// The scanned tensors (file order), when scanned.
    pub scanned: Option<Vec<Scanned>>,
    /// The input's bytes on disk (`Source::file_bytes`), kept once it is closed.
    file_bytes: u64,
}

/// An `Inspection` as reports show it (serialized; its path the adapter adds): the input's
/// layout, each tensor in input order with its fate, and the output's totals.
#[derive(serde::Serialize)]
pub struct InspectRows<'a> {
    pub format: InputFormat,
    /// For a PyTorch checkpoint: the dict converted, its entries left out, the globals its
    /// pickle names and those outside the allow-list (empty for safetensors).
    pub key: Option<&'a str>,
    pub skipped: &'a [String],
    pub globals: &'a [String],
    pub unlisted: &'a [String],
    pub header_bytes: u64,
    pub data_bytes: u64,
    pub file_bytes: u64,
    #[serde(serialize_with = "crate::report::pairs_as_map")]
    pub metadata: Option<&'a [(String, String)]>,
    pub tensors: Vec<TensorRow<'a>>,
    pub output_bytes: u64,
    pub output_header_sha256: String,
    pub to: Target,
    pub warnings: &'a [Warning],
    pub tensors_converted: usize,
    pub tensors_copied: usize,
    pub tensors_kept: usize,
    pub bytes_kept: u64,
    pub keep_unmatched: &'a [String],
    pub scanned: bool,
    /// A quantized input: its weights dequantized, and the tensors only they used (scales,
    /// global scales, zero points, shapes, activation scales), dropped.
    pub tensors_dequantized: usize,
    pub tensors_dropped: usize,
}

/// One input tensor and what the conversion does with it.
#[derive(serde::Serialize)]
pub struct TensorRow<'a> {
    pub name: &'a str,
    pub dtype: Shown<'a, Dtype>,
    pub shape: &'a [usize],
    pub bytes: u64,
    pub data_offsets: Span,
    pub target_dtype: Shown<'a, Dtype>,
    pub target_bytes: u64,
    /// "convert" or "copy".
    pub action: &'static str,
    pub target_offsets: Span,
    pub reason: ReasonCode,
    pub pattern: Option<&'a str>,
    /// FP8 targets: why a float tensor that is converted to BF16 is not quantized.
    pub not_quantized: Option<Fp8Skip>,
    /// With a scan, for the tensors it measured.
    pub numerics: Option<&'a Numerics>,
    /// A dequantized weight: the format of its codes and what they become.
    pub quantization: Option<crate::quant::Format>,
    /// A dropped tensor: what it was for, and the (output) name of the weight it served.
    pub companion: Option<CompanionRow<'a>>,
    /// A piece of fused MoE experts split per expert: the fused tensor's name.
    pub split_from: Option<&'a str>,
}

/// What a tensor a dequantization drops was for (`TensorRow::companion`).
#[derive(serde::Serialize)]
pub struct CompanionRow<'a> {
    pub role: crate::vocab::Companion,
    pub weight: &'a str,
}

impl Inspection {
    /// Unmap and close its input files (what reports show of it stays): a folder's dry run
    /// keeps every file's inspection, and must not keep thousands of files open.
    pub fn close(&mut self) {
        self.source.files = Vec::new();
    }

    /// What reports show of it.
    pub fn rows(&self) -> InspectRows<'_> {
        let (src, plan) = (&self.source, &self.plan);
        let h = &src.header;
        // The plan is in output order; report tensors in input order with their fate.
        let mut fate = vec![None; h.tensors.len()];
        for t in plan.tensors.iter().filter(|t| t.role == Role::Tensor) {
            fate[t.source] = Some(t);
        }
        let deq: Vec<(usize, crate::quant::Deq)> = plan
            .tensors
            .iter()
            .filter_map(|t| match t.action {
                Action::Dequantize(d) => Some((t.source, d)),
                _ => None,
            })
            .collect();
        let roles = crate::quant::companions(&h.tensors, &deq, |k| {
            plan.reasons.get(k) == Some(&crate::plan::Reason::Dropped)
        });
        let out_names: std::collections::HashMap<usize, &str> = deq
            .iter()
            .map(|&(i, d)| (i, d.out_name(&h.tensors[i].name)))
            .collect();
        let mut measured: Vec<Option<&Numerics>> = vec![None; h.tensors.len()];
        for t in self.scanned.as_deref().unwrap_or_default() {
            measured[t.source] = t.numerics.as_ref();
        }
        let tensors = h
            .tensors
            .iter()
            .zip(fate)
            .zip(measured)
            .zip(&plan.reasons)
            .enumerate()
            .map(|(i, (((t, planned), numerics), reason))| {
                // An FP8 input's scales are not written (`Reason::Dropped`).
                let (dtype, action, (a, b)) = match planned {
                    None => (&t.dtype, "drop", (0, 0)),
                    Some(p) => (
                        &p.dtype,
                        match p.action {
                            Action::Copy => "copy",
                            Action::Convert(_) => "convert",
                            Action::Quantize(_) => "quantize",
                            Action::Dequantize(_) => "dequantize",
                        },
                        (p.start, p.end),
                    ),
                };
                TensorRow {
                    name: &t.name,
                    dtype: Shown(&t.dtype),
                    shape: &t.shape,
                    bytes: t.len(),
                    data_offsets: Span(t.start, t.end),
                    target_dtype: Shown(dtype),
                    target_bytes: b - a,
                    action,
                    target_offsets: Span(a, b),
                    reason: reason.code(),
                    pattern: reason.pattern(),
                    not_quantized: plan.fp8_skips.get(i).copied().flatten(),
                    numerics,
                    quantization: match planned.map(|p| p.action) {
                        Some(Action::Dequantize(d)) => Some(d.format()),
                        _ => None,
                    },
                    companion: roles[i].map(|(role, w)| CompanionRow {
                        role,
                        weight: out_names.get(&w).copied().unwrap_or_default(),
                    }),
                    split_from: src.pieces.get(&t.name).map(String::as_str),
                }
            })
            .collect();
        let origin = src.origin.as_ref();
        let list = |f: fn(&Origin) -> &[String]| origin.map_or(&[][..], f);
        InspectRows {
            format: InputFormat::of(src.format()),
            key: origin.map(|o| o.key.as_str()),
            skipped: list(|o| &o.skipped),
            globals: list(|o| &o.globals),
            unlisted: list(|o| &o.unlisted),
            header_bytes: h.header_len,
            data_bytes: h.data_len(),
            file_bytes: self.file_bytes,
            metadata: h.metadata.as_deref(),
            tensors,
            output_bytes: plan.file_len(),
            output_header_sha256: crate::text::sha256_hex(&plan.header),
            to: plan.target,
            warnings: &plan.warnings,
            tensors_converted: plan.converted(),
            tensors_copied: plan.inputs() - plan.converted(),
            tensors_kept: plan.kept(),
            bytes_kept: plan.kept_bytes(),
            keep_unmatched: &plan.keep_unmatched,
            scanned: self.scanned.is_some(),
            tensors_dequantized: deq.len(),
            tensors_dropped: plan.dropped(),
        }
    }
}

impl InspectTask {
    /// Plan `path`; with `scan` (implied by `OnOverflow::Keep`), read the tensors to convert.
    /// An FP8 target reads the weights it would quantize (unless `opts` says which hold NaN
    /// or inf): those that do stay BF16, as in the conversion, whose plan this then is.
    /// With `dst`, first make every check a conversion into `dst` with `opts` would make
    /// (the destination, the report path, nothing to convert, free space), failing as it
    /// would: a dry run that says "fits" is one that converts.
    pub fn new(path: &Path, scan: bool, opts: &Options, dst: Option<&Path>) -> Result<InspectTask> {
        let source = Source::open_any(path, &opts.input)?;
        let plan_opts = &opts.plan.for_source(&source);
        let on_overflow = opts.on_overflow;
        if let Some(dst) = dst {
            check_outputs(&source, dst, opts)?;
        }
        let mut plan = plan::plan(path, &source.header, plan_opts)?;
        plan.warnings.splice(0..0, source.warnings());
        if let Some(dst) = dst {
            if !opts.scans_for_overflow() {
                check_something_changes(&source, &plan, opts.allow_copy)?;
            }
            check_space(dst, &plan)?;
        }
        let keep_overflowing = opts.scans_for_overflow();
        // With a destination (or a scan asked for), refusing an overflow is one of
        // convert's checks.
        let refuse_overflow = on_overflow == OnOverflow::Error && (dst.is_some() || scan);
        // Keeping (or refusing) what would overflow needs the data: it implies the scan.
        let measure = scan || keep_overflowing || refuse_overflow;
        let (source, scan) = if measure || reads_first(opts) {
            let kind = if measure {
                ScanKind::Numerics
            } else {
                ScanKind::NonFinite
            };
            (None, Some(Scan::new(source, &plan, kind, opts)?))
        } else {
            (Some(source), None)
        };
        Ok(InspectTask {
            source,
            plan,
            opts: plan_opts.clone(),
            scan,
            measured: measure,
            keep_overflowing,
            refuse_overflow,
            dst: dst.map(Path::to_path_buf),
        })
    }

    /// The plan (and the scan's results), planned again with what the scan found (the
    /// tensors kept from overflow, the FP8 weights holding NaN or inf) if anything.
    pub fn finish(self) -> Result<Inspection> {
        let Some(scan) = self.scan else {
            let source = self
                .source
                .expect("an unscanned inspection keeps its source");
            return Ok(Inspection {
                file_bytes: source.file_bytes(),
                source,
                plan: self.plan,
                scanned: None,
            });
        };
        let (source, scanned) = scan.finish();
        // As the conversion refuses it (`Keep`: a dequantized weight's overflow).
        let refuse = match self.keep_overflowing {
            true => Some(OnOverflow::Keep),
            false => self.refuse_overflow.then_some(OnOverflow::Error),
        };
        if let Some(on_overflow) = refuse {
            if let Some(e) = scan::refusal(&source.path, self.plan.target, on_overflow, &scanned) {
                return Err(e);
            }
        }
        let mut opts = self.opts;
        let weights = opts.target.strategy().is_some() && opts.unquantized.is_none();
        let plan = if self.keep_overflowing || weights {
            if self.keep_overflowing {
                opts.keep_names = scan::overflowing(&scanned);
            }
            if weights {
                opts.unquantized = Some(scan::nonfinite(&scanned));
            }
            let mut plan = plan::plan(&source.path, &source.header, &opts)?;
            plan.warnings.splice(0..0, source.warnings());
            if let Some(dst) = &self.dst {
                check_space(dst, &plan)?; // NaN/inf weights in BF16 take more
            }
            plan
        } else {
            self.plan
        };
        Ok(Inspection {
            file_bytes: source.file_bytes(),
            source,
            plan,
            scanned: self.measured.then_some(scanned),
        })
    }
}

/// A dry run's free-space check: the file `plan` writes fits where `dst` would be made.
fn check_space(dst: &Path, plan: &Plan) -> Result<()> {
    // A folder to create is created inside the nearest one that exists.
    let dir = crate::output::nearest_dir(&crate::output::parent_dir(dst));
    let have = crate::output::free_space(&dir).map_err(|e| Error::io(&dir, "statvfs", e))?;
    if have < plan.file_len() {
        return Err(Error::NoSpace {
            dir,
            need: plan.file_len(),
            have,
            folder: false,
        });
    }
    Ok(())
}

impl Task for InspectTask {
    fn step(&mut self, budget: u64) -> Result<bool> {
        match &mut self.scan {
            Some(scan) => scan.step(budget),
            None => Ok(true),
        }
    }

    fn progress(&self) -> (u64, u64) {
        self.scan.as_ref().map_or((0, 0), Scan::progress)
    }
}

impl Task for Verifier {
    fn step(&mut self, budget: u64) -> Result<bool> {
        Verifier::step(self, budget)
    }

    fn progress(&self) -> (u64, u64) {
        Verifier::progress(self)
    }

    fn take_warnings(&mut self) -> Vec<Warning> {
        Verifier::take_warnings(self)
    }
}

impl Task for crate::output::Copy {
    fn step(&mut self, budget: u64) -> Result<bool> {
        crate::output::Copy::step(self, budget)
    }

    fn progress(&self) -> (u64, u64) {
        crate::output::Copy::progress(self)
    }
}

/// Convert `src` to `dst` in one call (for Rust callers and tests; Python steps the task).
pub fn convert(src: &Path, dst: &Path, opts: &Options) -> Result<Report> {
    let mut task = ConvertTask::new(src, dst, opts)?;
    run(&mut task)?;
    task.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Conversion;
    use crate::plan::Reason;
    use crate::vocab::{ErrorKind, Target, WarningKind};

    /// A file with tensors `ok` (small F32), `hot` (one F32 value overflows in f16) and
    /// `ids` (I64), in a fresh folder.
    fn overflow_file(tag: &str) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!("stcast-task-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let h = r#"{"ok":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"hot":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"ids":{"dtype":"I64","shape":[1],"data_offsets":[16,24]}}"#;
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(h.as_bytes());
        for x in [1.0f32, 2.0, 65520.0, 3.0] {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        bytes.extend_from_slice(&7i64.to_le_bytes());
        let src = dir.join("in.safetensors");
        std::fs::write(&src, bytes).unwrap();
        (dir, src)
    }

    fn opts(on_overflow: OnOverflow) -> Options {
        Options {
            on_overflow,
            threads: 1,
            ..Options::new(Target::F16)
        }
    }

    #[test]
    fn convert_keeps_or_refuses_what_would_overflow() {
        let (dir, src) = overflow_file("modes");
        // Keep: the scan finds `hot`, which keeps its F32 bytes.
        let dst = dir.join("keep.safetensors");
        let r = convert(&src, &dst, &opts(OnOverflow::Keep)).unwrap();
        assert_eq!(r.kept.len(), 1);
        assert_eq!(r.kept[0].name, "hot");
        assert_eq!(r.kept[0].reason, Reason::KeptToAvoidOverflow);
        assert_eq!(r.tensors_converted, 1);
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        // Error: nothing is published.
        let dst = dir.join("error.safetensors");
        let e = convert(&src, &dst, &opts(OnOverflow::Error)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Refused);
        assert!(e.to_string().contains("most in tensor `hot` (1)"), "{e}");
        assert!(!dst.exists());
        // Warn: published, with the warning.
        let dst = dir.join("warn.safetensors");
        let r = convert(&src, &dst, &opts(OnOverflow::Warn)).unwrap();
        assert_eq!(r.warnings[0].kind, WarningKind::Overflow);
        assert!(r.warnings[0]
            .text
            .starts_with("1 finite value in 1 tensor became ±inf in F16"));
        assert_eq!(
            r.numerics.iter().find(|n| n.0 == "hot").unwrap().1.overflow,
            1
        );
        // The max-abs scan and the numerics scan agree on what overflows.
        for kind in [ScanKind::MaxAbs, ScanKind::Numerics] {
            let source = Source::open(&src).unwrap();
            let o = opts(OnOverflow::Keep);
            let plan = plan::plan(&src, &source.header, &o.plan).unwrap();
            let mut scan = Scan::new(source, &plan, kind, &o).unwrap();
            while !scan.step(1).unwrap() {}
            let (_, found) = scan.finish();
            let names: Vec<_> = scan::overflowing(&found).into_iter().collect();
            assert_eq!(names, ["hot"], "{kind:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn one_progress_count_over_scan_and_conversion() {
        let (dir, src) = overflow_file("progress");
        let dst = dir.join("out.safetensors");
        let mut task = ConvertTask::new(&src, &dst, &opts(OnOverflow::Keep)).unwrap();
        // Scanned: the two F32 tensors (16 bytes); converted: all 24 data bytes.
        assert_eq!(task.progress(), (0, 16 + 24));
        let mut last = 0;
        while !task.step(1).unwrap() {
            let (done, total) = task.progress();
            assert!(done >= last && total == 40);
            last = done;
        }
        assert_eq!(task.progress(), (40, 40));
        task.finish().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn overflow_messages_name_the_worst_tensors() {
        use crate::numerics::Numerics;
        let n = |overflow| Numerics {
            overflow,
            ..Numerics::default()
        };
        let all: Vec<(String, Numerics)> = (0..8)
            .map(|i| (format!("t{i}"), n(if i == 0 { 0 } else { i })))
            .collect();
        let p = Path::new("m.safetensors");
        assert!(plan::overflow_outcome(p, Target::F16, &all[..1], |_| false).is_none());
        let (e, w) = plan::overflow_outcome(p, Target::F16, &all, |_| false).unwrap();
        assert!(
            w.text.starts_with(
                "28 finite values in 7 tensors became ±inf in F16: `t7` (7), `t6` (6)"
            ),
            "{w}"
        );
        assert!(w.text.contains("`t3` (3) and 2 more ("), "{w}");
        let e = e.to_string();
        assert!(e.starts_with("m.safetensors: 28 finite values in 7 tensors would become ±inf in F16, most in tensor `t7` (7); nothing was written"), "{e}");
        let (_, one) = plan::overflow_outcome(p, Target::Bf16, &all[..2], |_| false).unwrap();
        assert!(one
            .text
            .starts_with("1 finite value in 1 tensor became ±inf in BF16: `t1` (1) ("));
    }

    #[test]
    fn thresholds_are_the_kernels_overflow_points() {
        use crate::dtype::BF16_OVERFLOW;
        use crate::kernels::{bf16_from_f32, f16_from_f32};
        assert_eq!(f32::from_bits(0x7F7F_8000) as f64, BF16_OVERFLOW);
        for (u, c) in [
            (0x7F7F_8000u32, Conversion::F32ToBf16),
            (0x477F_F000, Conversion::F32ToF16),
        ] {
            let x = f64::from(f32::from_bits(u));
            let below = f64::from(f32::from_bits(u - 1));
            assert!(c.overflows(x) && !c.overflows(below));
            let out = match c {
                Conversion::F32ToBf16 => (bf16_from_f32(u), bf16_from_f32(u - 1)),
                _ => (f16_from_f32(u), f16_from_f32(u - 1)),
            };
            let inf = if c == Conversion::F32ToBf16 {
                0x7F80
            } else {
                0x7C00
            };
            assert_eq!(out.0, inf);
            assert_ne!(out.1, inf);
        }
    }
}

/// verify against what convert writes (here: the conversion is a task's).
#[cfg(test)]
mod verify_tests {
    use crate::convert::Options;
    use crate::task::convert;
    use crate::verify::*;
    use crate::vocab::Target;
    use crate::{Isa, Tuning};
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> TempDir {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("stcast-verify-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A file with an F32 tensor of `n` varied values (NaNs and ties included) and an I64.
    fn write_source(path: &Path, n: usize) {
        let mut data = Vec::with_capacity(n * 4 + 16);
        let mut x = 0x1234_5678u32;
        for i in 0..n {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let bits = match i % 7 {
                0 => 0x7F80_0001 | (x & 0x8000_0000),
                1 => (x & 0xFFFF_0000) | 0x8000,
                _ => x,
            };
            data.extend_from_slice(&bits.to_le_bytes());
        }
        data.extend_from_slice(&[7u8; 16]);
        let json = format!(
            r#"{{"__metadata__":{{"b":"1","a":"2"}},"w":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{}]}},"i":{{"dtype":"I64","shape":[2],"data_offsets":[{},{}]}}}}"#,
            n * 4,
            n * 4,
            n * 4 + 16
        );
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json.as_bytes());
        file.extend_from_slice(&data);
        std::fs::write(path, file).unwrap();
    }

    fn small_windows(loose: bool, threads: usize) -> VerifyOptions {
        VerifyOptions {
            loose,
            threads,
            tuning: Tuning {
                window: 64 << 10,
                ..Tuning::default()
            },
            ..VerifyOptions::default()
        }
    }

    #[test]
    fn accepts_conversions_to_both_targets() {
        let dir = TempDir::new();
        let (src, dst) = (dir.0.join("a.safetensors"), dir.0.join("b.safetensors"));
        write_source(&src, 300_000);
        for target in [Target::Bf16, Target::F16] {
            let _ = std::fs::remove_file(&dst);
            let opts = Options {
                tuning: Tuning {
                    isa: Some(Isa::Scalar),
                    ..Tuning::default()
                },
                ..Options::new(target)
            };
            convert(&src, &dst, &opts).unwrap();
            for threads in [1, 3] {
                let r = verify(&src, &dst, &small_windows(false, threads)).unwrap();
                assert_eq!(r.mismatch, None, "{target:?}");
                assert_eq!((r.tensors_converted, r.tensors_identical), (1, 1));
            }
        }
    }

    #[test]
    fn measures_what_convert_measured() {
        let dir = TempDir::new();
        let (src, dst) = (dir.0.join("a.safetensors"), dir.0.join("b.safetensors"));
        write_source(&src, 300_000);
        for target in [Target::Bf16, Target::F16] {
            let _ = std::fs::remove_file(&dst);
            let opts = Options {
                threads: 3,
                tuning: Tuning {
                    window: 64 << 10,
                    ..Tuning::default()
                },
                ..Options::new(target)
            };
            let converted = convert(&src, &dst, &opts).unwrap();
            assert_eq!(converted.numerics.len(), 1);
            let n = &converted.numerics[0].1;
            // Every 7th value is a NaN (and some random ones); fp16 overflows many others.
            assert_eq!(n.elements, 300_000);
            assert!(n.nan_in > 300_000_u64.div_ceil(7), "{n:?}");
            assert!(n.overflow > 0 && (n.overflow > 50_000) == (target == Target::F16));
            for threads in [1, 3] {
                let r = verify(&src, &dst, &small_windows(false, threads)).unwrap();
                assert_eq!(r.numerics, converted.numerics, "{target:?}");
                assert_eq!(r.numerics_total, converted.numerics_total);
                assert_eq!(r.to, Some(target));
            }
        }
    }

    #[test]
    fn finds_the_first_flipped_bit() {
        let dir = TempDir::new();
        let (src, dst) = (dir.0.join("a.safetensors"), dir.0.join("b.safetensors"));
        let n = 300_000;
        write_source(&src, n);
        convert(&src, &dst, &Options::default()).unwrap();
        let mut bytes = std::fs::read(&dst).unwrap();
        let data_start = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        // The I64 tensor comes first (wider), then `w`; flip two elements of `w`.
        for index in [n - 5, 200_001] {
            bytes[data_start + 16 + index * 2] ^= 1;
        }
        std::fs::write(&dst, &bytes).unwrap();
        for threads in [1, 4] {
            let r = verify(&src, &dst, &small_windows(false, threads)).unwrap();
            let m = r.mismatch.unwrap();
            assert_eq!(m.tensor.as_deref(), Some("w"));
            assert_eq!(m.index, Some(200_001));
            assert!(
                m.message
                    .starts_with("tensor `w` element 200001: source 0x"),
                "{}",
                m.message
            );
        }
    }

    #[test]
    fn loose_accepts_other_nans_only() {
        let dir = TempDir::new();
        let (src, dst) = (dir.0.join("a.safetensors"), dir.0.join("b.safetensors"));
        write_source(&src, 1000);
        convert(&src, &dst, &Options::default()).unwrap();
        let mut bytes = std::fs::read(&dst).unwrap();
        let at = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize + 16;
        // Element 0 is a NaN: 0x7FC0 or 0xFFC0 becomes 0xFFFF.
        bytes[at..at + 2].copy_from_slice(&[0xFF, 0xFF]);
        std::fs::write(&dst, &bytes).unwrap();
        assert!(verify(&src, &dst, &small_windows(false, 1))
            .unwrap()
            .mismatch
            .is_some());
        assert!(verify(&src, &dst, &small_windows(true, 1)).unwrap().is_ok());
        bytes[at..at + 2].copy_from_slice(&[0x80, 0x7F]);
        std::fs::write(&dst, &bytes).unwrap();
        let m = verify(&src, &dst, &small_windows(true, 1))
            .unwrap()
            .mismatch
            .unwrap();
        assert_eq!(
            (m.index, m.found_bits.as_deref()),
            (Some(0), Some("0x7F80"))
        );
    }
}
