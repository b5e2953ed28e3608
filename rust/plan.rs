//! Plan the output of one input: each tensor's dtype and why, the order and offsets, the
//! header bytes, and the warnings a caller should hear before anything is written.

use std::borrow::Borrow;

use crate::numerics::Numerics;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use crate::dtype::{action_for, width_rank, Action};
use crate::error::{unmatched_message, Error, Fp8Problem, Result, Warning};
use crate::header::{SourceHeader, MAX_HEADER, PREFIX};
use crate::pattern::{compile_globs, glob_matches};
use crate::quant;
use crate::text::{count, esc, esc_path, name_list};
use crate::vocab::{is_quantized_dtype, Fp8Skip, ReasonCode, Target, Unmatched, WarningKind};

/// Why a tensor is converted, kept in its source dtype, or copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    Converted,
    /// An FP8 target's weight: F8_E4M3 with its scale.
    Quantized,
    /// An FP8 input's weight, dequantized with its scale.
    Dequantized,
    /// A dequantized weight's scale, zero point, global scale or shape (any packing:
    /// FP8, NVFP4, MXFP4, INT), or its module's activation scale: not in the output.
    Dropped,
    /// A float tensor that a `keep` pattern (this one, the first that matched) keeps.
    KeptByPattern(String),
    /// A float tensor with fewer elements than `keep_min_size` (this number).
    KeptByMinSize(u64),
    /// A float tensor that a scan found would overflow to infinity.
    KeptToAvoidOverflow,
    /// Already the target dtype.
    AlreadyTarget,
    /// BF16 under the F16 target without `from_bf16`.
    Bf16Source,
    /// A float format that is never converted: F8, F6, F4, complex.
    NotConverted,
    /// Integers and booleans.
    NotFloat,
}

impl Reason {
    /// The stable code (`vocab::ReasonCode`), as reports show it.
    pub fn code(&self) -> ReasonCode {
        match self {
            Reason::Converted => ReasonCode::Converted,
            Reason::Quantized => ReasonCode::Quantized,
            Reason::Dequantized => ReasonCode::Dequantized,
            Reason::Dropped => ReasonCode::Dropped,
            Reason::KeptByPattern(_) => ReasonCode::KeepPattern,
            Reason::KeptByMinSize(_) => ReasonCode::KeepMinSize,
            Reason::KeptToAvoidOverflow => ReasonCode::KeepOverflow,
            Reason::AlreadyTarget => ReasonCode::AlreadyTarget,
            Reason::Bf16Source => ReasonCode::Bf16Source,
            Reason::NotConverted => ReasonCode::NotConverted,
            Reason::NotFloat => ReasonCode::NotFloat,
        }
    }

    /// Why, in words, for messages (option names as `{placeholders}`).
    pub fn words(&self) -> String {
        match self {
            Reason::Converted => "it is converted".into(),
            Reason::Quantized => "it is quantized to FP8".into(),
            Reason::Dequantized => "it is dequantized with its scale".into(),
            Reason::Dropped => "it is a quantized weight's scale, zero point or shape (or \
                                an activation scale), used to dequantize and not written"
                .into(),
            Reason::KeptByPattern(p) => format!("the {{keep}} pattern `{}` keeps it", esc(p)),
            Reason::KeptByMinSize(n) => format!("{{keep_min_size={n}}} keeps it"),
            Reason::KeptToAvoidOverflow => "{on_overflow=keep} keeps it: it would overflow".into(),
            Reason::AlreadyTarget => "it already has the target dtype".into(),
            Reason::Bf16Source => "BF16 is copied as it is unless {from_bf16}".into(),
            Reason::NotConverted => "its dtype is never converted".into(),
            Reason::NotFloat => "it is not a float".into(),
        }
    }

    /// The `keep` pattern behind a `KeptByPattern`.
    pub fn pattern(&self) -> Option<&str> {
        match self {
            Reason::KeptByPattern(p) => Some(p),
            _ => None,
        }
    }

    /// Is this a tensor that would be converted but keeps its source dtype?
    pub fn is_kept(&self) -> bool {
        self.code().is_kept()
    }
}

/// A float tensor that keeps its source dtype, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptTensor {
    pub name: String,
    pub dtype: Dtype,
    pub bytes: u64,
    pub reason: Reason,
}

/// How to plan: the target, and which tensors keep their source dtype.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub target: Target,
    /// fnmatch patterns on tensor names (`*`, `?`, `[seq]`, `[!seq]`, case-sensitive; `*`
    /// matches dots too). A float tensor whose name one matches keeps its dtype and bytes.
    pub keep: Vec<String>,
    /// Float tensors with fewer elements than this keep their dtype (0: none).
    pub keep_min_size: u64,
    /// Under the F16 target, convert BF16 tensors too (otherwise they are copied).
    pub from_bf16: bool,
    /// Tensors that keep their dtype because converting them would overflow.
    pub keep_names: HashSet<String>,
    /// What a `keep` pattern that matches no tensor name does.
    pub unmatched: Unmatched,
    /// Plan a quantized checkpoint anyway (with a warning); otherwise it is refused
    /// (`quantized`).
    pub allow_quantized: bool,
    /// The config of the folder this file is in, when it has a `quantization_config`:
    /// the file is then quantized whatever its dtypes (its I8/U8 weights count too).
    pub quantization_config: Option<PathBuf>,
    /// The schemes the folder's model config gives the packed weights this dequantizes:
    /// each must describe them as their tensors store them (`quant::Schemes::check`).
    pub schemes: Option<quant::Schemes>,
    /// FP8 targets: the weights that hold NaN or inf, left unquantized in BF16. What a weight
    /// becomes decides the output's sizes and header, so these are found by reading the
    /// weights before anything is planned to be written (`ConvertTask`, `InspectTask`, or
    /// the caller, for a re-sharded group). `None`: not read yet; a plan made without them
    /// takes every weight for finite.
    pub unquantized: Option<HashSet<String>>,
    /// The options recorded in the output's `__metadata__` (`record::Record::text`); None:
    /// the input's `__metadata__` as it is.
    pub record: Option<String>,
    /// FP8 targets: what the model config says of its experts' sizes (why fused experts
    /// that stay fused do, in the warning: `experts::left`).
    pub experts: Option<crate::experts::Model>,
}

impl PlanOptions {
    /// Convert every float tensor the target takes; keep nothing.
    pub fn new(target: Target) -> PlanOptions {
        PlanOptions {
            target,
            keep: Vec::new(),
            keep_min_size: 0,
            from_bf16: false,
            keep_names: HashSet::new(),
            unmatched: Unmatched::Warn,
            allow_quantized: false,
            quantization_config: None,
            schemes: None,
            unquantized: None,
            record: None,
            experts: None,
        }
    }

    /// These options for `source`, opened: its record says the sizes its fused experts
    /// were split by, if any was (verify splits them as convert did).
    pub fn for_source(&self, source: &crate::source::Source) -> PlanOptions {
        let mut out = self.clone();
        if let (Some(sizes), Some(r)) = (source.experts, &self.record) {
            out.record = Some(crate::record::Record::with_experts(r, sizes));
        }
        out
    }

    /// The output's `__metadata__` of an input with `meta` (`record::with_record`).
    pub fn metadata(&self, meta: Option<&[(String, String)]>) -> Option<Vec<(String, String)>> {
        crate::record::with_record(meta, self.record.as_deref())
    }

    /// Was the weight `name` found to hold NaN or inf (an FP8 target leaves it BF16)?
    pub fn holds_nonfinite(&self, name: &str) -> bool {
        self.unquantized.as_ref().is_some_and(|u| u.contains(name))
    }
}

/// One tensor of the output.
#[derive(Clone, Debug)]
pub struct TensorPlan {
    /// Index into `SourceHeader::tensors`.
    pub source: usize,
    pub dtype: Dtype,
    pub action: Action,
    /// Byte range relative to the start of the output data section.
    pub start: u64,
    pub end: u64,
    /// What this entry is: a tensor of the input, or the scale of a quantized one.
    pub role: Role,
}

