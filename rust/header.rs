//! Read and validate a safetensors header: the tensors in data order and the metadata.

use std::borrow::Cow;
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

/// One tensor of the input, as its header describes it.
#[derive(Clone, Debug)]
pub struct SourceTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range relative to the start of its file's data (`InputFile::base`); for a
    /// gathered tensor, `start` is where its elements begin and `len()` its logical size.
    pub start: u64,
    pub end: u64,
    /// Which file of the source holds it (`Source::files`): 0 but for composites.
    pub input: usize,
    /// A view that is not one little-endian run (strided, or big-endian): read by gathering
    /// its elements window by window (`torch::gather`).
    pub gather: Option<Box<crate::torch::TensorDesc>>,
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
        Error::invalid_header(path, format!("{reason}{detail}"))
    })?;
    // The crate has checked the UTF-8 and the JSON already; this second, ordered pass
    // sees what its HashMap hides: duplicate keys and the order of the keys.
    let json = &bytes[PREFIX..PREFIX + header_len];
    let mut de = serde_json::Deserializer::from_slice(json);
    let keys = OrderedHeader::deserialize(&mut de)
        .map_err(|e| Error::invalid_header(path, e.to_string()))?;

    let mut tensors = Vec::with_capacity(keys.names.len());
    let mut bytes = 0u64;
    let mut empty = false;
    for name in keys.names {
        let info = meta
            .info(&name)
            .ok_or_else(|| Error::invalid_header(path, format!("tensor `{name}` is missing")))?;
        let (start, end) = info.data_offsets;
        bytes += (end - start) as u64;
        empty |= start == end;
        tensors.push(SourceTensor {
            name: name.into_owned(),
            dtype: info.dtype,
            shape: info.shape.clone(),
            start: start as u64,
            end: end as u64,
            input: 0,
            gather: None,
        });
    }
    // The crate keeps one entry per name, and has checked that those cover the data
    // exactly: a repeated name counts its bytes twice. (Empty tensors count nothing, so
    // with any of them the names are compared.)
    if bytes != meta.data_len() as u64 || empty {
        let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        if let Some(name) = duplicate(&names) {
            return Err(Error::invalid_header(
                path,
                format!("duplicate tensor name `{name}`"),
            ));
        }
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
struct OrderedHeader<'de> {
    /// Borrowed from the header where no escape needs decoding: no allocation per name.
    names: Vec<Cow<'de, str>>,
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

impl<'de> de::Deserialize<'de> for OrderedHeader<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_map(HeaderVisitor)
    }
}

struct HeaderVisitor;

impl<'de> Visitor<'de> for HeaderVisitor {
    type Value = OrderedHeader<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        // Duplicates are found afterwards (`duplicate`), only when the counts say so.
        let mut names = Vec::new();
        let mut metadata = None;
        let mut metadata_seen = false;
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            if key == "__metadata__" {
                if metadata_seen {
                    return Err(de::Error::custom("duplicate tensor name `__metadata__`"));
                }
                metadata_seen = true;
                metadata = map.next_value::<Option<OrderedMetadata>>()?.map(|m| m.0);
            } else {
                map.next_value::<IgnoredAny>()?;
                names.push(key);
            }
        }
        Ok(OrderedHeader { names, metadata })
    }
}

/// The first name that appears twice, if one does.
fn duplicate<'a>(names: &[&'a str]) -> Option<&'a str> {
    let mut seen = HashSet::with_capacity(names.len());
    names.iter().copied().find(|n| !seen.insert(*n))
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
