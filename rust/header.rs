//! Read and validate a safetensors header: the tensors in data order and the metadata.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorInfo};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::error::{Error, Result};

/// Size of the little-endian header-length prefix.
pub const PREFIX: usize = 8;
/// The reason given for data offsets that end past what a file offset can hold.
pub const END_OVERFLOWS: &str = "the tensors' data offsets end past any file size";
/// The safetensors format's limit on the header, which we keep for our output too.
pub const MAX_HEADER: usize = 100_000_000;

/// The name compressed-tensors gives a packed weight's shape (`X.weight_shape`, beside
/// `X.weight_packed`): read with the header (`SourceHeader::weight_shapes`).
pub const WEIGHT_SHAPE_SUFFIX: &str = ".weight_shape";

/// One tensor of the input, as its header describes it.
#[derive(Clone, Debug)]
pub struct SourceTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range relative to the start of its file's data (`InputFile::base`); for a
    /// gathered tensor, `start` is where its elements begin (for pieces: the first piece's
    /// first byte, in its file) and `len()` its logical size.
    pub start: u64,
    pub end: u64,
    /// Which file of the source holds it (`Source::files`): 0 but for composites.
    pub input: usize,
    /// A tensor that is not one little-endian run of its file (a strided or big-endian view,
    /// or boxes in several files): read by gathering its elements window by window
    /// (`Source::read`, `gather`).
    pub gather: Option<Box<crate::gather::Gather>>,
}

impl SourceTensor {
    /// Bytes of the tensor, written contiguously.
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
    /// The values of the packed weights' `X.weight_shape` tensors (I64 or I32 `[2]`),
    /// read with the header: a packed weight's width is not in its shape
    /// (`quant::dequantizable`). Empty for inputs other than safetensors files.
    pub weight_shapes: Vec<(String, [i64; 2])>,
}

impl SourceHeader {
    /// Where the data section starts in the file.
    pub fn data_start(&self) -> u64 {
        PREFIX as u64 + self.header_len
    }

    /// Bytes of all tensors (for one safetensors file: its data section).
    pub fn data_len(&self) -> u64 {
        self.tensors.iter().map(|t| t.len()).sum()
    }
}

/// Validate a whole safetensors file held in `bytes` (usually a read-only map).
///
/// One pass over the JSON, in key order: each entry is read as the `safetensors` crate's
/// own `TensorInfo` (its dtypes, its field rules), the `__metadata__` object keeps its key
/// order, and names are borrowed from the map until they are kept. The checks are the
/// crate's `SafeTensors::read_metadata` (prefix, 100 MB limit, UTF-8, JSON, offsets
/// contiguous from 0, sizes from shape and dtype, the data section ending at the file's
/// end), without its hash map and buffered parse: at 300,000 tensors those cost about
/// 0.5 s and 290 MB. The fuzz property (`fuzz/check.rs`) holds this to the crate on
/// arbitrary bytes: a header is accepted exactly when the crate accepts it (and it has no
/// duplicate names, which the crate's map would hide), with the crate's tensors. A refusal
/// asks the crate for its reason, so messages are the crate's, with our specifics.
pub fn read_header(path: &Path, bytes: &[u8]) -> Result<SourceHeader> {
    match parse(bytes) {
        Ok(header) => Ok(header),
        Err(Refused::Ours(what)) => Err(Error::invalid_header(path, what)),
        Err(Refused::Invalid(ours)) => Err(crate_refusal(path, bytes, ours)),
    }
}

/// Why `parse` refused a header.
enum Refused {
    /// Refused by us, whatever the crate says: a duplicate tensor name or `__metadata__`
    /// key (which the crate's maps would hide), or data offsets whose end overflows (on
    /// which the crate's unchecked addition would panic: it is never asked about those).
    Ours(String),
    /// Invalid as the crate defines it; our reason, used if the crate had none.
    Invalid(String),
}

fn invalid(reason: impl Into<String>) -> Refused {
    Refused::Invalid(reason.into())
}

