//! The numeric report file (`report=`): what rounding did to each converted tensor, as JSON.
//!
//! `convert` writes it from the numbers it measured while converting; `verify` writes the
//! same from a pair it verified. It is complete in its hidden temp before the output is
//! published, and published right after it.
//!
//! It also says how the engine's reports serialize (serde) where their shape is not the
//! derived one: the Python adapter turns them into plain dicts with `pythonize`, once.

use std::path::Path;

use serde::ser::{SerializeStruct, SerializeTuple};
use serde::{Serialize, Serializer};
use serde_json::{json, Map, Value};

use crate::error::Warning;
use crate::kernels::Isa;
use crate::numerics::{DequantizedTensor, Numerics};
use crate::plan::KeptTensor;
use crate::quant::QuantizedTensor;
use crate::vocab::Target;
use crate::VERSION;

/// One tensor's numeric report as a row (`_core.TensorNumerics.row`): its name, then its
/// counts and errors.
#[derive(Serialize)]
pub struct NumericsRow<'a> {
    pub name: &'a str,
    #[serde(flatten)]
    pub numerics: &'a Numerics,
}

/// The version of the report's JSON layout (that of the CLI's `--json` output).
pub const SCHEMA: u64 = 1;

fn fields(file: Option<&str>, name: Option<&str>, n: &Numerics) -> Value {
    let mut m = Map::new();
    if let Some(file) = file {
        m.insert("file".into(), file.into());
    }
    if let Some(name) = name {
        m.insert("name".into(), name.into());
    }
    m.insert("elements".into(), n.elements.into());
    m.insert("overflow".into(), n.overflow.into());
    m.insert("underflow_to_zero".into(), n.underflow_to_zero.into());
    m.insert("subnormal".into(), n.subnormal.into());
    m.insert("nan_in".into(), n.nan_in.into());
    m.insert("inf_in".into(), n.inf_in.into());
    m.insert("max_abs_error".into(), n.max_abs_error.into());
    m.insert("max_rel_error".into(), n.max_rel_error.into());
    Value::Object(m)
}

/// The report's bytes: `{"schema", "command": "report", "version", "result": {"src",
/// "dst", "to", "tensors": [...], "total": {...}}}`, indented by one space per level.
pub fn numeric_report<S: AsRef<str>, N: std::borrow::Borrow<Numerics>>(
    src: &Path,
    dst: &Path,
    target: Option<Target>,
    tensors: &[(S, N)],
    total: &Numerics,
    quantized: &[QuantizedTensor],
    dequantized: &[DequantizedTensor],
) -> Vec<u8> {
    let named: Vec<(Option<&str>, &str, &Numerics)> = tensors
        .iter()
        .map(|(n, x)| (None, n.as_ref(), x.borrow()))
        .collect();
    let dequantized: Vec<_> = dequantized.iter().map(|d| (None, d)).collect();
    folder_report(src, dst, target, &named, total, quantized, &dequantized)
}

/// One file's part of a folder's report: its path relative to the folder (or None), its
/// rows, their total, and its dequantized weights.
pub type FilePart<'a> = (
    Option<&'a str>,
    &'a [(String, Numerics)],
    &'a Numerics,
    &'a [DequantizedTensor],
);

/// `folder_report` from each file's rows and total, the totals merged.
pub fn files_report(
    src: &Path,
    dst: &Path,
    target: Option<Target>,
    parts: &[FilePart<'_>],
) -> Vec<u8> {
    let mut total = Numerics::default();
    let mut named = Vec::new();
    let mut dequantized = Vec::new();
    for (file, rows, t, deq) in parts {
        total.merge(t);
        named.extend(rows.iter().map(|(n, x)| (*file, n.as_str(), x)));
        dequantized.extend(deq.iter().map(|d| (*file, d)));
    }
    folder_report(src, dst, target, &named, &total, &[], &dequantized)
}

/// `numeric_report` for a folder: each tensor also names its file (relative path).
pub fn folder_report(
    src: &Path,
    dst: &Path,
    target: Option<Target>,
    tensors: &[(Option<&str>, &str, &Numerics)],
    total: &Numerics,
    quantized: &[QuantizedTensor],
    dequantized: &[(Option<&str>, &DequantizedTensor)],
) -> Vec<u8> {
    let mut doc = json!({
        "schema": SCHEMA,
        "command": "report",
        "version": VERSION,
        "result": {
            "src": src.to_string_lossy(),
            "dst": dst.to_string_lossy(),
            "to": target.map(Target::name),
            "tensors": tensors
                .iter()
                .map(|(f, n, x)| fields(*f, Some(n), x))
                .collect::<Vec<_>>(),
            "total": fields(None, None, total),
        },
    });
    // FP8 targets: what quantizing did to each weight (the rounding rows are the rest's).
    if !quantized.is_empty() {
        doc["result"]["quantized"] = serde_json::to_value(quantized).unwrap_or_default();
    }
    // A quantized input: the values each dequantized weight came to (for a folder, each
    // with its file first).
    if !dequantized.is_empty() {
        let rows = dequantized.iter().map(|(file, d)| {
            let mut m = Map::new();
            if let Some(file) = file {
                m.insert("file".into(), (*file).into());
            }
            if let Ok(Value::Object(fields)) = serde_json::to_value(d) {
                m.extend(fields);
            }
            Value::Object(m)
        });
        doc["result"]["dequantized"] = Value::Array(rows.collect());
    }
    let mut out = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b" ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    serde::Serialize::serialize(&doc, &mut ser).expect("JSON of plain values always serializes");
    out.push(b'\n');
    out
}

impl Serialize for Isa {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// A warning crosses as `(kind, template)`.
impl Serialize for Warning {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(2)?;
        t.serialize_element(&self.kind)?;
        t.serialize_element(&self.text)?;
        t.end()
    }
}

/// A kept tensor: its name, dtype, bytes, reason code and the pattern that kept it.
impl Serialize for KeptTensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_struct("KeptTensor", 5)?;
        m.serialize_field("name", &self.name)?;
        m.serialize_field("dtype", &Shown(&self.dtype))?;
        m.serialize_field("bytes", &self.bytes)?;
        m.serialize_field("reason", &self.reason.code())?;
        m.serialize_field("pattern", &self.reason.pattern())?;
        m.end()
    }
}

/// A value serialized as its `Display` text (dtypes: "F32").
pub struct Shown<'a, T: std::fmt::Display>(pub &'a T);

impl<T: std::fmt::Display> Serialize for Shown<'_, T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self.0)
    }
}

/// A byte range, serialized as a two-element list.
pub struct Span(pub u64, pub u64);

impl Serialize for Span {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq([self.0, self.1])
    }
}

/// Key-value pairs in their order, serialized as a map (`__metadata__`).
pub fn pairs_as_map<S: Serializer>(
    pairs: &Option<&[(String, String)]>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match pairs {
        None => s.serialize_none(),
        Some(pairs) => s.collect_map(pairs.iter().map(|(k, v)| (k, v))),
    }
}
