//! Prove that one file is exactly the conversion of another, streaming both in bounded memory.
//!
//! The expected action for each tensor is inferred from the destination: same dtype means
//! identical bytes; a BF16 or F16 tensor whose source is a float must equal the conversion
//! recomputed window by window. So files made with any target (or with tensors kept) verify.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use memmap2::Advice;
use safetensors::tensor::Dtype;

use crate::convert::{is_copy, Tuning};
use crate::dtype::{elem_size, Action, Conversion};
use crate::error::{Error, Result};
use crate::fused;
use crate::header::PREFIX;
use crate::input::{unmatched_prefix, InputOptions, TORCH_METADATA};
use crate::kernels::Isa;
use crate::numerics::{DequantizedTensor, Numerics, Range};
use crate::output::{check_side_output, write_file, Replace, Territory};
use crate::plan::{self, PlanOptions, Role};
use crate::quant::{Deq, Packing, Quant};
use crate::record::{self, own_record, Record};
use crate::source::{InputFile, PendingRelease, Source};
use crate::text::esc;
use crate::vocab::{OnOverflow, Strategy, Taken, Target, Unmatched};
use crate::window::{worker_pool, Cursor, Window, Work};

/// Elements recomputed and compared at once: the recomputed block stays in L1.
const BLOCK: usize = 4096;

/// How strictly to compare.
#[derive(Clone, Debug)]
pub struct VerifyOptions {
    /// For files written by other tools: tensor order, metadata order, alignment, header
    /// layout and NaN encodings are not compared (a NaN only has to stay a NaN).
    pub loose: bool,
    /// Strict mode checks DST against what `convert` plans with these options: the target
    /// (None: the one DST's converted tensors have), and which tensors keep their dtype.
    /// Each option not given (None, empty, false) is the one DST's record says, when DST
    /// has its own (`record`; `Verifier::from_sources`).
    pub target: Option<Target>,
    pub keep: Vec<String>,
    pub keep_min_size: Option<u64>,
    pub from_bf16: bool,
    /// Under `Keep`, a float tensor DST keeps in its source dtype must be one whose
    /// conversion overflows (checked on the data). None: warn, or DST's record's.
    pub on_overflow: Option<OnOverflow>,
    /// Worker threads; 0 means one per available core.
    pub threads: usize,
    /// Measure the conversions as `convert` does (`VerifyReport::numerics`).
    pub numerics: bool,
    /// Once verified, write the numeric report there (`report::numeric_report`); `force`
    /// lets it replace an existing file.
    pub report: Option<PathBuf>,
    pub force: bool,
    /// The window size and kernels (the other knobs do not apply).
    pub tuning: Tuning,
    /// How to read SRC when it is a PyTorch checkpoint (DST is always safetensors).
    pub input: InputOptions,
    /// DST may convert no tensor of SRC (one file of a folder, a shard of a group): as
    /// `convert::Options::allow_copy`.
    pub allow_copy: bool,
    /// DST is a lone checkpoint's output (not a folder's file): the files beside it must
    /// not mislead a loader of it (`beside::check`).
    pub lone: bool,
}

impl VerifyOptions {
    /// These options, each one not given taken from `record` (DST's own record).
    fn recorded(&self, record: Option<&Record>) -> VerifyOptions {
        let mut o = self.clone();
        let Some(r) = record else {
            return o;
        };
        o.target = o.target.or(Some(r.target()));
        if o.keep.is_empty() {
            o.keep = r.keep.clone();
        }
        o.keep_min_size = o.keep_min_size.or(Some(r.keep_min_size));
        o.from_bf16 |= r.from_bf16;
        o.on_overflow = o.on_overflow.or(Some(r.on_overflow()));
        if o.input.key.is_none() {
            o.input.key = r.key.clone();
        }
        if o.input.strip_prefix.is_empty() {
            o.input.strip_prefix = r.strip_prefix.clone();
        }
        let experts = r.experts.map(crate::experts::Model::of_sizes);
        o.input = o.input.clone().with_experts(experts, &o.keep);
        o
    }

    fn overflow(&self) -> OnOverflow {
        self.on_overflow.unwrap_or(OnOverflow::Warn)
    }
}

/// How a folder verification pairs and reads SRC, and which files DST should hold:
/// `name` (a re-sharding's stem), `key`, `strip_prefix`, `include`, `exclude` and the
/// target `to` as given, each one not given the record's `r` (of a file of DST's output:
/// `record_at`). The target is the whole output's: a file of it that holds no quantized
/// weight does not tell an FP8 run from a bf16 one.
pub fn recorded_source(r: Record, given: RecordedSource) -> RecordedSource {
    let or = |given: Vec<String>, recorded: Vec<String>| match given.is_empty() {
        true => recorded,
        false => given,
    };
    (
        given.0.or(r.name),
        given.1.or(r.key),
        or(given.2, r.strip_prefix),
        or(given.3, r.include),
        or(given.4, r.exclude),
        given.5.or(Some(r.to)),
    )
}

/// The record of DST's output file `path` (a safetensors file or an index): None where it
/// has none, else the record, or its text and why it is none convert writes.
pub fn record_at(path: &Path) -> Result<Option<std::result::Result<Record, (String, String)>>> {
    let text = match is_index(path) {
        // A folder output's index: its metadata's record.
        true => {
            let text = crate::run::check::read_bounded(path)?;
            let text = String::from_utf8_lossy(&text).into_owned();
            crate::run::json::index_record(&text).ok().flatten()
        }
        false => {
            let meta = crate::source::read_header(path)?.2;
            record::find(meta.as_deref()).map(str::to_string)
        }
    };
    Ok(text.map(|t| Record::parse(&t).map_err(|why| (t, why))))
}

fn is_index(path: &Path) -> bool {
    path.to_string_lossy().ends_with(".index.json")
}

/// How verify says that DST's file `path` holds a record (`text`) that is none convert
/// writes (`why`), a lone file's or a folder's alike.
pub fn not_a_record(path: &Path, text: &str, why: &str) -> String {
    let entry = match is_index(path) {
        true => "metadata",
        false => "__metadata__",
    };
    format!(
        "{entry} entry {:?} is not a record convert writes ({}): {}",
        record::KEY,
        esc(why),
        esc(text)
    )
}

/// `name`, `key`, `strip_prefix`, `include`, `exclude`, `to` (`recorded_source`).
pub type RecordedSource = (
    Option<String>,
    Option<String>,
    Vec<String>,
    Vec<String>,
    Vec<String>,
    Option<String>,
);

/// SRC opened (`open`) as `recorded` says, the caller's `given` input options with the
/// `key` and `strip_prefix` of DST's record (DST: `dst`) where not given: a failure that
/// SRC read as `given` does not meet alike (the same error) is the record's, DST's content
/// (`Error::Recorded`, bad input naming DST), not SRC's nor the caller's options.
pub fn open_recorded<T>(
    dst: &Path,
    recorded: &InputOptions,
    given: &InputOptions,
    open: impl Fn(&InputOptions) -> Result<T>,
) -> Result<T> {
    match open(recorded) {
        // SRC read as given fails alike: SRC's own problem, not the record's.
        Err(e) if recorded != given => match open(given) {
            Err(own) if own.to_string() == e.to_string() => Err(e),
            _ => Err(Error::Recorded {
                path: dst.to_path_buf(),
                problem: Box::new(e),
            }),
        },
        found => found,
    }
}

/// The input options `given`, with the `key` and `strip_prefix` of the record in DST file
/// `dst`'s `__metadata__` where not given (`open_recorded`); `given` where DST cannot be
/// read (the verification says why).
pub fn recorded_input(dst: &Path, given: &InputOptions) -> InputOptions {
    let Ok((_, _, meta, _)) = crate::source::read_header(dst) else {
        return given.clone();
    };
    let own = own_record(None, meta.as_deref()).and_then(|r| r.ok());
    let mut input = given.clone();
    if let Some(r) = own {
        if input.key.is_none() {
            input.key = r.key;
        }
        if input.strip_prefix.is_empty() {
            input.strip_prefix = r.strip_prefix;
        }
    }
    input
}

/// The record convert wrote last in DST's `__metadata__`, after SRC's keys (`own_record`,
/// checked): None where DST's metadata is SRC's as it is (an output of `--no-record`, its
/// record SRC's own where it holds one).
fn written_record<'a>(
    src: Option<&[(String, String)]>,
    dst: Option<&'a [(String, String)]>,
) -> Option<&'a str> {
    own_record(src, dst)?.ok()?;
    let text = record::find(dst)?;
    let as_is = record::find(src) == Some(text) && src == dst;
    (!as_is).then_some(text)
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            loose: false,
            target: None,
            keep: Vec::new(),
            keep_min_size: None,
            from_bf16: false,
            on_overflow: None,
            threads: 0,
            numerics: true,
            report: None,
            force: false,
            tuning: Tuning::default(),
            input: InputOptions::default(),
            allow_copy: false,
            lone: false,
        }
    }
}

/// The first difference found.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Mismatch {
    /// One line saying what differs.
    pub message: String,
    pub tensor: Option<String>,
    /// Element index within the tensor (byte index for sub-byte dtypes), for data mismatches.
    pub index: Option<u64>,
    /// Source element bits as hex of the source width; its value for float dtypes.
    pub source_bits: Option<String>,
    pub source_value: Option<f64>,
    /// Expected and found output element bits, as hex.
    pub expected_bits: Option<String>,
    pub found_bits: Option<String>,
}

