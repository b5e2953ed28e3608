//! Errors of the PyTorch checkpoint reader: one variant per failure, each with its data.
//!
//! Every `Display` is one lower-case line that names the entry, tensor or global concerned
//! and the numbers involved. No message names a command-line flag: callers add their own
//! advice ("select one with the key option" is as specific as these get).

use std::fmt;

use crate::format::Format;
use crate::torch::dtype::TorchDtype;

/// A storage reference whose dtype differs from the first reference of its key and whose
/// byte size (`numel * element size`) differs too. torch 2.15.0 refuses such a zip file
/// ("record size ... does not match expected size") unless it maps the file, and rebuilds
/// such a legacy tensor over uninitialised memory, so a tensor built on it is refused. In a
/// big-endian zip file, another element size is a conflict too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorageConflict {
    /// This reference's dtype and byte size.
    pub dtype: &'static TorchDtype,
    pub bytes: u64,
    /// The first reference's dtype and byte size.
    pub first_dtype: &'static TorchDtype,
    pub first_bytes: u64,
    /// Whether the conflict is the element size of a big-endian storage (torch swaps its
    /// bytes by the first reference's element size).
    pub big_endian: bool,
}

/// Why a tensor found in the pickle cannot be described (reported with its name by
/// [`crate::torch::Checkpoint::select`], and only for tensors that are selected).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TensorProblem {
    /// A torch dtype that safetensors has no equivalent for (complex128, qint8, bits8, ...).
    UnsupportedDtype { dtype: String },
    /// A tensor kind that is not a plain strided tensor over a storage.
    Layout { what: &'static str },
    /// The tensor would be built by (or from the result of) a global outside the allow-list.
    CallsGlobal { global: String },
    /// A tensor subclass named by a global outside the allow-list.
    Subclass { global: String },
    /// The rebuild call's arguments do not have the shape torch writes.
    BadArgs { func: &'static str, reason: String },
    /// The conj or neg bit is set: the stored numbers are not the tensor's values.
    LazyBit { bit: String },
    /// The last element of the view lies past the end of its storage.
    OutOfBounds { last: u64, available: u64 },
    /// Shape, stride or offset arithmetic overflows 64 bits.
    Overflow,
    /// Its storage reference names another dtype, of another byte size, than the first
    /// reference of the same storage key (see [`StorageConflict`]).
    StorageConflict {
        key: String,
        conflict: Box<StorageConflict>,
        legacy: bool,
    },
    /// More dimensions than the limit.
    TooManyDims { ndim: usize, limit: usize },
    /// Its name would be `__metadata__`, the header's metadata entry.
    ReservedName,
    /// A dict key on its path is neither a str nor an int (bytes, a tuple, ...).
    KeyNotString { kind: &'static str },
}

impl fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorProblem::UnsupportedDtype { dtype } => {
                write!(f, "dtype {dtype} has no safetensors equivalent")
            }
            TensorProblem::Layout { what } => {
                write!(f, "is a {what}, which safetensors cannot hold")
            }
            TensorProblem::CallsGlobal { global } => {
                write!(f, "refusing to load: the pickle calls {global} to build it")
            }
            TensorProblem::Subclass { global } => write!(
                f,
                "refusing to load: it is an instance of the tensor subclass {global}"
            ),
            TensorProblem::BadArgs { func, reason } => {
                write!(f, "malformed call to {func}: {reason}")
            }
            TensorProblem::LazyBit { bit } => write!(
                f,
                "has the {bit} bit set, so its stored numbers are not its values"
            ),
            TensorProblem::OutOfBounds { last, available } => write!(
                f,
                "its last element is element {last} of a storage that holds {available}"
            ),
            TensorProblem::Overflow => write!(f, "its shape, stride or offset overflows 64 bits"),
            TensorProblem::StorageConflict {
                key,
                conflict: c,
                legacy,
            } => write!(
                f,
                "its reference to storage `{key}` says {} of {} bytes, but the storage's first \
                 reference says {} of {} bytes; {}",
                c.dtype.name,
                c.bytes,
                c.first_dtype.name,
                c.first_bytes,
                if c.big_endian {
                    "the storage is big-endian, and torch.load swaps its bytes by the first \
                     reference's element size"
                } else if *legacy {
                    "torch.load rebuilds such a tensor over uninitialised memory"
                } else {
                    "torch.load refuses such a file (the record's size must match)"
                }
            ),
            TensorProblem::TooManyDims { ndim, limit } => {
                write!(f, "has {ndim} dimensions, more than the limit of {limit}")
            }
            TensorProblem::ReservedName => write!(
                f,
                "its name would be `__metadata__`, which a safetensors header reserves for \
                 the file's metadata"
            ),
            TensorProblem::KeyNotString { kind } => write!(
                f,
                "its dict key is {kind}, not a string: a safetensors file names each tensor \
                 by a string"
            ),
        }
    }
}