/// An output tensor's part in the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A tensor of the input (converted, quantized or copied).
    Tensor,
    /// The scale of the quantized weight `source` (no input bytes of its own: the
    /// conversion writes it while quantizing the weight).
    Scale(crate::quant::Quant),
}

impl TensorPlan {
    /// The output's name and shape of a `Role::Tensor` entry of source tensor `s`: its own,
    /// or a packed weight's unpacked (`quant::Deq::out_name`, `out_shape`).
    pub fn out_name_shape<'a>(
        &self,
        s: &'a crate::header::SourceTensor,
    ) -> (&'a str, std::borrow::Cow<'a, [usize]>) {
        match self.action {
            Action::Dequantize(d) => (d.out_name(&s.name), d.out_shape(&s.shape).into()),
            _ => (&s.name, std::borrow::Cow::Borrowed(&s.shape[..])),
        }
    }

    /// Input bytes this entry reads (none for a scale).
    pub fn src_len(&self, src: &SourceHeader) -> u64 {
        match self.role {
            Role::Tensor => src.tensors[self.source].len(),
            Role::Scale(_) => 0,
        }
    }
}

/// The whole output: its header bytes and where each tensor goes.
#[derive(Clone, Debug)]
pub struct Plan {
    pub target: Target,
    /// Prefix plus JSON header, padded with spaces to a multiple of 8 (empty once a
    /// conversion has written it: see `take_header`).
    pub header: Vec<u8>,
    /// Its length, which stays.
    pub header_len: u64,
    /// Tensors in output order.
    pub tensors: Vec<TensorPlan>,
    /// Why each tensor is planned as it is, in input order (indexed like
    /// `SourceHeader::tensors`).
    pub reasons: Vec<Reason>,
    /// The `keep` patterns that match no tensor name of this file, in the order given.
    pub keep_unmatched: Vec<String>,
    /// FP8 targets: why each float tensor of the input that is not quantized is not (indexed
    /// like `reasons`; empty for the other targets).
    pub fp8_skips: Vec<Option<crate::vocab::Fp8Skip>>,
    /// FP8 targets: where each quantized weight's scale goes in the output data (indexed
    /// like `tensors`).
    pub scales: Vec<Option<(u64, u64)>>,
    pub warnings: Vec<Warning>,
}

impl Plan {
    pub fn data_start(&self) -> u64 {
        self.header_len
    }

    /// The header bytes, handed over once (a header of many tensors is tens of MB).
    pub fn take_header(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.header)
    }

    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.end)
    }

    /// Are BF16 tensors copied because the target is fp16 without `from_bf16`?
    pub fn copies_bf16(&self) -> bool {
        self.reasons.iter().any(|r| matches!(r, Reason::Bf16Source))
    }

    pub fn file_len(&self) -> u64 {
        self.data_start() + self.data_len()
    }

    /// Tensors of the input that change dtype (quantized ones included).
    pub fn converted(&self) -> usize {
        self.tensors.iter().filter(|t| t.action.converts()).count()
    }

    /// Input tensors a dequantization drops (scales, global scales, zero points, shapes,
    /// activation scales).
    pub fn dropped(&self) -> usize {
        self.reasons
            .iter()
            .filter(|r| **r == Reason::Dropped)
            .count()
    }

    /// Weights quantized to FP8.
    pub fn quantized(&self) -> usize {
        self.tensors
            .iter()
            .filter(|t| matches!(t.action, Action::Quantize(_)))
            .count()
    }

    /// FP8 targets: the modules whose 2-D weight is not quantized, whatever its dtype, in
    /// input order (the config's `ignore`: a loader then leaves them as they are; one not
    /// listed would be read as FP8 codes with a made-up scale). `quant::unquantized_module`
    /// is the rule. Empty for the other targets.
    pub fn unquantized_modules(&self, src: &SourceHeader) -> Vec<String> {
        if self.target.strategy().is_none() {
            return Vec::new();
        }
        src.tensors
            .iter()
            .zip(&self.reasons)
            .filter(|(_, r)| **r != Reason::Quantized)
            .filter_map(|(t, _)| quant::unquantized_module(&t.name, &t.shape).map(String::from))
            .collect()
    }

    /// Tensors of the input in the output (scales not counted).
    pub fn inputs(&self) -> usize {
        self.tensors
            .iter()
            .filter(|t| t.role == Role::Tensor)
            .count()
    }

    /// The tensors that keep their source dtype, in output order.
    pub fn kept_tensors(&self, src: &SourceHeader) -> Vec<KeptTensor> {
        self.tensors
            .iter()
            .filter(|t| self.reasons[t.source].is_kept())
            .map(|t| KeptTensor {
                name: src.tensors[t.source].name.clone(),
                dtype: t.dtype,
                bytes: t.end - t.start,
                reason: self.reasons[t.source].clone(),
            })
            .collect()
    }

    /// Tensors that would be converted but keep their source dtype.
    pub fn kept(&self) -> usize {
        self.reasons.iter().filter(|r| r.is_kept()).count()
    }

    /// Their bytes (the same in the input and the output).
    pub fn kept_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| self.reasons[t.source].is_kept())
            .map(|t| t.end - t.start)
            .sum()
    }
}

/// Why a tensor that the target does not take is copied.
fn copy_reason(dtype: Dtype, target: Target) -> Reason {
    let wide_float = matches!(dtype, Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16);
    // Under `keep` every tensor's target is its own dtype.
    if Some(dtype) == target.dtype() || (target == Target::Keep && wide_float) {
        Reason::AlreadyTarget
    } else if dtype == Dtype::BF16 {
        Reason::Bf16Source
    } else if is_quantized_dtype(dtype) || dtype == Dtype::C64 {
        Reason::NotConverted
    } else {
        Reason::NotFloat
    }
}

/// `keep` patterns, compiled with fnmatch semantics.
pub(crate) struct KeepPatterns {
    patterns: Vec<glob::Pattern>,
    matched: Vec<bool>,
}

impl KeepPatterns {
    pub(crate) fn compile(keep: &[String]) -> Result<KeepPatterns> {
        let patterns = compile_globs(keep, crate::vocab::OptionName::Keep)?;
        Ok(KeepPatterns {
            matched: vec![false; patterns.len()],
            patterns,
        })
    }

    /// The first pattern that matches `name`; every matching pattern counts as used.
    pub(crate) fn first_match(&mut self, name: &str) -> Option<usize> {
        let mut first = None;
        for (i, p) in self.patterns.iter().enumerate() {
            if glob_matches(p, name) {
                self.matched[i] = true;
                first = first.or(Some(i));
            }
        }
        first
    }
}

