//! The streaming job: plan, create the hidden output, convert window by window into its
//! map, release pages behind us, publish.

use std::collections::VecDeque;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use memmap2::{Advice, MmapMut, UncheckedAdvice};

use crate::dtype::Action;
use crate::error::{Error, Result, Warning};
use crate::failpoint;
use crate::fp8::{self, Fp8Stats};
use crate::header::SourceTensor;
use crate::input::InputOptions;
use crate::kernels::Isa;
use crate::numerics::{DequantizedTensor, Numerics, Range};
use crate::output::{self, AtPath, Published, Replace, TempOutput, Territory};
use crate::plan::{self, KeptTensor, Plan, PlanOptions, Role, TensorPlan};
use crate::quant::{Deq, Layout, Packing, Quant, QuantizedTensor};
use crate::source::{fadvise_dontneed, PendingRelease, Source};
use crate::vocab::{OnOverflow, ReadAdvice, Side, Strategy, Taken, Target};
use crate::window::{worker_pool, Cursor, Window, Work, DEFAULT_STEP, DEFAULT_WINDOW};

/// Knobs that change speed and memory, never the output bytes. The defaults are the
/// measured best; benchmarks pass others through the API (`tuning=`).
#[derive(Clone, Debug)]
pub struct Tuning {
    /// Input bytes per window (rounded down to a multiple of 64, at least 64 KiB).
    pub window: usize,
    /// Kernel family; `None` picks the best this CPU supports.
    pub isa: Option<Isa>,
    /// Fault each window in with one call (`MADV_POPULATE_*`) instead of page by page.
    pub populate: bool,
    /// Read-ahead advice for the input mapping.
    pub advise: ReadAdvice,
    /// Output ranges whose writeback may be in flight before the oldest is waited for and
    /// dropped (at least 1). Each is about half a window (bf16) of dirty pages.
    pub write_behind: usize,
    /// Source bytes per step between two visits of the driver (see `DEFAULT_STEP`).
    pub step: u64,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            window: DEFAULT_WINDOW,
            isa: None,
            populate: true,
            advise: ReadAdvice::Sequential,
            write_behind: 1,
            step: DEFAULT_STEP,
        }
    }
}

/// The knobs of `tuning=` as given (benchmarks), each `None` for its default: input MiB
/// per window, the kernel family by name, `populate`, read-ahead advice by name, output
/// ranges in flight, and MiB between two visits of the driver.
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Knobs {
    pub window_mib: Option<usize>,
    pub isa: Option<String>,
    #[serde(default, deserialize_with = "strict_bool")]
    pub populate: Option<bool>,
    pub advise: Option<String>,
    pub write_behind: Option<usize>,
    pub step_mib: Option<u64>,
}

/// A knob that is a bool only when given as one: a string `"false"` is an error, not true
/// (a deserializer may read any value's truth for a bool).
fn strict_bool<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<bool>, D::Error> {
    struct Strict;
    impl serde::de::Visitor<'_> for Strict {
        type Value = Option<bool>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("true or false")
        }
        fn visit_bool<E>(self, v: bool) -> std::result::Result<Option<bool>, E> {
            Ok(Some(v))
        }
        fn visit_none<E>(self) -> std::result::Result<Option<bool>, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> std::result::Result<Option<bool>, E> {
            Ok(None)
        }
    }
    d.deserialize_any(Strict)
}

impl Tuning {
    /// The tuning `knobs` ask for, clamped to what the engine supports (a window of 1 MiB
    /// to 4 GiB, 1 to 64 ranges in flight, steps of 1 MiB to 64 GiB). An ISA this CPU
    /// lacks or an unknown advice is refused, in a message for the caller.
    pub fn new(knobs: &Knobs) -> std::result::Result<Tuning, String> {
        let mut t = Tuning::default();
        if let Some(mib) = knobs.window_mib {
            t.window = mib.clamp(1, 1 << 12) << 20;
        }
        if let Some(name) = &knobs.isa {
            let isa = Isa::available().into_iter().find(|i| i.name() == name);
            t.isa = Some(isa.ok_or_else(|| format!("isa {name:?} is not available here"))?);
        }
        if let Some(populate) = knobs.populate {
            t.populate = populate;
        }
        if let Some(name) = &knobs.advise {
            t.advise = ReadAdvice::from_name(name)
                .ok_or_else(|| format!("advise must be one of {:?}", ReadAdvice::NAMES))?;
        }
        if let Some(n) = knobs.write_behind {
            t.write_behind = n.clamp(1, 64);
        }
        if let Some(mib) = knobs.step_mib {
            t.step = mib.clamp(1, 1 << 16) << 20;
        }
        Ok(t)
    }
}

/// How to convert.
#[derive(Clone, Debug)]
pub struct Options {
    /// Target and which tensors keep their dtype.
    pub plan: PlanOptions,
    /// Worker threads; 0 means one per available core.
    pub threads: usize,
    /// Replace an existing destination.
    pub force: bool,
    /// With `force`: replace the destination only if it is this file (device, inode), the
    /// one stcast wrote there (a folder's manifest says so); otherwise `Error::NotOurs`.
    pub replaces: Option<(u64, u64)>,
    pub on_overflow: OnOverflow,
    /// Under `OnOverflow::Keep`: the tensors that would overflow were read for already and
    /// are in `plan.keep_names` (a re-sharding's plan), so no scan comes first; a
    /// dequantized weight that overflows is still refused, as `Keep` refuses it.
    pub overflow_known: bool,
    /// Measure each converted tensor as it is written (`Report::numerics`).
    pub numerics: bool,
    /// Write the numeric report there (`report::numeric_report`), published with the
    /// output; `force` lets it replace an existing file.
    pub report: Option<PathBuf>,
    /// Under an FP8 target, write the output's `quantization_config` beside it
    /// (`side_config_path`), published with it: a lone file's run, whose output no model
    /// config describes (a folder's runs write it into the folder's config).
    pub side_config: bool,
    /// With `side_config`: the model's config, written beside the output as `config.json`
    /// (its dtype set, and an FP8 output's `quantization_config`) instead.
    pub model_config: Option<PathBuf>,
    /// Write the output even when no tensor changes dtype (a folder's already converted
    /// files); otherwise such a run is refused (`Error::NothingToConvert`).
    pub allow_copy: bool,
    /// How to read a PyTorch checkpoint (its state dict, the prefixes to strip).
    pub input: InputOptions,
    pub tuning: Tuning,
}

impl Options {
    /// Does the plan wait for a read of the data: `OnOverflow::Keep`'s tensors not known?
    pub fn scans_for_overflow(&self) -> bool {
        self.on_overflow == OnOverflow::Keep && !self.overflow_known
    }