fn parse(bytes: &[u8]) -> std::result::Result<SourceHeader, Refused> {
    let prefix: [u8; PREFIX] = bytes
        .get(..PREFIX)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| invalid("header too small"))?;
    let n = usize::try_from(u64::from_le_bytes(prefix))
        .ok()
        .filter(|&n| n <= MAX_HEADER)
        .ok_or_else(|| invalid("header too large"))?;
    let json = PREFIX
        .checked_add(n)
        .and_then(|stop| bytes.get(PREFIX..stop))
        .ok_or_else(|| invalid("invalid header length"))?;
    let text =
        std::str::from_utf8(json).map_err(|e| invalid(format!("invalid UTF-8 in header: {e}")))?;
    let header: OrderedHeader = serde_json::from_str(text).map_err(|e| {
        let reason = e.to_string();
        // The crate's map would keep one of two equal `__metadata__` keys: ours to refuse.
        if reason.starts_with("duplicate __metadata__ key") {
            Refused::Ours(reason)
        } else {
            invalid(format!("invalid JSON in header: {reason}"))
        }
    })?;
    let mut tensors = header.tensors;
    // Stable: empty tensors that share an offset keep their JSON order.
    tensors.sort_by_key(|t| (t.start, t.end));
    // Before the offsets: a repeated name may hold contiguous bytes (`"h":[8,12]`,
    // `"h":[12,15]`) or break them, and either way the name is the reason.
    if let Some(name) = duplicate(&tensors) {
        return Err(Refused::Ours(format!("duplicate tensor name `{name}`")));
    }
    let end = validate(&tensors)?;
    let Some(file_end) = end.checked_add((PREFIX + n) as u64) else {
        return Err(Refused::Ours(format!("{END_OVERFLOWS} ({end} bytes)")));
    };
    if file_end != bytes.len() as u64 {
        return Err(invalid(
            "the data offsets do not cover the data section exactly",
        ));
    }
    let data = &bytes[PREFIX + n..];
    let weight_shapes = tensors
        .iter()
        .filter(|t| t.name.ends_with(WEIGHT_SHAPE_SUFFIX) && t.shape == [2])
        .filter_map(|t| {
            let b = data.get(t.start as usize..t.end as usize)?;
            let v = match t.dtype {
                Dtype::I64 => match b.as_chunks::<8>().0 {
                    [x, y] => [i64::from_le_bytes(*x), i64::from_le_bytes(*y)],
                    _ => return None,
                },
                Dtype::I32 => match b.as_chunks::<4>().0 {
                    [x, y] => [x, y].map(|w| i64::from(i32::from_le_bytes(*w))),
                    _ => return None,
                },
                _ => return None,
            };
            Some((t.name.clone(), v))
        })
        .collect();
    Ok(SourceHeader {
        header_len: n as u64,
        metadata: header.metadata,
        tensors,
        weight_shapes,
    })
}

/// The crate's `Metadata::validate` on tensors sorted by offsets: contiguous from 0, each
/// the size its shape and dtype give (in `usize`, as the crate computes it). Returns where
/// the data ends.
fn validate(tensors: &[SourceTensor]) -> std::result::Result<u64, Refused> {
    let mut at = 0u64;
    for t in tensors {
        if t.start != at || t.end < t.start {
            return Err(invalid(format!("invalid offset for tensor `{}`", t.name)));
        }
        at = t.end;
        let bits = t
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(t.dtype.bitsize()))
            .ok_or_else(|| invalid("overflow in the shape of a tensor"))?;
        if bits % 8 != 0 {
            return Err(invalid("a tensor does not end on a byte"));
        }
        if (bits / 8) as u64 != t.len() {
            return Err(invalid("invalid shape, data type, or offset for tensor"));
        }
    }
    Ok(at)
}

/// The refusal of a header `parse` refused as invalid: the crate's reason, with which
/// tensor and by how much where we can say. (`ours` only if the crate, against the fuzzed
/// property, accepted it.)
fn crate_refusal(path: &Path, bytes: &[u8], ours: String) -> Error {
    let Err(e) = SafeTensors::read_metadata(bytes) else {
        return Error::invalid_header(path, ours);
    };
    let detail = diagnose(bytes).map_or(String::new(), |d| format!(" ({d})"));
    // The crate's serde messages name its private types; say what they mean.
    let reason = e
        .to_string()
        .replace("struct HashMetadata", "a JSON object of tensors")
        .replace("struct TensorInfo", "a tensor entry");
    Error::invalid_header(path, format!("{reason}{detail}"))
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

/// The tensors of a header in JSON key order, and `__metadata__` in its order.
struct OrderedHeader {
    tensors: Vec<SourceTensor>,
    metadata: Option<Vec<(String, String)>>,
}

/// A JSON key, borrowed when it can be.
struct Key<'de>(Cow<'de, str>);