impl Mismatch {
    fn header(tensor: Option<&str>, message: String) -> Box<Mismatch> {
        Box::new(Mismatch {
            message,
            tensor: tensor.map(str::to_string),
            index: None,
            source_bits: None,
            source_value: None,
            expected_bits: None,
            found_bits: None,
        })
    }
}

/// The outcome of a verification (serialized without its paths and numerics, which the
/// adapter adds as Python holds them).
#[derive(Clone, Debug, serde::Serialize)]
pub struct VerifyReport {
    #[serde(skip)]
    pub src: PathBuf,
    #[serde(skip)]
    pub dst: PathBuf,
    pub loose: bool,
    pub tensors_converted: usize,
    pub tensors_identical: usize,
    /// Data bytes of both files compared before the first mismatch (all of them if none).
    pub bytes_compared: u64,
    pub seconds: f64,
    pub threads: usize,
    pub isa: Isa,
    pub mismatch: Option<Mismatch>,
    /// The target of the converted tensors when they all have the same one.
    pub to: Option<Target>,
    /// What rounding did to each converted tensor, in DST order, as `Report::numerics` of
    /// the conversion (empty without `VerifyOptions::numerics`; partial after a mismatch).
    #[serde(skip)]
    pub numerics: Vec<(String, Numerics)>,
    #[serde(skip)]
    pub numerics_total: Numerics,
    /// A quantized input: the values each dequantized weight came to, in DST order, as
    /// `Report::dequantized` of the conversion (what `--report` gives per weight).
    #[serde(skip)]
    pub dequantized: Vec<DequantizedTensor>,
    /// Verified, DST converts no tensor of SRC (`convert::is_copy`), and not to keep those
    /// that overflow: convert writes such a file only as one of a folder (`allow_copy`)
    /// whose other files it converts.
    pub copy: bool,
}

impl VerifyReport {
    pub fn is_ok(&self) -> bool {
        self.mismatch.is_none()
    }
}

/// What a destination tensor must hold.
#[derive(Clone, Copy, PartialEq)]
enum Expect {
    Identical,
    Convert(Conversion),
    /// The source's bytes, kept because converting them would overflow: the data must show
    /// a finite value that `Conversion` turns into infinity.
    KeptOverflow(Conversion),
    /// An FP8 target's weight: E4M3 bytes, and the scale that DST tensor `usize` holds, both
    /// recomputed group by group from the source.
    Quantize(Quant, usize),
    /// An FP8 input's weight: E4M3 times its scale (`Deq::scale`, in SRC), recomputed.
    Dequantize(Deq),
}

fn expectation(src: Dtype, dst: Dtype) -> Option<Expect> {
    if src == dst {
        return Some(Expect::Identical);
    }
    Conversion::between(src, dst).map(Expect::Convert)
}

impl Expect {
    /// Bytes per source and destination element (1 and 1 for sub-byte dtypes kept as
    /// they are).
    fn sizes(self, src: Dtype) -> (u64, u64) {
        match self {
            Expect::Identical | Expect::KeptOverflow(_) => (elem_size(src), elem_size(src)),
            Expect::Convert(c) => (c.src_size(), c.dst_size()),
            Expect::Quantize(q, _) => (q.size(), 1),
            Expect::Dequantize(d) => (1, d.out_size()),
        }
    }
}

/// One destination tensor and the source tensor it must come from.
#[derive(Clone, Copy)]
struct Pair {
    src: usize,
    dst: usize,
    expect: Expect,
    /// An FP8 target's weight left in BF16: its data must hold a NaN or an inf.
    nonfinite: bool,
}

/// A verification in progress: headers compared at `open`, data step by step.
pub struct Verifier {
    src: Source,
    dst: Source,
    /// Where views of the source that are not one run are gathered, a window at a time.
    gathered: Vec<u8>,
    /// Where an FP8 window is recomputed (quantized bytes and scales, or dequantized values):
    /// one buffer for the whole verification, not one per window.
    fp8_scratch: Vec<u8>,
    /// In destination order: the destination is read front to back.
    pairs: Vec<Pair>,
    pool: rayon::ThreadPool,
    threads: usize,
    isa: Isa,
    cursor: Cursor,
    report: VerifyReport,
    /// Where the numeric report goes once verified, and how to publish it.
    report_path: Option<(PathBuf, Replace)>,
    /// A lone output's verification: check the files beside it (`beside::check`), exactly
    /// unless loose.
    beside: Option<bool>,
    /// DST's record says convert wrote the model config beside it (`Record::config`).
    given_config: bool,
    /// The run's target as given, else as DST's record (or the config beside it) says: the
    /// configs beside DST are judged by it (`beside::check`), as a folder's are by the
    /// whole output's. An FP8 run whose weights stayed BF16 (NaN, empty, norms only)
    /// converted its tensors as a bf16 run does, yet wrote a quantization_config.
    target: Option<Target>,
    /// Strict mode: a converted tensor with values that became ±inf is a difference under
    /// `Keep` (convert would have kept it) and `Error` (convert would have refused).
    on_overflow: OnOverflow,
    started: Instant,
    /// Per pair, when measuring.
    numerics: Option<Vec<Numerics>>,
    /// What opening SRC found worth saying: a prefix given to strip that no name starts
    /// with (the record's were said by convert).
    warnings: Vec<crate::error::Warning>,
    /// Per pair kept to avoid overflow: the largest finite |x| seen so far.
    kept_max: Vec<f64>,
    /// Per pair dequantized: the values DST holds, as verified (`Range`).
    ranges: Vec<Range>,
    /// Per pair that must hold NaN or inf (`Pair::nonfinite`): has it so far.
    seen_nonfinite: Vec<bool>,
    /// Data bytes of both files to compare.
    total: u64,
    /// What each side has checked and read (small tensors batched, as convert does).
    src_reads: Reads,
    dst_reads: Reads,
}

/// Reads smaller than this fault their pages in themselves: one populate call per tensor
/// costs more than the faults of a 1 KiB tensor (300,000 of them spent a second in system
/// calls).
const POPULATE_MIN: usize = 64 << 10;

/// The reads of one side, batched across small tensors as convert batches them: its file
/// checked unchanged once per window of bytes (not per tensor), and the pages read dropped
/// in contiguous runs of about a window.
#[derive(Debug, Default)]
struct Reads {
    /// A file and the absolute range that its last check covers.
    checked: Option<(usize, u64, u64)>,
    /// Pages read and not yet released.
    pending: PendingRelease,
}

impl Reads {
    /// Check file `i` unchanged before reading `[a, a + n)`, unless a check made within the
    /// last window of bytes covers it.
    fn check(
        &mut self,
        files: &[InputFile],
        i: usize,
        (a, n): (u64, u64),
        window: u64,
    ) -> Result<()> {
        if let Some((f, from, to)) = self.checked {
            if f == i && a >= from && a + n <= to {
                return Ok(());
            }
        }
        files[i].check_unchanged()?;
        self.checked = Some((i, a, a + n.max(window)));
        Ok(())
    }

    /// `[a, b)` of file `i` is read: drop it now if it is large, else with its contiguous
    /// small neighbours once they make a window.
    fn release(&mut self, files: &[InputFile], i: usize, (a, b): (u64, u64), window: u64) {
        self.pending.add(files, i, (a, b), window);
        if b - a >= POPULATE_MIN as u64 {
            self.pending.flush(files);
        }
    }
}

/// Check that `dst` is exactly what stcast makes of `src`.
pub fn verify(src: &Path, dst: &Path, opts: &VerifyOptions) -> Result<VerifyReport> {
    let mut v = Verifier::open(src, dst, opts)?;
    while !v.step(u64::MAX)? {}
    v.finish()
}

fn s_input(src: &Source, pair: Pair) -> usize {
    src.header.tensors[pair.src].input
}

fn d_input(dst: &Source, pair: Pair) -> usize {
    dst.header.tensors[pair.dst].input
}

fn s_len(src: &Source, pair: Pair) -> u64 {
    src.header.tensors[pair.src].len()
}

/// The experts' sizes the model config a loader reads with the lone output `dst` gives
/// (`beside::model_config`), if any.
fn beside_experts(dst: &Path) -> Option<crate::experts::Model> {
    let config = crate::run::beside::model_config(dst)?;
    let text = crate::run::check::read_bounded(&config).ok()?;
    crate::experts::Model::of_config(&String::from_utf8_lossy(&text))
        .ok()
        .flatten()
}