    pub fn new(target: Target) -> Options {
        Options {
            plan: PlanOptions::new(target),
            threads: 0,
            force: false,
            replaces: None,
            on_overflow: OnOverflow::Warn,
            overflow_known: false,
            numerics: true,
            report: None,
            side_config: false,
            model_config: None,
            allow_copy: false,
            input: InputOptions::default(),
            tuning: Tuning::default(),
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options::new(Target::Bf16)
    }
}

/// What a finished conversion did (serialized without its paths and numerics, which the
/// adapter adds as Python holds them).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    #[serde(skip)]
    pub src: PathBuf,
    #[serde(skip)]
    pub dst: PathBuf,
    #[serde(rename = "to")]
    pub target: Target,
    pub tensors_converted: usize,
    /// Tensors copied, the kept ones included.
    pub tensors_copied: usize,
    /// Float tensors kept in their source dtype (by pattern, size or overflow), and their
    /// bytes.
    pub tensors_kept: usize,
    pub bytes_kept: u64,
    /// Those tensors, in output order.
    pub kept: Vec<KeptTensor>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub seconds: f64,
    pub threads: usize,
    pub isa: Isa,
    pub on_overflow: OnOverflow,
    pub warnings: Vec<Warning>,
    /// FP8 targets: the weights quantized, and what quantizing did to each (output order).
    pub tensors_quantized: usize,
    pub quantized: Vec<QuantizedTensor>,
    /// FP8 targets: the modules whose 2-D weight stays unquantized (a config's `ignore`).
    pub unquantized: Vec<String>,
    /// A quantized input: the values each dequantized weight came to (output order), and
    /// how many input tensors only they used (scales, shapes, zero points), dropped.
    pub dequantized: Vec<DequantizedTensor>,
    pub tensors_dropped: usize,
    /// What rounding did to each converted tensor, in output order (empty without
    /// `Options::numerics`), and to all of them.
    #[serde(skip)]
    pub numerics: Vec<(String, Numerics)>,
    #[serde(skip)]
    pub numerics_total: Numerics,
}

/// Every refusal a conversion can make before reading any data: the destination (see
/// `check_destination`) and the report's path. Returns how to write each.
pub fn check_outputs(src: &Source, dst: &Path, opts: &Options) -> Result<Outputs> {
    let mut taken = Territory::of_source(src);
    taken.check(dst, Side::Output)?;
    let replaced_mode = check_destination(src, dst, opts.force)?;
    let replace = match (opts.force, opts.replaces) {
        (false, _) => Replace::No,
        (true, None) => Replace::Any,
        (true, Some((dev, ino))) => {
            if let Ok(m) = std::fs::symlink_metadata(dst) {
                if (m.dev(), m.ino()) != (dev, ino) {
                    return Err(Error::NotOurs {
                        path: dst.to_path_buf(),
                    });
                }
            }
            Replace::Same { dev, ino }
        }
    };
    taken.add_name(dst, Taken::Output);
    let report = match &opts.report {
        None => None,
        Some(path) => {
            let replace = output::check_side_output(path, Side::Report, opts.force, &taken)?;
            taken.add_name(path, Taken::Output);
            Some((path.clone(), replace))
        }
    };
    if opts.side_config {
        check_beside_output(dst, opts)?;
    }
    let config = match (&opts.model_config, opts.plan.target.strategy()) {
        _ if !opts.side_config => None,
        (Some(given), _) => {
            // Read now, before any work: refused here if it is no JSON object.
            let text = crate::run::json::read_model_config(given)?;
            taken.add_name(given, Taken::Input);
            let path = output::parent_dir(dst).join("config.json");
            let replace = check_beside(&path, dst, opts.force, &taken)?;
            Some(SideConfig {
                path,
                replace,
                text: Some(text),
            })
        }
        (None, Some(_)) => {
            let path = crate::run::beside::side_config_path(dst);
            let replace = check_beside(&path, dst, opts.force, &taken)?;
            Some(SideConfig {
                path,
                replace,
                text: None,
            })
        }
        (None, None) => None,
    };
    let withdraw = if opts.side_config && opts.force {
        withdrawn(dst, opts.plan.target, config.as_ref())?
    } else {
        Vec::new()
    };
    Ok(Outputs {
        replace,
        mode: replaced_mode,
        report,
        config,
        withdraw,
    })
}

/// How a conversion writes its files, once checked.
#[derive(Clone, Debug)]
pub struct Outputs {
    replace: Replace,
    /// The mode of the file `force` replaces.
    mode: Option<u32>,
    report: Option<(PathBuf, Replace)>,
    config: Option<SideConfig>,
    /// Configs beside the output that would describe it wrongly, removed before it is
    /// published (`withdrawn`).
    withdraw: Vec<PathBuf>,
}

/// The configs beside a lone output that `force` replaces which would describe the new
/// weights wrongly, withdrawn before they are published, so that a run stopped between the
/// weights and their config leaves no config that misleads a loader: an FP8 side config
/// (`side_config_path`, stcast's name) this run does not write again, when it is the one
/// stcast wrote beside the output replaced (`beside::stale_side`: another is refused when
/// it would describe the new weights wrongly, else left), and a model config that this run
/// replaces (`config`) when it says another dtype or scheme (`beside::problem`).
fn withdrawn(dst: &Path, target: Target, config: Option<&SideConfig>) -> Result<Vec<PathBuf>> {
    use crate::run::beside::StaleSide;
    let mut out = Vec::new();
    let side = crate::run::beside::side_config_path(dst);
    if side.is_file() && config.is_none_or(|c| c.path != side) {
        match crate::run::beside::stale_side(&side, &[dst.to_path_buf()], target) {
            StaleSide::Withdraw => out.push(side),
            StaleSide::Refuse(why) => {
                return Err(Error::WrongConfig {
                    path: side,
                    why,
                    folder: true,
                })
            }
            StaleSide::Leave => {}
        }
    }
    let weights = crate::run::beside::Weights::planned(target);
    if let (Some(c), Some(weights)) = (config.filter(|c| c.text.is_some()), weights) {
        let old = crate::run::check::read_bounded(&c.path).ok();
        let wrong = old.is_some_and(|t| {
            crate::run::beside::problem(&String::from_utf8_lossy(&t), weights, false).is_some()
        });
        if wrong {
            out.push(c.path.clone());
        }
    }
    Ok(out)
}

/// The config a lone file's run writes beside its output: the model's (`text`, as given),
/// or else, under an FP8 target, its `quantization_config` alone.
#[derive(Clone, Debug)]
struct SideConfig {
    path: PathBuf,
    replace: Replace,
    text: Option<String>,
}

/// Refuse a lone output whose folder holds what would describe it wrongly: an earlier
/// re-sharding's shards or index under its stem (a loader reads them for it), or a config
/// this run leaves as it is (no model config given) that says another dtype or scheme than
/// the weights it writes (`beside::problem`). An FP8 side config of the output it replaces
/// is withdrawn when it is published instead (`Job::publish`).
fn check_beside_output(dst: &Path, opts: &Options) -> Result<()> {
    let left = crate::run::beside::leftovers(dst);
    if let Some(first) = left.first() {
        let dir = output::parent_dir(dst);
        return Err(Error::Survey {
            path: dir.join(first),
            dst: dir,
            problem: crate::error::SurveyProblem::Leftovers { listed: left },
        });
    }
    let weights = crate::run::beside::Weights::planned(opts.plan.target);
    let config = crate::run::beside::model_config(dst).filter(|_| opts.model_config.is_none());
    if let (Some(weights), Some(path)) = (weights, config) {
        crate::run::beside::refuse_wrong_config(path, weights, false)?;
    }
    Ok(())
}

/// `output::check_side_output` for a config in the output's own folder, which the output
/// creates when missing (nothing is there then: no identity tells the two names apart, and
/// the same name in the one folder is the output itself).
fn check_beside(path: &Path, dst: &Path, force: bool, taken: &Territory) -> Result<Replace> {
    if !output::parent_dir(dst).exists() {
        if path.file_name() == dst.file_name() {
            return Err(Error::SideOutput {
                path: path.to_path_buf(),
                role: Side::Config.name(),
                what: Taken::Output.what(),
            });
        }
        taken.check(path, Side::Config)?;
        return Ok(Replace::No);
    }
    output::check_side_output(path, Side::Config, force, taken)
}