/// Why a pickle stream was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickleProblem {
    /// The stream ended before STOP.
    Truncated,
    /// The pickle is larger than the limit (bytes).
    TooLarge { limit: u64 },
    /// An opcode this reader does not know.
    UnknownOpcode { op: u8 },
    /// An opcode refused on principle (INST, OBJ, EXT1/2/4, PERSID, out-of-band buffers).
    Forbidden { op: &'static str },
    /// An opcode needed more items than the stack (or the current MARK frame) holds.
    StackUnderflow { op: &'static str },
    /// An opcode that needs a MARK found none.
    NoMark { op: &'static str },
    /// Containers nest deeper than the limit.
    TooDeep { limit: usize },
    /// More objects (or stack slots, memo entries, container cells) than the limit.
    TooMany { what: &'static str, limit: u64 },
    /// GET of a memo slot that was never PUT.
    MemoMissing { index: u64 },
    /// A LONG1/LONG4 wider than the limit (bytes).
    LongTooWide { bytes: u64, limit: u64 },
    /// A string or line that is not valid UTF-8 / text where text is needed.
    BadText { op: &'static str },
    /// An operand of the wrong type.
    WrongType {
        op: &'static str,
        expected: &'static str,
        found: &'static str,
    },
    /// BUILD on an object that may not take state.
    Build { target: String },
    /// A call of an allowed global with arguments it does not accept.
    BadCall { global: String, reason: String },
    /// A persistent id that is not a storage tuple.
    PersistentId { reason: String },
}

impl fmt::Display for PickleProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PickleProblem::Truncated => write!(f, "the stream ends before STOP"),
            PickleProblem::TooLarge { limit } => {
                write!(f, "the pickle is larger than the limit of {limit} bytes")
            }
            PickleProblem::UnknownOpcode { op } => write!(f, "unknown opcode 0x{op:02x}"),
            PickleProblem::Forbidden { op } => write!(f, "opcode {op} is not allowed"),
            PickleProblem::StackUnderflow { op } => write!(f, "{op} on a stack too short"),
            PickleProblem::NoMark { op } => write!(f, "{op} without a MARK"),
            PickleProblem::TooDeep { limit } => {
                write!(f, "containers nest deeper than the limit of {limit}")
            }
            PickleProblem::TooMany { what, limit } => {
                write!(f, "more {what} than the limit of {limit}")
            }
            PickleProblem::MemoMissing { index } => {
                write!(f, "memo slot {index} is read but was never written")
            }
            PickleProblem::LongTooWide { bytes, limit } => write!(
                f,
                "an integer of {bytes} bytes is wider than the limit of {limit}"
            ),
            PickleProblem::BadText { op } => write!(f, "{op} holds text that is not valid"),
            PickleProblem::WrongType {
                op,
                expected,
                found,
            } => write!(f, "{op} expects {expected}, found {found}"),
            PickleProblem::Build { target } => write!(
                f,
                "BUILD on {target}; only an OrderedDict, a tensor or an object of an unlisted class may take state"
            ),
            PickleProblem::BadCall { global, reason } => write!(f, "call of {global}: {reason}"),
            PickleProblem::PersistentId { reason } => {
                write!(f, "persistent id is not a storage: {reason}")
            }
        }
    }
}

/// Everything that can make the reader refuse a file, a selection or a gather.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TorchError {
    /// The bytes are not a PyTorch checkpoint; `format` says what they look like.
    NotTorch { format: Format },
    /// No end-of-central-directory record: not a (complete) zip archive.
    ZipNoEnd,
    /// The end record, ZIP64 end record or central directory is inconsistent.
    ZipDirectory { reason: String },
    /// One entry is malformed or lies outside the file.
    ZipEntry { entry: String, reason: String },
    /// An entry the reader maps in place (`data.pkl`, `byteorder`, a storage) is compressed;
    /// torch stores every entry.
    ZipCompressed { entry: String, method: u16 },
    /// An entry is encrypted.
    ZipEncrypted { entry: String },
    /// An entry name with a `..` component, an absolute path or a NUL.
    ZipUnsafeName { entry: String },
    /// Two entries with one name.
    ZipDuplicate { entry: String },
    /// Two entries whose bytes overlap.
    ZipOverlap { entry: String, other: String },
    /// No `data.pkl` in the archive.
    ZipNoPickle,
    /// More than one `data.pkl` at the top of the archive.
    ZipManyPickles { first: String, second: String },
    /// A `byteorder` entry that is neither `little` nor `big`.
    ByteOrder { entry: String, value: String },
    /// A pickle stream was refused; `at` is the byte offset of the opcode within it.
    Pickle {
        pickle: &'static str,
        at: u64,
        problem: PickleProblem,
    },
    /// The pickle calls (or, `called == false`, refers to) a global that is never allowed.
    Denied { global: String, called: bool },
    /// A persistent id names a storage that the file does not hold.
    MissingStorage { key: String, entry: String },
    /// A storage's bytes are fewer than its element count needs.
    StorageTooShort { key: String, need: u64, have: u64 },
    /// A legacy view reaches past its root storage.
    StorageView {
        key: String,
        end: u64,
        available: u64,
    },
    /// The legacy header (magic number, protocol version, sys_info) is not torch's.
    LegacyHeader { reason: String },
    /// The legacy storage-key list is malformed or names a storage no tensor uses.
    LegacyKeys { reason: String },
    /// A legacy storage's element count disagrees with the pickle.
    LegacyCount {
        key: String,
        found: u64,
        expected: u64,
    },
    /// A legacy storage's bytes run past the end of the file.
    LegacyTruncated { key: String, need: u64, have: u64 },
    /// A selected tensor cannot be described.
    Tensor {
        name: String,
        problem: TensorProblem,
    },
    /// A selected entry is a value produced by a global outside the allow-list.
    PlaceholderValue { name: String, global: String },
    /// The checkpoint holds no tensor at all.
    NoTensors,
    /// Several dicts of tensors and no key to choose among them: (path, tensor count).
    Ambiguous { candidates: Vec<(String, usize)> },
    /// The key names nothing in the checkpoint.
    KeyNotFound {
        key: String,
        candidates: Vec<(String, usize)>,
    },
    /// The key (`""`: the top level) names something that is not a dict.
    NotADict { key: String, found: String },
    /// Two tensors get one name (after flattening and prefix stripping).
    DuplicateName {
        name: String,
        first: String,
        second: String,
    },
    /// Dicts nest deeper than the limit, or the walk visits too many (shared/cyclic) dicts.
    WalkTooLarge { limit: u64 },
    /// `gather`'s output length is not a whole number of elements.
    GatherLength { len: usize, elem_size: u64 },
    /// `gather` asked for elements past the tensor's end.
    GatherRange { first: u64, count: u64, numel: u64 },
    /// `gather` was given a map shorter than the tensor's storage needs.
    GatherMap { need: u64, have: u64 },
    /// `gather` was given a descriptor that fails its own checks.
    GatherInvalid { problem: TensorProblem },
}