impl Verifier {
    /// Open and validate both files and compare their headers.
    pub fn open(src_path: &Path, dst_path: &Path, opts: &VerifyOptions) -> Result<Verifier> {
        let started = Instant::now();
        let dst = match Source::open(dst_path) {
            Ok(dst) => dst,
            Err(e) => {
                // SRC's own problem first, as convert would say it.
                Source::open_any(src_path, &opts.input)?;
                return Err(match std::fs::symlink_metadata(dst_path) {
                    Err(missing) if missing.kind() == std::io::ErrorKind::NotFound => {
                        Error::io(dst_path, "DST does not exist", missing)
                    }
                    _ => e,
                });
            }
        };
        // SRC is read as DST's record says (`key`, `strip_prefix`) unless told otherwise.
        let own = own_record(None, dst.header.metadata.as_deref()).and_then(|r| r.ok());
        let recorded = opts.recorded(own.as_ref());
        let mut input = recorded.input;
        // An FP8 output of `--no-record` records no sizes its fused experts were split by:
        // the model config beside it (`--config` wrote it there) gives them, as convert
        // read them.
        let fp8 = match opts.target {
            Some(t) => t.strategy().is_some(),
            None => dst.header.tensors.iter().any(|t| t.dtype == Dtype::F8_E4M3),
        };
        if own.is_none() && opts.lone && fp8 && input.experts.is_none() {
            input = input.with_experts(beside_experts(dst_path), &recorded.keep);
        }
        let src = open_recorded(dst_path, &input, &opts.input, |i| {
            Source::open_any(src_path, i)
        })?;
        let warnings = match opts.input.strip_prefix.is_empty() {
            true => Vec::new(),
            false => src
                .unused_prefixes
                .iter()
                .map(|p| unmatched_prefix(p))
                .collect(),
        };
        // An output of `--no-record`: its target is the FP8 one the config beside it says
        // (`beside::configured`), as a folder's is its config's.
        let configured = opts.lone && own.is_none() && opts.target.is_none();
        let configured = configured
            .then(|| crate::run::beside::configured(dst_path))
            .flatten();
        let opts = &VerifyOptions {
            target: opts.target.or(configured),
            ..opts.clone()
        };
        let mut v = Self::from_sources(src, dst, opts, started)?;
        v.warnings = warnings;
        v.beside = opts.lone.then_some(!opts.loose);
        Ok(v)
    }

    /// `open` for sources opened already: a composite SRC (the tensors of one output shard,
    /// read from the input files that hold them) against the DST file.
    pub fn from_sources(
        src: Source,
        dst: Source,
        opts: &VerifyOptions,
        started: Instant,
    ) -> Result<Verifier> {
        let (src_path, dst_path) = (src.path.clone(), dst.path.clone());
        let (src_path, dst_path) = (src_path.as_path(), dst_path.as_path());
        let (sm, dm) = (
            src.header.metadata.as_deref(),
            dst.header.metadata.as_deref(),
        );
        let own = own_record(sm, dm).and_then(|r| r.ok());
        // DST holds SRC's metadata as it is, its record SRC's own: convert's output with
        // those options, or one of `--no-record` with the options given (any others).
        let given = (own.is_some() && written_record(sm, dm).is_none()).then(|| opts.clone());
        let mut opts = &opts.recorded(own.as_ref());
        if src.identities()?.contains(&dst.identity()?) {
            return Err(Error::SameFile {
                path: dst_path.to_path_buf(),
            });
        }
        let report_path = match &opts.report {
            None => None,
            Some(path) => {
                let mut taken = Territory::of_source(&src);
                taken.add_name(src_path, Taken::Input);
                taken.add_name(dst_path, Taken::Output);
                let replace =
                    check_side_output(path, crate::vocab::Side::Report, opts.force, &taken)?;
                Some((path.clone(), replace))
            }
        };
        let (pool, threads) = worker_pool(opts.threads, "stcast-verify", dst_path)?;
        let isa = opts.tuning.isa.unwrap_or_else(Isa::detect);
        let mut report = VerifyReport {
            src: src_path.to_path_buf(),
            dst: dst_path.to_path_buf(),
            loose: opts.loose,
            tensors_converted: 0,
            tensors_identical: 0,
            bytes_compared: 0,
            seconds: 0.0,
            threads,
            isa,
            mismatch: None,
            to: None,
            numerics: Vec::new(),
            numerics_total: Numerics::default(),
            dequantized: Vec::new(),
            copy: false,
        };
        let mut checked = check_headers(&src, &dst, opts)?;
        if let (Err(_), Some(given)) = (&checked, &given) {
            if let Ok(pairs) = check_headers(&src, &dst, given)? {
                (opts, checked) = (given, Ok(pairs));
            }
        }
        let mut pairs = match checked {
            Ok(pairs) => pairs,
            Err(m) => {
                report.mismatch = Some(*m);
                Vec::new()
            }
        };
        let mut targets = Vec::new();
        for p in &pairs {
            match p.expect {
                Expect::Identical | Expect::KeptOverflow(_) => report.tensors_identical += 1,
                Expect::Convert(_) => {
                    report.tensors_converted += 1;
                    targets.push(target_of(dst.header.tensors[p.dst].dtype));
                }
                Expect::Dequantize(q) => {
                    report.tensors_converted += 1;
                    targets.push(target_of(q.target));
                }
                Expect::Quantize(q, _) => {
                    report.tensors_converted += 1;
                    targets.push(Some(match q.strategy {
                        Strategy::Channel => Target::Fp8,
                        Strategy::Block => Target::Fp8Block,
                    }));
                }
            }
        }
        // Options under which convert writes nothing (DST's record says them, or a caller):
        // no output of convert is then a copy of SRC, but one file of a folder.
        if report.mismatch.is_none() && !opts.loose && is_copy(&src, report.tensors_converted) {
            report.copy = opts.overflow() != OnOverflow::Keep;
            if !opts.allow_copy {
                let target = opts.target.unwrap_or(Target::Bf16);
                let bf16 = |p: &Pair| src.header.tensors[p.src].dtype == Dtype::BF16;
                let e = Error::NothingToConvert {
                    path: src_path.to_path_buf(),
                    target,
                    bf16_copied: target == Target::F16 && !opts.from_bf16 && pairs.iter().any(bf16),
                };
                let why = format!(
                    "convert refuses these options: {} (a file of a folder output may convert \
                     nothing: verify the folders)",
                    e.message()
                );
                report.mismatch = Some(*Mismatch::header(None, why));
                pairs.clear();
            }
        }
        // Under an FP8 target the tensors not quantized become BF16: one target still, when
        // none is quantized too (as given or recorded: a folder's whole output's).
        let mut fp8 = targets.iter().copied().flatten().chain(opts.target);
        if let Some(fp8) = fp8.find(|t| t.strategy().is_some()) {
            for t in &mut targets {
                if *t == Some(Target::Bf16) {
                    *t = Some(fp8);
                }
            }
        }
        // One target for every converted tensor, and a known one: else none is claimed.
        if targets.iter().all(|t| Some(t) == targets.first()) {
            report.to = targets.first().copied().flatten();
        }
        // The overflow options are checked on the data: measuring is needed for them.
        let numerics = (opts.numerics || opts.overflow() != OnOverflow::Warn)
            .then(|| vec![Numerics::default(); pairs.len()]);
        let total: u64 = pairs.iter().map(|p| src.header.tensors[p.src].len()).sum();
        let dst_total: u64 = pairs.iter().map(|p| dst.header.tensors[p.dst].len()).sum();
        let given_config = written_record(sm, dm)
            .and_then(|t| Record::parse(t).ok())
            .is_some_and(|r| r.config);
        src.advise(Advice::Sequential);
        dst.advise(Advice::Sequential);
        Ok(Verifier {
            src,
            dst,
            gathered: Vec::new(),
            fp8_scratch: Vec::new(),
            pool,
            threads,
            isa,
            cursor: Cursor::new(opts.tuning.window, total),
            report,
            report_path,
            beside: None,
            given_config,
            target: opts.target,
            started,
            kept_max: vec![0.0; pairs.len()],
            ranges: vec![Range::default(); pairs.len()],
            seen_nonfinite: vec![false; pairs.len()],
            on_overflow: opts.overflow(),
            total: total + dst_total,
            numerics,
            pairs,
            warnings: Vec::new(),
            src_reads: Reads::default(),
            dst_reads: Reads::default(),
        })
    }

    /// Data bytes of both files compared, and in all: the total is `bytes_compared` of a
    /// verification that finds no difference.
    /// The warnings found since the last call (`Task::take_warnings`).
    pub fn take_warnings(&mut self) -> Vec<crate::error::Warning> {
        std::mem::take(&mut self.warnings)
    }

    pub fn progress(&self) -> (u64, u64) {
        (self.report.bytes_compared, self.total)
    }

    fn next_window(&mut self) -> Option<Window> {
        if self.report.mismatch.is_some() {
            return None;
        }
        let (pairs, src) = (&self.pairs, &self.src);
        let mut w = self
            .cursor
            .peek(pairs.len(), |i| src.header.tensors[pairs[i].src].len())?;
        // Whole groups, as convert reads them (`convert::Job::next_window`).
        let granule = match pairs[w.item].expect {
            Expect::Quantize(q, _) => Some(q.granule()),
            Expect::Dequantize(d) => Some(d.src_row()),
            _ => None,
        };
        if let Some(g) = granule {
            let left = src.header.tensors[pairs[w.item].src].len() - w.pos;
            if let Expect::Dequantize(d) = pairs[w.item].expect {
                // Its output (read, and recomputed beside it) is 2 to 8 times the codes: half
                // a window of it at a time, as convert writes it.
                let rows = self.cursor.window() / 2 / d.out_row().max(1);
                w.len = w.len.min(rows * d.src_row());
            }
            w.len = (w.len / g * g).max(g).min(left);
        }
        Some(w)
    }