/// Refuse a destination that cannot be written: a missing folder, the input itself, a
/// folder, an existing file without `force`. Returns the mode of the file `force` replaces.
pub fn check_destination(src: &Source, dst: &Path, force: bool) -> Result<Option<u32>> {
    // `out/` names a folder even where none exists (or where `out` is a file): refused now,
    // not when publishing fails after the whole conversion.
    if output::names_a_folder(dst) {
        return Err(match output::at_path(dst) {
            AtPath::Folder => Error::DestinationIsFolder {
                path: dst.to_path_buf(),
            },
            _ => Error::NoDestinationFolder {
                dir: dst.to_path_buf(),
                exists: std::fs::symlink_metadata(dst.components().as_path()).is_ok(),
            },
        });
    }
    // Missing folders are created (once every check has passed) inside the nearest one
    // that exists.
    let dir = output::parent_dir(dst);
    if let Err(at) = output::missing_dirs(&dir) {
        return Err(Error::NoDestinationFolder {
            dir: at,
            exists: true,
        });
    }
    let path = dst.to_path_buf();
    match output::at_path(dst) {
        AtPath::Nothing => Ok(None),
        AtPath::Folder => Err(Error::DestinationIsFolder { path }),
        AtPath::Special => Err(Error::DestinationIsSpecial { path }),
        AtPath::File { followed } => {
            if let Some(m) = &followed {
                if src.identities()?.contains(&(m.dev(), m.ino())) {
                    return Err(Error::DestinationIsInput { path });
                }
            }
            if !force {
                return Err(Error::DestinationExists { path });
            }
            // The replaced file's permissions carry over (a link's: those of its target).
            Ok(followed.map(|m| m.mode()))
        }
    }
}

/// Is an output of `src` that converts `converted` of its tensors a copy of it: no tensor
/// changes dtype and the format stays (a PyTorch checkpoint is worth writing as safetensors
/// as it is)?
pub fn is_copy(src: &Source, converted: usize) -> bool {
    converted == 0 && !src.changes_format()
}

/// Refuse an output that would be a copy of the input (`is_copy`).
pub fn check_something_changes(src: &Source, plan: &Plan, allow_copy: bool) -> Result<()> {
    if is_copy(src, plan.converted()) && !allow_copy {
        return Err(Error::NothingToConvert {
            path: src.path.clone(),
            target: plan.target,
            bf16_copied: plan.copies_bf16(),
        });
    }
    Ok(())
}

/// Tensors up to this size are converted in batches (`Job::small_batch`): for them the
/// per-window calls (a stat, faulting in, writeback) cost more than the conversion. Larger
/// ones keep windows of their own, which release memory sooner (300 tensors of 1 MB peaked
/// at 52 MiB RSS batched, 40 MiB not).
const SMALL_TENSOR: u64 = 256 << 10;

/// Small tensors this far apart in the input (a zip entry's local header between two
/// storages of a torch checkpoint) still make one batch: the bytes between are faulted in
/// and released with them.
const SMALL_GAP: u64 = 4096;

/// A conversion in progress. Dropping it before `finish` leaves nothing behind.
pub struct Job {
    src: Source,
    dst: PathBuf,
    plan: Plan,
    out: TempOutput,
    out_map: MmapMut,
    pool: rayon::ThreadPool,
    threads: usize,
    isa: Isa,
    tuning: Tuning,
    cursor: Cursor,
    /// Input pages read but not yet released.
    in_pending: PendingRelease,
    /// Where gathered tensors (strided or big-endian views) are copied, a window at a time.
    scratch: Vec<u8>,
    /// Output written since the last writeback start: an absolute file range.
    out_pending: Option<(u64, u64)>,
    /// Output whose writeback was started and that is dropped once written, oldest first.
    out_inflight: VecDeque<(u64, u64)>,
    mid_tensor_hit: bool,
    on_overflow: OnOverflow,
    started: Instant,
    /// Per tensor of `plan.tensors`, when measuring.
    numerics: Option<Vec<Numerics>>,
    /// Per tensor of `plan.tensors` under an FP8 target (empty otherwise): what quantizing did.
    fp8: Vec<Fp8Stats>,
    /// Per tensor of `plan.tensors` of a quantized input (empty otherwise): the values each
    /// dequantized weight came to.
    ranges: Vec<Range>,
    /// Every warning so far (the plan's first), and how many `take_warnings` handed out.
    warnings: Vec<Warning>,
    taken: usize,
    /// Where the numeric report goes, and once sealed its hidden file.
    report: Option<(PathBuf, Replace)>,
    report_out: Option<TempOutput>,
    /// The config a lone file's output gets beside it, and once sealed its hidden file.
    config: Option<SideConfig>,
    config_out: Option<TempOutput>,
    withdraw: Vec<PathBuf>,
    /// The destination's folders this job created: removed unless it publishes. Last, so
    /// that it drops after the outputs inside them.
    made_dirs: output::MadeDirs,
}

impl Job {
    /// Check the destination, plan, and create the hidden output, for an opened input
    /// (maybe scanned already: its stamp is still the one taken when it was opened, so a
    /// change during the scan is caught too).
    ///
    /// `OnOverflow::Keep` needs a scan first (`task::ConvertTask` does both); here the plan
    /// keeps `opts.plan.keep_names` as given.
    pub fn new(src: Source, dst: &Path, opts: &Options, started: Instant) -> Result<Job> {
        let outputs = check_outputs(&src, dst, opts)?;
        let mut plan = plan::plan(&src.path, &src.header, &opts.plan)?;
        check_something_changes(&src, &plan, opts.allow_copy)?;
        plan.warnings.splice(0..0, src.warnings());
        let dir = output::parent_dir(dst);
        // Temp files of killed runs (named ones, where O_TMPFILE is missing) go first.
        plan.warnings.extend(output::remove_stale_temps(&dir));

        // Every refusal is behind us: the destination's missing folders are made now.
        let made_dirs = output::MadeDirs::for_output(dst)?;
        let out = TempOutput::create(dst, outputs.replace, outputs.mode, "")?;
        out.preallocate(plan.file_len())?;
        // SAFETY: the file is ours alone (unnamed, or named and locked), and sized to
        // the plan by `preallocate`; nothing else resizes it while mapped.
        let mut out_map = unsafe { MmapMut::map_mut(&out.file) }
            .map_err(|e| Error::io(dst, "cannot map the output", e))?;
        let header = plan.take_header();
        out_map[..header.len()].copy_from_slice(&header);
        drop(header);
        if opts.tuning.advise != ReadAdvice::Normal {
            src.advise(Advice::Sequential);
        }

        let (pool, threads) = worker_pool(opts.threads, "stcast", dst)?;
        let cursor = Cursor::new(opts.tuning.window, src.header.data_len());
        let plan_len = plan.tensors.len();
        // A dequantized weight can overflow an F16 target (code x scale beyond 65504): its
        // overflow is counted as any conversion's, whatever the options.
        let dequantizes = plan
            .tensors
            .iter()
            .any(|t| matches!(t.action, Action::Dequantize(_)));
        if let Some(SideConfig {
            path, text: None, ..
        }) = &outputs.config
        {
            plan.warnings.push(crate::error::side_config_notice(path));
        }
        let warnings = plan.warnings.clone();
        Ok(Job {
            dst: dst.to_path_buf(),
            plan,
            out,
            out_map,
            pool,
            threads,
            isa: opts.tuning.isa.unwrap_or_else(Isa::detect),
            tuning: opts.tuning.clone(),
            cursor,
            in_pending: PendingRelease::default(),
            scratch: Vec::new(),
            out_pending: None,
            out_inflight: VecDeque::new(),
            mid_tensor_hit: false,
            on_overflow: opts.on_overflow,
            started,
            // The overflow guard and the report need the counts whatever `opts.numerics` says.
            numerics: (opts.numerics
                || opts.on_overflow == OnOverflow::Error
                || dequantizes
                || outputs.report.is_some())
            .then(|| vec![Numerics::default(); plan_len]),
            fp8: match opts.plan.target.strategy() {
                Some(_) => vec![Fp8Stats::default(); plan_len],
                None => Vec::new(),
            },
            ranges: match dequantizes {
                true => vec![Range::default(); plan_len],
                false => Vec::new(),
            },
            warnings,
            taken: 0,
            report: outputs.report,
            report_out: None,
            config: outputs.config,
            config_out: None,
            withdraw: outputs.withdraw,
            src,
            made_dirs,
        })
    }

