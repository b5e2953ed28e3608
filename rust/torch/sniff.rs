//! Tell what a file is from its first bytes (and, for a zip, its entry names).

use super::zip;
use crate::format::Format;

/// `0x1950a86a20f9469cfc6c`, little-endian, as LONG1 holds it.
pub const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

/// Whether `bytes` starts with the pickled legacy magic number (any pickle protocol).
pub fn looks_legacy(bytes: &[u8]) -> bool {
    let mut b = bytes;
    if b.first() == Some(&0x80) && b.len() >= 2 {
        b = &b[2..];
        if b.first() == Some(&0x95) {
            b = b.get(9..).unwrap_or(&[]);
        }
        b.len() >= 12 && b[0] == 0x8a && b[1] == 10 && b[2..12] == LEGACY_MAGIC
    } else {
        // Protocols 0 and 1 write the number as text.
        b.starts_with(b"L119547037146038801333356")
    }
}

/// What [`sniff_parsed`] found: the format, and the zip directory it parsed to tell (so that
/// the reader does not parse a directory of 500k entries a second time).
#[derive(Debug, Clone)]
pub struct Sniffed {
    pub format: Format,
    /// The parsed directory of a zip archive (`None` if not a zip, or a damaged one).
    pub archive: Option<zip::ZipArchive>,
}

fn looks_safetensors(bytes: &[u8]) -> bool {
    if bytes.len() < 10 {
        return false;
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&bytes[..8]);
    let n = u64::from_le_bytes(n);
    bytes[8] == b'{' && n >= 2 && n <= bytes.len() as u64 - 8
}

/// [`sniff`], keeping the zip directory it parses.
pub fn sniff_parsed(bytes: &[u8]) -> Sniffed {
    if !bytes.is_empty() && !looks_safetensors(bytes) && zip::looks_like_zip(bytes) {
        let (format, archive) = sniff_zip(bytes);
        return Sniffed { format, archive };
    }
    Sniffed {
        format: sniff(bytes),
        archive: None,
    }
}

/// Name what `bytes` (the whole file, or at least its start) look like.
pub fn sniff(bytes: &[u8]) -> Format {
    if bytes.is_empty() {
        return Format::Empty;
    }
    if looks_safetensors(bytes) {
        return Format::Safetensors;
    }
    if zip::looks_like_zip(bytes) {
        return sniff_zip(bytes).0;
    }
    if looks_legacy(bytes) {
        return Format::TorchLegacy;
    }
    if bytes.starts_with(b"GGUF") {
        return Format::Gguf;
    }
    if bytes.starts_with(b"\x93NUMPY") {
        return Format::Npy;
    }
    if bytes.first() == Some(&0x80) && bytes.get(1).is_some_and(|&p| p <= 5) {
        return Format::Pickle;
    }
    let text = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
    let start = text.iter().position(|b| !b.is_ascii_whitespace());
    let text = &text[start.unwrap_or(text.len())..];
    let starts = |p: &[u8]| text.len() >= p.len() && text[..p.len()].eq_ignore_ascii_case(p);
    if starts(b"<!doctype html") || starts(b"<html") {
        return Format::Html;
    }
    if text.starts_with(b"version https://git-lfs.github.com/spec/") {
        return Format::LfsPointer;
    }
    if bytes.starts_with(b"\x1f\x8b") {
        return Format::Gzip;
    }
    if bytes.starts_with(b"\x89HDF\r\n\x1a\n") {
        return Format::Hdf5;
    }
    if looks_like_text(bytes) {
        return if text.starts_with(b"{") || text.starts_with(b"[") {
            Format::Json
        } else {
            Format::Text
        };
    }
    Format::Unknown
}

/// Whether the file's first KiB is text: UTF-8 without control characters but tabs and
/// line breaks. A safetensors file never is: its 8-byte header length has zero high bytes.
fn looks_like_text(bytes: &[u8]) -> bool {
    let head = &bytes[..bytes.len().min(1024)];
    let valid = match std::str::from_utf8(head) {
        Ok(s) => s,
        // A character cut at the 1 KiB mark is still text; an invalid byte before it is not.
        Err(e) if e.error_len().is_none() => {
            std::str::from_utf8(&head[..e.valid_up_to()]).unwrap_or_default()
        }
        Err(_) => return false,
    };
    !valid.trim().is_empty()
        && valid
            .chars()
            .all(|c| !c.is_control() || matches!(c, '\t' | '\n' | '\r' | '\x0c'))
}

/// Whether a zip entry is a checkpoint's pickle: `data.pkl`, at the top or one folder down.
pub fn is_pickle_name(name: &str) -> bool {
    name == "data.pkl"
        || name
            .strip_suffix("/data.pkl")
            .is_some_and(|d| !d.contains('/'))
}

/// Whether a zip entry belongs to a TorchScript archive (`torch.jit.save`): its
/// `constants.pkl` or a file under `code/`, at the top or one folder down.
fn is_torchscript_name(name: &str) -> bool {
    let below = name.split_once('/').map_or(name, |(_, rest)| rest);
    [name, below]
        .iter()
        .any(|n| *n == "constants.pkl" || n.starts_with("code/"))
}

fn sniff_zip(bytes: &[u8]) -> (Format, Option<zip::ZipArchive>) {
    let classify = |names: &mut dyn Iterator<Item = &str>| {
        let (mut any, mut all_npy, mut pickle) = (false, true, false);
        for n in names {
            if is_torchscript_name(n) {
                return Format::TorchScript;
            }
            pickle |= is_pickle_name(n);
            any = true;
            all_npy &= n.ends_with(".npy");
        }
        if pickle {
            Format::TorchZip
        } else if any && all_npy {
            Format::Npz
        } else {
            Format::Zip
        }
    };
    match zip::parse(bytes) {
        Ok(a) => (classify(&mut a.entries.iter().map(|e| &*e.name)), Some(a)),
        // A damaged or refused archive: go by the first entry, and let `read` say what is wrong.
        Err(_) => {
            let first = zip::first_name(bytes).and_then(|n| std::str::from_utf8(n).ok());
            (classify(&mut first.into_iter()), None)
        }
    }
}