    /// Compare about `budget` source bytes (whole windows). Returns true when all is done
    /// or a mismatch was found.
    pub fn step(&mut self, budget: u64) -> Result<bool> {
        let mut spent = 0u64;
        while spent < budget {
            let Some(w) = self.next_window() else {
                break;
            };
            let pair = self.pairs[w.item];
            let (s, d) = (
                &self.src.header.tensors[pair.src],
                &self.dst.header.tensors[pair.dst],
            );
            let (src_size, dst_size) = pair.expect.sizes(s.dtype);
            let out_len = |len: u64| match pair.expect {
                Expect::Dequantize(q) => q.out_len(len),
                _ => len / src_size * dst_size,
            };
            let (sfile, sa) = self.src.locate(s);
            let (dfile, da) = self.dst.locate(d);
            let (sa, da) = ((sa + w.pos) as usize, (da + out_len(w.pos)) as usize);
            let (sn, dn) = (w.len as usize, out_len(w.len) as usize);
            let (si, di) = (s_input(&self.src, pair), d_input(&self.dst, pair));
            let window = self.cursor.window();
            self.src_reads
                .check(&self.src.files, si, (sa as u64, sn as u64), window)?;
            self.dst_reads
                .check(&self.dst.files, di, (da as u64, dn as u64), window)?;
            // One call per window instead of a fault per page; failure only costs speed.
            if s.gather.is_none() && sn >= POPULATE_MIN {
                let _ = sfile.map.advise_range(Advice::PopulateRead, sa, sn);
            }
            if dn >= POPULATE_MIN {
                let _ = dfile.map.advise_range(Advice::PopulateRead, da, dn);
            }
            let work = Work {
                pool: &self.pool,
                threads: self.threads,
                isa: self.isa,
                populate: false,
            };
            let dst_bytes = &dfile.map[da..da + dn];
            let src_bytes = match pair.expect {
                // gpt-oss windows run in the output's order: read from the whole tensor.
                Expect::Dequantize(q) if matches!(q.packing, Packing::GptOss { .. }) => {
                    &sfile.map[sa - w.pos as usize..sa - w.pos as usize + s.len() as usize]
                }
                _ => self.src.read(s, w.pos, w.len, &mut self.gathered)?,
            };
            let (found, measured) = if let Expect::Quantize(q, k) = pair.expect {
                let scale = &self.dst.header.tensors[k];
                let (sf, at) = self.dst.locate(scale);
                let per = q.scales_per_granule() * q.size();
                let at = (at + w.pos / q.granule() * per) as usize;
                let n = (w.len.div_ceil(q.granule()) * per) as usize;
                let scales = &sf.map[at..at + n];
                let first = w.pos / q.granule();
                let (src, dst) = (src_bytes, dst_bytes);
                let scratch = &mut self.fp8_scratch;
                if let Some(m) =
                    quantized_difference(&work, &s.name, q, first, src, dst, scales, scratch)
                {
                    self.report.mismatch = Some(m);
                    return Ok(true);
                }
                (None, Numerics::default())
            } else if let Expect::Dequantize(q) = pair.expect {
                // Every byte of it is written below.
                self.fp8_scratch.resize(dn, 0);
                let want = &mut self.fp8_scratch[..dn];
                let row0 = w.pos / q.src_row();
                let (pool, input) = (&self.pool, &self.src);
                crate::convert::dequantize_window(
                    pool,
                    self.threads,
                    q,
                    input,
                    row0,
                    src_bytes,
                    want,
                );
                let size = q.out_size() as usize;
                let at = want
                    .chunks(size)
                    .zip(dst_bytes.chunks(size))
                    .position(|(a, b)| a != b);
                if let (Some(k), false) = (at, q.packing == Packing::Fp8) {
                    // Packed codes: the element of DST, with what it should hold.
                    let (exp, got) = (&want[k * size..][..size], &dst_bytes[k * size..][..size]);
                    let index = out_len(w.pos) / size as u64 + k as u64;
                    let name = d.name.clone();
                    self.report.mismatch = Some(Mismatch {
                        message: format!(
                            "tensor `{}` element {index}: its packed codes in SRC (`{}`) \
                             should give {}, found {}",
                            esc(&name),
                            esc(&s.name),
                            hex(exp),
                            hex(got)
                        ),
                        tensor: Some(name),
                        index: Some(index),
                        source_bits: None,
                        source_value: None,
                        expected_bits: Some(hex(exp)),
                        found_bits: Some(hex(got)),
                    });
                    return Ok(true);
                }
                if at.is_none() {
                    let bf16 = q.target == Dtype::BF16;
                    self.ranges[w.item].merge(&Range::of(bf16, dst_bytes));
                }
                // E4M3 is one byte an element: the element is the source offset.
                (at, Numerics::default())
            } else {
                first_difference(
                    &work,
                    pair.expect,
                    s.dtype,
                    d.dtype,
                    self.report.loose,
                    self.numerics.is_some(),
                    src_bytes,
                    dst_bytes,
                )
            };
            if let Expect::KeptOverflow(c) = pair.expect {
                let m = work.split_one(
                    src_bytes,
                    (c.src_size() as usize, 1024),
                    |s| crate::scan::max_finite_abs(c, s),
                    f64::max,
                );
                self.kept_max[w.item] = self.kept_max[w.item].max(m);
            }
            if let Some(all) = &mut self.numerics {
                all[w.item].merge(&measured);
            }
            if pair.nonfinite && !self.seen_nonfinite[w.item] {
                self.seen_nonfinite[w.item] = crate::fp8::has_nonfinite(s.dtype, src_bytes);
            }
            if let Some(offset) = found {
                let offset = offset as u64;
                let index = (w.pos + offset) / src_size;
                self.report.bytes_compared += offset + offset / src_size * dst_size;
                self.report.mismatch = Some(self.describe(pair, index));
                return Ok(true);
            }
            if let Expect::Dequantize(q) = pair.expect {
                if let Packing::GptOss { .. } = q.packing {
                    // Its windows read all an expert's rows, and its scales: dropped once
                    // the expert is done.
                    let s = &self.src.header.tensors[pair.src];
                    let expert = q.rows * (q.cols / 2);
                    let done = (w.pos + w.len) / expert.max(1);
                    let (file, at) = self.src.locate(s);
                    file.release((at, at + done * expert));
                    let sc = &self.src.header.tensors[q.scale];
                    let (file, at) = self.src.locate(sc);
                    file.release((at, at + done * (expert / 16)));
                }
            }
            match &self.src.header.tensors[pair.src].gather {
                None => self.src_reads.release(
                    &self.src.files,
                    si,
                    (sa as u64, (sa + sn) as u64),
                    window,
                ),
                // A view's elements lie anywhere in its storage: drop its pages once done.
                Some(_) if w.pos + w.len == s_len(&self.src, pair) => {
                    self.src
                        .release_gathered(&self.src.header.tensors[pair.src]);
                }
                Some(_) => {}
            }
            self.dst_reads
                .release(&self.dst.files, di, (da as u64, (da + dn) as u64), window);
            self.cursor.advance(w);
            self.report.bytes_compared += w.len + dn as u64;
            spent += w.len;
            let last = w.pos + w.len == s_len(&self.src, pair);
            if let (Expect::Convert(_), true, false) = (pair.expect, last, self.report.loose) {
                if let Some(m) = self.overflow_mismatch(pair, w.item) {
                    self.report.mismatch = Some(m);
                    return Ok(true);
                }
            }
            if pair.nonfinite && last && !self.seen_nonfinite[w.item] {
                let name = &self.src.header.tensors[pair.src].name;
                self.report.mismatch = Some(*Mismatch::header(
                    Some(name),
                    format!(
                        "tensor `{}` is BF16 in DST, but it holds no NaN or inf: an FP8 target \
                         quantizes it",
                        esc(name)
                    ),
                ));
                return Ok(true);
            }
            if let Expect::KeptOverflow(c) = pair.expect {
                let name = &self.src.header.tensors[pair.src].name;
                if last && !c.overflows(self.kept_max[w.item]) {
                    self.report.mismatch = Some(*Mismatch::header(
                        Some(name),
                        format!(
                            "tensor `{}` is kept in {} in DST, but none of its values would \
                             overflow when converted ({{on_overflow=keep}} keeps only those \
                             that would)",
                            esc(name),
                            self.src.header.tensors[pair.src].dtype
                        ),
                    ));
                    return Ok(true);
                }
            }
        }
        let done = self.next_window().is_none();
        if done {
            self.src_reads.pending.flush(&self.src.files);
            self.dst_reads.pending.flush(&self.dst.files);
        }
        Ok(done)
    }

    /// Under `on_overflow` keep or error, a converted tensor whose finite values became ±inf
    /// is not what convert writes.
    fn overflow_mismatch(&self, pair: Pair, item: usize) -> Option<Mismatch> {
        let n = self.numerics.as_ref()?[item].overflow;
        if n == 0 || self.on_overflow == OnOverflow::Warn {
            return None;
        }
        let (s, d) = (
            &self.src.header.tensors[pair.src],
            &self.dst.header.tensors[pair.dst],
        );
        let values = crate::text::count(n, "finite value");
        let why = match self.on_overflow {
            OnOverflow::Keep => format!("{{on_overflow=keep}} keeps such a tensor in {}", s.dtype),
            _ => "convert with {on_overflow=error} refuses such a conversion".to_string(),
        };
        Some(*Mismatch::header(
            Some(&s.name),
            format!(
                "tensor `{}` is converted to {} in DST and {values} became ±inf; {why}",
                esc(&s.name),
                d.dtype
            ),
        ))
    }