/// Plan the output of `src` under `opts`: order, offsets, header bytes, reasons, warnings.
/// `path` is the input's, for messages.
pub fn plan(path: &Path, src: &SourceHeader, opts: &PlanOptions) -> Result<Plan> {
    if let Some(why) = already_quantized(src, opts) {
        return Err(Error::AlreadyQuantized {
            path: path.to_path_buf(),
            why,
        });
    }
    let mut patterns = KeepPatterns::compile(&opts.keep)?;
    let mut reasons = Vec::with_capacity(src.tensors.len());
    let mut tensors: Vec<TensorPlan> = Vec::with_capacity(src.tensors.len());
    let strategy = opts.target.strategy();
    let mut fp8_skips = Vec::new();
    let names: HashSet<&str> = match strategy {
        Some(_) => src.tensors.iter().map(|t| t.name.as_str()).collect(),
        None => HashSet::new(),
    };
    let unpaired = |(tensor, problem)| Error::Fp8Unpaired {
        path: path.to_path_buf(),
        tensor,
        problem: Box::new(problem),
    };
    let (deq, dropped) = match (opts.target.dtype(), strategy) {
        (Some(d), None) => {
            quant::dequantizable(&src.tensors, &src.weight_shapes, d).map_err(unpaired)?
        }
        _ => (Vec::new(), Vec::new()),
    };
    if let Some(schemes) = &opts.schemes {
        schemes.check(&src.tensors, &deq).map_err(unpaired)?;
    }
    for (i, t) in src.tensors.iter().enumerate() {
        let hit = patterns.first_match(&t.name);
        let dequantizing = dropped.get(i) == Some(&true) || matches!(deq.get(i), Some(Some(_)));
        if let (Some(k), true) = (hit, dequantizing) {
            let pattern = opts.keep[k].clone();
            return Err(unpaired((t.name.clone(), Fp8Problem::Kept { pattern })));
        }
        if dropped.get(i) == Some(&true) {
            reasons.push(Reason::Dropped);
            continue;
        }
        if let Some(Some(d)) = deq.get(i) {
            reasons.push(Reason::Dequantized);
            tensors.push(TensorPlan {
                source: i,
                dtype: d.target,
                action: Action::Dequantize(*d),
                start: 0,
                end: 0,
                role: Role::Tensor,
            });
            continue;
        }
        if let Some(strategy) = strategy {
            let float = matches!(t.dtype, Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16);
            let choice = match quant::choose(&t.name, t.dtype, &t.shape, strategy) {
                Ok(_) if opts.holds_nonfinite(&t.name) => Err(Fp8Skip::NonFinite),
                Ok(_) if names.contains(quant::scale_name(&t.name).as_str()) => {
                    Err(Fp8Skip::ScaleNameTaken)
                }
                Ok(q) if q.granule() > quant::MAX_GROUP => Err(Fp8Skip::GroupTooLarge),
                c => c,
            };
            let keep_min = t.len() / crate::dtype::elem_size(t.dtype) < opts.keep_min_size;
            if let (Ok(q), None, false) = (choice, hit, keep_min) {
                reasons.push(Reason::Quantized);
                fp8_skips.push(None);
                tensors.push(TensorPlan {
                    source: i,
                    dtype: Dtype::F8_E4M3,
                    action: Action::Quantize(q),
                    start: 0,
                    end: 0,
                    role: Role::Tensor,
                });
                tensors.push(TensorPlan {
                    source: i,
                    dtype: q.d,
                    action: Action::Copy,
                    start: 0,
                    end: 0,
                    role: Role::Scale(q),
                });
                continue;
            }
            fp8_skips.push(if float { choice.err() } else { None });
        }
        let natural = action_for(t.dtype, opts.target, opts.from_bf16);
        let reason = match natural {
            Action::Copy | Action::Quantize(_) | Action::Dequantize(_) => {
                copy_reason(t.dtype, opts.target)
            }
            Action::Convert(c) => {
                if let Some(k) = hit {
                    Reason::KeptByPattern(opts.keep[k].clone())
                } else if t.len() / c.src_size() < opts.keep_min_size {
                    Reason::KeptByMinSize(opts.keep_min_size)
                } else if opts.keep_names.contains(&t.name) {
                    Reason::KeptToAvoidOverflow
                } else {
                    Reason::Converted
                }
            }
        };
        let (action, dtype) = match reason {
            Reason::Converted => (natural, opts.target.dtype().unwrap_or(t.dtype)),
            _ => (Action::Copy, t.dtype),
        };
        reasons.push(reason);
        tensors.push(TensorPlan {
            source: i,
            dtype,
            action,
            start: 0,
            end: 0,
            role: Role::Tensor,
        });
    }
    if strategy.is_none() && opts.target.dtype().is_some() {
        check_packed_left(path, src, &reasons, opts.allow_quantized)?;
    }
    // Dequantizing: every quantized tensor with its scale, every scale with its weight.
    if reasons.contains(&Reason::Dequantized) {
        check_fp8_pairs(path, src, &reasons)?;
    }
    let keep_unmatched: Vec<String> = opts
        .keep
        .iter()
        .zip(&patterns.matched)
        .filter(|(_, &m)| !m)
        .map(|(p, _)| p.clone())
        .collect();
    if opts.unmatched == Unmatched::Error && !keep_unmatched.is_empty() {
        return Err(Error::UnmatchedPatterns {
            path: path.to_path_buf(),
            patterns: keep_unmatched,
        });
    }

    // Stable, so input order survives within each width; every tensor's length is a
    // multiple of its element size, so each group starts aligned for the next. Kept
    // tensors keep their source width and so land in that width's group (kept F32 before
    // the converted 16-bit ones).
    tensors.sort_by_key(|t| std::cmp::Reverse(width_rank(t.dtype)));
    let mut offset = 0u64;
    let mut scale_at = vec![
        None;
        if strategy.is_some() {
            src.tensors.len()
        } else {
            0
        }
    ];
    for t in &mut tensors {
        let len = match t.role {
            Role::Tensor => t.action.out_len(src.tensors[t.source].len()),
            Role::Scale(q) => q.scale_len(),
        };
        t.start = offset;
        t.end = offset + len;
        offset = t.end;
        if let Role::Scale(_) = t.role {
            scale_at[t.source] = Some((t.start, t.end));
        }
    }
    let scales: Vec<Option<(u64, u64)>> = match strategy {
        None => Vec::new(),
        Some(_) => tensors
            .iter()
            .map(|t| match t.action {
                Action::Quantize(_) => scale_at[t.source],
                _ => None,
            })
            .collect(),
    };

    let header = encode_header(src, &opts.metadata(src.metadata.as_deref()), &tensors);
    if header.len() - PREFIX > MAX_HEADER {
        return Err(Error::OutputHeaderTooLarge {
            path: path.to_path_buf(),
            limit: MAX_HEADER,
        });
    }
    let mut plan = Plan {
        target: opts.target,
        header_len: header.len() as u64,
        header,
        tensors,
        reasons,
        keep_unmatched,
        fp8_skips,
        scales,
        warnings: Vec::new(),
    };
    let quantized = quantized(src, &plan, opts);
    if let (Some((why, tensors)), false) = (&quantized, opts.allow_quantized) {
        return Err(Error::Quantized {
            path: path.to_path_buf(),
            why: why.clone(),
            tensors: tensors.clone(),
        });
    }
    plan.warnings = plan_warnings(&plan, src, opts, quantized);
    Ok(plan)
}

/// The header bytes of an output holding `tensors` (planned from `src`): the length prefix,
/// then the JSON with `__metadata__` (`meta`) first, padded with spaces to a multiple of 8.
pub(crate) fn encode_header(
    src: &SourceHeader,
    meta: &Option<Vec<(String, String)>>,
    tensors: &[TensorPlan],
) -> Vec<u8> {
    // Written straight into one buffer about the source header's size: no allocation per
    // tensor, and no second copy (a header of 300,000 tensors is tens of MB).
    let mut out: Vec<u8> =
        Vec::with_capacity(PREFIX + src.header_len as usize + src.header_len as usize / 8 + 64);
    out.extend_from_slice(&[0u8; PREFIX]);
    out.push(b'{');
    if let Some(meta) = meta {
        encode_metadata(&mut out, meta);
    }
    for (i, t) in tensors.iter().enumerate() {
        if i > 0 || meta.is_some() {
            out.push(b',');
        }
        let s = &src.tensors[t.source];
        match t.role {
            Role::Tensor => {
                let (name, shape) = t.out_name_shape(s);
                encode_entry(&mut out, name, t.dtype, &shape, (t.start, t.end))
            }
            Role::Scale(q) => encode_entry(
                &mut out,
                &quant::scale_name(&s.name),
                t.dtype,
                &q.scale_shape(),
                (t.start, t.end),
            ),
        }
    }
    out.push(b'}');
    // Padding to 8 keeps the data section, and so every tensor, aligned.
    while !(out.len() - PREFIX).is_multiple_of(8) {
        out.push(b' ');
    }
    let n = (out.len() - PREFIX) as u64;
    out[..PREFIX].copy_from_slice(&n.to_le_bytes());
    out
}

/// A JSON string, quoted and escaped as serde_json writes it.
fn quote(out: &mut Vec<u8>, s: &str) {
    // Writing into a Vec cannot fail.
    serde_json::to_writer(&mut *out, s).expect("strings always serialize")
}

