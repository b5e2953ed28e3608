//! A safe, bounded reader for PyTorch checkpoints (`torch.save` files: `.bin`, `.pt`,
//! `.pth`), without torch and without executing anything.
//!
//! The caller maps the file and hands its bytes to [`read`], which returns a [`Checkpoint`]:
//! the pickle as inert values, the storages located in the file, and one checked
//! [`TensorDesc`] (or the reason there is none) per tensor. [`Checkpoint::select`] picks the
//! state dict (a key, or the only dict of tensors) and flattens it to named tensors;
//! [`gather`] then copies any window of a tensor's logical elements, in row-major order and
//! little-endian, into a buffer, so a converter can stream tensors in bounded memory.
//!
//! ```text
//! sniff(&map)                         -> Format       what the bytes look like
//! read(&map, &Limits::default())      -> Checkpoint   parse, check, locate (no data read)
//! ckpt.tensor_dicts()                 -> Vec<TensorDict>  dicts holding tensors, with counts
//! ckpt.select(key)                    -> Selection    named tensors, skipped entries,
//!                                                     placeholder globals
//! t.is_contiguous(), t.contiguous_range(), t.span()   where a tensor's bytes are
//! gather(&map, &t, first_elem, &mut out)              copy a window, swapping big-endian
//! ```
//!
//! Formats: the zip format of torch >= 1.6 ([`zip`]; stored entries mapped in place, ZIP64
//! supported, sizes from the central directory) and the legacy format ([`legacy`]). The
//! pickle is read by an allow-listed unpickler ([`pickle`]) modelled on torch's
//! `weights_only` unpickler: rebuild functions, storage classes and dtypes map to stubs;
//! any other global is an inert [`pickle::Placeholder`]; `os`, `posix`, `sys`, `subprocess`,
//! `builtins.eval` and the like are refused outright ([`TorchError::Denied`]).
//!
//! Integration notes:
//! - Byte ranges: `TensorDesc::data_start..+data_len` is the storage (view) in the file;
//!   `contiguous_range()` is the tensor's own bytes when it is contiguous; `span()` covers
//!   every element (for read-ahead advice). Tensors sharing a storage share `storage`.
//! - Big-endian: `TensorDesc::big_endian` (zip `byteorder` = `big`); `gather` swaps, a
//!   caller that copies `contiguous_range()` itself must too (or just use `gather`).
//! - Placeholders: `Checkpoint::placeholders` / `Selection::placeholders` list every
//!   non-allowed global (`numpy.core.multiarray._reconstruct`, ...) for a warning; one that
//!   builds a selected entry makes `select` fail.
//! - Errors are [`TorchError`]: one lower-case line each, naming the entry or tensor.
//! - Policy beyond torch's `weights_only` rules: BUILD, APPEND and SETITEM are also accepted
//!   on the (inert) result of calling an unlisted global, so numpy arrays, `argparse`
//!   namespaces and Lightning hyper-parameters load as placeholders; a denied global
//!   (`os`, `posix`, `nt`, `sys`, `subprocess`, `builtins.eval`/`exec`/`getattr`, ...) is
//!   refused wherever it appears, selected or not.
//!
//! Known limits: a pickled whole model (`torch.save(model)`) is refused as "not a dict of
//! tensors"; tensor subclasses, sparse, quantized, nested and meta tensors, conj/neg views
//! and dtypes safetensors lacks (complex128, complex32, bits*, float4, int1-7/uint1-7) are
//! refused by name when selected; non-contiguous windows are gathered element by element
//! (contiguous runs along the innermost dimension are copied whole); the tar format of torch
//! before 0.1.10 is not read.

pub mod dtype;
pub mod error;
pub mod legacy;
pub mod pickle;
mod select;
pub mod sniff;
pub mod tensor;
pub mod zip;

#[cfg(test)]
mod tests;

use std::collections::HashMap;

pub use error::{PickleProblem, TensorProblem, TorchError};
pub use pickle::{Global, ObjId, Object, Pickle};
pub use select::{NamedTensor, Selection, TensorDict};
pub use tensor::{gather, gather_releasing, TensorDesc};

use dtype::TorchDtype;
use pickle::{Objects, StorageConflict, StorageRef, Storages};

// The one enum of file kinds and the sniffing live with the inputs; named here as before.
pub use crate::format::Format;
pub use sniff::{is_pickle_name, sniff};