    /// The report of a finished verification; once verified, the numeric report is written
    /// (atomically) where `VerifyOptions::report` said.
    pub fn finish(self) -> Result<VerifyReport> {
        let report_path = self.report_path.clone();
        let beside = self.beside.and_then(|exact| {
            let to = self.target.or(self.report.to);
            let given = self.given_config;
            crate::run::beside::check(&self.report.dst, &self.dst.header, to, exact, given)
        });
        let mut report = self.conclude();
        if let (Some(message), true) = (beside, report.is_ok()) {
            report.mismatch = Some(*Mismatch::header(None, message));
        }
        if let (Some((path, replace)), true) = (report_path, report.is_ok()) {
            let bytes = crate::report::numeric_report(
                &report.src,
                &report.dst,
                report.to,
                &report.numerics,
                &report.numerics_total,
                &[],
                &report.dequantized,
            );
            write_file(&path, &bytes, replace, "")?;
        }
        Ok(report)
    }

    fn conclude(self) -> VerifyReport {
        let mut report = self.report;
        report.seconds = self.started.elapsed().as_secs_f64();
        report.dequantized = self
            .pairs
            .iter()
            .zip(&self.ranges)
            .filter_map(|(p, r)| match p.expect {
                Expect::Dequantize(q) => Some(DequantizedTensor {
                    name: self.dst.header.tensors[p.dst].name.clone(),
                    format: q.format().text,
                    range: r.clone(),
                }),
                _ => None,
            })
            .collect();
        if let Some(all) = self.numerics {
            report.numerics = self
                .pairs
                .iter()
                .zip(all)
                .filter(|(p, _)| matches!(p.expect, Expect::Convert(_)))
                .map(|(p, n)| (self.dst.header.tensors[p.dst].name.clone(), n))
                .collect();
            report.numerics_total = Numerics::total(report.numerics.iter().map(|(_, n)| n));
        }
        report
    }

    /// Describe the element `index` of a pair, known to differ.
    fn describe(&self, pair: Pair, index: u64) -> Mismatch {
        let (s, d) = (
            &self.src.header.tensors[pair.src],
            &self.dst.header.tensors[pair.dst],
        );
        let (src_size, dst_size) = pair.expect.sizes(s.dtype);
        let (src_size, dst_size) = (src_size as usize, dst_size as usize);
        let (dfile, da) = self.dst.locate(d);
        let da = da as usize + index as usize * dst_size;
        let mut element = Vec::new();
        let source = match self
            .src
            .read(s, index * src_size as u64, src_size as u64, &mut element)
        {
            Ok(b) => b.to_vec(),
            Err(_) => vec![0u8; src_size],
        };
        let source = source.as_slice();
        let found = &dfile.map[da..da + dst_size];
        let mut expected = vec![0u8; dst_size];
        match pair.expect {
            Expect::Identical | Expect::KeptOverflow(_) | Expect::Quantize(..) => {
                expected.copy_from_slice(source)
            }
            Expect::Dequantize(q) => {
                let (row, col) = (index / q.cols, index % q.cols);
                // The element's whole row, dequantized as convert does it.
                let mut row_out = vec![0u8; (q.cols * q.out_size()) as usize];
                let mut row_in = Vec::new();
                if let Ok(b) = self.src.read(s, row * q.cols, q.cols, &mut row_in) {
                    let (pool, input) = (&self.pool, &self.src);
                    crate::convert::dequantize_window(pool, 1, q, input, row, b, &mut row_out);
                }
                let o = (col * q.out_size()) as usize;
                expected.copy_from_slice(&row_out[o..o + dst_size]);
            }
            Expect::Convert(c) => c.kernel()(self.isa, source, &mut expected),
        }
        let value = float_value(s.dtype, source);
        let what = if s.dtype.bitsize().is_multiple_of(8) {
            "element"
        } else {
            "byte"
        };
        let shown = value.map_or(String::new(), |v| format!(" ({v})"));
        Mismatch {
            message: format!(
                "tensor `{}` {what} {index}: source {}{shown} should give {}, found {}",
                s.name,
                hex(source),
                hex(&expected),
                hex(found)
            ),
            tensor: Some(s.name.clone()),
            index: Some(index),
            source_bits: Some(hex(source)),
            source_value: value.map(|v| v.as_f64()),
            expected_bits: Some(hex(&expected)),
            found_bits: Some(hex(found)),
        }
    }
}

/// The target whose converted tensors have `dtype`; `None` for a dtype no target writes.
/// Every target is named: a new one must say here what it writes.
fn target_of(dtype: Dtype) -> Option<Target> {
    Target::ALL.iter().copied().find(|&t| match t {
        Target::Bf16 | Target::F16 => t.dtype() == Some(dtype),
        // Its weights are F8_E4M3 (which the FP8 check reads), its other tensors BF16.
        Target::Keep | Target::Fp8 | Target::Fp8Block => false,
    })
}

/// The target a run had, from which dtypes its converted tensors have in DST
/// (`converted_to`). Only a bf16 run writes converted BF16 tensors (fp16 copies BF16 or
/// converts it to F16), so any converted BF16 tensor means bf16, whatever else DST holds;
/// else converted F16 tensors mean fp16. With no tensor converted, the default, bf16.
/// Every target is named: a new one must say where it stands.
fn inferred_target(converted_to: impl Fn(Dtype) -> bool) -> Target {
    // In order of precedence.
    let evidence = |t: Target| match t {
        Target::Bf16 | Target::F16 => t.dtype().is_some_and(&converted_to),
        Target::Keep | Target::Fp8 | Target::Fp8Block => false,
    };
    [Target::Bf16, Target::F16]
        .into_iter()
        .find(|&t| evidence(t))
        .unwrap_or(Target::Bf16)
}