/// `"__metadata__":{...}`, keys in the given order.
pub(crate) fn encode_metadata(out: &mut Vec<u8>, meta: &[(String, String)]) {
    out.extend_from_slice(b"\"__metadata__\":{");
    for (i, (k, v)) in meta.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        quote(out, k);
        out.push(b':');
        quote(out, v);
    }
    out.push(b'}');
}

/// One tensor's entry: `"name":{"dtype":...,"shape":[...],"data_offsets":[start,end]}`.
pub(crate) fn encode_entry(
    out: &mut Vec<u8>,
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    (start, end): (u64, u64),
) {
    use std::io::Write;
    // At 300,000 tensors this runs 300,000 times: integers through `itoa`, not `fmt`.
    let mut num = itoa::Buffer::new();
    quote(out, name);
    let _ = write!(out, ":{{\"dtype\":\"{dtype}\",\"shape\":[");
    for (k, &d) in shape.iter().enumerate() {
        if k > 0 {
            out.push(b',');
        }
        out.extend_from_slice(num.format(d).as_bytes());
    }
    out.extend_from_slice(b"],\"data_offsets\":[");
    out.extend_from_slice(num.format(start).as_bytes());
    out.push(b',');
    out.extend_from_slice(num.format(end).as_bytes());
    out.extend_from_slice(b"]}");
}

/// `quantized`: what `quantized` found (a checkpoint converted anyway).
fn plan_warnings(
    plan: &Plan,
    src: &SourceHeader,
    opts: &PlanOptions,
    quantized: Option<(String, Vec<String>)>,
) -> Vec<Warning> {
    let mut warnings = Vec::new();
    if opts.unmatched == Unmatched::Warn && !plan.keep_unmatched.is_empty() {
        warnings.push(Warning::new(
            WarningKind::UnmatchedPattern,
            unmatched_message(&plan.keep_unmatched),
        ));
    }
    let bf16_copied = plan
        .reasons
        .iter()
        .filter(|r| **r == Reason::Bf16Source)
        .count();
    if bf16_copied > 0 {
        let has_f16 = plan.tensors.iter().any(|t| t.dtype == Dtype::F16);
        let (what, verb) = if bf16_copied == 1 {
            ("1 BF16 tensor".to_string(), "is")
        } else {
            (format!("{bf16_copied} BF16 tensors"), "are")
        };
        let mix = if has_f16 {
            "the output mixes BF16 and F16"
        } else {
            "they stay BF16"
        };
        warnings.push(Warning::new(
            WarningKind::Bf16Copied,
            format!("{what} {verb} copied unchanged, so {mix} ({{from_bf16}} converts them too)"),
        ));
    }
    if let Some((why, named)) = quantized {
        warnings.push(quantized_warning(&why, &named, plan.target));
    }
    warnings.extend(fp8_warnings(plan, src, opts.experts.as_ref()));
    // Under `keep` nothing is converted on purpose: the format is what changes.
    if plan.converted() == 0 && plan.target != Target::Keep {
        warnings.push(Warning::new(
            WarningKind::NothingToConvert,
            format!(
                "nothing to convert: no tensor becomes {} (the output is a regrouped byte copy)",
                plan.target.describe()
            ),
        ));
    }
    warnings
}

/// A tensor of a quantized layout that no pairing took (GPTQ/AWQ `qweight`, `qzeros`,
/// `g_idx`; a gpt-oss half without the other; a compressed-tensors pack without its scale;
/// any of bitsandbytes', `bitsandbytes_part`): its format and why stcast cannot read it. Names alone do not make a pack: a plain
/// `seq_packed` integer, or an F32 `x_blocks`, is an ordinary tensor.
fn packed_left(t: &crate::header::SourceTensor) -> Option<(&'static str, &'static str)> {
    let u8_blocks = t.dtype == Dtype::U8 && t.shape.len() >= 2;
    let name = t.name.as_str();
    if name.ends_with(".qweight") {
        Some(("GPTQ/AWQ", "packed codes in a layout stcast does not read"))
    } else if name.ends_with(".qzeros") {
        Some((
            "GPTQ/AWQ",
            "packed zero points in a layout stcast does not read",
        ))
    } else if name.ends_with("g_idx") {
        Some((
            "GPTQ act-order",
            "a group index reorders its weight's columns",
        ))
    } else if name.ends_with(quant::BLOCKS_SUFFIX) && u8_blocks {
        Some(("gpt-oss MXFP4", "no `_scales` beside it"))
    } else if name.ends_with(quant::SCALES_SUFFIX) && u8_blocks {
        Some(("gpt-oss MXFP4", "no `_blocks` beside it"))
    } else if name
        .strip_suffix(quant::PACKED_SUFFIX)
        .is_some_and(|w| quant::module_of(w).is_some())
    {
        Some(("pack-quantized", "no scale stcast pairs with it"))
    } else {
        bitsandbytes_part(name).map(|detail| (BITSANDBYTES, detail))
    }
}

/// The format `bitsandbytes_part` tells.
const BITSANDBYTES: &str = "bitsandbytes";

/// What a tensor of a bitsandbytes-quantized weight is, by the names bitsandbytes saves
/// (`<weight>.absmax`, `.quant_map`, their `nested_` pair and the packed
/// `.quant_state.bitsandbytes__nf4` of 4-bit NF4/FP4; `.SCB` and `.weight_format` of
/// LLM.int8), or None. Its statistics are F32: a conversion would round them under a config
/// that still says bitsandbytes (loaded, wrong weights), and stcast does not dequantize its
/// codes; no option lets it through but `to="keep"`.
fn bitsandbytes_part(name: &str) -> Option<&'static str> {
    let (_, last) = name.rsplit_once('.')?;
    if name.contains(".quant_state.bitsandbytes__") {
        return Some("the packed state of 4-bit codes");
    }
    match last {
        "absmax" | "nested_absmax" => Some("the block scales of 4-bit codes"),
        "quant_map" | "nested_quant_map" => Some("the code book of 4-bit codes"),
        "SCB" => Some("the row scales of LLM.int8 codes"),
        "weight_format" => Some("the layout of LLM.int8 codes"),
        _ => None,
    }
}

/// A packed weight no layout stcast dequantizes takes (`packed_left`) is refused, naming it
/// and its format: converting the rest would write a checkpoint without it. `allowed`
/// (`allow_quantized`) lifts it, but never for bitsandbytes (`bitsandbytes_part`).
fn check_packed_left(
    path: &Path,
    src: &SourceHeader,
    reasons: &[Reason],
    allowed: bool,
) -> Result<()> {
    for (t, r) in src.tensors.iter().zip(reasons) {
        if matches!(r, Reason::Dequantized | Reason::Dropped) {
            continue;
        }
        let left = packed_left(t).filter(|(format, _)| !allowed || *format == BITSANDBYTES);
        if let Some((format, detail)) = left {
            return Err(Error::Fp8Unpaired {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                problem: Box::new(Fp8Problem::Packed {
                    format,
                    detail: detail.to_string(),
                }),
            });
        }
    }
    Ok(())
}

/// An FP8 checkpoint is dequantized whole or not at all: refuse a quantized tensor left as
/// it is, or a weight's scale or zero point left without its weight (another file holds it).
fn check_fp8_pairs(path: &Path, src: &SourceHeader, reasons: &[Reason]) -> Result<()> {
    for (t, r) in src.tensors.iter().zip(reasons) {
        let role = quant::companion_role(&t.name).filter(|_| *r != Reason::Dropped);
        let problem = if let Some(role) = role {
            Fp8Problem::NoWeight {
                role,
                dtype: t.dtype.to_string(),
            }
        } else if is_quantized_dtype(t.dtype) && !matches!(r, Reason::Dequantized | Reason::Dropped)
        {
            Fp8Problem::NoScale
        } else {
            continue;
        };
        return Err(Error::Fp8Unpaired {
            path: path.to_path_buf(),
            tensor: t.name.clone(),
            problem: Box::new(problem),
        });
    }
    Ok(())
}