/// Bounds on everything the reader allocates or walks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest pickle (`data.pkl`, or the legacy main pickle), in bytes.
    pub max_pickle_bytes: u64,
    /// Most objects in the pickle (also bounds the stack, memo and dict walks).
    pub max_objects: usize,
    /// Deepest nesting of containers (and of MARKs).
    pub max_depth: usize,
    /// Widest integer (LONG1/LONG4), in bytes.
    pub max_long_bytes: usize,
    /// Most dimensions of a tensor.
    pub max_ndim: usize,
    /// Whether `pathlib` paths stand as inert records rather than being refused: in a
    /// `torch.distributed.checkpoint` `.metadata` only (its `StorageMeta.checkpoint_id`).
    pub inert_paths: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_pickle_bytes: 256 << 20,
            max_objects: 1 << 24,
            max_depth: 1000,
            max_long_bytes: 1024,
            max_ndim: 64,
            inert_paths: false,
        }
    }
}

/// One storage: its bytes in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Storage {
    /// The key the pickle names it by (`0`, `1`, ... in zips; a number in legacy files).
    pub key: StorageKey,
    /// The dtype of its first reference (`uint8` for untyped storages).
    pub dtype: &'static TorchDtype,
    pub elem_size: u64,
    /// Elements, as the pickle records them.
    pub numel: u64,
    /// File offset of its first byte.
    pub offset: u64,
    /// Its length in bytes (`numel * elem_size`).
    pub len: u64,
    pub big_endian: bool,
    /// Whether it is a zip entry, `{prefix}/data/{key}` (false in legacy files).
    pub in_zip: bool,
}

/// A storage's key: one written as torch writes keys (`0`, `1`, ...: decimal, no leading
/// zero) is held as its value, so that 500k storages keep no text each (some 20 MB).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StorageKey {
    Number(u64),
    Text(Box<str>),
}

impl StorageKey {
    pub fn new(key: &str) -> StorageKey {
        match decimal(key) {
            Some(n) => StorageKey::Number(n),
            None => StorageKey::Text(key.into()),
        }
    }
}

impl std::fmt::Display for StorageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StorageKey::Number(n) => write!(f, "{n}"),
            StorageKey::Text(t) => f.write_str(t),
        }
    }
}

impl PartialEq<&str> for StorageKey {
    fn eq(&self, other: &&str) -> bool {
        match self {
            // A number is only ever made of the one text that spells it.
            StorageKey::Number(n) => decimal(other) == Some(*n),
            StorageKey::Text(t) => **t == **other,
        }
    }
}

/// A parsed checkpoint. Nothing of the storages' data has been read.
#[derive(Debug, Clone)]
pub struct Checkpoint<'a> {
    pub format: Format,
    /// The unpickled object, as inert values.
    pub pickle: Pickle<'a>,
    pub storages: Vec<Storage>,
    /// One entry per tensor the pickle builds, indexed by [`Object::Tensor`].
    pub tensors: Vec<Result<TensorDesc, TensorProblem>>,
    /// Globals outside the allow-list, `module.name`, in order of first appearance.
    pub placeholders: Vec<String>,
    /// Every global the pickle names, allowed or not, in order of first appearance.
    pub globals: Vec<String>,
    /// The zip archive's folder (`archive`, or the file stem); `None` for legacy files.
    pub prefix: Option<String>,
    limits: Limits,
}

impl Checkpoint<'_> {
    /// The tensor an object stands for, if it is one.
    pub fn tensor_of(&self, id: ObjId) -> Option<&Result<TensorDesc, TensorProblem>> {
        match &*self.pickle.get(id) {
            Object::Tensor(i) => self.tensors.get(*i as usize),
            _ => None,
        }
    }
}

/// A persistent id, `('storage', storage_type, key, location, numel[, view_metadata])`; its
/// keys are borrowed from the pickle.
pub(crate) struct Pid<'p> {
    pub dtype: &'static TorchDtype,
    pub key: &'p str,
    pub numel: u64,
    /// `(view_key, offset, size)` of a legacy storage view.
    pub view: Option<(&'p str, u64, u64)>,
}

pub(crate) fn pid_error(reason: impl Into<String>) -> TorchError {
    TorchError::Pickle {
        pickle: "pickle",
        at: 0,
        problem: PickleProblem::PersistentId {
            reason: reason.into(),
        },
    }
}