/// Compare names, shapes, dtypes and metadata; in strict mode also what `convert` plans with
/// the options (each tensor converted or kept, the order, the header byte for byte). Returns
/// the pairs in destination order, or the first difference. `Err` only for options that
/// cannot be planned (an invalid `keep` pattern).
#[allow(clippy::type_complexity)]
fn check_headers(
    src: &Source,
    dst: &Source,
    opts: &VerifyOptions,
) -> Result<std::result::Result<Vec<Pair>, Box<Mismatch>>> {
    let (sh, dh) = (&src.header, &dst.header);
    let by_name: HashMap<&str, usize> = sh
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let fail = |tensor: Option<&str>, message: String| Ok(Err(Mismatch::header(tensor, message)));
    if !dh.tensors.is_empty()
        && dh.tensors.iter().all(|t| {
            let packed = [crate::quant::PACKED_SUFFIX, crate::quant::BLOCKS_SUFFIX];
            !by_name.contains_key(t.name.as_str())
                && !packed
                    .iter()
                    .any(|p| by_name.contains_key(format!("{}{p}", t.name).as_str()))
        })
    {
        return fail(
            None,
            format!(
                "DST is not a conversion of SRC: none of its {} tensors is in SRC",
                dh.tensors.len()
            ),
        );
    }
    let mut pairs = Vec::with_capacity(dh.tensors.len());
    let scales = fp8_scales(sh, dh, &by_name, opts.target.and_then(|t| t.strategy()));
    let scale_tensors: HashSet<usize> = scales.values().map(|&(k, _)| k).collect();
    // An FP8 input dequantized: its weights' scales are not in DST.
    let (deq, dropped) = match dh
        .tensors
        .iter()
        .map(|t| t.dtype)
        .find(|d| matches!(d, Dtype::BF16 | Dtype::F16))
    {
        Some(d)
            if sh.tensors.iter().any(|t| {
                matches!(t.dtype, Dtype::F8_E4M3 | Dtype::I8)
                    || t.name.ends_with(crate::quant::PACKED_SUFFIX)
                    || t.name.ends_with(crate::quant::BLOCKS_SUFFIX)
            }) =>
        {
            match crate::quant::dequantizable(&sh.tensors, &sh.weight_shapes, d) {
                Ok(found) => found,
                Err((tensor, problem)) => {
                    return fail(
                        Some(&tensor),
                        format!(
                            "SRC tensor `{}` {problem}: convert does not dequantize SRC",
                            esc(&tensor)
                        ),
                    );
                }
            }
        }
        _ => (Vec::new(), Vec::new()),
    };
    // Packed weights are named otherwise once unpacked (`X.weight_packed` -> `X.weight`).
    let renamed: HashMap<&str, usize> = deq
        .iter()
        .enumerate()
        .filter_map(|(si, q)| {
            let n = sh.tensors[si].name.as_str();
            q.map(|q| (q.out_name(n), si)).filter(|(o, _)| *o != n)
        })
        .collect();
    for (di, d) in dh.tensors.iter().enumerate() {
        let name = esc(&d.name);
        if scale_tensors.contains(&di) {
            continue; // checked with its weight
        }
        if let Some(&(k, q)) = scales.get(&di) {
            pairs.push(Pair {
                src: by_name[d.name.as_str()],
                dst: di,
                expect: Expect::Quantize(q, k),
                nonfinite: false,
            });
            continue;
        }
        let Some(&si) = by_name
            .get(d.name.as_str())
            .or_else(|| renamed.get(d.name.as_str()))
        else {
            return fail(
                Some(&d.name),
                format!("tensor `{name}` is in DST but not in SRC"),
            );
        };
        let s = &sh.tensors[si];
        let src_shape = match deq.get(si) {
            Some(Some(q)) => q.out_shape(&s.shape),
            _ => s.shape.clone(),
        };
        if dropped.get(si) == Some(&true) {
            return fail(
                Some(&d.name),
                format!(
                    "tensor `{name}` is a scale or zero point of a weight DST holds \
                     dequantized: convert does not write it"
                ),
            );
        }
        if src_shape != d.shape {
            return fail(
                Some(&d.name),
                format!(
                    "tensor `{name}`: shape {:?} in SRC, {:?} in DST",
                    src_shape, d.shape
                ),
            );
        }
        if let Some(Some(q)) = deq.get(si) {
            if d.dtype == q.target {
                pairs.push(Pair {
                    src: si,
                    dst: di,
                    expect: Expect::Dequantize(*q),
                    nonfinite: false,
                });
                continue;
            }
            // A dequantization to the other 16-bit dtype.
            if let (Some(q), true) = (
                crate::quant::dequantizable(&sh.tensors, &sh.weight_shapes, d.dtype)
                    .ok()
                    .and_then(|(deq, _)| deq[si]),
                matches!(d.dtype, Dtype::BF16 | Dtype::F16),
            ) {
                pairs.push(Pair {
                    src: si,
                    dst: di,
                    expect: Expect::Dequantize(q),
                    nonfinite: false,
                });
                continue;
            }
            // Its scales are not in DST (`dropped`): codes kept without them are no weight,
            // in either mode (loose would take them as a tensor kept in its dtype).
            return fail(
                Some(&d.name),
                format!(
                    "tensor `{name}` is {} in DST, but its scales are not: convert dequantizes \
                     it to {}",
                    d.dtype, q.target
                ),
            );
        }
        let Some(expect) = expectation(s.dtype, d.dtype) else {
            // A narrow float in SRC and a wide one in DST: the arguments the wrong way round?
            let swapped = expectation(d.dtype, s.dtype).is_some();
            let hint = if swapped {
                " (are SRC and DST swapped? verify takes the original first)"
            } else {
                ""
            };
            return fail(
                Some(&d.name),
                format!(
                    "tensor `{name}`: {} in SRC cannot become {} in DST{hint}",
                    s.dtype, d.dtype
                ),
            );
        };
        pairs.push(Pair {
            src: si,
            dst: di,
            expect,
            nonfinite: false,
        });
    }
    let n_dropped = dropped.iter().filter(|&&d| d).count();
    if sh.tensors.len() + scales.len() != dh.tensors.len() + n_dropped {
        let in_dst: HashSet<&str> = dh.tensors.iter().map(|t| t.name.as_str()).collect();
        let missing = sh
            .tensors
            .iter()
            .enumerate()
            .find(|(i, t)| !in_dst.contains(t.name.as_str()) && dropped.get(*i) != Some(&true))
            .map(|(_, t)| t)
            .map_or("?", |t| t.name.as_str());
        return fail(
            Some(missing),
            format!("tensor `{}` is in SRC but not in DST", esc(missing)),
        );
    }
    // The entry stcast gives every output of a PyTorch checkpoint: another tool's output
    // need not have it (loose).
    // Nor its `format` (`pt`), which tools drop (model_free_ptq writes no metadata).
    let added = (src.origin.is_some() || opts.loose).then_some(TORCH_METADATA.0);
    // DST's own record of convert's options follows SRC's keys (replacing SRC's own).
    if let Some(Err((text, why))) = own_record(sh.metadata.as_deref(), dh.metadata.as_deref()) {
        return fail(None, not_a_record(&dst.path, text, &why));
    }
    let own = written_record(sh.metadata.as_deref(), dh.metadata.as_deref());
    let want = record::with_record(sh.metadata.as_deref(), own);
    if let Some((why, hint)) = metadata_difference(&want, &dh.metadata, opts.loose, added) {
        return fail(None, format!("__metadata__ differs: {}{hint}", esc(&why)));
    }
    check_plan(src, dst, opts, pairs)
}

/// The first group of a quantized weight's window (whole groups from group `first`) whose
/// recomputed scale or E4M3 bytes differ from DST's, described; None if all agree.
/// `scratch` holds the recomputed window.
#[allow(clippy::too_many_arguments)]
fn quantized_difference(
    work: &Work,
    name: &str,
    q: Quant,
    first: u64,
    src: &[u8],
    dst: &[u8],
    scales: &[u8],
    scratch: &mut Vec<u8>,
) -> Option<Mismatch> {
    let e = esc(name);
    let fail = |message: String| Some(*Mismatch::header(Some(name), message));
    if crate::fp8::has_nonfinite(q.d, src) {
        return fail(format!(
            "tensor `{e}` is quantized to FP8 in DST, but it holds NaN or inf: convert leaves \
             such a weight unquantized, in BF16"
        ));
    }
    // Every byte of both is written by the quantizer.
    scratch.resize(dst.len() + scales.len(), 0);
    let (want_q, want_s) = scratch.split_at_mut(dst.len());
    let want_s = &mut want_s[..scales.len()];
    crate::convert::quantize_window(work.pool, work.threads, q, src, want_q, want_s);
    let size = q.size() as usize;
    // The group of scale `i` of this window, in words.
    let group = |i: u64| -> String {
        let g = first * q.scales_per_granule() + i;
        match q.strategy {
            Strategy::Channel => format!("row {g}"),
            Strategy::Block => {
                let tiles = q.cols.div_ceil(crate::quant::BLOCK);
                format!("block ({}, {})", g / tiles, g % tiles)
            }
        }
    };
    let hexs = |b: &[u8]| {
        b.iter()
            .rev()
            .map(|x| format!("{x:02x}"))
            .collect::<String>()
    };
    if let Some(i) = want_s
        .chunks(size)
        .zip(scales.chunks(size))
        .position(|(a, b)| a != b)
    {
        let (a, b) = (&want_s[i * size..][..size], &scales[i * size..][..size]);
        return fail(format!(
            "tensor `{e}` {}: scale should be 0x{}, found 0x{} (a tampered scale, or not \
             model_free_ptq's arithmetic)",
            group(i as u64),
            hexs(a),
            hexs(b)
        ));
    }
    let i = want_q.iter().zip(dst).position(|(a, b)| a != b)? as u64;
    let cols = q.cols;
    let row = first * (q.granule() / q.size() / cols) + i / cols;
    let col = i % cols;
    let g = match q.strategy {
        Strategy::Channel => i / cols,
        Strategy::Block => {
            (i / cols / crate::quant::BLOCK) * cols.div_ceil(crate::quant::BLOCK)
                + col / crate::quant::BLOCK
        }
    };
    fail(format!(
        "tensor `{e}` element ({row}, {col}) in {}: E4M3 0x{:02x} expected, found 0x{:02x}",
        group(g),
        want_q[i as usize],
        dst[i as usize]
    ))
}

/// DST's FP8 weights (by DST index): each an F8_E4M3 tensor whose SRC tensor is a 2-D F32,
/// F16 or BF16 one and that has a scale `X_scale` in SRC's dtype, shaped per channel or per
/// block; with the scale's DST index and how it was quantized.
///
/// A scale shape can fit both strategies (one row of at most 128 columns: `[1, 1]`, one
/// group either way, the same bytes). Such a weight takes the strategy `want` names (the
/// target asked), else the one the file's other weights show; only a file whose every
/// weight fits both is read per channel (and then either reading holds).
fn fp8_scales(
    sh: &crate::header::SourceHeader,
    dh: &crate::header::SourceHeader,
    by_name: &HashMap<&str, usize>,
    want: Option<Strategy>,
) -> HashMap<usize, (usize, Quant)> {
    let in_dst: HashMap<&str, usize> = dh
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut fits = Vec::new();
    for (di, d) in dh.tensors.iter().enumerate() {
        let Some(&si) = by_name.get(d.name.as_str()) else {
            continue;
        };
        let s = &sh.tensors[si];
        if d.dtype != Dtype::F8_E4M3 || s.shape.len() != 2 || s.shape != d.shape {
            continue;
        }
        let Some(&k) = in_dst.get(crate::quant::scale_name(&d.name).as_str()) else {
            continue;
        };
        let scale = &dh.tensors[k];
        if scale.dtype != s.dtype || by_name.contains_key(scale.name.as_str()) {
            continue;
        }
        let found: Vec<Quant> = [Strategy::Channel, Strategy::Block]
            .into_iter()
            .filter_map(|st| {
                let q = crate::quant::choose("weight", s.dtype, &s.shape, st).ok()?;
                (q.scale_shape()[..] == scale.shape[..]).then_some(q)
            })
            .collect();
        if !found.is_empty() {
            fits.push((di, k, found));
        }
    }
    let shown = want.or_else(|| {
        fits.iter()
            .find(|(_, _, f)| f.len() == 1)
            .map(|(_, _, f)| f[0].strategy)
    });
    fits.into_iter()
        .map(|(di, k, found)| {
            let q = found
                .iter()
                .find(|q| Some(q.strategy) == shown)
                .unwrap_or(&found[0]);
            (di, (k, *q))
        })
        .collect()
}

