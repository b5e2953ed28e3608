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
}

impl Conversion {
    /// Bytes per source element.
    pub fn src_size(self) -> u64 {
        match self {
            Conversion::F16ToBf16 => 2,
            Conversion::F32ToBf16 | Conversion::F32ToF16 => 4,
            Conversion::F64ToBf16 | Conversion::F64ToF16 => 8,
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

/// The action for a source dtype under a target.
pub fn action_for(dtype: Dtype, target: Target) -> Action {
    use Conversion::*;
    match (target, dtype) {
        (Target::Bf16, Dtype::F32) => Action::Convert(F32ToBf16),
        (Target::Bf16, Dtype::F16) => Action::Convert(F16ToBf16),
        (Target::Bf16, Dtype::F64) => Action::Convert(F64ToBf16),
        (Target::F16, Dtype::F32) => Action::Convert(F32ToF16),
        (Target::F16, Dtype::F64) => Action::Convert(F64ToF16),
        _ => Action::Copy,
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

/// Plan the output of `src` converted to `target`: order, offsets, header bytes, warnings.
pub fn plan(path: &Path, src: &SourceHeader, target: Target) -> Result<Plan> {
    let mut tensors: Vec<TensorPlan> = src
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let action = action_for(t.dtype, target);
            let dtype = match action {
                Action::Copy => t.dtype,
                Action::Convert(_) => target.dtype(),
            };
            TensorPlan {
                source: i,
                dtype,
                action,
                start: 0,
                end: 0,
            }
        })
        .collect();
    // Stable, so input order survives within each width; every tensor's length is a
    // multiple of its element size, so each group starts aligned for the next.
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
        target,
        header,
        tensors,
        warnings: Vec::new(),
    };
    plan.warnings = plan_warnings(src, &plan);
    Ok(plan)
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

fn plan_warnings(src: &SourceHeader, plan: &Plan) -> Vec<String> {
    let mut warnings = Vec::new();
    let has_quantized = src.tensors.iter().any(|t| is_quantized_dtype(t.dtype));
    let f32_names: Vec<&str> = src
        .tensors
        .iter()
        .filter(|t| t.dtype == Dtype::F32)
        .map(|t| t.name.as_str())
        .collect();
    if has_quantized && !f32_names.is_empty() {
        let scales: Vec<&str> = f32_names
            .iter()
            .copied()
            .filter(|n| n.to_ascii_lowercase().contains("scale"))
            .collect();
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
        let plan = plan(p(), &src, Target::Bf16).unwrap();
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
        let plan = plan(p(), &src, Target::Bf16).unwrap();
        assert_eq!(plan.warnings.len(), 1);
        assert!(plan.warnings[0].contains("nothing to convert"));
    }

    #[test]
    fn quantized_checkpoint_warns_with_scale_names() {
        let h = r#"{"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]},"w.weight_scale":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        let src = read_header(p(), &file(h, 8)).unwrap();
        let plan = plan(p(), &src, Target::Bf16).unwrap();
        assert!(
            plan.warnings[0].contains("`w.weight_scale`"),
            "{:?}",
            plan.warnings
        );
    }
}
