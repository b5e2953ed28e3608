//! The numeric report file (`report=`): what rounding did to each converted tensor, as JSON.
//!
//! `convert` writes it from the numbers it measured while converting; `verify` writes the
//! same from a pair it verified. It is complete in its hidden temp before the output is
//! published, and published right after it.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::numerics::Numerics;
use crate::vocab::Target;
use crate::VERSION;

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
) -> Vec<u8> {
    let named: Vec<(Option<&str>, &str, &Numerics)> = tensors
        .iter()
        .map(|(n, x)| (None, n.as_ref(), x.borrow()))
        .collect();
    folder_report(src, dst, target, &named, total)
}

/// `numeric_report` for a folder: each tensor also names its file (relative path).
pub fn folder_report(
    src: &Path,
    dst: &Path,
    target: Option<Target>,
    tensors: &[(Option<&str>, &str, &Numerics)],
    total: &Numerics,
) -> Vec<u8> {
    let doc = json!({
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
    let mut out = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b" ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    serde::Serialize::serialize(&doc, &mut ser).expect("JSON of plain values always serializes");
    out.push(b'\n');
    out
}