    /// Source data bytes done and in all.
    pub fn progress(&self) -> (u64, u64) {
        self.cursor.progress()
    }

    /// Convert about `budget` source bytes (whole windows). Returns true when all is done.
    pub fn step(&mut self, budget: u64) -> Result<bool> {
        let mut spent = 0u64;
        while spent < budget {
            let Some(w) = self.next_window() else {
                break;
            };
            if let Some((items, bytes, span)) = self.small_batch(w) {
                self.convert_batch(w.item, items, bytes, span)?;
                spent += bytes;
                continue;
            }
            let t = &self.plan.tensors[w.item];
            let s = &self.src.header.tensors[t.source];
            let (action, tensor_len, input) = (t.action, s.len(), s.input);
            let gathered = s.gather.is_some();
            let (file, src_abs) = self.src.locate(s);
            let src_abs = src_abs + w.pos;
            let dst_abs = self.plan.data_start() + t.start + action.out_len(w.pos);
            let dst_n = action.out_len(w.len);
            let da = dst_abs as usize;
            file.check_unchanged()?;
            if self.tuning.advise == ReadAdvice::WillNeed && !gathered {
                // Start reading the next window while this one converts.
                let next = (src_abs + w.len) as usize;
                let end = (next + w.len as usize).min(file.map.len());
                if next < end {
                    let _ = file.map.advise_range(Advice::WillNeed, next, end - next);
                }
            }
            let src_bytes = match action {
                Action::Dequantize(d) => dequant_input(&self.src, s, d, w, &mut self.scratch)?,
                _ => self.src.read(s, w.pos, w.len, &mut self.scratch)?,
            };
            let faulted = if let Action::Quantize(q) = action {
                let (s0, _) = self.plan.scales[w.item].expect("a quantized weight has a scale");
                let per = q.scales_per_granule() * q.size();
                let at = self.plan.data_start() + s0 + w.pos / q.granule() * per;
                let n = w.len.div_ceil(q.granule()) * per;
                let (qd, sd) = two_mut(
                    &mut self.out_map,
                    (da, dst_n as usize),
                    (at as usize, n as usize),
                );
                let stats = quantize_window(&self.pool, self.threads, q, src_bytes, qd, sd);
                // A NaN or inf in a group makes its amax, so its scale, NaN or inf: the scales
                // tell, without a second pass over the elements.
                if fp8::has_nonfinite(q.d, sd) {
                    return Err(Error::NonFiniteWeight {
                        path: self.src.path.clone(),
                        tensor: s.name.clone(),
                    });
                }
                self.fp8[w.item].merge(&stats);
                false
            } else if let Action::Dequantize(d) = action {
                let dst_bytes = &mut self.out_map[da..da + dst_n as usize];
                let (pool, src) = (&self.pool, &self.src);
                let range = dequantize_step(pool, self.threads, d, src, s, w, src_bytes, dst_bytes);
                if let Some(all) = &mut self.numerics {
                    all[w.item].merge(&range.numerics());
                }
                self.ranges[w.item].merge(&range);
                false
            } else {
                let dst_bytes = &mut self.out_map[da..da + dst_n as usize];
                let work = Work {
                    pool: &self.pool,
                    threads: self.threads,
                    isa: self.isa,
                    populate: self.tuning.populate,
                };
                match (action, &mut self.numerics) {
                    (Action::Convert(c), Some(all)) => {
                        let (measured, faulted) = work.convert_and_measure(c, src_bytes, dst_bytes);
                        all[w.item].merge(&measured);
                        faulted
                    }
                    _ => work.run(action, src_bytes, dst_bytes),
                }
            };
            if faulted {
                // Pages past the end of a file truncated just now: say so rather than fault.
                self.src.check_unchanged()?;
                return Err(Error::io(
                    &self.src.path,
                    "cannot read the input",
                    std::io::Error::from_raw_os_error(libc::EFAULT),
                ));
            }
            self.cursor.advance(w);
            spent += w.len;
            let gptoss = matches!(action, Action::Dequantize(d) if matches!(d.packing, Packing::GptOss { .. }));
            if gptoss {
                // Released expert by expert above.
            } else if !gathered {
                self.release_input(input, src_abs, w.len);
            } else if w.pos + w.len == tensor_len {
                // A view's elements lie anywhere in its storage: drop its pages once done.
                let s = &self.src.header.tensors[t_source_of(&self.plan, w.item)];
                self.src.release_gathered(s);
            }
            self.note_output(dst_abs, dst_n)?;
            if let (Some((a, b)), true) = (
                self.plan.scales.get(w.item).copied().flatten(),
                w.pos + w.len == tensor_len,
            ) {
                // The weight is done, so is its scale: written back and dropped like the rest.
                let base = self.plan.data_start();
                self.write_behind((base + a, base + b))?;
            }
            if w.pos + w.len < tensor_len && !self.mid_tensor_hit {
                self.mid_tensor_hit = true;
                failpoint::hit("mid-tensor")
                    .map_err(|e| Error::io(&self.dst, "conversion failed", e))?;
            }
        }
        let finished = self.next_window().is_none();
        if finished {
            self.flush_pages()?;
            self.check_overflow()?;
        }
        Ok(finished)
    }

    /// From window `w` at the start of a tensor smaller than a window: how many consecutive
    /// whole tensors (and their source bytes) fit in one window, their input and output
    /// each contiguous. None when `w` is not such a tensor, or it is alone: a window's
    /// per-call costs (a stat, faulting in, writeback) are then paid once for the batch.
    fn small_batch(&self, w: Window) -> Option<(usize, u64, u64)> {
        let window = self.tuning.window as u64;
        let tensors = &self.plan.tensors;
        let src = &self.src.header.tensors;
        let first = &tensors[w.item];
        let len = |i: usize| src[tensors[i].source].len();
        let head = &src[first.source];
        let plain = |t: &TensorPlan| {
            t.role == Role::Tensor
                && !matches!(t.action, Action::Quantize(_) | Action::Dequantize(_))
        };
        if w.pos != 0
            || w.len != len(w.item)
            || w.len > SMALL_TENSOR
            || head.gather.is_some()
            || !plain(first)
        {
            return None;
        }
        let (mut items, mut bytes) = (1, w.len);
        let (mut src_end, mut dst_end) = (
            src[first.source].end,
            first.start + first.action.out_len(w.len),
        );
        while let Some(t) = tensors.get(w.item + items) {
            let s = &src[t.source];
            if !plain(t)
                || s.input != head.input
                || s.gather.is_some()
                || s.len() > SMALL_TENSOR
                || s.start < src_end
                || s.start - src_end > SMALL_GAP
                || t.start != dst_end
                || s.end - head.start > window
            {
                break;
            }
            bytes += s.len();
            src_end = s.end;
            dst_end = t.start + t.action.out_len(s.len());
            items += 1;
        }
        (items > 1).then_some((items, bytes, src_end - head.start))
    }