pub(crate) fn parse_pid<'p>(objects: Objects<'p, '_>, pid: ObjId) -> Result<Pid<'p>, TorchError> {
    let get = |id: ObjId| objects.get(id);
    let text = |id: ObjId| -> Option<&'p str> {
        let o = objects.arena(id)?;
        match (o.as_str(), o.as_bytes()) {
            (Some(s), _) => Some(s),
            (_, Some(b)) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    };
    let Some(Object::Tuple(t)) = objects.arena(pid) else {
        return Err(pid_error(format!("it is {}", get(pid).kind())));
    };
    if t.len() != 5 && t.len() != 6 {
        return Err(pid_error(format!("a tuple of {} items", t.len())));
    }
    if text(t[0]) != Some("storage") {
        return Err(pid_error("its first item is not `storage`"));
    }
    let dtype = match &*get(t[1]) {
        Object::Global(Global::StorageClass(d)) => *d,
        Object::Global(Global::UntypedStorage) => dtype::uint8(),
        other => return Err(pid_error(format!("its storage type is {}", other.kind()))),
    };
    let key = text(t[2]).ok_or_else(|| pid_error("its key is not a str"))?;
    let numel = match &*get(t[4]) {
        Object::Int(n) if *n >= 0 => *n as u64,
        Object::BigInt(_) => {
            return Err(pid_error(
                "its element count is too large: an integer wider than 64 bits",
            ))
        }
        _ => return Err(pid_error("its element count is not a non-negative int")),
    };
    let view = match t.get(5).map(|&v| get(v)).as_deref() {
        None | Some(Object::None) => None,
        Some(Object::Tuple(v)) if v.len() == 3 => {
            let view_key = text(v[0]).ok_or_else(|| pid_error("its view key is not a str"))?;
            match (&*get(v[1]), &*get(v[2])) {
                (Object::Int(o), Object::Int(s)) if *o >= 0 && *s >= 0 => {
                    Some((view_key, *o as u64, *s as u64))
                }
                _ => return Err(pid_error("its view offset or size is not an int")),
            }
        }
        Some(other) => return Err(pid_error(format!("its view is {}", other.kind()))),
    };
    Ok(Pid {
        dtype,
        key,
        numel,
        view,
    })
}

/// The value of a key written as torch writes one (decimal digits, no leading zero), so that
/// two keys have the same value exactly when they are the same text.
fn decimal(key: &str) -> Option<u64> {
    let b = key.as_bytes();
    let canonical = !b.is_empty()
        && b.len() <= 19
        && b.iter().all(u8::is_ascii_digit)
        && (b[0] != b'0' || b.len() == 1);
    canonical.then(|| key.parse().ok()).flatten()
}

struct ZipStorages<'a> {
    archive: &'a zip::ZipArchive,
    prefix: &'a str,
    big_endian: bool,
    storages: Vec<Storage>,
    /// Storages by key: a decimal key (torch writes `0`, `1`, ...) below the number of
    /// zip entries at that index (`u32::MAX` for none), any other by its text; no copy
    /// or hash of torch's keys (500k storages: some 40 MB).
    by_number: Vec<u32>,
    /// The entry `{prefix}data/{n}` by `n` (a decimal key, as above; `u32::MAX` for none):
    /// found in one pass over the directory, not searched for by name per storage.
    entry_of: Vec<u32>,
    by_key: HashMap<String, usize>,
    /// The name of the entry last looked up.
    name: String,
    release: &'a dyn Fn(&[u8]),
}

/// The reference `pid` makes to storage `index`, first named with dtype `first` and length
/// `first_bytes`: as torch 2.15.0's `persistent_load` (zip and legacy): the same dtype, or
/// another dtype of the same byte size, shares the storage's bytes under the reference's own
/// dtype; another byte size under another dtype is a conflict, and so is another element size
/// in a big-endian file (torch swaps the bytes by the first reference's element size).
pub(crate) fn reference(
    index: usize,
    first: &'static TorchDtype,
    first_bytes: u64,
    pid: &Pid,
    big_endian: bool,
) -> StorageRef {
    let bytes = pid.numel.saturating_mul(u64::from(pid.dtype.size));
    let swapped = big_endian && pid.dtype.size != first.size;
    let conflict =
        (pid.dtype != first && (bytes != first_bytes || swapped)).then_some(StorageConflict {
            dtype: pid.dtype,
            bytes,
            first_dtype: first,
            first_bytes,
            big_endian: swapped,
        });
    StorageRef {
        storage: index,
        // The same dtype returns the cached storage (its first reference's).
        dtype: if conflict.is_some() { first } else { pid.dtype },
        offset: 0,
        len: None,
        conflict,
    }
}