fn list(candidates: &[(String, usize)]) -> String {
    const SHOWN: usize = 12;
    let mut s = String::new();
    for (i, (path, n)) in candidates.iter().take(SHOWN).enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let path = if path.is_empty() { "(top level)" } else { path };
        let unit = if *n == 1 { "tensor" } else { "tensors" };
        s.push_str(&format!("`{path}` ({n} {unit})"));
    }
    if candidates.len() > SHOWN {
        s.push_str(&format!(" and {} more", candidates.len() - SHOWN));
    }
    s
}

impl fmt::Display for TorchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TorchError::NotTorch { format } => {
                write!(f, "this is {}, not a PyTorch checkpoint", format.describe())
            }
            TorchError::ZipNoEnd => write!(
                f,
                "no zip end-of-central-directory record: the archive is truncated or not a zip"
            ),
            TorchError::ZipDirectory { reason } => write!(f, "zip central directory: {reason}"),
            TorchError::ZipEntry { entry, reason } => write!(f, "zip entry `{entry}`: {reason}"),
            TorchError::ZipCompressed { entry, method } => write!(
                f,
                "zip entry `{entry}` is compressed (method {method}); its data is read in place, so it \
                 must be stored, as torch.save writes it"
            ),
            TorchError::ZipEncrypted { entry } => write!(f, "zip entry `{entry}` is encrypted"),
            TorchError::ZipUnsafeName { entry } => write!(
                f,
                "zip entry `{entry}` has an unsafe name (a `..` component, an absolute path or a nul)"
            ),
            TorchError::ZipDuplicate { entry } => {
                write!(f, "zip entry `{entry}` appears more than once")
            }
            TorchError::ZipOverlap { entry, other } => {
                write!(f, "zip entry `{entry}` overlaps entry `{other}`")
            }
            TorchError::ZipNoPickle => write!(
                f,
                "the zip archive has no data.pkl, so it is not a PyTorch checkpoint"
            ),
            TorchError::ZipManyPickles { first, second } => write!(
                f,
                "the zip archive has two pickles, `{first}` and `{second}`; expected one"
            ),
            TorchError::ByteOrder { entry, value } => write!(
                f,
                "zip entry `{entry}` says byte order `{value}`; expected `little` or `big`"
            ),
            TorchError::Pickle {
                pickle,
                at,
                problem,
            } => write!(f, "{pickle}, byte {at}: {problem}"),
            TorchError::Denied { global, called } => {
                if *called {
                    write!(f, "refusing to load: the pickle calls {global}")
                } else {
                    write!(f, "refusing to load: the pickle refers to {global}")
                }
            }
            TorchError::MissingStorage { key, entry } => write!(
                f,
                "a tensor uses storage `{key}`, but the file has no {entry}"
            ),
            TorchError::StorageTooShort { key, need, have } => write!(
                f,
                "storage `{key}` needs {need} bytes but the file holds {have}"
            ),
            TorchError::StorageView {
                key,
                end,
                available,
            } => write!(
                f,
                "a view of storage `{key}` ends at byte {end}, past its {available} bytes"
            ),
            TorchError::LegacyHeader { reason } => {
                write!(f, "legacy torch file header: {reason}")
            }
            TorchError::LegacyKeys { reason } => {
                write!(f, "legacy torch file storage list: {reason}")
            }
            TorchError::LegacyCount {
                key,
                found,
                expected,
            } => write!(
                f,
                "legacy storage `{key}` is recorded with {found} elements, but the pickle says {expected}"
            ),
            TorchError::LegacyTruncated { key, need, have } => write!(
                f,
                "legacy storage `{key}` needs {need} bytes but only {have} remain in the file"
            ),
            TorchError::Tensor { name, problem } => write!(f, "tensor `{name}`: {problem}"),
            TorchError::PlaceholderValue { name, global } => write!(
                f,
                "refusing to load: entry `{name}` is built by {global}, which is not on the allow-list"
            ),
            TorchError::NoTensors => write!(f, "the checkpoint holds no tensors"),
            TorchError::Ambiguous { candidates } => write!(
                f,
                "the checkpoint holds several dicts of tensors: {}; select one with the key option",
                list(candidates)
            ),
            TorchError::KeyNotFound { key, candidates } => {
                if candidates.is_empty() {
                    write!(f, "key `{key}` is not in the checkpoint, which holds no tensors")
                } else {
                    write!(
                        f,
                        "key `{key}` is not in the checkpoint; dicts of tensors: {}",
                        list(candidates)
                    )
                }
            }
            TorchError::NotADict { key, found } => {
                if key.is_empty() {
                    write!(f, "the checkpoint's top level is {found}, not a dict of tensors")
                } else {
                    write!(f, "key `{key}` names {found}, not a dict of tensors")
                }
            }
            TorchError::DuplicateName {
                name,
                first,
                second,
            } => write!(
                f,
                "tensors `{first}` and `{second}` would both be named `{name}`"
            ),
            TorchError::WalkTooLarge { limit } => write!(
                f,
                "the checkpoint's dicts nest or repeat beyond the limit of {limit}"
            ),
            TorchError::GatherLength { len, elem_size } => write!(
                f,
                "gather buffer of {len} bytes is not a multiple of the element size {elem_size}"
            ),
            TorchError::GatherRange {
                first,
                count,
                numel,
            } => write!(
                f,
                "gather of {count} elements from element {first} runs past the tensor's {numel}"
            ),
            TorchError::GatherMap { need, have } => write!(
                f,
                "gather needs {need} bytes of the file but the map holds {have}"
            ),
            TorchError::GatherInvalid { problem } => {
                write!(f, "gather of an invalid tensor description: {problem}")
            }
        }
    }
}

impl std::error::Error for TorchError {}