    /// Convert `items` whole tensors from plan index `first` (`bytes` of input, within `span`
    /// bytes of the input from the first's start), in input order with gaps of at most
    /// `SMALL_GAP` between them and contiguous in the output, as one window.
    fn convert_batch(&mut self, first: usize, items: usize, bytes: u64, span: u64) -> Result<()> {
        let t0 = &self.plan.tensors[first];
        let s0 = &self.src.header.tensors[t0.source];
        let input = s0.input;
        let (file, src_abs) = self.src.locate(s0);
        let dst_abs = self.plan.data_start() + t0.start;
        let last = &self.plan.tensors[first + items - 1];
        let dst_end = self.plan.data_start()
            + last.start
            + last
                .action
                .out_len(self.src.header.tensors[last.source].len());
        let (sa, da) = (src_abs as usize, dst_abs as usize);
        let (sn, dn) = (span as usize, (dst_end - dst_abs) as usize);
        file.check_unchanged()?;
        let work = Work {
            pool: &self.pool,
            threads: self.threads,
            isa: self.isa,
            populate: self.tuning.populate,
        };
        let src_bytes = &file.map[sa..sa + sn];
        let mut dst_bytes = &mut self.out_map[da..da + dn];
        if work.fault_in(src_bytes, dst_bytes) {
            self.src.check_unchanged()?;
            return Err(Error::io(
                &self.src.path,
                "cannot read the input",
                std::io::Error::from_raw_os_error(libc::EFAULT),
            ));
        }
        let mut pieces = Vec::with_capacity(items);
        for t in &self.plan.tensors[first..first + items] {
            let s = &self.src.header.tensors[t.source];
            let (at, n) = ((s.start - s0.start) as usize, s.len() as usize);
            let (d, rest) =
                std::mem::take(&mut dst_bytes).split_at_mut(t.action.out_len(n as u64) as usize);
            dst_bytes = rest;
            pieces.push((t.action, &src_bytes[at..at + n], d));
        }
        let measured = work.run_batch(&mut pieces, self.numerics.is_some());
        if let Some(all) = &mut self.numerics {
            for (k, m) in measured.into_iter().enumerate() {
                all[first + k].merge(&m);
            }
        }
        self.cursor.advance_items(items, bytes);
        self.release_input(input, src_abs, span);
        self.note_output(dst_abs, dn as u64)?;
        Ok(())
    }

    /// What FP8 did to each quantized weight, in output order (empty for other targets).
    fn quantized(&self) -> Vec<QuantizedTensor> {
        quantized_tensors(&self.plan, &self.src, &self.fp8)
    }

    /// The values each dequantized weight came to, in output order (empty for other inputs).
    fn dequantized(&self) -> Vec<DequantizedTensor> {
        dequantized_tensors(&self.plan, &self.src, &self.ranges)
    }

    /// Warnings not handed out yet: the plan's, then the overflow warning of the last step.
    pub fn take_warnings(&mut self) -> Vec<Warning> {
        let new = self.warnings[self.taken..].to_vec();
        self.taken = self.warnings.len();
        new
    }

    /// The measured tensors whose action `wanted` accepts, by name, in output order.
    fn measured_by(&self, wanted: impl Fn(&Action) -> bool) -> Vec<(&str, &Numerics)> {
        let Some(all) = &self.numerics else {
            return Vec::new();
        };
        self.plan
            .tensors
            .iter()
            .zip(all)
            .filter(|(t, _)| wanted(&t.action))
            .map(|(t, n)| (self.src.header.tensors[t.source].name.as_str(), n))
            .collect()
    }

    /// The converted tensors, measured, by name, in output order.
    fn measured(&self) -> Vec<(&str, &Numerics)> {
        self.measured_by(|a| matches!(a, Action::Convert(_)))
    }

    /// Once everything is converted: refuse overflow under `OnOverflow::Error` (nothing is
    /// published then), else warn about it; warn about values that underflowed to zero.
    fn check_overflow(&mut self) -> Result<()> {
        let measured = self.measured();
        // The dequantized weights that overflowed the target (only their overflow counts:
        // E4M3 holds no infinity, so every ±inf written is a finite value that overflowed).
        let mut dequantized = self.measured_by(|a| matches!(a, Action::Dequantize(_)));
        dequantized.retain(|(_, n)| n.overflow > 0);
        if let (OnOverflow::Keep, Some((tensor, n))) = (self.on_overflow, dequantized.first()) {
            let (path, target) = (&self.src.path, self.plan.target);
            return Err(unkeepable_overflow(path, tensor, n.overflow, target));
        }
        let all: Vec<(&str, &Numerics)> = measured.iter().chain(&dequantized).copied().collect();
        let mut found = Vec::new();
        let is_dequantized = |name: &str| dequantized.iter().any(|(d, _)| *d == name);
        if let Some((error, warning)) =
            plan::overflow_outcome(&self.src.path, self.plan.target, &all, is_dequantized)
        {
            if self.on_overflow == OnOverflow::Error {
                return Err(error);
            }
            found.push(warning);
        }
        // After overflow: the graver loss is read first.
        found.extend(plan::underflow_warning(&measured));
        self.warnings.extend(found);
        Ok(())
    }

    /// The next window of the plan's tensors, in output order. A quantized weight's windows
    /// hold whole groups (rows, or bands of 128 rows): at least one, however long.
    fn next_window(&mut self) -> Option<Window> {
        let (plan, src) = (&self.plan, &self.src);
        let mut w = self
            .cursor
            .peek(plan.tensors.len(), |i| plan.tensors[i].src_len(&src.header))?;
        let left = plan.tensors[w.item].src_len(&src.header) - w.pos;
        match plan.tensors[w.item].action {
            Action::Quantize(q) => {
                let g = q.granule();
                w.len = (w.len / g * g).max(g).min(left);
            }
            Action::Dequantize(d) => w.len = dequant_window(d, self.cursor.window(), w.len, left),
            _ => {}
        }
        Some(w)
    }

    /// Drop input pages that are done with, in contiguous batches of about a window.
    fn release_input(&mut self, input: usize, at: u64, n: u64) {
        let window = self.tuning.window as u64;
        self.in_pending
            .add(&self.src.files, input, (at, at + n), window);
    }

    /// Start writeback of finished output and drop the window written before it.
    fn note_output(&mut self, at: u64, n: u64) -> Result<()> {
        let (a, b) = match self.out_pending {
            Some((a, b)) if b == at => (a, b + n),
            Some(r) => {
                self.write_behind(r)?;
                (at, at + n)
            }
            None => (at, at + n),
        };
        self.out_pending = Some((a, b));
        // Output windows are half the input ones for bf16; batch them to a window.
        if b - a >= self.tuning.window as u64 / 2 {
            self.out_pending = None;
            self.write_behind((a, b))?;
        }
        Ok(())
    }

    /// Start writing `r` back, then wait for the oldest range beyond the write-behind depth
    /// (by default the previous one) and drop its pages, so dirty and resident memory stay
    /// at a few windows whatever the file size.
    fn write_behind(&mut self, r: (u64, u64)) -> Result<()> {
        let fd = self.out.file.as_raw_fd();
        // Starting writeback is advisory; a real write error surfaces in `settle` or fsync.
        let _ = sync_range(fd, r, libc::SYNC_FILE_RANGE_WRITE);
        self.out_inflight.push_back(r);
        while self.out_inflight.len() > self.tuning.write_behind.max(1) {
            let oldest = self.out_inflight.pop_front().expect("non-empty");
            self.settle(oldest)?;
        }
        Ok(())
    }

