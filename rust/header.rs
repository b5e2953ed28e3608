//! Read and validate the input header, then plan the output header and tensor layout.

use std::collections::HashSet;
use std::fmt;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};

use crate::error::{Error, Result};

/// Size of the little-endian header-length prefix.
pub const PREFIX: usize = 8;
/// The safetensors format's limit on the header, which we keep for our output too.
pub const MAX_HEADER: usize = 100_000_000;

/// What to convert floating-point tensors to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Bf16,
    F16,
}

impl Target {
    pub fn parse(s: &str) -> Option<Target> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Some(Target::Bf16),
            "fp16" | "f16" | "float16" | "half" => Some(Target::F16),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Target::Bf16 => "bf16",
            Target::F16 => "fp16",
        }
    }

    pub fn dtype(self) -> Dtype {
        match self {
            Target::Bf16 => Dtype::BF16,
            Target::F16 => Dtype::F16,
        }
    }
}

/// Which kernel turns a source tensor into its output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conversion {
    F32ToBf16,
    F16ToBf16,
    F64ToBf16,
    F32ToF16,
    F64ToF16,
    Bf16ToF16,
}

/// The smallest magnitude that rounds to infinity in bf16: the f32 midpoint 0x7F7F8000
/// between the largest bf16 (0x7F7F, odd) and 2^128, which ties upwards: 2^128 - 2^119.
pub const BF16_OVERFLOW: f64 = 339_617_752_923_046_005_526_922_703_901_628_039_168.0;
/// The smallest magnitude that rounds to infinity in f16: 65520, the midpoint between
/// 65504 (0x7BFF, odd) and 2^16, which ties upwards.
pub const F16_OVERFLOW: f64 = 65520.0;

impl Conversion {
    /// Bytes per source element.
    pub fn src_size(self) -> u64 {
        match self {
            Conversion::F16ToBf16 | Conversion::Bf16ToF16 => 2,
            Conversion::F32ToBf16 | Conversion::F32ToF16 => 4,
            Conversion::F64ToBf16 | Conversion::F64ToF16 => 8,
        }
    }

    /// Does a finite source value of magnitude `max_abs` become infinite?
    pub fn overflows(self, max_abs: f64) -> bool {
        match self {
            // Every f16 value is a bf16 value.
            Conversion::F16ToBf16 => false,
            Conversion::F32ToBf16 | Conversion::F64ToBf16 => max_abs >= BF16_OVERFLOW,
            Conversion::F32ToF16 | Conversion::F64ToF16 | Conversion::Bf16ToF16 => {
                max_abs >= F16_OVERFLOW
            }
        }
    }
}

/// What happens to one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Copy,
    Convert(Conversion),
}

/// One tensor of the input, as its header describes it.
#[derive(Clone, Debug)]
pub struct SourceTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range relative to the start of the data section.
    pub start: u64,
    pub end: u64,
}

impl SourceTensor {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

/// The validated input header.
#[derive(Clone, Debug)]
pub struct SourceHeader {
    /// Length of the JSON header (without the 8-byte prefix).
    pub header_len: u64,
    /// `__metadata__` in input key order, when present.
    pub metadata: Option<Vec<(String, String)>>,
    /// Tensors in data-offset order (ties between empty tensors: JSON key order).
    pub tensors: Vec<SourceTensor>,
}

impl SourceHeader {
    /// Where the data section starts in the file.
    pub fn data_start(&self) -> u64 {
        PREFIX as u64 + self.header_len
    }

    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.end)
    }
}

/// Why a tensor is converted, kept in its source dtype, or copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    Converted,
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
    /// A stable machine-readable name, used by the JSON output.
    pub fn code(&self) -> &'static str {
        match self {
            Reason::Converted => "converted",
            Reason::KeptByPattern(_) => "keep_pattern",
            Reason::KeptByMinSize(_) => "keep_min_size",
            Reason::KeptToAvoidOverflow => "keep_overflow",
            Reason::AlreadyTarget => "already_target",
            Reason::Bf16Source => "bf16_source",
            Reason::NotConverted => "not_converted",
            Reason::NotFloat => "not_float",
        }
    }

    /// Is this a tensor that would be converted but keeps its source dtype?
    pub fn is_kept(&self) -> bool {
        matches!(
            self,
            Reason::KeptByPattern(_) | Reason::KeptByMinSize(_) | Reason::KeptToAvoidOverflow
        )
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
        }
    }
}