/// FP8 targets: the weights left unquantized that a user would not expect (NaN or inf in
/// them, 3-D experts, a vision-language model's vision side), and under blocks the fused layers vLLM needs in multiples of 128.
fn fp8_warnings(
    plan: &Plan,
    src: &SourceHeader,
    model: Option<&crate::experts::Model>,
) -> Vec<Warning> {
    let mut out = Vec::new();
    let named = |skip: Fp8Skip| -> Vec<&str> {
        plan.fp8_skips
            .iter()
            .zip(&src.tensors)
            .filter(|(s, _)| **s == Some(skip))
            .map(|(_, t)| t.name.as_str())
            .collect()
    };
    let nonfinite = named(Fp8Skip::NonFinite);
    if !nonfinite.is_empty() {
        out.push(Warning::new(
            WarningKind::NotQuantized,
            format!(
                "{} NaN or inf, so no finite scale exists: left unquantized in BF16 and \
                 listed in the quantization_config's ignore: {}",
                if nonfinite.len() == 1 {
                    "1 weight holds".to_string()
                } else {
                    format!("{} weights hold", nonfinite.len())
                },
                name_list(nonfinite.iter().copied(), 5)
            ),
        ));
    }
    let big = named(Fp8Skip::GroupTooLarge);
    if !big.is_empty() {
        out.push(Warning::new(
            WarningKind::NotQuantized,
            format!(
                "{} a group (a row, or a band of 128 rows) larger than the {} MiB a window \
                 holds: left unquantized in BF16: {}",
                if big.len() == 1 {
                    "1 weight has".to_string()
                } else {
                    format!("{} weights have", big.len())
                },
                quant::MAX_GROUP >> 20,
                name_list(big.iter().copied(), 5)
            ),
        ));
    }
    // Fused experts left fused: one warning per reason (`experts::left`), but for those a
    // `keep` pattern keeps (as it says).
    let by_pattern = |i: usize| matches!(plan.reasons[i], Reason::KeptByPattern(_));
    let kept: HashSet<&str> = (0..src.tensors.len())
        .filter(|&i| by_pattern(i))
        .map(|i| src.tensors[i].name.as_str())
        .collect();
    let kept = |name: &str| kept.contains(name);
    let mut experts: Vec<(Option<crate::experts::Left>, &str)> = plan
        .fp8_skips
        .iter()
        .zip(&src.tensors)
        .enumerate()
        .filter(|(i, (s, _))| **s == Some(Fp8Skip::Experts) && !by_pattern(*i))
        .map(|(_, (_, t))| {
            (
                crate::experts::left(t, &src.tensors, model, &kept),
                t.name.as_str(),
            )
        })
        .collect();
    experts.sort_by_key(|(why, _)| *why);
    for group in experts.chunk_by(|a, b| a.0 == b.0) {
        let why = group[0]
            .0
            .map_or(String::new(), |w| format!(" ({})", w.words()));
        out.push(Warning::new(
            WarningKind::NotQuantized,
            format!(
                "{} of fused MoE experts (3-D) {} BF16, unquantized, not split per \
                 expert{why}: {}",
                count(group.len() as u64, "weight"),
                if group.len() == 1 { "stays" } else { "stay" },
                name_list(group.iter().map(|(_, n)| *n), 5)
            ),
        ));
    }
    let vision = named(Fp8Skip::Vision);
    if !vision.is_empty() {
        let parts: Vec<&str> = quant::VISION_MODULES
            .into_iter()
            .filter(|m| {
                vision
                    .iter()
                    .any(|n| n.to_ascii_lowercase().split('.').any(|p| p == *m))
            })
            .collect();
        out.push(Warning::new(
            WarningKind::NotQuantized,
            format!(
                "{} of the vision tower and its projector ({}) stay BF16, unquantized, as \
                 llm-compressor's FP8 recipes and vLLM leave them: {}",
                count(vision.len() as u64, "weight"),
                parts.join(", "),
                name_list(vision.iter().copied(), 5)
            ),
        ));
    }
    if plan.target.strategy() == Some(crate::vocab::Strategy::Block) {
        let misfit =
            quant::misfit_fused_parts(plan.tensors.iter().filter_map(|t| match t.action {
                Action::Quantize(q) => Some((src.tensors[t.source].name.as_str(), q.rows)),
                _ => None,
            }));
        if !misfit.is_empty() {
            out.push(Warning::new(
                WarningKind::BlockShape,
                format!(
                    "vLLM fuses these layers with the next ones and needs their output size \
                     in multiples of 128 under FP8 blocks; it may refuse: {}",
                    name_list(misfit.iter().map(String::as_str), 5)
                ),
            ));
        }
    }
    out
}

/// The one quantized policy, for files and folders alike: a checkpoint is quantized when
/// its folder's config has a `quantization_config`, or when it holds F8/F4/F6 tensors
/// beside F32 ones (a tensor's name alone never makes it so: ordinary models carry F32
/// tensors named `scale`, and U8 buffers). Its conversion is refused unless
/// `allow_quantized` when it would convert F32 tensors: any, without `keep` patterns; with
/// them (the caller chose what stays) a scale-like one, or any at all when no F32 tensor is
/// named like a scale (then any of them may be one: `--keep zzz` must not let `s` through).
/// Returns why it is quantized (a template) and the F32 tensors that would change (the
/// scale-like ones, if any).
fn quantized(src: &SourceHeader, plan: &Plan, opts: &PlanOptions) -> Option<(String, Vec<String>)> {
    let why = match &opts.quantization_config {
        Some(config) => format!("{} has a quantization_config", esc_path(config)),
        None => {
            // FP8 weights with their scales (and zero points, dropped) are dequantized: what
            // is left is quantized.
            let mut lowp: Vec<String> = src
                .tensors
                .iter()
                .zip(&plan.reasons)
                .filter(|(t, r)| {
                    is_quantized_dtype(t.dtype)
                        && !matches!(r, Reason::Dequantized | Reason::Dropped)
                })
                .map(|(t, _)| t.dtype.to_string())
                .collect();
            let wide = |d: Dtype| matches!(d, Dtype::F32 | Dtype::F64);
            if lowp.is_empty() || !src.tensors.iter().any(|t| wide(t.dtype)) {
                return None;
            }
            lowp.sort();
            lowp.dedup();
            format!("it holds {} tensors beside F32 ones", lowp.join(", "))
        }
    };
    let f32_names: Vec<&str> = src
        .tensors
        .iter()
        .zip(&plan.reasons)
        .filter(|(t, r)| matches!(t.dtype, Dtype::F32 | Dtype::F64) && **r == Reason::Converted)
        .map(|(t, _)| t.name.as_str())
        .collect();
    let scales: Vec<&str> = f32_names
        .iter()
        .copied()
        .filter(|n| n.to_ascii_lowercase().contains("scale"))
        .collect();
    let scales_named = src
        .tensors
        .iter()
        .any(|t| t.dtype == Dtype::F32 && t.name.to_ascii_lowercase().contains("scale"));
    if f32_names.is_empty() || (!opts.keep.is_empty() && scales_named && scales.is_empty()) {
        return None;
    }
    let named = if scales.is_empty() { f32_names } else { scales };
    Some((why, named.into_iter().map(String::from).collect()))
}

/// An FP8 target's input that is quantized already: why (a template naming a quantized
/// tensor, or the config), or None. Neither `allow_quantized` nor `keep` lets it through:
/// its codes would be copied without the scales that give them meaning (or its scales
/// quantized as weights), and the output's config would describe them wrong.
fn already_quantized(src: &SourceHeader, opts: &PlanOptions) -> Option<String> {
    opts.target.strategy()?;
    if let Some(t) = src.tensors.iter().find(|t| is_quantized_dtype(t.dtype)) {
        return Some(format!("tensor `{}` is {}", esc(&t.name), t.dtype));
    }
    // Packed codes (compressed-tensors, gpt-oss, GPTQ): read as the bf16 target would pair
    // them, whether or not the pairing holds.
    let paired = quant::dequantizable(&src.tensors, &src.weight_shapes, Dtype::BF16);
    let packed = match &paired {
        Ok((deq, _)) => src
            .tensors
            .iter()
            .zip(deq)
            .find(|(_, d)| d.is_some())
            .map(|(t, _)| t),
        Err((name, _)) => src.tensors.iter().find(|t| t.name == *name),
    };
    if let Some(t) = packed.or_else(|| src.tensors.iter().find(|t| packed_left(t).is_some())) {
        return Some(format!(
            "tensor `{}` holds quantized codes or their scales",
            esc(&t.name)
        ));
    }
    let config = opts.quantization_config.as_ref()?;
    Some(format!("{} has a quantization_config", esc_path(config)))
}