    fn settle(&mut self, r: (u64, u64)) -> Result<()> {
        let fd = self.out.file.as_raw_fd();
        let rc = sync_range(
            fd,
            r,
            libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER,
        );
        if let Err(e) = rc {
            // EIO here is a real write error: stop rather than publish a bad file.
            if e.raw_os_error() == Some(libc::EIO) {
                return Err(Error::io(&self.dst, "write failed", e));
            }
        }
        // SAFETY: MADV_DONTNEED on a shared file mapping only drops our page-table
        // entries; the data stays in the page cache and file, and a later touch of the
        // same pages re-reads it. No Rust reference into this range is alive.
        unsafe {
            let _ = self.out_map.unchecked_advise_range(
                UncheckedAdvice::DontNeed,
                r.0 as usize,
                (r.1 - r.0) as usize,
            );
        }
        fadvise_dontneed(fd, r);
        Ok(())
    }

    fn flush_pages(&mut self) -> Result<()> {
        self.in_pending.flush(&self.src.files);
        if let Some(r) = self.out_pending.take() {
            self.write_behind(r)?;
        }
        while let Some(r) = self.out_inflight.pop_front() {
            self.settle(r)?;
        }
        Ok(())
    }

    /// After the last `step`: check the input once more, make the output durable, and
    /// write the report into its hidden file. After this only the names are missing.
    pub fn seal(&mut self) -> Result<()> {
        // Everything is read: an input unchanged now was unchanged while it was read.
        self.src.check_unchanged()?;
        // fsync writes the mapped pages too: they are the file's page cache.
        self.out.seal()?;
        if let Some((path, replace)) = &self.report {
            let measured = self.measured();
            let total = Numerics::total(measured.iter().map(|(_, n)| *n));
            let quantized = self.quantized();
            let dequantized = self.dequantized();
            let bytes = crate::report::numeric_report(
                &self.src.path,
                &self.dst,
                Some(self.plan.target),
                &measured,
                &total,
                &quantized,
                &dequantized,
            );
            let out = TempOutput::create(path, *replace, None, "")?;
            (&out.file)
                .write_all(&bytes)
                .map_err(|e| Error::io(path, "write failed", e))?;
            out.seal()?;
            self.report_out = Some(out);
        }
        if let Some(SideConfig {
            path,
            replace,
            text,
        }) = &self.config
        {
            let ignore = self.plan.unquantized_modules(&self.src.header);
            let ignore = self.plan.target.strategy().map(|_| &ignore[..]);
            let given = text.as_deref().unwrap_or("{}");
            // A dense output's config loses its quantization keys, as a dequantized
            // folder's does.
            let target = self.plan.target;
            let dense =
                crate::run::beside::problem(given, crate::run::beside::Weights::Dense, false)
                    .is_some()
                    && crate::run::beside::Weights::dense(target);
            let text = crate::run::json::config_text(given, target, dense, ignore)
                .map_err(|_| Error::BadConfig {
                    path: path.clone(),
                    reason: "not a JSON object",
                })?
                .unwrap_or_else(|| given.to_string());
            let out = TempOutput::create(path, *replace, None, "")?;
            (&out.file)
                .write_all(text.as_bytes())
                .map_err(|e| Error::io(path, "write failed", e))?;
            out.seal()?;
            self.config_out = Some(out);
        }
        Ok(())
    }

    /// After `seal`: what the output will be once published (`TempOutput::identity`).
    pub fn sealed(&self) -> Result<Published> {
        self.out.identity()
    }

    /// The SHA-256 of the header in the output (its length prefix and JSON), read back from
    /// the output's mapping: the header written.
    pub fn header_sha256(&self) -> String {
        crate::text::sha256_hex(&self.out_map[..self.plan.header_len as usize])
    }

    /// After `seal`: give the output its name (the commit point), then the report.
    pub fn publish(self) -> Result<Report> {
        let Job {
            src,
            dst,
            out,
            out_map,
            threads,
            isa,
            started,
            on_overflow,
            plan,
            warnings,
            report_out,
            config_out,
            withdraw,
            numerics,
            made_dirs,
            fp8,
            ranges,
            ..
        } = self;
        drop(out_map);
        let quantized = quantized_tensors(&plan, &src, &fp8);
        let dequantized = dequantized_tensors(&plan, &src, &ranges);
        let unquantized = plan.unquantized_modules(&src.header);
        let kept = plan.kept_tensors(&src.header);
        // The names move from the header into the report (no copy of 300k names).
        let bytes_in = src.file_bytes();
        let mut names: Vec<String> = src.header.tensors.into_iter().map(|t| t.name).collect();
        let numerics: Vec<(String, Numerics)> = match numerics {
            None => Vec::new(),
            Some(all) => plan
                .tensors
                .iter()
                .zip(all)
                .filter(|(t, _)| matches!(t.action, Action::Convert(_)))
                .map(|(t, n)| (std::mem::take(&mut names[t.source]), n))
                .collect(),
        };
        for path in &withdraw {
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::io(path, "cannot remove", e));
                }
                _ => {}
            }
        }
        out.publish()?;
        made_dirs.keep();
        for side in [report_out, config_out].into_iter().flatten() {
            side.publish().map_err(|e| Error::AfterCommit {
                published: dst.clone(),
                source: Box::new(e),
                folder: false,
            })?;
        }
        Ok(Report {
            numerics_total: Numerics::total(numerics.iter().map(|(_, n)| n)),
            numerics,
            tensors_kept: plan.kept(),
            bytes_kept: plan.kept_bytes(),
            kept,
            bytes_in,
            bytes_out: plan.file_len(),
            src: src.path,
            dst,
            target: plan.target,
            tensors_converted: plan.converted(),
            tensors_copied: plan.inputs() - plan.converted(),
            tensors_quantized: quantized.len(),
            quantized,
            dequantized,
            tensors_dropped: plan.dropped(),
            unquantized,
            seconds: started.elapsed().as_secs_f64(),
            threads,
            isa,
            on_overflow,
            warnings,
        })
    }
}