/// What a `keep` pattern that matches no tensor name does: probably a typo.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Unmatched {
    /// A plan warning.
    #[default]
    Warn,
    /// A refusal (`--strict`).
    Error,
    /// Nothing: the caller judges the patterns over several files (a folder).
    Ignore,
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
}

/// The whole output: its header bytes and where each tensor goes.
#[derive(Clone, Debug)]
pub struct Plan {
    pub target: Target,
    /// Prefix plus JSON header, padded with spaces to a multiple of 8.
    pub header: Vec<u8>,
    /// Tensors in output order.
    pub tensors: Vec<TensorPlan>,
    /// Why each tensor is planned as it is, in input order (indexed like
    /// `SourceHeader::tensors`).
    pub reasons: Vec<Reason>,
    /// The `keep` patterns that match no tensor name of this file, in the order given.
    pub keep_unmatched: Vec<String>,
    pub warnings: Vec<String>,
}

impl Plan {
    pub fn data_start(&self) -> u64 {
        self.header.len() as u64
    }

    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.end)
    }

    pub fn file_len(&self) -> u64 {
        self.data_start() + self.data_len()
    }

    pub fn converted(&self) -> usize {
        self.tensors
            .iter()
            .filter(|t| matches!(t.action, Action::Convert(_)))
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

/// Validate a whole safetensors file held in `bytes` (usually a read-only map).
///
/// Every check of the `safetensors` crate applies, and its reason is part of our message;
/// on top of it we refuse duplicate names and keep the key order of `__metadata__`.
pub fn read_header(path: &Path, bytes: &[u8]) -> Result<SourceHeader> {
    let (header_len, meta) = SafeTensors::read_metadata(bytes).map_err(|e| {
        // Keep the crate's reason, and say which tensor and by how much where we can.
        let detail = diagnose(bytes).map_or(String::new(), |d| format!(" ({d})"));
        // The crate's serde messages name its private types; say what they mean.
        let reason = e
            .to_string()
            .replace("struct HashMetadata", "a JSON object of tensors")
            .replace("struct TensorInfo", "a tensor entry");
        Error::invalid(path, format!("invalid safetensors file: {reason}{detail}"))
    })?;
    // The crate has checked the UTF-8 and the JSON already; this second, ordered pass
    // sees what its HashMap hides: duplicate keys and the order of the keys.
    let json = &bytes[PREFIX..PREFIX + header_len];
    let mut de = serde_json::Deserializer::from_slice(json);
    let keys = OrderedHeader::deserialize(&mut de)
        .map_err(|e| Error::invalid(path, format!("invalid header: {e}")))?;

    let mut tensors = Vec::with_capacity(keys.names.len());
    for name in keys.names {
        let info = meta.info(&name).ok_or_else(|| {
            Error::invalid(path, format!("invalid header: tensor `{name}` is missing"))
        })?;
        let (start, end) = info.data_offsets;
        tensors.push(SourceTensor {
            name,
            dtype: info.dtype,
            shape: info.shape.clone(),
            start: start as u64,
            end: end as u64,
        });
    }
    // Stable: empty tensors that share an offset keep their JSON order.
    tensors.sort_by_key(|t| (t.start, t.end));
    Ok(SourceHeader {
        header_len: header_len as u64,
        metadata: keys.metadata,
        tensors,
    })
}

/// Best-effort specifics for a header the crate refused: the first tensor whose offsets
/// or size are wrong, or how the data section disagrees with the file length.
fn diagnose(bytes: &[u8]) -> Option<String> {
    let n = usize::try_from(u64::from_le_bytes(bytes.get(..PREFIX)?.try_into().ok()?)).ok()?;
    let json = bytes.get(PREFIX..PREFIX.checked_add(n)?)?;
    let value: serde_json::Value = serde_json::from_slice(json).ok()?;
    let mut tensors: Vec<(&String, Dtype, Vec<u64>, u64, u64)> = Vec::new();
    for (name, info) in value.as_object()? {
        if name == "__metadata__" {
            continue;
        }
        let dtype: Dtype = serde_json::from_value(info.get("dtype")?.clone()).ok()?;
        let shape = info.get("shape")?.as_array()?;
        let shape: Vec<u64> = shape.iter().map(|d| d.as_u64()).collect::<Option<_>>()?;
        let offsets = info.get("data_offsets")?.as_array()?;
        let (start, end) = (offsets.first()?.as_u64()?, offsets.get(1)?.as_u64()?);
        tensors.push((name, dtype, shape, start, end));
    }
    tensors.sort_by_key(|t| (t.3, t.4));
    let mut expect = 0u64;
    for (name, dtype, shape, start, end) in &tensors {
        if end < start {
            return Some(format!(
                "tensor `{name}`: data_offsets end {end} is before start {start}"
            ));
        }
        if *start > expect {
            return Some(format!(
                "{} unused bytes before tensor `{name}`",
                start - expect
            ));
        }
        if *start < expect {
            return Some(format!("tensor `{name}` overlaps the tensor before it"));
        }
        let elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let bits = elems.and_then(|e| e.checked_mul(dtype.bitsize() as u64));
        let Some(bits) = bits else {
            return Some(format!("tensor `{name}`: shape {shape:?} overflows"));
        };
        if bits / 8 != end - start {
            return Some(format!(
                "tensor `{name}`: shape {shape:?} of {dtype} needs {} bytes, data_offsets give {}",
                bits / 8,
                end - start
            ));
        }
        expect = *end;
    }
    let have = (bytes.len() - PREFIX - n) as u64;
    match have.cmp(&expect) {
        std::cmp::Ordering::Less => Some(format!(
            "file is truncated: the header describes {expect} data bytes, the file has {have}"
        )),
        std::cmp::Ordering::Greater => Some(format!(
            "{} trailing bytes after the last tensor",
            have - expect
        )),
        std::cmp::Ordering::Equal => None,
    }
}

/// The top-level keys of a header in JSON order, and `__metadata__` in its order.
struct OrderedHeader {
    names: Vec<String>,
    metadata: Option<Vec<(String, String)>>,
}

impl<'de> de::Deserialize<'de> for OrderedHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_map(HeaderVisitor)
    }
}