/// DST must be what `convert` writes with `opts` under one target (as asked, else the one
/// DST's converted tensors show). Strict mode: every float tensor converted unless the
/// options keep it, in the planned order, with the planned header bytes. Loose mode
/// (`loose_difference`): any float tensor may be kept, but what is converted is converted
/// to that target.
fn check_plan(
    src: &Source,
    dst: &Source,
    opts: &VerifyOptions,
    mut pairs: Vec<Pair>,
) -> Result<std::result::Result<Vec<Pair>, Box<Mismatch>>> {
    let (sh, dh) = (&src.header, &dst.header);
    let fail = |tensor: Option<&str>, message: String| Ok(Err(Mismatch::header(tensor, message)));
    // The target: as asked, else the one DST's converted tensors have (`inferred_target`).
    let converted_to = |dtype: Dtype| {
        pairs.iter().any(|p| {
            matches!(p.expect, Expect::Convert(_) | Expect::Dequantize(_))
                && dh.tensors[p.dst].dtype == dtype
        })
    };
    let converted_any = pairs.iter().any(|p| {
        matches!(
            p.expect,
            Expect::Convert(_) | Expect::Quantize(..) | Expect::Dequantize(_)
        )
    });
    let fp8 = pairs.iter().find_map(|p| match p.expect {
        Expect::Quantize(q, _) => Some(match q.strategy {
            Strategy::Channel => Target::Fp8,
            Strategy::Block => Target::Fp8Block,
        }),
        _ => None,
    });
    // A PyTorch checkpoint whose every tensor kept its dtype was converted with `keep`.
    let target = opts
        .target
        .or(fp8)
        .unwrap_or(if !converted_any && src.changes_format() {
            Target::Keep
        } else {
            inferred_target(converted_to)
        });
    let mut popts = PlanOptions {
        keep: opts.keep.clone(),
        keep_min_size: opts.keep_min_size.unwrap_or(0),
        from_bf16: opts.from_bf16,
        unmatched: Unmatched::Ignore,
        // What was converted is checked, not judged again.
        allow_quantized: true,
        // DST's own record, checked already (`check_headers`), is where convert puts it.
        record: written_record(sh.metadata.as_deref(), dh.metadata.as_deref()).map(str::to_string),
        ..PlanOptions::new(target)
    };
    let planned = plan::plan(&src.path, sh, &popts)?;
    let mut actions = vec![Action::Copy; sh.tensors.len()];
    for t in planned.tensors.iter().filter(|t| t.role == Role::Tensor) {
        actions[t.source] = t.action;
    }
    if opts.loose {
        let quantizes = pairs
            .iter()
            .any(|p| matches!(p.expect, Expect::Quantize(..)));
        let run = LooseRun {
            target,
            given: opts.target.is_some(),
            quantizes,
        };
        for p in &mut pairs {
            if let Some(why) = loose_difference(&run, actions[p.src], p, dh) {
                return fail(Some(&sh.tensors[p.src].name), why);
            }
        }
        return Ok(Ok(pairs));
    }
    for p in &mut pairs {
        let (s, d) = (&sh.tensors[p.src], &dh.tensors[p.dst]);
        let name = esc(&s.name);
        match (actions[p.src], p.expect) {
            (Action::Convert(c), Expect::Convert(got)) if c == got => {}
            (Action::Quantize(q), Expect::Quantize(got, _)) if q == got => {}
            (Action::Dequantize(q), Expect::Dequantize(got)) if q == got => {}
            // Convert leaves a weight holding NaN or inf in BF16 (converted to it, or kept
            // byte for byte when it was BF16 already): the data must show one.
            (Action::Quantize(_), Expect::Convert(_) | Expect::Identical)
                if d.dtype == Dtype::BF16 =>
            {
                p.nonfinite = true;
                popts
                    .unquantized
                    .get_or_insert_default()
                    .insert(s.name.clone());
            }
            (Action::Quantize(q), _) => {
                return fail(
                    Some(&s.name),
                    format!(
                        "tensor `{name}` is {} in DST, but {{to={}}} quantizes it to FP8 with \
                         a {} scale ({{to}} and {{keep}} as convert had them?)",
                        d.dtype,
                        target.name(),
                        q.strategy.name()
                    ),
                );
            }
            (_, Expect::Quantize(..)) => {
                let why = match planned.fp8_skips.get(p.src).copied().flatten() {
                    Some(skip) => format!("it is {}", skip.words()),
                    None => planned.reasons[p.src].words(),
                };
                return fail(
                    Some(&s.name),
                    format!(
                        "tensor `{name}` is quantized to FP8 in DST, but {{to={}}} does not \
                         quantize it ({why})",
                        target.name()
                    ),
                );
            }
            (Action::Convert(c), Expect::Identical) if opts.overflow() == OnOverflow::Keep => {
                p.expect = Expect::KeptOverflow(c);
                popts.keep_names.insert(s.name.clone());
            }
            (Action::Convert(_), Expect::Identical) => {
                // A BF16 tensor kept under fp16: convert had no `from_bf16`.
                let options = if s.dtype == Dtype::BF16 {
                    "without {from_bf16}"
                } else {
                    "the same {keep} patterns, {keep_min_size} and {on_overflow}"
                };
                return fail(
                    Some(&s.name),
                    format!(
                        "tensor `{name}` is kept in {} in DST, but these options convert it to \
                         {} ({options} as convert? {{loose}} accepts any kept tensor)",
                        s.dtype,
                        target.describe()
                    ),
                );
            }
            (Action::Convert(c), Expect::Convert(_)) => {
                return fail(
                    Some(&s.name),
                    format!(
                        "tensor `{name}` is {} in DST, but these options convert it to {} \
                         ({{to}} as convert had it?)",
                        d.dtype,
                        conversion_dtype(c)
                    ),
                );
            }
            (Action::Copy, Expect::Convert(_)) => {
                let why = planned.reasons[p.src].words();
                return fail(
                    Some(&s.name),
                    format!(
                        "tensor `{name}` is converted to {} in DST, but these options keep it \
                         in {} ({why})",
                        d.dtype, s.dtype
                    ),
                );
            }
            _ => {}
        }
    }
    // With the tensors kept to avoid overflow, the plan is the one `convert` made.
    let planned = plan::plan(&src.path, sh, &popts)?;
    let order: Vec<usize> = pairs.iter().map(|p| p.src).collect();
    let want: Vec<usize> = planned
        .tensors
        .iter()
        .filter(|t| t.role == Role::Tensor)
        .map(|t| t.source)
        .collect();
    if let Some(at) = want.iter().zip(&order).position(|(a, b)| a != b) {
        let (w, g) = (&sh.tensors[want[at]].name, &sh.tensors[order[at]].name);
        return fail(
            Some(g),
            format!(
                "tensor order differs at position {at}: expected `{}`, found `{}` ({{loose}} \
                 accepts any order, as for files other tools wrote)",
                esc(w),
                esc(g)
            ),
        );
    }
    let data_start = dh.data_start() as usize;
    let got = &dst.primary().map[..data_start];
    if planned.header.as_slice() != got {
        // Compare the JSON text, after the length prefix, to show where it departs.
        let (w, g) = (&planned.header[PREFIX..], &got[PREFIX.min(got.len())..]);
        let at = w
            .iter()
            .zip(g)
            .position(|(a, b)| a != b)
            .unwrap_or(w.len().min(g.len()));
        let excerpt = |h: &[u8]| {
            String::from_utf8_lossy(&h[at.min(h.len())..(at + 24).min(h.len())]).into_owned()
        };
        return fail(
            None,
            format!(
                "DST header is not the one stcast writes: its JSON differs at byte {at} \
                 (expected {}, found {}; {{loose}} ignores the header layout)",
                esc(&format!("{:?}", excerpt(w))),
                esc(&format!("{:?}", excerpt(g)))
            ),
        );
    }
    Ok(Ok(pairs))
}

/// What loose mode knows of the run that wrote DST (`loose_difference`).
struct LooseRun {
    target: Target,
    /// The target was asked, not inferred from DST.
    given: bool,
    /// DST holds a quantized weight: an FP8 output (whose config, checked beside it, names
    /// the weights it leaves unquantized).
    quantizes: bool,
}

/// Loose mode's rule for one tensor of `run`, of which `planned` is what convert does with
/// it: what is wrong with it, or None. A tensor kept in its source dtype passes (another
/// tool's keep list); a converted one must be converted to the target's dtype, a quantized
/// one with the target's strategy: one output holds one target's conversions. Under an FP8
/// target, a weight it quantizes is quantized, kept, or converted to BF16: in an FP8 output
/// as another tool leaves a weight out (its config's `ignore`, checked beside the tensors),
/// in an output that quantizes none only as convert leaves one out, for holding NaN or inf
/// (`Pair::nonfinite`, checked on the data).
fn loose_difference(
    run: &LooseRun,
    planned: Action,
    p: &mut Pair,
    dh: &crate::header::SourceHeader,
) -> Option<String> {
    let d = &dh.tensors[p.dst];
    let name = esc(&d.name);
    let to = run.target.name();
    let shown = if run.given {
        ""
    } else {
        " (the target the output's other converted tensors show)"
    };
    match p.expect {
        Expect::Identical | Expect::KeptOverflow(_) => None,
        Expect::Quantize(q, _) => (run.target.strategy() != Some(q.strategy)).then(|| {
            let does = match run.target.strategy() {
                Some(s) => format!("quantizes with a {} scale", s.name()),
                None => "quantizes none".to_string(),
            };
            format!(
                "tensor `{name}` is quantized to FP8 with a {} scale in DST, but {{to={to}}}{shown} \
                 {does}: one output is one target's conversion",
                q.strategy.name()
            )
        }),
        Expect::Convert(_) | Expect::Dequantize(_) if run.target.dtype() != Some(d.dtype) => {
            let converts = match run.target.dtype() {
                Some(t) => format!("converts to {t}"),
                None => "converts none".to_string(),
            };
            Some(format!(
                "tensor `{name}` is converted to {} in DST, but {{to={to}}}{shown} {converts} \
                 ({{loose}} accepts a tensor kept in its own dtype, not one converted to another \
                 target's)",
                d.dtype
            ))
        }
        Expect::Convert(_) | Expect::Dequantize(_) => {
            p.nonfinite = matches!(planned, Action::Quantize(_)) && !run.quantizes;
            None
        }
    }
}