impl<'de> de::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(
                self,
                v: &'de str,
            ) -> std::result::Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> std::result::Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
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
        // Duplicate names are found afterwards (`duplicate`), only when the offsets say so.
        let mut tensors = Vec::new();
        let mut metadata = None;
        let mut metadata_seen = false;
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            if key == "__metadata__" {
                if metadata_seen {
                    return Err(de::Error::custom("duplicate field `__metadata__`"));
                }
                metadata_seen = true;
                metadata = map.next_value::<Option<OrderedMetadata>>()?.map(|m| m.0);
            } else {
                let Entry(info) = map.next_value()?;
                let (start, end) = info.data_offsets;
                tensors.push(SourceTensor {
                    name: key.into_owned(),
                    dtype: info.dtype,
                    shape: info.shape,
                    start: start as u64,
                    end: end as u64,
                    input: 0,
                    gather: None,
                });
            }
        }
        Ok(OrderedHeader { tensors, metadata })
    }
}

/// One tensor entry, read as the crate reads it: its `TensorInfo` fields (the crate's
/// dtype names, shape and offsets types) from an object or a 3-element array, a repeated
/// or missing field refused. A field the crate does not know is parsed whole, as the
/// crate's buffered (`flatten`) parse does: a lone surrogate, a number out of range or a
/// nesting past serde_json's limit in it refuses the file there too. (Skipping it with
/// `IgnoredAny`, as `TensorInfo`'s own derive does, checks none of those.)
struct Entry(TensorInfo);

const FIELDS: &[&str] = &["dtype", "shape", "data_offsets"];

impl<'de> de::Deserialize<'de> for Entry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_struct("TensorInfo", FIELDS, EntryVisitor)
    }
}

struct EntryVisitor;

impl<'de> Visitor<'de> for EntryVisitor {
    type Value = Entry;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a tensor entry")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Entry, A::Error> {
        let dtype = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let shape = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(1, &self))?;
        let data_offsets = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(2, &self))?;
        Ok(Entry(TensorInfo {
            dtype,
            shape,
            data_offsets,
        }))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Entry, A::Error> {
        let (mut dtype, mut shape, mut data_offsets) = (None, None, None);
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            match &*key {
                "dtype" if dtype.is_none() => dtype = Some(map.next_value()?),
                "shape" if shape.is_none() => shape = Some(map.next_value()?),
                "data_offsets" if data_offsets.is_none() => data_offsets = Some(map.next_value()?),
                "dtype" | "shape" | "data_offsets" => {
                    let field = FIELDS.iter().find(|f| **f == key).expect("a field");
                    return Err(de::Error::duplicate_field(field));
                }
                _ => {
                    map.next_value::<serde_json::Value>()?;
                }
            }
        }
        Ok(Entry(TensorInfo {
            dtype: dtype.ok_or_else(|| de::Error::missing_field("dtype"))?,
            shape: shape.ok_or_else(|| de::Error::missing_field("shape"))?,
            data_offsets: data_offsets.ok_or_else(|| de::Error::missing_field("data_offsets"))?,
        }))
    }
}