struct HeaderVisitor;

impl<'de> Visitor<'de> for HeaderVisitor {
    type Value = OrderedHeader;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut seen = HashSet::new();
        let mut names = Vec::new();
        let mut metadata = None;
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(de::Error::custom(format!("duplicate tensor name `{key}`")));
            }
            if key == "__metadata__" {
                metadata = map.next_value::<Option<OrderedMetadata>>()?.map(|m| m.0);
            } else {
                map.next_value::<IgnoredAny>()?;
                names.push(key);
            }
        }
        Ok(OrderedHeader { names, metadata })
    }
}

struct OrderedMetadata(Vec<(String, String)>);

impl<'de> de::Deserialize<'de> for OrderedMetadata {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_map(MetadataVisitor)
    }
}

struct MetadataVisitor;

impl<'de> Visitor<'de> for MetadataVisitor {
    type Value = OrderedMetadata;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object of strings")
    }

    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut seen = HashSet::new();
        let mut entries = Vec::new();
        while let Some((k, v)) = map.next_entry::<String, String>()? {
            if !seen.insert(k.clone()) {
                return Err(de::Error::custom(format!(
                    "duplicate __metadata__ key `{k}`"
                )));
            }
            entries.push((k, v));
        }
        Ok(OrderedMetadata(entries))
    }
}

/// Is this dtype one of the low-precision formats used by quantized checkpoints?
pub fn is_quantized_dtype(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::F8_E4M3
            | Dtype::F8_E5M2
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ
            | Dtype::F4
            | Dtype::F6_E2M3
            | Dtype::F6_E3M2
    )
}

/// The action for a source dtype under a target (before any `keep` rule).
pub fn action_for(dtype: Dtype, target: Target, from_bf16: bool) -> Action {
    use Conversion::*;
    match (target, dtype) {
        (Target::Bf16, Dtype::F32) => Action::Convert(F32ToBf16),
        (Target::Bf16, Dtype::F16) => Action::Convert(F16ToBf16),
        (Target::Bf16, Dtype::F64) => Action::Convert(F64ToBf16),
        (Target::F16, Dtype::F32) => Action::Convert(F32ToF16),
        (Target::F16, Dtype::F64) => Action::Convert(F64ToF16),
        (Target::F16, Dtype::BF16) if from_bf16 => Action::Convert(Bf16ToF16),
        _ => Action::Copy,
    }
}