fn conversion_dtype(c: Conversion) -> Dtype {
    match c {
        Conversion::F32ToF16 | Conversion::F64ToF16 | Conversion::Bf16ToF16 => Dtype::F16,
        _ => Dtype::BF16,
    }
}

/// Why two `__metadata__` differ, or None; with a hint (a template) when only the strict
/// rules fail them. Loose: key order is free, no metadata equals an empty one, and DST may
/// lack the key `added`, which stcast adds to SRC's own (`format` for a PyTorch checkpoint).
fn metadata_difference(
    src: &Option<Vec<(String, String)>>,
    dst: &Option<Vec<(String, String)>>,
    loose: bool,
    added: Option<&str>,
) -> Option<(String, &'static str)> {
    let plain = |why: String| Some((why, ""));
    let empty = Vec::new();
    let (s, d) = (
        src.as_ref().unwrap_or(&empty),
        dst.as_ref().unwrap_or(&empty),
    );
    if !loose && src.is_some() != dst.is_some() {
        let (has, lacks) = if src.is_some() {
            ("SRC", "DST")
        } else {
            ("DST", "SRC")
        };
        // Loose takes none for an empty one; entries in it are still compared below.
        let hint = if s.is_empty() && d.is_empty() {
            " ({loose} takes no __metadata__ for an empty one)"
        } else {
            ""
        };
        return Some((
            format!("{has} has a __metadata__ entry, {lacks} has none"),
            hint,
        ));
    }
    let dmap: HashMap<&str, &str> = d.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let smap: HashMap<&str, &str> = s.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    for (k, v) in s {
        match dmap.get(k.as_str()) {
            None if loose && added == Some(k.as_str()) => {}
            None if added == Some(k.as_str()) => {
                let why = format!("key {k:?} is missing in DST");
                return Some((
                    why,
                    " ({loose} takes an output without it: other tools drop it)",
                ));
            }
            None => return plain(format!("key {k:?} is missing in DST")),
            Some(dv) if dv != v => {
                return plain(format!("key {k:?} is {v:?} in SRC, {dv:?} in DST"))
            }
            _ => {}
        }
    }
    if let Some((k, _)) = d.iter().find(|(k, _)| !smap.contains_key(k.as_str())) {
        return plain(format!("key {k:?} is in DST but not in SRC"));
    }
    if !loose && s != d {
        let at = s.iter().zip(d).position(|(a, b)| a.0 != b.0).unwrap_or(0);
        let why = format!(
            "key order differs at position {at}: expected {:?}, found {:?}",
            s[at].0, d[at].0
        );
        return Some((why, " ({loose} accepts any key order)"));
    }
    None
}

/// The byte offset (in `src`) of the first source element whose output differs, comparing
/// on the pool in blocks that stay in cache; with `measure`, also the numerics of the
/// conversion (of the blocks before a difference), measured on each recomputed block.
#[allow(clippy::too_many_arguments)]
fn first_difference(
    work: &Work,
    expect: Expect,
    src_dtype: Dtype,
    dst_dtype: Dtype,
    loose: bool,
    measure: bool,
    src: &[u8],
    dst: &[u8],
) -> (Option<usize>, Numerics) {
    // In loose mode a float NaN may come out as any NaN.
    let nan = if loose { nan_test(dst_dtype) } else { None };
    let (src_size, dst_size) = expect.sizes(src_dtype);
    let (src_size, dst_size) = (src_size as usize, dst_size as usize);
    let isa = work.isa;
    let check = |offset: usize, s: &[u8], d: &[u8]| -> (Option<usize>, Numerics) {
        let mut buf = [0u8; 2 * BLOCK];
        let mut measured = Numerics::default();
        let blocks = s.chunks(BLOCK * src_size).zip(d.chunks(BLOCK * dst_size));
        for (k, (sb, db)) in blocks.enumerate() {
            let want: &[u8] = match expect {
                // Quantized weights are compared by `quantized_difference`, dequantized ones
                // after `dequantize_window` (see `step`).
                Expect::Identical
                | Expect::KeptOverflow(_)
                | Expect::Quantize(..)
                | Expect::Dequantize(_) => sb,
                Expect::Convert(c) => {
                    let want = &mut buf[..db.len()];
                    if measure {
                        measured.merge(&fused::convert_and_measure(isa, c, sb, want));
                    } else {
                        c.kernel()(isa, sb, want);
                    }
                    want
                }
            };
            if want == db {
                continue;
            }
            let elems = want.chunks_exact(dst_size).zip(db.chunks_exact(dst_size));
            for (i, (w, g)) in elems.enumerate() {
                let both_nan = nan.is_some_and(|(exp, mant)| {
                    let is_nan = |b: &[u8]| {
                        let bits = le_bits(b);
                        bits & exp == exp && bits & mant != 0
                    };
                    is_nan(w) && is_nan(g)
                });
                if w != g && !both_nan {
                    return (Some(offset + (k * BLOCK + i) * src_size), measured);
                }
            }
        }
        (None, measured)
    };
    let merge = |(a, mut total): (Option<usize>, Numerics),
                 (b, more): (Option<usize>, Numerics)| {
        total.merge(&more);
        let first = match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        (first, total)
    };
    work.split_pair(src, dst, (src_size, dst_size, BLOCK), check, merge)
}

/// Exponent and mantissa masks of a float dtype: a NaN has all exponent bits and some
/// mantissa bits set.
fn nan_test(d: Dtype) -> Option<(u64, u64)> {
    Some(match d {
        Dtype::BF16 => (0x7F80, 0x007F),
        Dtype::F16 => (0x7C00, 0x03FF),
        Dtype::F32 => (0x7F80_0000, 0x007F_FFFF),
        Dtype::F64 => (0x7FF0_0000_0000_0000, 0x000F_FFFF_FFFF_FFFF),
        _ => return None,
    })
}

fn le_bits(b: &[u8]) -> u64 {
    b.iter().rev().fold(0, |acc, &x| acc << 8 | u64::from(x))
}

/// A source element's value, kept in its own precision so that it prints shortest.
#[derive(Clone, Copy)]
enum Value {
    F32(f32),
    F64(f64),
}

impl Value {
    fn as_f64(self) -> f64 {
        match self {
            Value::F32(v) => v.into(),
            Value::F64(v) => v,
        }
    }
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::F32(v) => write!(f, "{v:e}"),
            Value::F64(v) => write!(f, "{v:e}"),
        }
    }
}

fn float_value(d: Dtype, b: &[u8]) -> Option<Value> {
    let bits = le_bits(b);
    Some(match d {
        Dtype::F64 => Value::F64(f64::from_bits(bits)),
        Dtype::F32 => Value::F32(f32::from_bits(bits as u32)),
        Dtype::BF16 => Value::F32(f32::from_bits((bits as u32) << 16)),
        Dtype::F16 => Value::F32(f32_from_half(bits as u16)),
        _ => return None,
    })
}

/// The exact f32 value of IEEE binary16 bits (NaN stays NaN).
fn f32_from_half(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((h >> 10) & 0x1F);
    let m = f32::from(h & 0x3FF);
    match e {
        0 => sign * m * 2f32.powi(-24),
        31 if m == 0.0 => sign * f32::INFINITY,
        31 => f32::NAN,
        _ => sign * (1.0 + m / 1024.0) * 2f32.powi(e - 15),
    }
}

/// Little-endian element bytes as one hex number.
fn hex(le: &[u8]) -> String {
    let mut s = String::from("0x");
    for b in le.iter().rev() {
        s.push_str(&format!("{b:02X}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_from_dst_dtypes_name_each_target() {
        assert_eq!(target_of(Dtype::BF16), Some(Target::Bf16));
        assert_eq!(target_of(Dtype::F16), Some(Target::F16));
        // No target writes these: no guess.
        assert_eq!(target_of(Dtype::F32), None);
        assert_eq!(target_of(Dtype::F8_E4M3), None);
        let only = |d: &'static [Dtype]| move |x: Dtype| d.contains(&x);
        assert_eq!(inferred_target(only(&[])), Target::Bf16);
        assert_eq!(inferred_target(only(&[Dtype::BF16])), Target::Bf16);
        assert_eq!(inferred_target(only(&[Dtype::F16])), Target::F16);
        assert_eq!(
            inferred_target(only(&[Dtype::F16, Dtype::BF16])),
            Target::Bf16
        );
    }
}