impl Storages for ZipStorages<'_> {
    fn release(&mut self, bytes: &[u8]) {
        (self.release)(bytes)
    }

    fn load(&mut self, objects: Objects<'_, '_>, pid: ObjId) -> Result<StorageRef, TorchError> {
        let pid = parse_pid(objects, pid)?;
        if pid.view.is_some() {
            return Err(pid_error("storage views exist only in legacy files"));
        }
        let number = decimal(pid.key)
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n < self.by_number.len());
        let found = match number {
            Some(n) => Some(self.by_number[n] as usize).filter(|&i| i != u32::MAX as usize),
            None => self.by_key.get(pid.key).copied(),
        };
        if let Some(index) = found {
            let s = &self.storages[index];
            return Ok(reference(index, s.dtype, s.len, &pid, self.big_endian));
        }
        // The entry's name, in one buffer reused for every storage.
        let name = &mut self.name;
        name.clear();
        name.push_str(self.prefix);
        name.push_str("data/");
        name.push_str(pid.key);
        let entry = match number {
            Some(n) => match self.entry_of[n] {
                u32::MAX => None,
                i => Some(&self.archive.entries[i as usize]),
            },
            None => self.archive.get(name),
        };
        if let Some(e) = entry.filter(|e| e.method != 0) {
            return Err(TorchError::ZipCompressed {
                entry: e.name.to_string(),
                method: e.method,
            });
        }
        let Some(entry) = entry else {
            return Err(TorchError::MissingStorage {
                key: pid.key.to_string(),
                entry: format!("entry `{name}`"),
            });
        };
        let es = u64::from(pid.dtype.size);
        let need = pid.numel.saturating_mul(es);
        if need > entry.size {
            return Err(TorchError::StorageTooShort {
                key: pid.key.to_string(),
                need,
                have: entry.size,
            });
        }
        self.storages.push(Storage {
            key: StorageKey::new(pid.key),
            dtype: pid.dtype,
            elem_size: es,
            numel: pid.numel,
            offset: entry.data,
            len: need,
            big_endian: self.big_endian,
            in_zip: true,
        });
        let index = self.storages.len() - 1;
        match number {
            // At most one storage per zip entry, so the index fits.
            Some(n) => self.by_number[n] = index as u32,
            None => {
                self.by_key.insert(pid.key.to_string(), index);
            }
        }
        Ok(reference(index, pid.dtype, need, &pid, false))
    }
}

/// For each `n` below the number of entries, the index of the entry `{prefix}data/{n}` (`n`
/// in decimal, as [`decimal`] reads keys), or `u32::MAX`.
fn entries_by_number(archive: &zip::ZipArchive, prefix: &str) -> Vec<u32> {
    let mut out = vec![u32::MAX; archive.entries.len()];
    for (i, e) in archive.entries.iter().enumerate() {
        let n = e
            .name
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix("data/"))
            .and_then(decimal)
            .and_then(|n| usize::try_from(n).ok());
        if let Some(slot) = n.and_then(|n| out.get_mut(n)) {
            // Names are unique (the directory was checked), so each slot is set once.
            *slot = i as u32;
        }
    }
    out
}