fn sync_range(fd: i32, (a, b): (u64, u64), flags: libc::c_uint) -> std::io::Result<()> {
    // SAFETY: sync_file_range on our own descriptor and a range inside the file.
    let rc = unsafe { libc::sync_file_range(fd, a as i64, (b - a) as i64, flags) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What FP8 did to each weight `plan` quantizes (`fp8`: per plan tensor), in output order.
fn quantized_tensors(plan: &Plan, src: &Source, fp8: &[Fp8Stats]) -> Vec<QuantizedTensor> {
    plan.tensors
        .iter()
        .zip(fp8)
        .filter_map(|(t, st)| match t.action {
            Action::Quantize(q) => Some(QuantizedTensor::new(
                src.header.tensors[t.source].name.clone(),
                q,
                st,
            )),
            _ => None,
        })
        .collect()
}

/// The values each weight `plan` dequantizes came to (`ranges`: per plan tensor), in output
/// order.
fn dequantized_tensors(plan: &Plan, src: &Source, ranges: &[Range]) -> Vec<DequantizedTensor> {
    plan.tensors
        .iter()
        .zip(ranges)
        .filter_map(|(t, r)| match t.action {
            Action::Dequantize(d) => Some(DequantizedTensor {
                name: d.out_name(&src.header.tensors[t.source].name).to_string(),
                format: d.format().text,
                range: r.clone(),
            }),
            _ => None,
        })
        .collect()
}

/// Two disjoint ranges `(start, len)` of `buf`, mutably.
fn two_mut(buf: &mut [u8], a: (usize, usize), b: (usize, usize)) -> (&mut [u8], &mut [u8]) {
    if a.0 <= b.0 {
        let (x, y) = buf.split_at_mut(b.0);
        (&mut x[a.0..a.0 + a.1], &mut y[..b.1])
    } else {
        let (x, y) = buf.split_at_mut(a.0);
        (&mut y[..a.1], &mut x[b.0..b.0 + b.1])
    }
}

/// Quantize one window of whole groups of `q`'s weight into `qd` (E4M3) and `sd` (their
/// scales), the groups split over the pool's threads.
pub(crate) fn quantize_window(
    pool: &rayon::ThreadPool,
    threads: usize,
    q: Quant,
    src: &[u8],
    qd: &mut [u8],
    sd: &mut [u8],
) -> Fp8Stats {
    use rayon::prelude::*;
    let g = q.granule() as usize;
    let size = q.size() as usize;
    let per = (q.scales_per_granule() * q.size()) as usize;
    let groups = src.len().div_ceil(g);
    let run = |s: &[u8], qd: &mut [u8], sd: &mut [u8]| -> Fp8Stats {
        let cols = q.cols as usize;
        match q.strategy {
            Strategy::Channel => fp8::quantize_channel(q.d, cols, s, qd, sd),
            Strategy::Block => {
                let mut all = Fp8Stats::default();
                for ((s, qd), sd) in s
                    .chunks(g)
                    .zip(qd.chunks_mut(g / size))
                    .zip(sd.chunks_mut(per))
                {
                    all.merge(&fp8::quantize_band(q.d, cols, s, qd, sd));
                }
                all
            }
        }
    };
    if groups < 2 || threads < 2 || src.len() < (512 << 10) {
        return run(src, qd, sd);
    }
    let chunk = groups.div_ceil(threads * 4).max(1);
    pool.install(|| {
        src.par_chunks(chunk * g)
            .zip(qd.par_chunks_mut(chunk * g / size))
            .zip(sd.par_chunks_mut(chunk * per))
            .map(|((s, qd), sd)| run(s, qd, sd))
            .reduce(Fp8Stats::default, |mut a, b| {
                a.merge(&b);
                a
            })
    })
}

/// `OnOverflow::Keep`'s refusal of a dequantized weight that overflows the target: it has
/// no dtype of its own to keep (its codes mean nothing without the scale dequantization
/// drops).
pub(crate) fn unkeepable_overflow(path: &Path, tensor: &str, values: u64, target: Target) -> Error {
    Error::Fp8Unpaired {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        problem: Box::new(crate::error::Fp8Problem::Overflow { values, target }),
    }
}

/// The length of a dequantized weight's window of about `len` source bytes (`left` are
/// left): whole granules (E4M3: rows of `cols` bytes; packed: a row's codes; gpt-oss: a
/// group of all an expert's rows), at least one, and no more than keep the window's output
/// what a bf16 window's is (each E4M3 byte becomes 2, a packed one 4 or more: half the
/// window), so memory stays bounded as any conversion's.
pub(crate) fn dequant_window(d: Deq, window: u64, len: u64, left: u64) -> u64 {
    let g = d.src_row();
    let rows = window / 2 / d.out_row().max(1);
    let len = len.min(rows * g);
    (len / g * g).max(g).min(left)
}

/// The source bytes of a dequantized weight's window `w` (`scratch` holds a gathered
/// view's). gpt-oss windows run over the blocks in the output's order: the kernel reads
/// the window's blocks from the whole tensor, in place.
pub(crate) fn dequant_input<'a>(
    src: &'a Source,
    s: &SourceTensor,
    d: Deq,
    w: Window,
    scratch: &'a mut Vec<u8>,
) -> Result<&'a [u8]> {
    if let Packing::GptOss { .. } = d.packing {
        let (f, at) = src.locate(s);
        return Ok(&f.map[at as usize..(at + s.len()) as usize]);
    }
    src.read(s, w.pos, w.len, scratch)
}

/// Dequantize window `w` of weight `s` (its bytes `input`, from `dequant_input`) into
/// `dst`, and drop the pages of the scales (and gpt-oss blocks) it is done with: the
/// conversion's step and a scan's (`scan::Scan`) are one. Returns the values written.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dequantize_step(
    pool: &rayon::ThreadPool,
    threads: usize,
    d: Deq,
    src: &Source,
    s: &SourceTensor,
    w: Window,
    input: &[u8],
    dst: &mut [u8],
) -> Range {
    let row0 = w.pos / d.src_row();
    dequantize_window(pool, threads, d, src, row0, input, dst);
    release_companions(src, d, row0 + w.len / d.src_row());
    if let Packing::GptOss { .. } = d.packing {
        // Its windows read all an expert's rows: its pages go once it is done.
        let (file, at) = src.locate(s);
        let expert = d.rows * (d.cols / 2);
        file.release((at, at + (w.pos + w.len) / expert * expert));
    }
    Range::of(d.target == safetensors::Dtype::BF16, dst)
}

/// A dequantized weight's rows before `row_end` are done: drop the pages of the scale
/// and zero point rows they read, so that a big scale (small groups: a quarter of the
/// weight in F32 for groups of 16) stays resident a window at a time, not whole.
fn release_companions(src: &Source, d: Deq, row_end: u64) {
    if let Packing::GptOss { .. } = d.packing {
        // Scales [E, rows, G]: an expert's go once its G granules are done.
        let t = &src.header.tensors[d.scale];
        let groups = d.cols / 32;
        let per = d.rows * groups;
        let (file, at) = src.locate(t);
        file.release((at, at + row_end / groups.max(1) * per));
        return;
    }
    let done = match d.layout {
        Layout::Tensor => return,
        Layout::Channel | Layout::Group(_) => row_end,
        Layout::Block => row_end / crate::quant::BLOCK,
    };
    for k in d.companions() {
        let t = &src.header.tensors[k];
        // Channel, group and block scales (and their zero points) are [rows, n].
        let rows = t.shape.first().map_or(1, |&r| r.max(1) as u64);
        let bytes = done.min(rows) * (t.len() / rows);
        if bytes > 0 {
            let (file, at) = src.locate(t);
            file.release((at, at + bytes));
        }
    }
}