/// Why a tensor that the target does not take is copied.
fn copy_reason(dtype: Dtype, target: Target) -> Reason {
    if dtype == target.dtype() {
        Reason::AlreadyTarget
    } else if dtype == Dtype::BF16 {
        Reason::Bf16Source
    } else if is_quantized_dtype(dtype) || dtype == Dtype::C64 {
        Reason::NotConverted
    } else {
        Reason::NotFloat
    }
}

/// Sort key for output grouping: widest element first, sub-byte dtypes last.
pub fn width_rank(d: Dtype) -> usize {
    let bits = d.bitsize();
    if bits.is_multiple_of(8) {
        bits
    } else {
        0
    }
}

/// `keep` patterns, compiled with fnmatch semantics.
struct KeepPatterns {
    patterns: Vec<glob::Pattern>,
    matched: Vec<bool>,
}

impl KeepPatterns {
    fn compile(path: &Path, keep: &[String]) -> Result<KeepPatterns> {
        let patterns = keep
            .iter()
            .map(|p| {
                glob::Pattern::new(&collapse_stars(p)).map_err(|e| {
                    Error::invalid(path, format!("invalid --keep pattern `{p}`: {}", e.msg))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KeepPatterns {
            matched: vec![false; patterns.len()],
            patterns,
        })
    }

    /// The first pattern that matches `name`; every matching pattern counts as used.
    fn first_match(&mut self, name: &str) -> Option<usize> {
        // fnmatch: `*` and `?` match any character, dots and slashes included.
        let opts = glob::MatchOptions {
            case_sensitive: true,
            require_literal_separator: false,
            require_literal_leading_dot: false,
        };
        let mut first = None;
        for (i, p) in self.patterns.iter().enumerate() {
            if p.matches_with(name, opts) {
                self.matched[i] = true;
                first = first.or(Some(i));
            }
        }
        first
    }
}

/// `**` means `*` in fnmatch, but the glob crate takes it for a recursive path wildcard
/// (and refuses it inside a name). Inside `[...]` a repeated `*` names the same set, so
/// collapsing every run keeps the meaning.
fn collapse_stars(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len());
    for c in pattern.chars() {
        if !(c == '*' && out.ends_with('*')) {
            out.push(c);
        }
    }
    out
}

/// Plan the output of `src` under `opts`: order, offsets, header bytes, reasons, warnings.
pub fn plan(path: &Path, src: &SourceHeader, opts: &PlanOptions) -> Result<Plan> {
    let mut patterns = KeepPatterns::compile(path, &opts.keep)?;
    let mut reasons = Vec::with_capacity(src.tensors.len());
    let mut tensors: Vec<TensorPlan> = Vec::with_capacity(src.tensors.len());
    for (i, t) in src.tensors.iter().enumerate() {
        let hit = patterns.first_match(&t.name);
        let natural = action_for(t.dtype, opts.target, opts.from_bf16);
        let reason = match natural {
            Action::Copy => copy_reason(t.dtype, opts.target),
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
            Reason::Converted => (natural, opts.target.dtype()),
            _ => (Action::Copy, t.dtype),
        };
        reasons.push(reason);
        tensors.push(TensorPlan {
            source: i,
            dtype,
            action,
            start: 0,
            end: 0,
        });
    }
    let keep_unmatched: Vec<String> = opts
        .keep
        .iter()
        .zip(&patterns.matched)
        .filter(|(_, &m)| !m)
        .map(|(p, _)| p.clone())
        .collect();
    if opts.unmatched == Unmatched::Error && !keep_unmatched.is_empty() {
        return Err(Error::refused(
            path,
            format!(
                "{} (--strict); nothing was written",
                unmatched_message(&keep_unmatched)
            ),
        ));
    }

    // Stable, so input order survives within each width; every tensor's length is a
    // multiple of its element size, so each group starts aligned for the next. Kept
    // tensors keep their source width and so land in that width's group (kept F32 before
    // the converted 16-bit ones).
    tensors.sort_by_key(|t| std::cmp::Reverse(width_rank(t.dtype)));
    let mut offset = 0u64;
    for t in &mut tensors {
        let s = &src.tensors[t.source];
        let len = match t.action {
            Action::Copy => s.len(),
            Action::Convert(c) => s.len() / c.src_size() * 2,
        };
        t.start = offset;
        t.end = offset + len;
        offset = t.end;
    }

    let header = encode_header(src, &tensors);
    if header.len() - PREFIX > MAX_HEADER {
        return Err(Error::invalid(
            path,
            format!("output header would exceed {MAX_HEADER} bytes"),
        ));
    }
    let mut plan = Plan {
        target: opts.target,
        header,
        tensors,
        reasons,
        keep_unmatched,
        warnings: Vec::new(),
    };
    plan.warnings = plan_warnings(src, &plan, opts);
    Ok(plan)
}

/// "--keep pattern `x` matches no tensor name", for one or several patterns.
pub fn unmatched_message(patterns: &[String]) -> String {
    let list = patterns
        .iter()
        .map(|p| format!("`{p}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if patterns.len() == 1 {
        format!("--keep pattern {list} matches no tensor name (a typo?)")
    } else {
        format!("--keep patterns {list} match no tensor name (typos?)")
    }
}

pub(crate) fn encode_header(src: &SourceHeader, tensors: &[TensorPlan]) -> Vec<u8> {
    let quote = |s: &str| serde_json::to_string(s).expect("strings always serialize");
    let mut json = String::from("{");
    if let Some(meta) = &src.metadata {
        json.push_str("\"__metadata__\":{");
        for (i, (k, v)) in meta.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json.push_str(&quote(k));
            json.push(':');
            json.push_str(&quote(v));
        }
        json.push('}');
    }
    for (i, t) in tensors.iter().enumerate() {
        if i > 0 || src.metadata.is_some() {
            json.push(',');
        }
        let s = &src.tensors[t.source];
        let shape: Vec<String> = s.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            quote(&s.name),
            t.dtype,
            shape.join(","),
            t.start,
            t.end
        ));
    }
    json.push('}');
    // Padding to 8 keeps the data section, and so every tensor, aligned.
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(PREFIX + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out
}

fn plan_warnings(src: &SourceHeader, plan: &Plan, opts: &PlanOptions) -> Vec<String> {
    let mut warnings = Vec::new();
    if opts.unmatched == Unmatched::Warn && !plan.keep_unmatched.is_empty() {
        warnings.push(unmatched_message(&plan.keep_unmatched));
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
        warnings.push(format!(
            "{what} {verb} copied unchanged, so {mix}; --from-bf16 converts BF16 to F16 too"
        ));
    }
    let has_quantized = src.tensors.iter().any(|t| is_quantized_dtype(t.dtype));
    // F32 tensors that a `keep` rule keeps are safe.
    let f32_names: Vec<&str> = src
        .tensors
        .iter()
        .zip(&plan.reasons)
        .filter(|(t, r)| t.dtype == Dtype::F32 && **r == Reason::Converted)
        .map(|(t, _)| t.name.as_str())
        .collect();
    let scales: Vec<&str> = f32_names
        .iter()
        .copied()
        .filter(|n| n.to_ascii_lowercase().contains("scale"))
        .collect();
    // Whoever chose what to keep, and kept every scale-like tensor, knows the checkpoint.
    let kept_scales = !opts.keep.is_empty() && scales.is_empty();
    if has_quantized && !f32_names.is_empty() && !kept_scales {
        let named = if scales.is_empty() {
            &f32_names
        } else {
            &scales
        };
        let mut list = named
            .iter()
            .take(5)
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ");
        if named.len() > 5 {
            list.push_str(&format!(" and {} more", named.len() - 5));
        }
        warnings.push(format!(
            "this looks like a quantized checkpoint (F8/F4/F6 tensors beside F32 ones): \
             its F32 scale tensors will be converted too, which changes the model; \
             scale-like tensors: {list}"
        ));
    }
    if plan.converted() == 0 {
        warnings.push(format!(
            "nothing to convert: no tensor becomes {} (the output is a regrouped byte copy)",
            plan.target.dtype()
        ));
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data_len: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.resize(v.len() + data_len, 0);
        v
    }

    fn p() -> &'static Path {
        Path::new("x.safetensors")
    }