fn read_zip<'a>(
    bytes: &'a [u8],
    archive: Option<zip::ZipArchive>,
    limits: &Limits,
    release: &dyn Fn(&[u8]),
) -> Result<Checkpoint<'a>, TorchError> {
    // Sniffing parsed the directory already; only a damaged one is parsed again, for its error.
    let archive = match archive {
        Some(a) => a,
        None => zip::parse(bytes)?,
    };
    let mut pickles = archive.entries.iter().filter(|e| is_pickle_name(&e.name));
    let Some(pkl) = pickles.next() else {
        return Err(TorchError::ZipNoPickle);
    };
    if let Some(other) = pickles.next() {
        return Err(TorchError::ZipManyPickles {
            first: pkl.name.to_string(),
            second: other.name.to_string(),
        });
    }
    let prefix = &pkl.name[..pkl.name.len() - "data.pkl".len()];
    if pkl.method != 0 {
        return Err(TorchError::ZipCompressed {
            entry: pkl.name.to_string(),
            method: pkl.method,
        });
    }
    let big_endian = match archive.get_stored(&format!("{prefix}byteorder"))? {
        None => false,
        Some(e) => {
            let raw = archive.data(bytes, e);
            match String::from_utf8_lossy(raw).trim() {
                "little" => false,
                "big" => true,
                other => {
                    return Err(TorchError::ByteOrder {
                        entry: e.name.to_string(),
                        value: other.chars().take(40).collect(),
                    })
                }
            }
        }
    };
    if pkl.size > limits.max_pickle_bytes {
        return Err(TorchError::Pickle {
            pickle: "data.pkl",
            at: 0,
            problem: PickleProblem::TooLarge {
                limit: limits.max_pickle_bytes,
            },
        });
    }
    let mut loader = ZipStorages {
        archive: &archive,
        prefix,
        big_endian,
        storages: Vec::new(),
        by_number: vec![u32::MAX; archive.entries.len()],
        entry_of: entries_by_number(&archive, prefix),
        by_key: HashMap::new(),
        name: String::new(),
        release,
    };
    let pickle = pickle::unpickle(archive.data(bytes, pkl), "data.pkl", limits, &mut loader)?;
    let ZipStorages { mut storages, .. } = loader;
    storages.shrink_to_fit();
    let prefix = prefix.trim_end_matches('/').to_string();
    // The directory (500k entries: some 40 MB) is not needed to describe the tensors.
    drop(archive);
    Ok(finish(
        Format::TorchZip,
        pickle,
        storages,
        Some(prefix),
        limits,
    ))
}

fn finish<'a>(
    format: Format,
    mut pickle: Pickle<'a>,
    storages: Vec<Storage>,
    prefix: Option<String>,
    limits: &Limits,
) -> Checkpoint<'a> {
    let mut tensors: Vec<_> = std::mem::take(&mut pickle.tensors)
        .into_iter()
        .map(|slot| slot.and_then(|raw| tensor::describe(raw, &storages, limits.max_ndim)))
        .collect();
    // Collected in place, in the raw tensors' larger (and doubled) allocation.
    tensors.shrink_to_fit();
    let placeholders = pickle.placeholders.clone();
    let globals = pickle.globals.clone();
    Checkpoint {
        format,
        pickle,
        storages,
        tensors,
        placeholders,
        globals,
        prefix,
        limits: limits.clone(),
    }
}

/// Parse a PyTorch checkpoint: `bytes` is the whole (mapped) file. Reads the zip directory
/// or legacy headers and the pickle; locates every storage; reads no tensor data.
pub fn read<'a>(bytes: &'a [u8], limits: &Limits) -> Result<Checkpoint<'a>, TorchError> {
    read_sniffed(bytes, sniff::sniff_parsed(bytes), limits)
}

/// [`read`] of bytes already sniffed by [`sniff::sniff_parsed`]: the zip directory it
/// parsed is used, not parsed again.
pub fn read_sniffed<'a>(
    bytes: &'a [u8],
    sniffed: sniff::Sniffed,
    limits: &Limits,
) -> Result<Checkpoint<'a>, TorchError> {
    read_releasing(bytes, sniffed, limits, &|_| {})
}

/// [`read_sniffed`], handing `release` the parts of `bytes` the reader is done with (a long
/// str of the pickle, once checked), whose pages the caller may drop from its mapping.
pub fn read_releasing<'a>(
    bytes: &'a [u8],
    sniffed: sniff::Sniffed,
    limits: &Limits,
    release: &dyn Fn(&[u8]),
) -> Result<Checkpoint<'a>, TorchError> {
    match sniffed.format {
        Format::TorchZip | Format::Zip => read_zip(bytes, sniffed.archive, limits, release),
        Format::TorchLegacy => {
            let (pickle, storages) = legacy::read(bytes, limits)?;
            Ok(finish(Format::TorchLegacy, pickle, storages, None, limits))
        }
        format => Err(TorchError::NotTorch { format }),
    }
}