/// Dequantize one window of whole rows (from row `row0`) of an FP8 input's weight into
/// `dst`, the rows split over the pool's threads; its scale and zero point (whole) are read
/// from `input`, where `dequantizable` found them beside the weight.
pub(crate) fn dequantize_window(
    pool: &rayon::ThreadPool,
    threads: usize,
    d: Deq,
    input: &Source,
    row0: u64,
    src: &[u8],
    dst: &mut [u8],
) {
    use rayon::prelude::*;
    let whole = |k: usize| {
        let t = &input.header.tensors[k];
        let (file, at) = input.locate(t);
        &file.map[at as usize..(at + t.len()) as usize]
    };
    let scales = whole(d.scale);
    if d.packing != Packing::Fp8 {
        return unpack_window(pool, threads, d, whole, row0, src, dst);
    }
    let zero_points = d.zero_point.map(|z| fp8::ZeroPoints {
        dtype: z.dtype,
        data: whole(z.tensor),
    });
    let cols = d.cols as usize;
    let out = d.out_size() as usize;
    let layout = match d.layout {
        Layout::Tensor => fp8::ScaleLayout::Tensor,
        Layout::Channel => fp8::ScaleLayout::Channel,
        Layout::Block => fp8::ScaleLayout::Block {
            rows: crate::quant::BLOCK as usize,
            cols: crate::quant::BLOCK as usize,
        },
        Layout::Group(size) => fp8::ScaleLayout::Block {
            rows: 1,
            cols: size as usize,
        },
    };
    let rows = src.len() / cols.max(1);
    let run = |r0: usize, s: &[u8], o: &mut [u8]| {
        if d.scale_inv {
            fp8::dequantize_once(layout, d.s_dtype, scales, cols, r0, s, d.target, o);
        } else {
            fp8::dequantize(
                layout,
                d.s_dtype,
                scales,
                zero_points,
                cols,
                r0,
                s,
                d.target,
                o,
            );
        }
    };
    if threads < 2 || src.len() < (512 << 10) || rows < 2 {
        return run(row0 as usize, src, dst);
    }
    let per = rows.div_ceil(threads * 4).max(1);
    pool.install(|| {
        src.par_chunks(per * cols)
            .zip(dst.par_chunks_mut(per * cols * out))
            .enumerate()
            .for_each(|(k, (s, o))| run(row0 as usize + k * per, s, o));
    });
}

/// `dequantize_window` for packed codes (`Packing`, not FP8): `src` holds whole rows from
/// row `row0` (for gpt-oss: the whole blocks tensor, and `row0` the first granule of the
/// window, which `dst`'s length sizes), `whole` gives an input tensor's bytes.
fn unpack_window<'a>(
    pool: &rayon::ThreadPool,
    threads: usize,
    d: Deq,
    whole: impl Fn(usize) -> &'a [u8] + Sync,
    row0: u64,
    src: &[u8],
    dst: &mut [u8],
) {
    use crate::packed;
    use rayon::prelude::*;
    let (cols, target) = (d.cols as usize, d.target);
    let scales = whole(d.scale);
    if let Packing::GptOss { .. } = d.packing {
        let (rows, groups) = (d.rows as usize, cols / 32);
        let n = dst.len() / d.out_row().max(1) as usize;
        let (mut q, mut done) = (row0 as usize, 0usize);
        let (mut blocks, mut sc) = (Vec::new(), Vec::new());
        while done < n {
            // One expert's run of groups [g0, g1).
            let (e, g0) = (q / groups, q % groups);
            let g1 = groups.min(g0 + n - done);
            let gw = g1 - g0;
            blocks.clear();
            sc.clear();
            for r in 0..rows {
                let at = (e * rows + r) * groups;
                blocks.extend_from_slice(src.get((at + g0) * 16..(at + g1) * 16).unwrap_or(&[]));
                sc.extend_from_slice(scales.get(at + g0..at + g1).unwrap_or(&[]));
            }
            let out = d.out_row() as usize;
            let o = &mut dst[done * out..(done + gw) * out];
            if blocks.len() == rows * gw * 16 && sc.len() == rows * gw {
                packed::gptoss_transposed(rows, gw, &blocks, &sc, target, o);
            }
            q += gw;
            done += gw;
        }
        return;
    }
    let global = match d.packing {
        Packing::Nvfp4 { global, scalar } => {
            let b = whole(global);
            let g = b
                .first_chunk::<4>()
                .map_or(f32::NAN, |b| f32::from_le_bytes(*b));
            Some(if scalar {
                packed::GlobalScale::Scalar(g)
            } else {
                packed::GlobalScale::Tensor(g)
            })
        }
        _ => None,
    };
    let zero_points = d.zero_point.map(|z| whole(z.tensor));
    let (src_row, out_row) = (d.src_row() as usize, d.out_row() as usize);
    let run = |r0: usize, s: &[u8], o: &mut [u8]| {
        let n = s.len() / src_row.max(1);
        match d.packing {
            Packing::Nvfp4 { .. } | Packing::Mxfp4 => {
                let per = match d.layout {
                    Layout::Group(g) => cols / g as usize,
                    _ => return,
                };
                let sc = scales.get(r0 * per..(r0 + n) * per).unwrap_or(&[]);
                if sc.len() != n * per {
                    return;
                }
                match global {
                    Some(g) => packed::nvfp4(cols, s, sc, g, target, o),
                    None => packed::mxfp4(cols, s, sc, target, o),
                }
            }
            Packing::Int { bits } => {
                let zp = zero_points.map(|data| packed::ZeroPoints::PackedRows {
                    bits,
                    groups: match d.layout {
                        Layout::Group(g) => cols / g as usize,
                        _ => 1,
                    },
                    data,
                });
                let codes = packed::Codes::Packed { bits, words: s };
                packed::int(
                    int_layout(d.layout),
                    cols,
                    r0,
                    codes,
                    d.s_dtype,
                    scales,
                    zp,
                    target,
                    o,
                );
            }
            Packing::I8 => {
                let zp = zero_points.map(packed::ZeroPoints::I8);
                let codes = packed::Codes::I8(s);
                packed::int(
                    int_layout(d.layout),
                    cols,
                    r0,
                    codes,
                    d.s_dtype,
                    scales,
                    zp,
                    target,
                    o,
                );
            }
            Packing::Fp8 | Packing::GptOss { .. } => {}
        }
    };
    let rows = src.len() / src_row.max(1);
    if threads < 2 || src.len() < (256 << 10) || rows < 2 {
        return run(row0 as usize, src, dst);
    }
    let per = rows.div_ceil(threads * 4).max(1);
    pool.install(|| {
        src.par_chunks(per * src_row)
            .zip(dst.par_chunks_mut(per * out_row))
            .enumerate()
            .for_each(|(k, (s, o))| run(row0 as usize + k * per, s, o));
    });
}

/// The packed kernels' name for a scale layout (blocks are FP8's alone).
fn int_layout(l: Layout) -> crate::packed::IntLayout {
    match l {
        Layout::Tensor => crate::packed::IntLayout::Tensor,
        Layout::Channel | Layout::Block => crate::packed::IntLayout::Channel,
        Layout::Group(g) => crate::packed::IntLayout::Group(g as usize),
    }
}

/// The source tensor of the plan's tensor `i`.
fn t_source_of(plan: &Plan, i: usize) -> usize {
    plan.tensors[i].source
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_clamps_and_refuses() {
        let t = Tuning::new(&Knobs::default()).unwrap();
        assert_eq!(
            (t.window, t.write_behind, t.step),
            (DEFAULT_WINDOW, 1, DEFAULT_STEP)
        );
        let knobs = Knobs {
            window_mib: Some(0),
            write_behind: Some(1000),
            step_mib: Some(1 << 20),
            advise: Some("willneed".into()),
            populate: Some(false),
            ..Knobs::default()
        };
        let t = Tuning::new(&knobs).unwrap();
        assert_eq!((t.window, t.write_behind, t.step), (1 << 20, 64, 1 << 36));
        assert_eq!((t.advise, t.populate), (ReadAdvice::WillNeed, false));
        let bad = Knobs {
            advise: Some("later".into()),
            ..Knobs::default()
        };
        assert!(Tuning::new(&bad)
            .unwrap_err()
            .contains("advise must be one of"));
        let bad = Knobs {
            isa: Some("vax".into()),
            ..Knobs::default()
        };
        assert_eq!(
            Tuning::new(&bad).unwrap_err(),
            "isa \"vax\" is not available here"
        );
    }
}