/// The first name that appears twice, if one does.
fn duplicate(tensors: &[SourceTensor]) -> Option<&str> {
    let mut seen = HashSet::with_capacity(tensors.len());
    tensors
        .iter()
        .map(|t| t.name.as_str())
        .find(|n| !seen.insert(*n))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{file, p};

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

    /// The single pass accepts what the crate accepts (the fuzz property, on cases picked
    /// at each of the crate's rules).
    #[test]
    fn accepts_exactly_what_the_crate_accepts() {
        let t = |dtype: &str, shape: &str, a: u64, b: u64| {
            format!(r#"{{"dtype":"{dtype}","shape":{shape},"data_offsets":[{a},{b}]}}"#)
        };
        let nested = |depth: usize| {
            let (open, close) = ("[".repeat(depth), "]".repeat(depth));
            format!(
                r#"{{"a":{{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":{open}{close}}}}}"#
            )
        };
        let cases: Vec<(String, usize)> = vec![
            (format!(r#"{{"a":{}}}"#, t("F32", "[2]", 0, 8)), 8),
            (format!(r#"{{"a":{}}}"#, t("F4", "[3]", 0, 1)), 1),
            (format!(r#"{{"a":{}}}"#, t("F4", "[4]", 0, 2)), 2),
            (format!(r#"{{"a":{}}}"#, t("F6_E2M3", "[4]", 0, 3)), 3),
            (format!(r#"{{"a":{}}}"#, t("F6_E2M3", "[2]", 0, 1)), 1),
            (format!(r#"{{"a":{}}}"#, t("F32", "[]", 0, 4)), 4),
            (format!(r#"{{"a":{}}}"#, t("F32", "[0]", 0, 0)), 0),
            (format!(r#"{{"a":{}}}"#, t("F32", "[2]", 1, 9)), 9),
            (format!(r#"{{"a":{}}}"#, t("F32", "[2]", 8, 0)), 8),
            (format!(r#"{{"a":{}}}"#, t("F32", "[2]", 0, 8)), 9),
            (format!(r#"{{"a":{}}}"#, t("F32", "[2]", 0, 8)), 7),
            (format!(r#"{{"a":{}}}"#, t("F128", "[2]", 0, 8)), 8),
            (
                format!(r#"{{"a":{}}}"#, t("F32", "[4294967296,4294967296,4]", 0, 0)),
                0,
            ),
            (
                format!(
                    r#"{{"a":{},"b":{}}}"#,
                    t("F32", "[0]", 0, 0),
                    t("F32", "[0]", 0, 0)
                ),
                0,
            ),
            (
                format!(
                    r#"{{"a":{},"b":{}}}"#,
                    t("F32", "[1]", 4, 8),
                    t("F32", "[1]", 0, 4)
                ),
                8,
            ),
            (
                format!(
                    r#"{{"a":{},"b":{}}}"#,
                    t("F32", "[1]", 0, 4),
                    t("F32", "[1]", 0, 4)
                ),
                4,
            ),
            (r#"{"__metadata__":null}"#.to_string(), 0),
            // Found by review: a field the crate does not know is parsed whole by it.
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":"\ud800"}}"#
                    .to_string(),
                4,
            ),
            (
                r#"{"a":{"x":"\udfff","dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#
                    .to_string(),
                4,
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1e400}}"#.to_string(),
                4,
            ),
            // Nesting in an unknown field: within serde_json's limit, and one past it.
            (nested(125), 4),
            (nested(126), 4),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":{"y":[1,"z",null]}}}"#
                    .to_string(),
                4,
            ),
            (r#"{"a":["F32",[1],[0,4]]}"#.to_string(), 4),
            (r#"{"a":["F32",[1],[0,4],1]}"#.to_string(), 4),
            (r#"{"a":["F32",[1]]}"#.to_string(), 4),
            (
                r#"{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#
                    .to_string(),
                4,
            ),
            // Found by the fuzzer: a repeated name whose two entries are contiguous.
            (
                format!(
                    r#"{{"h":{},"h":{}}}"#,
                    t("I8", "[2]", 0, 2),
                    t("I8", "[3]", 2, 5)
                ),
                5,
            ),
            (r#"{"__metadata__":{"k":"v"}}"#.to_string(), 0),
            (r#"{"__metadata__":{"k":1}}"#.to_string(), 0),
            (r#"{"__metadata__":[]}"#.to_string(), 0),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}"#.to_string(),
                4,
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}"#.to_string(),
                4,
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}"#.to_string(),
                4,
            ),
            (r#"{"a":{"dtype":"F32","shape":[1]}}"#.to_string(), 4),
            (r#"{"a":null}"#.to_string(), 0),
            (r#"{}"#.to_string(), 0),
            (r#"{} "#.to_string(), 0),
            (r#"{}x"#.to_string(), 0),
            (r#"[]"#.to_string(), 0),
        ];
        for (h, data) in cases {
            let bytes = file(&h, data);
            let ours = read_header(p(), &bytes);
            let theirs = SafeTensors::read_metadata(&bytes);
            if h.contains(r#""h":"#) {
                let err = ours.unwrap_err().to_string();
                assert!(err.contains("duplicate tensor name `h`"), "{err}");
                continue;
            }
            assert_eq!(ours.is_ok(), theirs.is_ok(), "{h} + {data}: {ours:?}");
        }
    }

    /// Offsets whose end passes u64 are ours to refuse: the crate's unchecked addition
    /// would panic on them (found by review).
    #[test]
    fn offsets_ending_past_u64_are_refused_without_the_crate() {
        let s = (1u64 << 61) - 1;
        let entries: Vec<String> = (0..8)
            .map(|i| {
                format!(
                    r#""t{i}":{{"dtype":"U8","shape":[{s}],"data_offsets":[{},{}]}}"#,
                    i * s,
                    (i + 1) * s
                )
            })
            .collect();
        let h = format!("{{{}}}", entries.join(","));
        let err = read_header(p(), &file(&h, 0)).unwrap_err().to_string();
        assert!(err.contains(END_OVERFLOWS), "{err}");
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
}