/// The warning of a quantized checkpoint converted anyway (`allow_quantized`).
fn quantized_warning(why: &str, named: &[String], target: Target) -> Warning {
    Warning::new(
        WarningKind::Quantized,
        format!(
            "quantized checkpoint ({why}): its F32 scale tensors become {} \
             too, which changes the model; scale-like tensors: {} (keep them with {{keep}})",
            target.describe(),
            name_list(named.iter().map(String::as_str), 5)
        ),
    )
}

/// The warning for values that became zero: how many, in how many tensors, the worst.
pub fn underflow_warning<S: AsRef<str>, N: Borrow<Numerics>>(
    numerics: &[(S, N)],
) -> Option<Warning> {
    let mut hit: Vec<(&str, u64)> = numerics
        .iter()
        .filter(|(_, n)| n.borrow().underflow_to_zero > 0)
        .map(|(name, n)| (name.as_ref(), n.borrow().underflow_to_zero))
        .collect();
    if hit.is_empty() {
        return None;
    }
    hit.sort_by_key(|t| std::cmp::Reverse(t.1));
    let values: u64 = hit.iter().map(|t| t.1).sum();
    let worst = hit
        .iter()
        .take(3)
        .map(|(name, n)| format!("`{}` {n}", esc(name)))
        .collect::<Vec<_>>()
        .join(", ");
    Some(Warning::new(
        WarningKind::Underflow,
        format!(
            "{} underflowed to zero in {} (worst: {worst})",
            crate::text::count(values, "value"),
            crate::text::count(hit.len() as u64, "tensor")
        ),
    ))
}