    #[test]
    fn keys_in_any_order_are_read_in_offset_order() {
        let h = r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let src = read_header(p(), &file(h, 16)).unwrap();
        let names: Vec<_> = src.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn duplicate_names_are_refused() {
        let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let err = read_header(p(), &file(h, 8)).unwrap_err().to_string();
        assert!(err.contains("duplicate tensor name `a`"), "{err}");
        assert!(err.starts_with("x.safetensors: "), "{err}");
    }

    #[test]
    fn crate_reasons_are_kept() {
        let err = read_header(p(), &[1, 2, 3]).unwrap_err().to_string();
        assert!(err.contains("too small"), "{err}");
        let h = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        let err = read_header(p(), &file(h, 8)).unwrap_err().to_string();
        assert!(err.contains("invalid safetensors file"), "{err}");
    }

    #[test]
    fn refusals_name_the_tensor_and_the_numbers() {
        let h = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        let err = read_header(p(), &file(h, 8)).unwrap_err().to_string();
        assert!(
            err.contains("tensor `a`: shape [3] of F32 needs 12 bytes, data_offsets give 8"),
            "{err}"
        );
        let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let err = read_header(p(), &file(h, 4)).unwrap_err().to_string();
        assert!(
            err.contains("truncated: the header describes 8 data bytes, the file has 4"),
            "{err}"
        );
        let err = read_header(p(), &file(h, 10)).unwrap_err().to_string();
        assert!(err.contains("2 trailing bytes"), "{err}");
        let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
        let err = read_header(p(), &file(h, 12)).unwrap_err().to_string();
        assert!(err.contains("4 unused bytes before tensor `b`"), "{err}");
    }

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
        assert!(plan.warnings[0].contains("nothing to convert"));
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
                (name, t.dtype.to_string(), plan.reasons[t.source].code())
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
            let mut k = KeepPatterns::compile(p(), &[pattern.to_string()]).unwrap();
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
        let err = KeepPatterns::compile(p(), &["a[".to_string()])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("invalid --keep pattern `a[`"), "{err}");
    }

    #[test]
    fn unmatched_patterns_warn_fail_or_pass() {
        let src = source(&[("w", "F32", 2)]);
        let mut opts = keep_opts(Target::Bf16, &["w", "*nrom*", "x?"], 0);
        let plan1 = plan(p(), &src, &opts).unwrap();
        assert_eq!(plan1.keep_unmatched, ["*nrom*", "x?"]);
        assert!(
            plan1.warnings[0].contains("--keep patterns `*nrom*`, `x?` match no tensor name"),
            "{:?}",
            plan1.warnings
        );
        opts.unmatched = Unmatched::Ignore;
        let plan2 = plan(p(), &src, &opts).unwrap();
        assert_eq!(plan2.keep_unmatched, ["*nrom*", "x?"]);
        assert!(!plan2.warnings.iter().any(|w| w.contains("--keep")));
        opts.unmatched = Unmatched::Error;
        let err = plan(p(), &src, &opts).unwrap_err();
        assert_eq!(err.kind(), "refused");
        assert!(err.to_string().contains("(--strict)"), "{err}");
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
            plan1.warnings[0].contains("the output mixes BF16 and F16"),
            "{:?}",
            plan1.warnings
        );
        assert!(plan1.warnings[0].contains("--from-bf16"));
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
    fn quantized_checkpoint_warns_with_scale_names() {
        let h = r#"{"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]},"w.weight_scale":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        let src = read_header(p(), &file(h, 8)).unwrap();
        let plan1 = plan(p(), &src, &PlanOptions::new(Target::Bf16)).unwrap();
        assert!(
            plan1.warnings[0].contains("`w.weight_scale`"),
            "{:?}",
            plan1.warnings
        );
        // Kept scales are safe: no warning, even with other F32 tensors converted.
        let h = r#"{"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]},"w.weight_scale":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},"norm":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
        let src = read_header(p(), &file(h, 12)).unwrap();
        let kept = plan(p(), &src, &keep_opts(Target::Bf16, &["*scale"], 0)).unwrap();
        assert!(
            !kept.warnings.iter().any(|w| w.contains("quantized")),
            "{:?}",
            kept.warnings
        );
    }
}