/// The overflow check of a conversion whose numerics were measured: the error under
/// `on_overflow=error`, else the warning.
pub fn overflow_outcome<S: AsRef<str>, N: Borrow<Numerics>>(
    path: &Path,
    target: Target,
    numerics: &[(S, N)],
    dequantized: impl Fn(&str) -> bool,
) -> Option<(Error, Warning)> {
    let mut hot: Vec<(&str, u64)> = numerics
        .iter()
        .filter(|(_, n)| n.borrow().overflow > 0)
        .map(|(name, n)| (name.as_ref(), n.borrow().overflow))
        .collect();
    if hot.is_empty() {
        return None;
    }
    hot.sort_by_key(|t| std::cmp::Reverse(t.1));
    let values: u64 = hot.iter().map(|t| t.1).sum();
    let worst = hot
        .iter()
        .take(5)
        .map(|(name, n)| format!("`{}` ({n})", esc(name)))
        .collect::<Vec<_>>()
        .join(", ");
    let more = if hot.len() > 5 {
        format!(" and {} more", hot.len() - 5)
    } else {
        String::new()
    };
    let deq = hot.iter().filter(|(name, _)| dequantized(name)).count();
    let warning = Warning::new(
        WarningKind::Overflow,
        format!(
            "{} in {} became ±inf in {}: {worst}{more} ({})",
            crate::text::count(values, "finite value"),
            crate::text::count(hot.len() as u64, "tensor"),
            target.describe(),
            crate::error::overflow_advice(deq, hot.len())
        ),
    );
    let error = Error::Overflow {
        path: path.to_path_buf(),
        target,
        values,
        tensors: hot.len(),
        worst: hot[0].0.to_string(),
        worst_values: hot[0].1,
        dequantized: deq,
    };
    Some((error, warning))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Conversion;
    use crate::header::read_header;
    use crate::testutil::{file, p};
    use crate::vocab::WarningKind;

    #[test]
    fn plan_groups_by_width_and_aligns() {
        let h = r#"{"__metadata__":{"z":"1","a":"2"},"i8":{"dtype":"I8","shape":[3],"data_offsets":[0,3]},"f32":{"dtype":"F32","shape":[3],"data_offsets":[3,15]},"i64":{"dtype":"I64","shape":[1],"data_offsets":[15,23]},"f64":{"dtype":"F64","shape":[1],"data_offsets":[23,31]},"bf":{"dtype":"BF16","shape":[1],"data_offsets":[31,33]}}"#;
        let src = read_header(p(), &file(h, 33)).unwrap();
        let plan = plan(p(), &src, &PlanOptions::new(Target::Bf16)).unwrap();
        let order: Vec<_> = plan
            .tensors
            .iter()
            .map(|t| src.tensors[t.source].name.as_str())
            .collect();
        assert_eq!(order, ["i64", "f32", "f64", "bf", "i8"]);
        for t in &plan.tensors {
            let size = (t.dtype.bitsize() / 8) as u64;
            assert_eq!(t.start % size, 0);
        }
        assert_eq!(plan.header.len() % 8, 0);
        let json = std::str::from_utf8(&plan.header[8..]).unwrap();
        assert!(
            json.starts_with(r#"{"__metadata__":{"z":"1","a":"2"},"i64":"#),
            "{json}"
        );
        assert_eq!(plan.data_len(), 8 + 6 + 2 + 2 + 3);
    }

    #[test]
    fn nothing_to_convert_warns() {
        let h = r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}"#;
        let src = read_header(p(), &file(h, 4)).unwrap();
        let plan = plan(p(), &src, &PlanOptions::new(Target::Bf16)).unwrap();
        assert_eq!(plan.warnings.len(), 1);
        assert!(plan.warnings[0].text.contains("nothing to convert"));
    }

    #[test]
    fn an_int_weights_dropped_scale_is_not_called_fp8() {
        // An INT8 int-quantized weight (an I8 `weight` with its F32 scale per row).
        let h = r#"{"m.weight":{"dtype":"I8","shape":[2,4],"data_offsets":[0,8]},"m.weight_scale":{"dtype":"F32","shape":[2,1],"data_offsets":[8,16]}}"#;
        let src = read_header(p(), &file(h, 16)).unwrap();
        let plan = plan(p(), &src, &PlanOptions::new(Target::Bf16)).unwrap();
        assert_eq!(plan.reasons, [Reason::Dequantized, Reason::Dropped]);
        let words = plan.reasons[1].words();
        assert!(!words.contains("FP8") && words.contains("scale"), "{words}");
    }

    /// A file of `(name, dtype, elements)` tensors laid out in order, zero data.
    fn source(tensors: &[(&str, &str, usize)]) -> SourceHeader {
        let mut json = String::from("{");
        let mut at = 0;
        for (i, (name, dtype, n)) in tensors.iter().enumerate() {
            let size = match *dtype {
                "F64" | "I64" => 8,
                "F32" | "I32" => 4,
                "F16" | "BF16" => 2,
                _ => 1,
            };
            if i > 0 {
                json.push(',');
            }
            json.push_str(&format!(
                r#""{name}":{{"dtype":"{dtype}","shape":[{n}],"data_offsets":[{at},{}]}}"#,
                at + n * size
            ));
            at += n * size;
        }
        json.push('}');
        read_header(p(), &file(&json, at)).unwrap()
    }

    fn keep_opts(target: Target, keep: &[&str], min: u64) -> PlanOptions {
        PlanOptions {
            keep: keep.iter().map(|s| s.to_string()).collect(),
            keep_min_size: min,
            ..PlanOptions::new(target)
        }
    }

    /// (name, output dtype, reason code) in output order; every tensor aligned.
    fn layout(src: &SourceHeader, plan: &Plan) -> Vec<(String, String, &'static str)> {
        let mut at = 0;
        plan.tensors
            .iter()
            .map(|t| {
                assert_eq!(t.start, at);
                assert_eq!(t.start % (t.dtype.bitsize() / 8).max(1) as u64, 0);
                at = t.end;
                let name = src.tensors[t.source].name.clone();
                (
                    name,
                    t.dtype.to_string(),
                    plan.reasons[t.source].code().name(),
                )
            })
            .collect()
    }

    #[test]
    fn keep_patterns_and_min_size_keep_the_source_dtype() {
        let src = source(&[
            ("emb", "F32", 5),
            ("l0.input_layernorm.weight", "F32", 3),
            ("l0.q", "F32", 7),
            ("l0.bias", "F32", 2),
            ("rope.inv_freq", "F64", 1),
            ("ids", "I64", 1),
            ("half", "BF16", 3),
        ]);
        let opts = keep_opts(Target::Bf16, &["*norm*", "*.inv_freq", "ids"], 3);
        let plan = plan(p(), &src, &opts).unwrap();
        let got = layout(&src, &plan);
        let want = [
            ("rope.inv_freq", "F64", "keep_pattern"),
            ("ids", "I64", "not_float"),
            ("l0.input_layernorm.weight", "F32", "keep_pattern"),
            ("l0.bias", "F32", "keep_min_size"),
            ("emb", "BF16", "converted"),
            ("l0.q", "BF16", "converted"),
            ("half", "BF16", "already_target"),
        ];
        let want: Vec<_> = want
            .iter()
            .map(|(a, b, c)| (a.to_string(), b.to_string(), *c))
            .collect();
        assert_eq!(got, want);
        // The first pattern that matches is the reason; `ids` matched (no typo warning).
        assert_eq!(plan.reasons[1], Reason::KeptByPattern("*norm*".to_string()));
        assert_eq!(plan.kept(), 3);
        assert_eq!(plan.kept_bytes(), 8 + 12 + 8);
        assert!(plan.keep_unmatched.is_empty());
        assert!(plan.warnings.is_empty(), "{:?}", plan.warnings);
    }

    #[test]
    fn kept_f32_groups_before_bf16_and_stays_aligned() {
        // Odd element counts: a kept F32 tensor after converted ones would misalign.
        let src = source(&[
            ("a", "F32", 3),
            ("a.norm", "F32", 1),
            ("b", "F16", 1),
            ("c", "F32", 5),
            ("b.norm", "F64", 1),
            ("z", "U8", 3),
        ]);
        let plan = plan(p(), &src, &keep_opts(Target::Bf16, &["*.norm"], 0)).unwrap();
        let order: Vec<_> = layout(&src, &plan).into_iter().map(|t| t.0).collect();
        assert_eq!(order, ["b.norm", "a.norm", "a", "b", "c", "z"]);
        assert_eq!(plan.header.len() % 8, 0);
    }

    #[test]
    fn fnmatch_semantics() {
        let names = [
            "model.layers.0.mlp.gate.weight",
            "Norm",
            "x.y",
            "a[1]",
            "ab",
        ];
        let matches = |pattern: &str| -> Vec<&str> {
            let mut k = KeepPatterns::compile(&[pattern.to_string()]).unwrap();
            names
                .iter()
                .copied()
                .filter(|n| k.first_match(n).is_some())
                .collect()
        };
        assert_eq!(matches("*gate.weight"), ["model.layers.0.mlp.gate.weight"]);
        assert_eq!(
            matches("model.**.weight"),
            ["model.layers.0.mlp.gate.weight"]
        );
        assert_eq!(matches("**"), names);
        assert_eq!(matches("norm"), Vec::<&str>::new()); // case-sensitive
        assert_eq!(matches("?.?"), ["x.y"]);
        assert_eq!(matches("a[[]1]"), ["a[1]"]);
        assert_eq!(matches("[!x]b"), ["ab"]);
        let err = KeepPatterns::compile(&["a[".to_string()])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("keep: invalid pattern `a[`"), "{err}");
    }

    #[test]
    fn unmatched_patterns_warn_fail_or_pass() {
        let src = source(&[("w", "F32", 2)]);
        let mut opts = keep_opts(Target::Bf16, &["w", "*nrom*", "x?"], 0);
        let plan1 = plan(p(), &src, &opts).unwrap();
        assert_eq!(plan1.keep_unmatched, ["*nrom*", "x?"]);
        assert!(
            plan1.warnings[0]
                .text
                .contains("{keep} patterns `*nrom*`, `x?` match no tensor name"),
            "{:?}",
            plan1.warnings
        );
        opts.unmatched = Unmatched::Ignore;
        let plan2 = plan(p(), &src, &opts).unwrap();
        assert_eq!(plan2.keep_unmatched, ["*nrom*", "x?"]);
        assert!(!plan2
            .warnings
            .iter()
            .any(|w| w.kind == WarningKind::UnmatchedPattern));
        opts.unmatched = Unmatched::Error;
        let err = plan(p(), &src, &opts).unwrap_err();
        assert_eq!(err.kind(), crate::vocab::ErrorKind::Refused);
        assert!(
            err.template().contains("({strict} makes this an error)"),
            "{err}"
        );
        opts.keep.truncate(1);
        assert!(plan(p(), &src, &opts).is_ok());
    }

    #[test]
    fn fp16_bf16_sources_copied_unless_from_bf16() {
        let src = source(&[("a", "F32", 2), ("b", "BF16", 2), ("c", "F16", 2)]);
        let plan1 = plan(p(), &src, &PlanOptions::new(Target::F16)).unwrap();
        let got: Vec<_> = layout(&src, &plan1).into_iter().map(|t| t.2).collect();
        assert_eq!(got, ["converted", "bf16_source", "already_target"]);
        assert!(
            plan1.warnings[0]
                .text
                .contains("the output mixes BF16 and F16"),
            "{:?}",
            plan1.warnings
        );
        assert!(plan1.warnings[0].text.contains("{from_bf16}"));
        let opts = PlanOptions {
            from_bf16: true,
            ..PlanOptions::new(Target::F16)
        };
        let plan2 = plan(p(), &src, &opts).unwrap();
        let got = layout(&src, &plan2);
        assert_eq!(got[1], ("b".into(), "F16".into(), "converted"));
        assert_eq!(
            plan2.tensors[1].action,
            Action::Convert(Conversion::Bf16ToF16)
        );
        assert!(plan2.warnings.is_empty(), "{:?}", plan2.warnings);
        // Under bf16, from_bf16 changes nothing.
        let opts = PlanOptions {
            from_bf16: true,
            ..PlanOptions::new(Target::Bf16)
        };
        let plan3 = plan(p(), &src, &opts).unwrap();
        assert_eq!(plan3.reasons[1], Reason::AlreadyTarget);
    }

    #[test]
    fn overflow_names_are_kept_after_patterns_and_size() {
        let src = source(&[("a", "F32", 4), ("b", "F32", 4), ("c", "I32", 1)]);
        let mut opts = keep_opts(Target::F16, &["a"], 0);
        opts.keep_names = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let plan = plan(p(), &src, &opts).unwrap();
        assert_eq!(plan.reasons[0], Reason::KeptByPattern("a".into()));
        assert_eq!(plan.reasons[1], Reason::KeptToAvoidOverflow);
        assert_eq!(plan.reasons[2], Reason::NotFloat);
        assert_eq!(plan.converted(), 0);
        assert_eq!(plan.kept(), 2);
    }

    #[test]
    fn fp8_targets_refuse_a_quantized_input_whatever_the_options() {
        let h = r#"{"a.weight":{"dtype":"F8_E4M3","shape":[1,4],"data_offsets":[0,4]},"a.weight_scale":{"dtype":"F32","shape":[1,1],"data_offsets":[4,8]}}"#;
        let src = read_header(p(), &file(h, 8)).unwrap();
        for target in [Target::Fp8, Target::Fp8Block] {
            for (allow, keep) in [(false, &[][..]), (true, &[][..]), (true, &["*scale*"][..])] {
                let opts = PlanOptions {
                    allow_quantized: allow,
                    ..keep_opts(target, keep, 0)
                };
                let e = plan(p(), &src, &opts).unwrap_err();
                assert!(matches!(e, Error::AlreadyQuantized { .. }), "{e:?}");
                let text = e.template();
                assert!(text.contains("`a.weight` is F8_E4M3"), "{text}");
                assert!(!text.contains("{allow_quantized}") && !text.contains("{keep"));
            }
        }
        // A quantization_config says so too, whatever the dtypes.
        let h = r#"{"a.weight":{"dtype":"F32","shape":[1,1],"data_offsets":[0,4]}}"#;
        let src = read_header(p(), &file(h, 4)).unwrap();
        let opts = PlanOptions {
            allow_quantized: true,
            quantization_config: Some(PathBuf::from("config.json")),
            ..PlanOptions::new(Target::Fp8)
        };
        let e = plan(p(), &src, &opts).unwrap_err();
        assert!(e
            .template()
            .contains("config.json has a quantization_config"));
        // Other targets keep their policy.
        assert!(plan(p(), &src, &PlanOptions::new(Target::Bf16)).is_ok());
    }

    #[test]
    fn fp8_ignore_lists_every_unquantized_matrix_weight() {
        let h = r#"{"m.a.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"m.i.weight":{"dtype":"I8","shape":[2,2],"data_offsets":[16,20]},"m.f.weight":{"dtype":"F64","shape":[1,1],"data_offsets":[20,28]},"m.n.weight":{"dtype":"F32","shape":[2],"data_offsets":[28,36]},"weight":{"dtype":"I8","shape":[2,2],"data_offsets":[36,40]}}"#;
        let src = read_header(p(), &file(h, 40)).unwrap();
        let plan = plan(p(), &src, &PlanOptions::new(Target::Fp8)).unwrap();
        assert_eq!(plan.unquantized_modules(&src), ["m.i", "m.f"]);
    }

    #[test]
    fn fp8_leaves_a_vision_tower_unquantized_and_says_so() {
        let h = r#"{"model.visual.blocks.0.attn.qkv.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"model.multi_modal_projector.linear_1.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[16,32]},"model.language_model.layers.0.mlp.up_proj.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[32,48]}}"#;
        let src = read_header(p(), &file(h, 48)).unwrap();
        let plan = plan(p(), &src, &PlanOptions::new(Target::Fp8)).unwrap();
        assert_eq!(
            plan.fp8_skips,
            [Some(Fp8Skip::Vision), Some(Fp8Skip::Vision), None]
        );
        // Listed in the config's ignore, so that a loader leaves them as they are.
        assert_eq!(
            plan.unquantized_modules(&src),
            [
                "model.visual.blocks.0.attn.qkv",
                "model.multi_modal_projector.linear_1"
            ]
        );
        let w: Vec<_> = plan
            .warnings
            .iter()
            .filter(|w| w.kind == WarningKind::NotQuantized)
            .collect();
        assert_eq!(w.len(), 1, "{:?}", plan.warnings);
        assert!(
            w[0].text.starts_with(
                "2 weights of the vision tower and its projector (visual, \
                 multi_modal_projector) stay BF16, unquantized"
            ),
            "{}",
            w[0].text
        );
    }

    #[test]
    fn bitsandbytes_is_refused_whatever_the_options() {
        // 4-bit NF4 (attack z10 r14): the refusal named `--keep '*scale*'` (matching
        // nothing) and `--allow-quantized`, which rounded absmax and quant_map to BF16.
        let h = r#"{"l.weight":{"dtype":"U8","shape":[8,1],"data_offsets":[0,8]},"l.weight.absmax":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"l.weight.quant_map":{"dtype":"F32","shape":[1],"data_offsets":[12,16]},"l.weight.quant_state.bitsandbytes__nf4":{"dtype":"U8","shape":[8],"data_offsets":[16,24]},"norm.weight":{"dtype":"F32","shape":[2],"data_offsets":[24,32]}}"#;
        let src = read_header(p(), &file(h, 32)).unwrap();
        for opts in [
            PlanOptions::new(Target::Bf16),
            PlanOptions {
                allow_quantized: true,
                ..PlanOptions::new(Target::F16)
            },
            keep_opts(Target::Bf16, &["*absmax", "*quant_map"], 0),
        ] {
            let e = plan(p(), &src, &opts).unwrap_err();
            let text = e.template();
            assert!(
                text.contains("tensor `l.weight.absmax` is a bitsandbytes tensor"),
                "{text}"
            );
            assert!(
                !text.contains("{keep") && !text.contains("{allow"),
                "{text}"
            );
        }
        let e = plan(p(), &src, &PlanOptions::new(Target::Fp8)).unwrap_err();
        assert!(matches!(e, Error::AlreadyQuantized { .. }), "{e:?}");
        // Its format alone changes under `keep`.
        assert!(plan(p(), &src, &PlanOptions::new(Target::Keep)).is_ok());
        // LLM.int8: its row scales.
        let h = r#"{"l.weight":{"dtype":"I8","shape":[2,2],"data_offsets":[0,4]},"l.SCB":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        let src = read_header(p(), &file(h, 12)).unwrap();
        let e = plan(p(), &src, &PlanOptions::new(Target::Bf16)).unwrap_err();
        assert!(e.template().contains("`l.SCB` is a bitsandbytes tensor"));
    }

    #[test]
    fn quantized_checkpoints_are_refused_unless_allowed() {
        let h = r#"{"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]},"w.weight_scale":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        let src = read_header(p(), &file(h, 8)).unwrap();
        let e = plan(p(), &src, &PlanOptions::new(Target::Bf16)).unwrap_err();
        assert_eq!(e.kind(), crate::vocab::ErrorKind::Refused);
        let text = e.template();
        assert!(text.contains("F8_E4M3 tensors beside F32"), "{text}");
        assert!(text.contains("`w.weight_scale`") && text.contains("{allow_quantized}"));
        let allowed = PlanOptions {
            allow_quantized: true,
            ..PlanOptions::new(Target::Bf16)
        };
        let plan1 = plan(p(), &src, &allowed).unwrap();
        assert_eq!(plan1.warnings[0].kind, WarningKind::Quantized);
        assert!(
            plan1.warnings[0].text.contains("`w.weight_scale`"),
            "{:?}",
            plan1.warnings
        );
        // Kept scales are safe: neither refused nor warned, even with other F32 converted.
        let h = r#"{"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]},"w.weight_scale":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},"norm":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
        let src = read_header(p(), &file(h, 12)).unwrap();
        let kept = plan(p(), &src, &keep_opts(Target::Bf16, &["*scale"], 0)).unwrap();
        assert!(
            !kept
                .warnings
                .iter()
                .any(|w| w.kind == WarningKind::Quantized),
            "{:?}",
            kept.warnings
        );
        // A scale that no pattern keeps is named.
        let e = plan(p(), &src, &keep_opts(Target::Bf16, &["norm"], 0)).unwrap_err();
        assert!(e.template().contains("`w.weight_scale`"));
        // Where no F32 tensor is named like a scale, any may be one: a pattern that keeps
        // none of them lets nothing through.
        let h = r#"{"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]},"s":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        let src = read_header(p(), &file(h, 8)).unwrap();
        let e = plan(p(), &src, &keep_opts(Target::Bf16, &["zzz"], 0)).unwrap_err();
        assert!(e.template().contains("`s`"), "{}", e.template());
        // ... nor is `*scale*` suggested, which would keep none of them.
        let text = e.template();
        assert!(
            !text.contains("*scale*") && text.contains("{keep} patterns"),
            "{text}"
        );
        assert!(plan(p(), &src, &keep_opts(Target::Bf16, &["s"], 0)).is_ok());
    }

    #[test]
    fn a_quantization_config_makes_any_file_quantized() {
        let h = r#"{"q":{"dtype":"I8","shape":[4],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        let src = read_header(p(), &file(h, 8)).unwrap();
        // I8 beside F32 alone is no quantized checkpoint.
        assert!(plan(p(), &src, &PlanOptions::new(Target::Bf16)).is_ok());
        let opts = PlanOptions {
            quantization_config: Some(PathBuf::from("m/config.json")),
            ..PlanOptions::new(Target::Bf16)
        };
        let e = plan(p(), &src, &opts).unwrap_err();
        assert!(
            e.template()
                .contains("(m/config.json has a quantization_config)"),
            "{}",
            e.template()
        );
    }
}
