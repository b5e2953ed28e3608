//! A bounded, allow-listed unpickler (protocols 0-5) that executes nothing.
//!
//! Objects live in an arena ([`Pickle::objects`]) and refer to each other by [`ObjId`], so
//! the memo's shared references behave as in Python, no value is ever copied by GET, and
//! dropping or walking the result needs no recursion. Memory: strs and bytes borrow the
//! pickle's (mapped) bytes, never copied, and a long str's pages are handed back once checked
//! ([`Storages::release`]); ints of 0 to 2**31 - 2 live in their [`ObjId`] ([`INLINE`]), not
//! in the arena; and objects nothing reaches any more (a tensor's rebuild arguments, once it
//! is made) are reclaimed between opcodes, so the arena holds what the stack, the memo and
//! the result reach, and the finished [`Pickle`] only what its root reaches: a full, inert
//! object tree, for any pickle read as data. The allow-list follows torch's own
//! `torch/_weights_only_unpickler.py`: the tensor rebuild functions, storage classes, dtypes,
//! `collections.OrderedDict` and the protocol-2 helpers for sets, complex numbers and bytes
//! map to inert stubs ([`Global`]). Any other global becomes a [`Placeholder`]; calling one
//! yields another placeholder. A few globals (os, posix, sys, subprocess, `builtins.eval`,
//! ...) are refused outright. Every resource is bounded by [`Limits`].

use std::borrow::Cow;
use std::collections::HashMap;

use super::dtype::{self, TorchDtype};
pub use super::error::StorageConflict;
use super::error::{PickleProblem, TensorProblem, TorchError};
use super::Limits;

/// Index of an object in [`Pickle::objects`], or (with [`INLINE`] set) an int held in the
/// id itself: an int of 0 to 2**31 - 1 costs no object (a list of 15 M ints, 4 bytes each).
pub type ObjId = u32;

/// The bit of an [`ObjId`] that marks an inline int (its value in the other 31 bits).
pub const INLINE: ObjId = 1 << 31;

/// The id of `v` held inline, if it fits.
fn inline_int(v: i64) -> Option<ObjId> {
    // Not 2**31 - 1: its id would be `u32::MAX`, which the memo keeps for "no entry".
    u32::try_from(v)
        .ok()
        .filter(|&v| v < INLINE - 1)
        .map(|v| v | INLINE)
}

/// The memo: a vector (4 bytes an entry) for the dense indices picklers write (0, 1, 2, ...),
/// a map for any far beyond them, so that one PUT of index 2**32 - 1 allocates nothing big.
///
/// Pruning (see [`Storages::prunes`]), the memo keeps only the entries some GET reads (the
/// indices `read`, found by [`memo_reads`] before the run): an object memoized and never
/// read again is then held by nothing but its container, and goes with it.
#[derive(Default)]
struct Memo {
    dense: Vec<ObjId>,
    sparse: HashMap<u64, ObjId>,
    len: usize,
    /// A bit per index: the only indices whose objects are kept (`None`: every index).
    read: Option<Vec<u64>>,
}

/// A dense memo slot without an entry.
const NO_ENTRY: ObjId = u32::MAX;

impl Memo {
    fn get(&self, index: u64) -> Option<ObjId> {
        match usize::try_from(index).ok().and_then(|i| self.dense.get(i)) {
            Some(&id) if id != NO_ENTRY => Some(id),
            // (An index the vector grew over may still be in the map.)
            _ => self.sparse.get(&index).copied(),
        }
    }

    fn contains(&self, index: u64) -> bool {
        self.get(index).is_some()
    }

    fn len(&self) -> usize {
        self.len
    }

    /// Every id the memo holds.
    fn ids(&self) -> impl Iterator<Item = ObjId> + '_ {
        let dense = self.dense.iter().copied().filter(|&id| id != NO_ENTRY);
        dense.chain(self.sparse.values().copied())
    }

    /// Rewrite every id the memo holds.
    fn remap(&mut self, map: impl Fn(ObjId) -> ObjId) {
        for id in self.dense.iter_mut().filter(|id| **id != NO_ENTRY) {
            *id = map(*id);
        }
        for id in self.sparse.values_mut() {
            *id = map(*id);
        }
    }

    /// Whether `index` is one that the memo keeps.
    fn keeps(&self, index: u64) -> bool {
        self.read.as_ref().is_none_or(|r| {
            let word = usize::try_from(index / 64).ok().and_then(|w| r.get(w));
            word.is_some_and(|w| w & (1 << (index % 64)) != 0)
        })
    }

    fn insert(&mut self, index: u64, id: ObjId) {
        if self.read.is_some() {
            // Only MEMOIZE numbers the entries then (`memo_reads`): each index is new.
            self.len += 1;
            if self.keeps(index) {
                self.sparse.insert(index, id);
            }
            return;
        }
        // The vector grows to at most twice the entries (and 4096 slots) beyond them.
        let near = (2 * self.len + 4096) as u64;
        if index < self.dense.len() as u64 || index <= near {
            let i = index as usize;
            if i >= self.dense.len() {
                self.dense.resize(i + 1, NO_ENTRY);
            }
            let new = self.dense[i] == NO_ENTRY && self.sparse.remove(&index).is_none();
            self.len += usize::from(new);
            self.dense[i] = id;
        } else if self.sparse.insert(index, id).is_none() {
            self.len += 1;
        }
    }
}

/// A reference from the pickle to (a view of) one storage of the file.
///
/// Each reference carries its own dtype, the storage class its persistent id names: torch
/// (checked with torch 2.15.0, zip and legacy files, `weights_only` True and False) gives a
/// tensor rebuilt by `_rebuild_tensor_v2` the dtype of its own reference, over the same
/// bytes, when two references of one storage key name different classes of the same byte
/// size. References of one key whose byte sizes differ are a [`StorageConflict`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorageRef {
    /// Index into [`crate::torch::Checkpoint::storages`].
    pub storage: usize,
    /// The dtype of this reference's storage class (`uint8` for an untyped storage).
    pub dtype: &'static TorchDtype,
    /// Byte offset of the view within the storage (legacy storage views; else 0).
    pub offset: u64,
    /// Byte length of the view, or `None` for the whole storage.
    pub len: Option<u64>,
    /// Set when this reference cannot be served by the storage its key first named.
    pub conflict: Option<StorageConflict>,
}

/// A dict (or `collections.OrderedDict`) in insertion order. Duplicate keys are kept as
/// written; [`crate::torch::Checkpoint`] resolves them (the last value wins, as in Python).
#[derive(Debug, Clone, PartialEq)]
pub struct Dict {
    pub items: Vec<(ObjId, ObjId)>,
    pub ordered: bool,
    /// The state BUILD gave an OrderedDict (a state dict's `_metadata`), recorded only.
    pub state: Option<ObjId>,
}

/// A value made by (or of) a global outside the allow-list. Nothing about it is evaluated.
#[derive(Debug, Clone, PartialEq)]
pub struct Placeholder {
    /// `module.name` of the global.
    pub global: String,
    /// Whether this is the result of calling the global (REDUCE, NEWOBJ) rather than the
    /// global itself.
    pub called: bool,
    pub args: Option<ObjId>,
    pub state: Option<ObjId>,
    /// Items APPENDed or SETITEMed onto it (list and dict subclasses), flattened.
    pub items: Vec<ObjId>,
}

/// The allow-listed globals, as inert stubs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Global {
    /// `torch._utils._rebuild_tensor` (torch < 0.4).
    RebuildTensor,
    /// `torch._utils._rebuild_tensor_v2`.
    RebuildTensorV2,
    /// `torch._utils._rebuild_tensor_v3` (dtype given explicitly).
    RebuildTensorV3,
    /// `torch._utils._rebuild_parameter`.
    RebuildParameter,
    /// `torch._utils._rebuild_parameter_with_state`.
    RebuildParameterWithState,
    /// `torch._tensor._rebuild_from_type_v2`.
    RebuildFromType,
    /// Another torch rebuild function, for a tensor kind safetensors cannot hold.
    UnsupportedRebuild(&'static str),
    /// `torch.Tensor`.
    TensorClass,
    /// `torch.nn.parameter.Parameter`.
    ParameterClass,
    /// `collections.OrderedDict`.
    OrderedDict,
    /// `builtins.set` / `__builtin__.set`.
    Set,
    /// `builtins.frozenset`.
    FrozenSet,
    /// `builtins.complex`.
    Complex,
    /// `builtins.bytearray`.
    Bytearray,
    /// `_codecs.encode` (protocol 2 writes bytes as `encode(str, 'latin1')`).
    Encode,
    /// `torch.Size`.
    Size,
    /// A typed storage class such as `torch.FloatStorage`.
    StorageClass(&'static TorchDtype),
    /// `torch.storage.UntypedStorage`.
    UntypedStorage,
    /// A dtype such as `torch.bfloat16`.
    Dtype(&'static TorchDtype),
}

impl Global {
    /// The name it is pickled under, for messages.
    pub fn name(&self) -> String {
        match self {
            Global::RebuildTensor => "torch._utils._rebuild_tensor".into(),
            Global::RebuildTensorV2 => "torch._utils._rebuild_tensor_v2".into(),
            Global::RebuildTensorV3 => "torch._utils._rebuild_tensor_v3".into(),
            Global::RebuildParameter => "torch._utils._rebuild_parameter".into(),
            Global::RebuildParameterWithState => {
                "torch._utils._rebuild_parameter_with_state".into()
            }
            Global::RebuildFromType => "torch._tensor._rebuild_from_type_v2".into(),
            Global::UnsupportedRebuild(what) => format!("a torch rebuild function for a {what}"),
            Global::TensorClass => "torch.Tensor".into(),
            Global::ParameterClass => "torch.nn.parameter.Parameter".into(),
            Global::OrderedDict => "collections.OrderedDict".into(),
            Global::Set => "builtins.set".into(),
            Global::FrozenSet => "builtins.frozenset".into(),
            Global::Complex => "builtins.complex".into(),
            Global::Bytearray => "builtins.bytearray".into(),
            Global::Encode => "_codecs.encode".into(),
            Global::Size => "torch.Size".into(),
            Global::StorageClass(t) => format!("the {} storage class", t.name),
            Global::UntypedStorage => "torch.storage.UntypedStorage".into(),
            Global::Dtype(t) => format!("torch.{}", t.name),
        }
    }
}

/// One unpickled value. Strings and byte strings are borrowed from the pickle's (mapped)
/// bytes, never copied, unless the pickle spells them with escapes (protocol 0).
#[derive(Debug, Clone, PartialEq)]
pub enum Object<'a> {
    None,
    Bool(bool),
    Int(i64),
    /// An integer wider than 64 bits: little-endian two's complement bytes.
    BigInt(Box<[u8]>),
    Float(f64),
    Complex(f64, f64),
    Str(&'a str),
    /// A str decoded from escapes (protocol 0's STRING and UNICODE).
    OwnedStr(Box<str>),
    Bytes(&'a [u8]),
    /// Bytes made, not borrowed (decoded escapes, `_codecs.encode`, `bytearray`).
    OwnedBytes(Box<[u8]>),
    Tuple(Box<[ObjId]>),
    /// Boxed, as sets, so that an object takes 24 bytes (a pickle may hold millions).
    List(Box<Vec<ObjId>>),
    Set(Box<Vec<ObjId>>),
    Dict(Box<Dict>),
    Global(Global),
    Placeholder(Box<Placeholder>),
    Storage(Box<StorageRef>),
    /// Index into the checkpoint's tensor table.
    Tensor(u32),
}

/// Call `f` on each id `o` holds (its items, keys, values, arguments and state).
fn each_child(o: &Object<'_>, mut f: impl FnMut(ObjId)) {
    match o {
        Object::Tuple(t) => t.iter().copied().for_each(f),
        Object::List(l) | Object::Set(l) => l.iter().copied().for_each(f),
        Object::Dict(d) => {
            d.items.iter().for_each(|&(k, v)| {
                f(k);
                f(v)
            });
            d.state.into_iter().for_each(f);
        }
        Object::Placeholder(p) => {
            p.args.into_iter().chain(p.state).for_each(&mut f);
            p.items.iter().copied().for_each(f);
        }
        _ => {}
    }
}

/// Rewrite each id `o` holds.
fn remap_children(o: &mut Object<'_>, f: impl Fn(ObjId) -> ObjId) {
    match o {
        Object::Tuple(t) => t.iter_mut().for_each(|id| *id = f(*id)),
        Object::List(l) | Object::Set(l) => l.iter_mut().for_each(|id| *id = f(*id)),
        Object::Dict(d) => {
            for (k, v) in d.items.iter_mut() {
                (*k, *v) = (f(*k), f(*v));
            }
            d.state = d.state.map(&f);
        }
        Object::Placeholder(p) => {
            p.args = p.args.map(&f);
            p.state = p.state.map(&f);
            p.items.iter_mut().for_each(|id| *id = f(*id));
        }
        _ => {}
    }
}

impl Object<'_> {
    /// The text of a str.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Object::Str(s) => Some(s),
            Object::OwnedStr(s) => Some(s),
            _ => None,
        }
    }

    /// The bytes of a byte string.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Object::Bytes(b) => Some(b),
            Object::OwnedBytes(b) => Some(b),
            _ => None,
        }
    }

    /// A short name of the value's type, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Object::None => "None",
            Object::Bool(_) => "a bool",
            Object::Int(_) | Object::BigInt(_) => "an int",
            Object::Float(_) => "a float",
            Object::Complex(..) => "a complex number",
            Object::Str(_) | Object::OwnedStr(_) => "a str",
            Object::Bytes(_) | Object::OwnedBytes(_) => "bytes",
            Object::Tuple(_) => "a tuple",
            Object::List(_) => "a list",
            Object::Set(_) => "a set",
            Object::Dict(_) => "a dict",
            Object::Global(_) => "an allowed global",
            Object::Placeholder(p) if p.called => "an object of an unlisted class",
            Object::Placeholder(_) => "an unlisted global",
            Object::Storage(_) => "a storage",
            Object::Tensor(_) => "a tensor",
        }
    }
}

/// A tensor as the pickle describes it, before its storage is located in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct RawTensor {
    pub storage: StorageRef,
    pub dtype: &'static TorchDtype,
    pub offset: u64,
    pub shape: Vec<u64>,
    pub stride: Vec<u64>,
}

/// A tensor slot: a well-formed call of a rebuild function, or why it is not one.
pub type TensorSlot = Result<RawTensor, TensorProblem>;

/// A view of an arena of objects that resolves ids, inline ints included.
#[derive(Debug, Clone, Copy)]
pub struct Objects<'p, 'a>(pub &'p [Object<'a>]);

impl<'p, 'a> Objects<'p, 'a> {
    /// The object `id` (an inline int is made; others are borrowed).
    pub fn get(self, id: ObjId) -> Cow<'p, Object<'a>> {
        if id & INLINE != 0 {
            return Cow::Owned(Object::Int(i64::from(id & !INLINE)));
        }
        Cow::Borrowed(self.0.get(id as usize).unwrap_or(&Object::None))
    }

    /// The object `id` if it lives in the arena (every object but an inline int).
    pub fn arena(self, id: ObjId) -> Option<&'p Object<'a>> {
        if id & INLINE != 0 {
            return None;
        }
        self.0.get(id as usize)
    }

    /// The text of `id` if it is a str.
    pub fn str_of(self, id: ObjId) -> Option<&'p str> {
        self.arena(id).and_then(Object::as_str)
    }

    /// The items of `id` if it is a dict, in insertion order.
    pub fn dict_items(self, id: ObjId) -> Option<&'p [(ObjId, ObjId)]> {
        match self.arena(id)? {
            Object::Dict(d) => Some(&d.items),
            _ => None,
        }
    }

    /// The items of `id` if it is a list or a tuple.
    pub fn seq(self, id: ObjId) -> Option<&'p [ObjId]> {
        match self.arena(id)? {
            Object::List(l) => Some(l),
            Object::Tuple(t) => Some(t),
            _ => None,
        }
    }

    /// `id` if it is an int that fits in 64 bits.
    pub fn int(self, id: ObjId) -> Option<i64> {
        match &*self.get(id) {
            Object::Int(n) => Some(*n),
            _ => None,
        }
    }

    /// `id` if it is a list or tuple of non-negative ints (a shape, a size).
    pub fn sizes(self, id: ObjId) -> Option<Vec<u64>> {
        self.seq(id)?
            .iter()
            .map(|&i| self.int(i).and_then(|n| u64::try_from(n).ok()))
            .collect()
    }
}

/// What a persistent id (a storage reference) resolves to; supplied by the file format.
pub trait Storages {
    /// Resolve the persistent id `pid` (an object of `objects`) to a storage.
    fn load(&mut self, objects: Objects<'_, '_>, pid: ObjId) -> Result<StorageRef, TorchError>;

    /// The unpickler is done reading `bytes`, a part of the (mapped) pickle that it keeps
    /// only borrowed (a long str, checked; the pickle behind it, a chunk at a time): their
    /// pages may be dropped, to be read again from the file if ever needed. By default
    /// nothing is dropped.
    fn release(&mut self, _bytes: &[u8]) {}

    /// Whether this reader drops, as they are parsed, the dict items it will never read
    /// ([`Storages::skips_value`], [`Storages::keeps_item`]). The objects that the items
    /// dropped held are reclaimed as they go; a pickle whose dropped objects are reached
    /// again (a GET of one into an item kept) is read again whole. By default nothing is.
    fn prunes(&self) -> bool {
        false
    }

    /// Whether the value now begun under `key`, in a dict that is itself the value of the
    /// key `parent` of its dict, is never read: it is parsed but its containers are left
    /// empty. `first`: the value's first object (the class of a record).
    fn skips_value(
        &mut self,
        _: Objects<'_, '_>,
        _parent: ObjId,
        _key: ObjId,
        _first: ObjId,
    ) -> bool {
        false
    }

    /// Whether the item `key: value`, set in a dict that is the value of the key `parent` of
    /// its dict, is kept.
    fn keeps_item(
        &mut self,
        _: Objects<'_, '_>,
        _parent: ObjId,
        _key: ObjId,
        _value: ObjId,
    ) -> bool {
        true
    }
}

/// The memo indices that a GET reads, a bit per index, if the pickle (through its STOP)
/// numbers its entries with MEMOIZE only and every opcode is one this unpickler reads;
/// else `None`. (A GET of an index not yet memoized, which the run refuses, is left out:
/// the bits never outnumber the MEMOIZEs.)
/// The pages scanned are handed to `storages` to drop as it goes.
fn memo_reads(data: &[u8], storages: &mut dyn Storages) -> Option<Vec<u64>> {
    let mut reads: Vec<u64> = Vec::new();
    let mut memoized = 0u64;
    let mut read = |i: u64, memoized: u64| {
        if i < memoized {
            let w = (i / 64) as usize;
            if w >= reads.len() {
                reads.resize(w + 1, 0);
            }
            reads[w] |= 1 << (i % 64);
        }
    };
    let mut pos = 0usize;
    let mut released = 0usize;
    let take = |pos: &mut usize, n: usize| -> Option<usize> {
        let at = *pos;
        *pos = at.checked_add(n).filter(|&e| e <= data.len())?;
        Some(at)
    };
    let int = |at: usize, n: usize| -> u64 {
        let mut a = [0u8; 8];
        a[..n].copy_from_slice(&data[at..at + n]);
        u64::from_le_bytes(a)
    };
    let line = |pos: &mut usize| -> Option<&[u8]> {
        let n = data.get(*pos..)?.iter().position(|&b| b == b'\n')?;
        let l = &data[*pos..*pos + n];
        *pos += n + 1;
        Some(l)
    };
    loop {
        if pos - released >= RELEASE_CHUNK {
            storages.release(&data[released..pos]);
            released = pos;
        }
        let op = data[take(&mut pos, 1)?];
        match op {
            b'.' => break,
            b'('
            | b'0'
            | b'1'
            | b'2'
            | b'N'
            | 0x88
            | 0x89
            | b')'
            | b't'
            | 0x85..=0x87
            | b']'
            | b'l'
            | b'a'
            | b'e'
            | b'}'
            | b'd'
            | b's'
            | b'u'
            | 0x8f
            | 0x90
            | 0x91
            | 0x93
            | b'R'
            | b'b'
            | 0x81
            | 0x92
            | b'Q' => {}
            0x94 => memoized += 1,
            0x80 | b'K' => {
                take(&mut pos, 1)?;
            }
            b'M' => {
                take(&mut pos, 2)?;
            }
            b'J' => {
                take(&mut pos, 4)?;
            }
            b'G' | 0x95 => {
                take(&mut pos, 8)?;
            }
            b'I' | b'L' | b'F' | b'S' | b'V' => {
                line(&mut pos)?;
            }
            b'c' => {
                line(&mut pos)?;
                line(&mut pos)?;
            }
            0x8a | b'U' | 0x8c | b'C' => {
                let n = int(take(&mut pos, 1)?, 1);
                take(&mut pos, usize::try_from(n).ok()?)?;
            }
            0x8b | b'T' | b'X' | b'B' => {
                let n = int(take(&mut pos, 4)?, 4);
                take(&mut pos, usize::try_from(n).ok()?)?;
            }
            0x8d | 0x8e | 0x96 => {
                let n = int(take(&mut pos, 8)?, 8);
                take(&mut pos, usize::try_from(n).ok()?)?;
            }
            b'h' => read(int(take(&mut pos, 1)?, 1), memoized),
            b'j' => read(int(take(&mut pos, 4)?, 4), memoized),
            b'g' => {
                let l = line(&mut pos)?;
                read(std::str::from_utf8(l).ok()?.trim().parse().ok()?, memoized);
            }
            // PUT (numbered by the pickle), and what the unpickler refuses anyway.
            _ => return None,
        }
    }
    Some(reads)
}

/// Strs longer than this are checked and released (see [`Storages::release`]) in chunks.
const RELEASE_CHUNK: usize = 8 << 20;

/// A persistent-id handler that refuses every persistent id (for the legacy header pickles).
pub struct NoStorages;

impl Storages for NoStorages {
    fn load(&mut self, _: Objects<'_, '_>, _: ObjId) -> Result<StorageRef, TorchError> {
        Err(TorchError::Pickle {
            pickle: "header pickle",
            at: 0,
            problem: PickleProblem::PersistentId {
                reason: "no storage is allowed here".into(),
            },
        })
    }
}

/// The result of unpickling one stream.
#[derive(Debug, Clone)]
pub struct Pickle<'a> {
    pub objects: Vec<Object<'a>>,
    pub root: ObjId,
    pub tensors: Vec<TensorSlot>,
    /// Globals outside the allow-list, `module.name`, in order of first appearance.
    pub placeholders: Vec<String>,
    /// Every global the stream names, allowed or not, `module.name` as pickled, in order of
    /// first appearance (at most `MAX_NAMED`).
    pub globals: Vec<String>,
    /// Bytes consumed, through STOP.
    pub end: usize,
    /// Whether the reader's hooks pruned it ([`Storages::prunes`]): the items they did not
    /// keep are not in it.
    pub pruned: bool,
}

/// The arena size below which unreachable objects are not reclaimed.
const MIN_COLLECT: usize = 1 << 16;

#[cfg(not(test))]
fn min_collect() -> usize {
    MIN_COLLECT
}

/// Tests may set it per thread (0: reclaim before every opcode).
#[cfg(test)]
fn min_collect() -> usize {
    tests::COLLECT_AT.with(|c| c.get())
}

/// The most distinct global names a pickle's lists keep.
const MAX_NAMED: usize = 10_000;

impl<'a> Pickle<'a> {
    /// The object `id` (ids come from this pickle, so they are in range): borrowed from the
    /// arena, or made for an inline int.
    pub fn get(&self, id: ObjId) -> Cow<'_, Object<'a>> {
        // Ids are only ever made by `Unpickler::push`, which checks them against the arena.
        Objects(&self.objects).get(id)
    }

    /// The text of `id` if it is a str (borrowed for as long as the pickle).
    pub fn str_of(&self, id: ObjId) -> Option<&str> {
        self.view().str_of(id)
    }

    /// The object `id` if it lives in the arena (every object but an inline int).
    pub fn arena(&self, id: ObjId) -> Option<&Object<'a>> {
        self.view().arena(id)
    }

    /// The items of `id` if it is a dict, in insertion order.
    pub fn dict_items(&self, id: ObjId) -> Option<&[(ObjId, ObjId)]> {
        self.view().dict_items(id)
    }

    /// The items of `id` if it is a list or a tuple.
    pub fn seq(&self, id: ObjId) -> Option<&[ObjId]> {
        self.view().seq(id)
    }

    /// The arena as a view that resolves ids.
    pub fn view(&self) -> Objects<'_, 'a> {
        Objects(&self.objects)
    }
}

/// Modules none of whose globals may appear at all, as in torch's blocklist (and more).
const DENIED_MODULES: &[&str] = &[
    "os",
    "posix",
    "nt",
    "sys",
    "subprocess",
    "_posixsubprocess",
    "shutil",
    "socket",
    "pty",
    "runpy",
    "importlib",
    "ctypes",
    "code",
    "codeop",
    "marshal",
    "pickle",
    "_pickle",
    "webbrowser",
    "multiprocessing",
    "signal",
    "posixpath",
    "ntpath",
    "io",
    "_io",
    "tempfile",
    "pathlib",
];

/// `builtins` names that may stand as inert placeholders; any other builtin is refused.
const HARMLESS_BUILTINS: &[&str] = &[
    "object",
    "int",
    "float",
    "str",
    "bytes",
    "list",
    "dict",
    "tuple",
    "bool",
    "slice",
    "range",
    "type",
    "len",
    "min",
    "max",
    "abs",
    "round",
    "print",
    "repr",
    "hash",
    "id",
    "iter",
    "next",
    "zip",
    "map",
    "filter",
    "sorted",
    "reversed",
    "enumerate",
    "sum",
    "any",
    "all",
    "divmod",
    "pow",
    "ord",
    "chr",
    "hex",
    "oct",
    "bin",
    "format",
    "isinstance",
    "issubclass",
    "callable",
];

/// A `pathlib` path class: an inert record where `Limits::inert_paths` allows it.
fn is_path_class(module: &str, name: &str) -> bool {
    module == "pathlib"
        && matches!(
            name,
            "PosixPath" | "PurePosixPath" | "WindowsPath" | "PureWindowsPath" | "Path"
        )
}

/// What `(module, name)` is, after protocol-2 name mapping.
enum Resolved {
    Allowed(Global),
    Placeholder(String),
    Denied(String),
}

fn resolve(module: &str, name: &str) -> Resolved {
    // Python 2 names that protocol 2 writes (torch's NAME_MAPPING / IMPORT_MAPPING).
    let (module, name) = match (module, name) {
        ("__builtin__", "unicode") | ("__builtin__", "basestring") => ("builtins", "str"),
        ("__builtin__", "long") => ("builtins", "int"),
        ("__builtin__", "xrange") => ("builtins", "range"),
        ("__builtin__", "unichr") => ("builtins", "chr"),
        ("__builtin__", "reduce") => ("functools", "reduce"),
        ("__builtin__", "intern") => ("sys", "intern"),
        ("__builtin__", n) | ("exceptions", n) => ("builtins", n),
        ("copy_reg", n) => ("copyreg", n),
        ("cPickle", n) => ("pickle", n),
        ("commands", n) => ("subprocess", n),
        other => other,
    };
    let full = format!("{module}.{name}");
    let root = module.split('.').next().unwrap_or(module);
    if DENIED_MODULES.contains(&root) {
        return Resolved::Denied(full);
    }
    let allowed = match (module, name) {
        ("torch._utils", "_rebuild_tensor") => Some(Global::RebuildTensor),
        ("torch._utils", "_rebuild_tensor_v2") => Some(Global::RebuildTensorV2),
        ("torch._utils", "_rebuild_tensor_v3") => Some(Global::RebuildTensorV3),
        ("torch._utils", "_rebuild_parameter") => Some(Global::RebuildParameter),
        ("torch._utils", "_rebuild_parameter_with_state") => {
            Some(Global::RebuildParameterWithState)
        }
        ("torch._tensor", "_rebuild_from_type_v2") => Some(Global::RebuildFromType),
        ("torch._utils", "_rebuild_qtensor") => {
            Some(Global::UnsupportedRebuild("quantized tensor"))
        }
        ("torch._utils", "_rebuild_sparse_tensor")
        | ("torch._utils", "_rebuild_sparse_csr_tensor") => {
            Some(Global::UnsupportedRebuild("sparse tensor"))
        }
        ("torch._utils", "_rebuild_meta_tensor_no_storage") => {
            Some(Global::UnsupportedRebuild("meta tensor without data"))
        }
        ("torch._utils", "_rebuild_wrapper_subclass") => {
            Some(Global::UnsupportedRebuild("wrapper tensor subclass"))
        }
        ("torch._utils", "_rebuild_nested_tensor") => {
            Some(Global::UnsupportedRebuild("nested tensor"))
        }
        ("torch._utils", "_rebuild_device_tensor_from_numpy")
        | ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor")
        | ("torch._utils", "_rebuild_xla_tensor")
        | ("torch._utils", "_rebuild_mps_tensor") => Some(Global::UnsupportedRebuild(
            "device tensor without a storage",
        )),
        ("torch", "Tensor") | ("torch._tensor", "Tensor") => Some(Global::TensorClass),
        ("torch.nn.parameter", "Parameter") => Some(Global::ParameterClass),
        ("collections", "OrderedDict") => Some(Global::OrderedDict),
        ("builtins", "set") => Some(Global::Set),
        ("builtins", "frozenset") => Some(Global::FrozenSet),
        ("builtins", "complex") => Some(Global::Complex),
        ("builtins", "bytearray") => Some(Global::Bytearray),
        ("_codecs", "encode") => Some(Global::Encode),
        ("torch", "Size") => Some(Global::Size),
        ("torch", "UntypedStorage") | ("torch.storage", "UntypedStorage") => {
            Some(Global::UntypedStorage)
        }
        ("torch", n) | ("torch.cuda", n) if n.ends_with("Storage") => {
            dtype::storage_class(n).map(Global::StorageClass)
        }
        ("torch", n) => dtype::by_name(n).map(Global::Dtype),
        _ => None,
    };
    match allowed {
        Some(g) => Resolved::Allowed(g),
        None if module == "builtins" && !HARMLESS_BUILTINS.contains(&name) => {
            Resolved::Denied(full)
        }
        None => Resolved::Placeholder(full),
    }
}

fn op_name(op: u8) -> &'static str {
    match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'a' => "APPEND",
        b'e' => "APPENDS",
        b's' => "SETITEM",
        b'u' => "SETITEMS",
        b't' => "TUPLE",
        b'l' => "LIST",
        b'd' => "DICT",
        b'R' => "REDUCE",
        b'b' => "BUILD",
        b'Q' => "BINPERSID",
        b'p' | b'q' | b'r' => "PUT",
        0x94 => "MEMOIZE",
        0x81 => "NEWOBJ",
        0x92 => "NEWOBJ_EX",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x93 => "STACK_GLOBAL",
        _ => "an opcode",
    }
}

/// Unpickle one stream from the start of `data`, which may continue past its STOP.
pub fn unpickle<'a>(
    data: &'a [u8],
    label: &'static str,
    limits: &Limits,
    storages: &mut dyn Storages,
) -> Result<Pickle<'a>, TorchError> {
    if storages.prunes() {
        let read = memo_reads(data, storages);
        match unpickle_pass(data, label, limits, storages, Some(read)) {
            Err(Pass::Unsound) => {}
            Err(Pass::Failed(e)) => return Err(e),
            Ok(p) => return Ok(p),
        }
    }
    unpickle_pass(data, label, limits, storages, None).map_err(|e| match e {
        Pass::Failed(e) => e,
        Pass::Unsound => unreachable!("only a pruning pass is unsound"),
    })
}

/// Why a pass did not give a pickle.
enum Pass {
    Failed(TorchError),
    /// Pruning, an object dropped was reached again: the pickle is read again whole.
    Unsound,
}

/// One pass over the pickle; `prune`: with the memo entries that a GET reads, if known.
fn unpickle_pass<'a>(
    data: &'a [u8],
    label: &'static str,
    limits: &Limits,
    storages: &mut dyn Storages,
    prune: Option<Option<Vec<u64>>>,
) -> Result<Pickle<'a>, Pass> {
    let cap = usize::try_from(limits.max_pickle_bytes).unwrap_or(usize::MAX);
    let capped = data.len() > cap;
    let pruning = prune.is_some();
    let mut u = Unpickler {
        data: &data[..data.len().min(cap)],
        capped,
        pos: 0,
        released: 0,
        op_at: 0,
        label,
        limits: limits.clone(),
        objects: Vec::new(),
        depth: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Memo {
            read: prune.flatten(),
            ..Memo::default()
        },
        tensors: Vec::new(),
        placeholders: Vec::new(),
        seen: HashMap::new(),
        globals: Vec::new(),
        named: HashMap::new(),
        denied: None,
        allowed: HashMap::new(),
        small: vec![None; 3],
        made: 0,
        next_collect: min_collect(),
        cells: 0,
        bytes: 0,
        storages,
        pruning,
        flags: Vec::new(),
        skipping: None,
        asked: None,
        made_from: 0,
        unsound: false,
    };
    let root = match u.run() {
        Ok(root) if !u.unsound => root,
        _ if u.unsound => return Err(Pass::Unsound),
        Ok(_) => unreachable!(),
        Err(e) => return Err(Pass::Failed(e)),
    };
    // Only what the result reaches is kept.
    u.stack.clear();
    u.memo = Memo::default();
    let root = u.collect(Some(root));
    // Nothing made inside a value skipped may be in the result but what no container
    // emptied can stand for (a str, a class named again).
    if pruning
        && (0..u.objects.len()).any(|i| u.flags[i] & SKIP_MADE != 0 && !u.is_inert(i as ObjId))
    {
        return Err(Pass::Unsound);
    }
    u.objects.shrink_to_fit();
    u.depth.shrink_to_fit();
    Ok(Pickle {
        objects: u.objects,
        root,
        tensors: u.tensors,
        placeholders: u.placeholders,
        globals: u.globals,
        end: u.pos,
        pruned: pruning,
    })
}

struct Unpickler<'a, 's> {
    data: &'a [u8],
    /// Whether `data` was cut at the size limit (so running out means "too large").
    capped: bool,
    pos: usize,
    /// Where the pickle's pages not yet handed to `Storages::release` begin.
    released: usize,
    op_at: usize,
    label: &'static str,
    limits: Limits,
    objects: Vec<Object<'a>>,
    depth: Vec<u32>,
    stack: Vec<ObjId>,
    marks: Vec<usize>,
    memo: Memo,
    tensors: Vec<TensorSlot>,
    placeholders: Vec<String>,
    seen: HashMap<String, ()>,
    globals: Vec<String>,
    named: HashMap<String, ()>,
    denied: Option<String>,
    /// Allowed globals by their GLOBAL operand (`module\nname\n`), once resolved.
    allowed: HashMap<&'a [u8], Global>,
    /// The ids of None, False and True, once made: immutable values, shared (as Python
    /// shares them) rather than made once per occurrence.
    small: Vec<Option<ObjId>>,
    /// Objects made, over the whole run (the arena holds only those still reachable).
    made: usize,
    /// The arena size at which unreachable objects are next reclaimed.
    next_collect: usize,
    /// Object ids held in containers, over the whole run.
    cells: u64,
    /// Bytes of strings and byte strings made, over the whole run.
    bytes: u64,
    storages: &'s mut dyn Storages,
    /// Whether dict items the reader never reads are dropped as they are parsed.
    pruning: bool,
    /// Per object: `SKIP_MADE`, `HOLLOW`, `PINNED`.
    flags: Vec<u8>,
    /// (mark level, stack slot) of the dict value being skipped, if one is.
    skipping: Option<(usize, usize)>,
    /// (mark level, stack slot) of the dict value last asked about.
    asked: Option<(usize, usize)>,
    /// The arena's length when the opcode now read began.
    made_from: usize,
    /// A pruning pass reached an object it had emptied.
    unsound: bool,
}

/// An object made while a value was skipped.
const SKIP_MADE: u8 = 1;
/// A container left empty (its items, state or appended items dropped).
const HOLLOW: u8 = 2;
/// An object a GET will read again: never emptied.
const PINNED: u8 = 4;

type R<T> = Result<T, TorchError>;

impl<'a> Unpickler<'a, '_> {
    fn err(&self, problem: PickleProblem) -> TorchError {
        TorchError::Pickle {
            pickle: self.label,
            at: self.op_at as u64,
            problem,
        }
    }

    fn short(&self) -> TorchError {
        if self.capped {
            self.err(PickleProblem::TooLarge {
                limit: self.limits.max_pickle_bytes,
            })
        } else {
            self.err(PickleProblem::Truncated)
        }
    }

    /// The next `n` bytes, borrowed from the pickle (not from `self`, so that they can be
    /// handed to `push_*` without a copy).
    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let Some(end) = end else {
            return Err(self.short());
        };
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn take_len(&mut self, n: u64) -> R<&'a [u8]> {
        let n = usize::try_from(n).map_err(|_| self.short())?;
        self.take(n)
    }

    fn u8(&mut self) -> R<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> R<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> R<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> R<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A protocol-0 text line, without its newline.
    fn line(&mut self, op: &'static str) -> R<&'a str> {
        let data = self.data;
        let rest = &data[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return Err(self.short());
        };
        self.pos += n + 1;
        std::str::from_utf8(&rest[..n]).map_err(|_| self.err(PickleProblem::BadText { op }))
    }

    fn charge_bytes(&mut self, n: usize) -> R<()> {
        self.bytes = self.bytes.saturating_add(n as u64);
        let limit = self.limits.max_pickle_bytes.saturating_mul(2);
        if self.bytes > limit {
            return Err(self.err(PickleProblem::TooMany {
                what: "bytes of strings",
                limit,
            }));
        }
        Ok(())
    }

    fn charge_cells(&mut self, n: usize) -> R<()> {
        self.cells = self.cells.saturating_add(n as u64);
        let limit = (self.limits.max_objects as u64).saturating_mul(4);
        if self.cells > limit {
            return Err(self.err(PickleProblem::TooMany {
                what: "container items",
                limit,
            }));
        }
        Ok(())
    }

    fn depth_of(&self, id: ObjId) -> u32 {
        self.depth.get(id as usize).copied().unwrap_or(0)
    }

    fn check_depth(&self, d: u32) -> R<()> {
        if d as usize > self.limits.max_depth {
            return Err(self.err(PickleProblem::TooDeep {
                limit: self.limits.max_depth,
            }));
        }
        Ok(())
    }

    /// Add an object to the arena, with the nesting depth of its contents.
    fn alloc(&mut self, obj: Object<'a>, depth: u32) -> R<ObjId> {
        if self.made >= self.limits.max_objects || self.objects.len() >= INLINE as usize {
            return Err(self.err(PickleProblem::TooMany {
                what: "objects",
                limit: self.limits.max_objects as u64,
            }));
        }
        self.check_depth(depth)?;
        let id = self.objects.len() as ObjId;
        self.made += 1;
        self.objects.push(obj);
        self.depth.push(depth);
        self.flags.push(if self.skipping.is_some() {
            SKIP_MADE
        } else {
            0
        });
        Ok(id)
    }

    fn push_id(&mut self, id: ObjId) -> R<()> {
        if self.stack.len() >= self.limits.max_objects {
            return Err(self.err(PickleProblem::TooMany {
                what: "stack entries",
                limit: self.limits.max_objects as u64,
            }));
        }
        self.stack.push(id);
        Ok(())
    }

    fn push(&mut self, obj: Object<'a>) -> R<()> {
        if let Object::Int(v) = obj {
            if let Some(id) = inline_int(v) {
                return self.push_id(id);
            }
        }
        let slot = match obj {
            Object::None => Some(0),
            Object::Bool(b) => Some(1 + usize::from(b)),
            _ => None,
        };
        let Some(slot) = slot else {
            let id = self.alloc(obj, 0)?;
            return self.push_id(id);
        };
        let id = match self.small[slot] {
            Some(id) => id,
            None => {
                let id = self.alloc(obj, 0)?;
                self.small[slot] = Some(id);
                id
            }
        };
        self.push_id(id)
    }

    /// A container of `items`, one deeper than its deepest item.
    fn push_container(&mut self, obj: Object<'a>, items: &[ObjId]) -> R<()> {
        let d = items.iter().map(|&i| self.depth_of(i)).max().unwrap_or(0) + 1;
        self.charge_cells(items.len())?;
        let id = self.alloc(obj, d)?;
        self.push_id(id)
    }

    /// A container made of `items` (moved, not copied), one deeper than its deepest item.
    fn push_items(
        &mut self,
        items: Vec<ObjId>,
        make: impl FnOnce(Vec<ObjId>) -> Object<'a>,
    ) -> R<()> {
        let d = items.iter().map(|&i| self.depth_of(i)).max().unwrap_or(0) + 1;
        self.charge_cells(items.len())?;
        let id = self.alloc(make(items), d)?;
        self.push_id(id)
    }

    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self, op: u8) -> R<ObjId> {
        if self.stack.len() <= self.floor() {
            return Err(self.err(PickleProblem::StackUnderflow { op: op_name(op) }));
        }
        self.stack
            .pop()
            .ok_or_else(|| self.err(PickleProblem::StackUnderflow { op: op_name(op) }))
    }

    fn top(&self, op: u8) -> R<ObjId> {
        if self.stack.len() <= self.floor() {
            return Err(self.err(PickleProblem::StackUnderflow { op: op_name(op) }));
        }
        self.stack
            .last()
            .copied()
            .ok_or_else(|| self.err(PickleProblem::StackUnderflow { op: op_name(op) }))
    }

    fn pop_mark(&mut self, op: u8) -> R<Vec<ObjId>> {
        let Some(mark) = self.marks.pop() else {
            return Err(self.err(PickleProblem::NoMark { op: op_name(op) }));
        };
        let mark = mark.min(self.stack.len());
        if mark >= self.stack.len() - mark {
            return Ok(self.stack.split_off(mark));
        }
        // More items above the mark than below (APPENDS of a long list): they keep the
        // stack's buffer, and the few below move to a new one, so that 15 M items are never
        // held twice.
        let mut items = std::mem::take(&mut self.stack);
        self.stack = items[..mark].to_vec();
        items.drain(..mark);
        Ok(items)
    }

    fn obj(&self, id: ObjId) -> Cow<'_, Object<'a>> {
        Objects(&self.objects).get(id)
    }

    fn arena(&self, id: ObjId) -> Option<&Object<'a>> {
        Objects(&self.objects).arena(id)
    }

    fn str_of(&self, id: ObjId) -> Option<&str> {
        self.arena(id).and_then(Object::as_str)
    }

    fn obj_mut(&mut self, id: ObjId) -> Option<&mut Object<'a>> {
        if id & INLINE != 0 {
            return None;
        }
        self.objects.get_mut(id as usize)
    }

    fn wrong(&self, op: u8, expected: &'static str, found: ObjId) -> TorchError {
        self.err(PickleProblem::WrongType {
            op: op_name(op),
            expected,
            found: self.obj(found).kind(),
        })
    }

    fn memo_put(&mut self, index: u64, op: u8) -> R<()> {
        let top = self.top(op)?;
        if !self.memo.contains(index) && self.memo.len() >= self.limits.max_objects {
            return Err(self.err(PickleProblem::TooMany {
                what: "memo entries",
                limit: self.limits.max_objects as u64,
            }));
        }
        if self.pruning && self.memo.keeps(index) {
            if let Some(f) = self.flags.get_mut(top as usize) {
                *f |= PINNED;
            }
        }
        self.memo.insert(index, top);
        Ok(())
    }

    fn memo_get(&mut self, index: u64) -> R<()> {
        let Some(id) = self.memo.get(index) else {
            return Err(self.err(PickleProblem::MemoMissing { index }));
        };
        if self.pruning && self.skipping.is_none() && self.skip_made(id) && !self.is_inert(id) {
            // Made inside a skipped value, and read into one kept: it may have been emptied.
            self.unsound = true;
            return Err(self.err(PickleProblem::MemoMissing { index }));
        }
        self.push_id(id)
    }

    fn skip_made(&self, id: ObjId) -> bool {
        self.flags
            .get(id as usize)
            .is_some_and(|f| f & SKIP_MADE != 0)
    }

    /// Whether `id` holds no other object, so that no emptying can have changed it.
    fn is_inert(&self, id: ObjId) -> bool {
        match self.arena(id) {
            None => true,
            Some(Object::Tuple(t)) => t.is_empty(),
            Some(Object::List(_) | Object::Set(_) | Object::Dict(_) | Object::Tensor(_)) => false,
            Some(Object::Storage(_)) => false,
            Some(Object::Placeholder(p)) => {
                !p.called && p.args.is_none() && p.state.is_none() && p.items.is_empty()
            }
            Some(_) => true,
        }
    }

    /// Whether a change to `target` (APPEND, SETITEM, BUILD, ADDITEMS) is dropped: it was
    /// made inside the value being skipped and no GET reads it. Marks it so.
    fn hollows(&mut self, target: ObjId) -> bool {
        if !self.pruning || self.skipping.is_none() {
            return false;
        }
        match self.flags.get_mut(target as usize) {
            Some(f) if *f & SKIP_MADE != 0 && *f & PINNED == 0 => {
                *f |= HOLLOW;
                true
            }
            _ => false,
        }
    }

    /// The key under which the container at stack slot `at` is the value of the dict being
    /// filled just below it (the innermost mark below `at`), if it is one.
    fn parent_key(&self, at: usize) -> Option<ObjId> {
        let below = self.marks.iter().rev().copied().find(|&m| m <= at)?;
        let owner = *self.stack.get(below.checked_sub(1)?)?;
        if !matches!(self.arena(owner), Some(Object::Dict(_))) {
            return None;
        }
        (at > below && !(at - below).is_multiple_of(2)).then(|| self.stack[at - 1])
    }

    /// After each opcode, pruning: when a value of a dict begins (its key below it, just
    /// above the dict's mark), ask the reader whether it skips it.
    fn track_slot(&mut self) {
        let level = self.marks.len();
        let len = self.stack.len();
        if let Some((l, v)) = self.skipping {
            if level < l || len <= v {
                self.skipping = None;
            } else if level > l {
                return;
            }
        }
        if let Some((l, v)) = self.asked {
            if level < l || len <= v {
                self.asked = None;
            }
        }
        let Some(&m) = self.marks.last() else {
            return;
        };
        if m == 0 || len < m + 2 || !(len - m).is_multiple_of(2) {
            return;
        }
        let v = len - 1;
        if self.asked == Some((level, v)) {
            return;
        }
        let dict = self.stack[m - 1];
        if !matches!(self.arena(dict), Some(Object::Dict(_))) {
            return;
        }
        self.asked = Some((level, v));
        let (key, first) = (self.stack[v - 1], self.stack[v]);
        let skip = self.parent_key(m - 1).is_some_and(|parent| {
            self.storages
                .skips_value(Objects(&self.objects), parent, key, first)
        });
        // The value's first object, made by the opcode just read, is the value's: skipped
        // with it, or kept with it (made while the value before it was being skipped).
        if first & INLINE == 0 && first as usize >= self.made_from {
            let f = &mut self.flags[first as usize];
            *f = if skip {
                *f | SKIP_MADE
            } else {
                *f & !SKIP_MADE
            };
        }
        if skip {
            self.skipping = Some((level, v));
        } else if self.skipping.is_some_and(|(l, _)| l == level) {
            self.skipping = None;
        }
    }

    /// A str borrowed from the pickle (checked to be UTF-8, not copied).
    fn push_str(&mut self, raw: &'a [u8], op: &'static str) -> R<()> {
        let bad = |u: &Self| u.err(PickleProblem::BadText { op });
        if raw.len() <= RELEASE_CHUNK {
            let s = std::str::from_utf8(raw).map_err(|_| bad(self))?;
            return self.push(Object::Str(s));
        }
        // A long str (a 200 MB one outside the tensors): checked a chunk at a time, each
        // chunk's pages handed back once checked, so that it costs no memory while kept.
        let mut at = 0;
        while at < raw.len() {
            let end = (at + RELEASE_CHUNK).min(raw.len());
            let checked = match std::str::from_utf8(&raw[at..end]) {
                Ok(_) => end - at,
                // A character cut at the chunk's end: it starts the next chunk.
                Err(e) if e.error_len().is_none() && end < raw.len() && e.valid_up_to() > 0 => {
                    e.valid_up_to()
                }
                Err(_) => return Err(bad(self)),
            };
            self.storages.release(&raw[at..at + checked]);
            at += checked;
        }
        // SAFETY: every byte of `raw` was checked above, in pieces that each end on a
        // character boundary; valid UTF-8 pieces make valid UTF-8.
        let s = unsafe { std::str::from_utf8_unchecked(raw) };
        self.push(Object::Str(s))
    }

    /// Python 2 `str` (BINSTRING, SHORT_BINSTRING) borrowed from the pickle: text if UTF-8,
    /// as torch's default `encoding="utf-8"` decodes it, else bytes.
    fn push_py2_raw(&mut self, raw: &'a [u8]) -> R<()> {
        match std::str::from_utf8(raw) {
            Ok(s) => self.push(Object::Str(s)),
            Err(_) => self.push(Object::Bytes(raw)),
        }
    }

    fn push_owned_bytes(&mut self, raw: Vec<u8>) -> R<()> {
        self.charge_bytes(raw.len())?;
        self.push(Object::OwnedBytes(raw.into_boxed_slice()))
    }

    /// Python 2 `str` decoded from a STRING line: text if UTF-8, else bytes.
    fn push_py2_str(&mut self, raw: Vec<u8>) -> R<()> {
        match String::from_utf8(raw) {
            Ok(s) => {
                self.charge_bytes(s.len())?;
                self.push(Object::OwnedStr(s.into_boxed_str()))
            }
            Err(e) => self.push_owned_bytes(e.into_bytes()),
        }
    }

    fn push_long(&mut self, raw: &'a [u8]) -> R<()> {
        let obj = long_from_le(raw);
        if let Object::BigInt(b) = &obj {
            if b.len() > self.limits.max_long_bytes {
                return Err(self.err(PickleProblem::LongTooWide {
                    bytes: b.len() as u64,
                    limit: self.limits.max_long_bytes as u64,
                }));
            }
        }
        self.push(obj)
    }

    fn check_long_len(&self, n: u64) -> R<()> {
        if n > self.limits.max_long_bytes as u64 {
            return Err(self.err(PickleProblem::LongTooWide {
                bytes: n,
                limit: self.limits.max_long_bytes as u64,
            }));
        }
        Ok(())
    }

    fn global(&mut self, module: &str, name: &str) -> R<()> {
        let full = format!("{module}.{name}");
        if !self.named.contains_key(&full) && self.globals.len() < MAX_NAMED {
            self.globals.push(full.clone());
            self.named.insert(full, ());
        }
        match resolve(module, name) {
            Resolved::Allowed(g) => self.push(Object::Global(g)),
            Resolved::Denied(full) if self.limits.inert_paths && is_path_class(module, name) => {
                self.note_placeholder(&full);
                self.push(Object::Placeholder(Box::new(Placeholder {
                    global: full,
                    called: false,
                    args: None,
                    state: None,
                    items: Vec::new(),
                })))
            }
            Resolved::Denied(full) => {
                self.denied.get_or_insert_with(|| full.clone());
                self.note_placeholder(&full);
                self.push(Object::Placeholder(Box::new(Placeholder {
                    global: full,
                    called: false,
                    args: None,
                    state: None,
                    items: Vec::new(),
                })))
            }
            Resolved::Placeholder(full) => {
                self.note_placeholder(&full);
                self.push(Object::Placeholder(Box::new(Placeholder {
                    global: full,
                    called: false,
                    args: None,
                    state: None,
                    items: Vec::new(),
                })))
            }
        }
    }

    fn note_placeholder(&mut self, full: &str) {
        if !self.seen.contains_key(full) && self.placeholders.len() < MAX_NAMED {
            self.seen.insert(full.to_string(), ());
            self.placeholders.push(full.to_string());
        }
    }

    fn is_denied(&self, global: &str) -> bool {
        let root = global.split('.').next().unwrap_or(global);
        if self.limits.inert_paths {
            if let Some(("pathlib", name)) = global.split_once('.') {
                if is_path_class("pathlib", name) {
                    return false;
                }
            }
        }
        DENIED_MODULES.contains(&root)
            || global
                .strip_prefix("builtins.")
                .is_some_and(|n| !HARMLESS_BUILTINS.contains(&n))
    }

    /// A call (REDUCE, NEWOBJ) of a placeholder: another, inert, placeholder.
    fn call_placeholder(&mut self, callee: ObjId, args: ObjId) -> R<ObjId> {
        let callee_obj = self.obj(callee);
        let Object::Placeholder(p) = &*callee_obj else {
            return Err(self.wrong(b'R', "a callable", callee));
        };
        let global = p.global.clone();
        if self.is_denied(&global) {
            return Err(TorchError::Denied {
                global,
                called: true,
            });
        }
        // Called with a storage (in its arguments, or one tuple down), it stands for a
        // tensor that an unlisted function would build: a tensor slot that says so.
        let has_storage = |id: ObjId| matches!(&*self.obj(id), Object::Storage(_));
        let storage_arg = self.tuple_items(args).is_some_and(|a| {
            a.iter().any(|&i| {
                has_storage(i)
                    || self
                        .tuple_items(i)
                        .is_some_and(|t| t.iter().any(|&j| has_storage(j)))
            })
        });
        if storage_arg {
            return self.new_tensor(Err(TensorProblem::CallsGlobal { global }));
        }
        let d = self.depth_of(args) + 1;
        self.alloc(
            Object::Placeholder(Box::new(Placeholder {
                global,
                called: true,
                args: Some(args),
                state: None,
                items: Vec::new(),
            })),
            d,
        )
    }

    fn new_tensor(&mut self, slot: TensorSlot) -> R<ObjId> {
        let index = u32::try_from(self.tensors.len()).map_err(|_| {
            self.err(PickleProblem::TooMany {
                what: "tensors",
                limit: u32::MAX as u64,
            })
        })?;
        self.tensors.push(slot);
        self.alloc(Object::Tensor(index), 0)
    }

    fn bad_call(&self, g: Global, reason: impl Into<String>) -> TorchError {
        self.err(PickleProblem::BadCall {
            global: g.name(),
            reason: reason.into(),
        })
    }

    fn tuple_items(&self, id: ObjId) -> Option<&[ObjId]> {
        match self.arena(id) {
            Some(Object::Tuple(t)) => Some(t),
            _ => None,
        }
    }

    /// REDUCE of an allowed global: the stub's result.
    fn call_global(&mut self, g: Global, args: ObjId, nested: bool) -> R<ObjId> {
        let Some(a) = self.tuple_items(args).map(<[ObjId]>::to_vec) else {
            return Err(self.bad_call(g, format!("arguments are {}", self.obj(args).kind())));
        };
        match g {
            Global::RebuildTensor | Global::RebuildTensorV2 | Global::RebuildTensorV3 => {
                let slot = self.rebuild_tensor(g, &a);
                self.new_tensor(slot)
            }
            Global::RebuildParameter
            | Global::RebuildParameterWithState
            | Global::ParameterClass => {
                let Some(&data) = a.first() else {
                    return self.new_tensor(Err(TensorProblem::BadArgs {
                        func: "a parameter rebuild",
                        reason: "no arguments".into(),
                    }));
                };
                match &*self.obj(data) {
                    Object::Tensor(_) => Ok(data),
                    Object::Placeholder(p) => {
                        let global = p.global.clone();
                        self.new_tensor(Err(TensorProblem::CallsGlobal { global }))
                    }
                    other => {
                        let reason = format!("its data is {}", other.kind());
                        self.new_tensor(Err(TensorProblem::BadArgs {
                            func: "a parameter rebuild",
                            reason,
                        }))
                    }
                }
            }
            Global::RebuildFromType => {
                let bad = |reason: String| TensorProblem::BadArgs {
                    func: "torch._tensor._rebuild_from_type_v2",
                    reason,
                };
                if a.len() != 4 {
                    return self.new_tensor(Err(bad(format!("{} arguments", a.len()))));
                }
                match &*self.obj(a[1]) {
                    Object::Global(Global::TensorClass | Global::ParameterClass) => {}
                    Object::Placeholder(p) => {
                        let global = p.global.clone();
                        return self.new_tensor(Err(TensorProblem::Subclass { global }));
                    }
                    other => {
                        let reason = format!("its type is {}", other.kind());
                        return self.new_tensor(Err(bad(reason)));
                    }
                }
                match &*self.obj(a[0]) {
                    Object::Global(inner) if !nested && *inner != Global::RebuildFromType => {
                        let inner = *inner;
                        self.call_global(inner, a[2], true)
                    }
                    Object::Placeholder(p) => {
                        let global = p.global.clone();
                        self.new_tensor(Err(TensorProblem::CallsGlobal { global }))
                    }
                    other => {
                        let reason = format!("its function is {}", other.kind());
                        self.new_tensor(Err(bad(reason)))
                    }
                }
            }
            Global::UnsupportedRebuild(what) => {
                self.new_tensor(Err(TensorProblem::Layout { what }))
            }
            Global::OrderedDict => {
                let mut dict = Dict {
                    items: Vec::new(),
                    ordered: true,
                    state: None,
                };
                match a.as_slice() {
                    [] => {}
                    [src] => {
                        let pairs = match &*self.obj(*src) {
                            Object::List(v) => v.to_vec(),
                            Object::Tuple(v) => v.to_vec(),
                            Object::Dict(d) => {
                                dict.items = d.items.clone();
                                Vec::new()
                            }
                            other => {
                                let reason = format!("its argument is {}", other.kind());
                                return Err(self.bad_call(g, reason));
                            }
                        };
                        for p in pairs {
                            match self.tuple_items(p) {
                                Some([k, v]) => dict.items.push((*k, *v)),
                                _ => return Err(self.bad_call(g, "an item is not a pair")),
                            }
                        }
                    }
                    _ => return Err(self.bad_call(g, format!("{} arguments", a.len()))),
                }
                let ids: Vec<ObjId> = dict.items.iter().flat_map(|&(k, v)| [k, v]).collect();
                self.charge_cells(ids.len())?;
                let d = ids.iter().map(|&i| self.depth_of(i)).max().unwrap_or(0) + 1;
                self.alloc(Object::Dict(Box::new(dict)), d)
            }
            Global::Set | Global::FrozenSet => {
                let items = match a.as_slice() {
                    [] => Vec::new(),
                    [src] => match &*self.obj(*src) {
                        Object::List(v) | Object::Set(v) => v.to_vec(),
                        Object::Tuple(v) => v.to_vec(),
                        other => {
                            let reason = format!("its argument is {}", other.kind());
                            return Err(self.bad_call(g, reason));
                        }
                    },
                    _ => return Err(self.bad_call(g, format!("{} arguments", a.len()))),
                };
                self.charge_cells(items.len())?;
                let d = items.iter().map(|&i| self.depth_of(i)).max().unwrap_or(0) + 1;
                self.alloc(Object::Set(Box::new(items)), d)
            }
            Global::Complex => {
                let num = |o: &Object| match o {
                    Object::Int(i) => Some(*i as f64),
                    Object::Float(f) => Some(*f),
                    Object::Bool(b) => Some(f64::from(u8::from(*b))),
                    _ => None,
                };
                let (re, im) = match a.as_slice() {
                    [] => (Some(0.0), Some(0.0)),
                    [r] => (num(&self.obj(*r)), Some(0.0)),
                    [r, i] => (num(&self.obj(*r)), num(&self.obj(*i))),
                    _ => (None, None),
                };
                match (re, im) {
                    (Some(re), Some(im)) => self.alloc(Object::Complex(re, im), 0),
                    _ => Err(self.bad_call(g, "arguments are not two numbers")),
                }
            }
            Global::Encode | Global::Bytearray => {
                let out = match a.as_slice() {
                    [] if g == Global::Bytearray => Vec::new(),
                    [b] if g == Global::Bytearray => match self.obj(*b).as_bytes() {
                        Some(b) => b.to_vec(),
                        None => {
                            let reason = format!("its argument is {}", self.obj(*b).kind());
                            return Err(self.bad_call(g, reason));
                        }
                    },
                    [s, enc] => match (self.obj(*s).as_str(), self.obj(*enc).as_str()) {
                        (Some(s), Some(enc)) => match encode(s, enc) {
                            Some(b) => b,
                            None => {
                                let reason = format!("cannot encode with `{enc}`");
                                return Err(self.bad_call(g, reason));
                            }
                        },
                        _ => return Err(self.bad_call(g, "arguments are not two strs")),
                    },
                    _ => return Err(self.bad_call(g, format!("{} arguments", a.len()))),
                };
                self.charge_bytes(out.len())?;
                self.alloc(Object::OwnedBytes(out.into_boxed_slice()), 0)
            }
            Global::Size => match a.as_slice() {
                [] => self.alloc(Object::Tuple(Box::new([])), 1),
                [t] if matches!(&*self.obj(*t), Object::Tuple(_)) => Ok(*t),
                [l] if matches!(&*self.obj(*l), Object::List(_)) => {
                    let items = match &*self.obj(*l) {
                        Object::List(v) => v.to_vec(),
                        _ => Vec::new(),
                    };
                    self.charge_cells(items.len())?;
                    let d = items.iter().map(|&i| self.depth_of(i)).max().unwrap_or(0) + 1;
                    self.alloc(Object::Tuple(items.into_boxed_slice()), d)
                }
                _ => Err(self.bad_call(g, "its argument is not a tuple")),
            },
            Global::TensorClass
            | Global::StorageClass(_)
            | Global::UntypedStorage
            | Global::Dtype(_) => Err(self.bad_call(g, "this reader does not evaluate it")),
        }
    }

    fn rebuild_tensor(&self, g: Global, a: &[ObjId]) -> TensorSlot {
        let func = match g {
            Global::RebuildTensor => "torch._utils._rebuild_tensor",
            Global::RebuildTensorV3 => "torch._utils._rebuild_tensor_v3",
            _ => "torch._utils._rebuild_tensor_v2",
        };
        let bad = |reason: String| TensorProblem::BadArgs { func, reason };
        let (min, max) = match g {
            Global::RebuildTensor => (4, 4),
            Global::RebuildTensorV3 => (7, 8),
            _ => (6, 7),
        };
        if a.len() < min || a.len() > max {
            return Err(bad(format!("{} arguments", a.len())));
        }
        // Any placeholder among the arguments means an unlisted global builds this tensor.
        for &arg in a {
            if let Object::Placeholder(p) = &*self.obj(arg) {
                return Err(TensorProblem::CallsGlobal {
                    global: p.global.clone(),
                });
            }
        }
        let Some(Object::Storage(storage)) = self.arena(a[0]) else {
            return Err(bad(format!("its storage is {}", self.obj(a[0]).kind())));
        };
        let storage = **storage;
        let offset = match &*self.obj(a[1]) {
            Object::Int(i) => u64::try_from(*i).map_err(|_| bad(format!("offset {i}")))?,
            Object::BigInt(_) => {
                return Err(bad(
                    "its offset is too large: an integer wider than 64 bits".into(),
                ))
            }
            other => return Err(bad(format!("its offset is {}", other.kind()))),
        };
        let ints = |id: ObjId, what: &str| -> Result<Vec<u64>, TensorProblem> {
            let items: &[ObjId] = match self.arena(id) {
                Some(Object::Tuple(t)) => t,
                Some(Object::List(l)) => l,
                _ => return Err(bad(format!("its {what} is {}", self.obj(id).kind()))),
            };
            if items.len() > self.limits.max_ndim {
                return Err(TensorProblem::TooManyDims {
                    ndim: items.len(),
                    limit: self.limits.max_ndim,
                });
            }
            items
                .iter()
                .map(|&i| match &*self.obj(i) {
                    Object::Int(v) => u64::try_from(*v).map_err(|_| bad(format!("{what} {v}"))),
                    Object::BigInt(_) => Err(TensorProblem::Overflow),
                    other => Err(bad(format!("its {what} holds {}", other.kind()))),
                })
                .collect()
        };
        let shape = ints(a[2], "size")?;
        let stride = ints(a[3], "stride")?;
        if shape.len() != stride.len() {
            return Err(bad(format!(
                "{} sizes but {} strides",
                shape.len(),
                stride.len()
            )));
        }
        let (dtype, meta) = match g {
            Global::RebuildTensorV3 => match &*self.obj(a[6]) {
                Object::Global(Global::Dtype(t)) => (*t, a.get(7)),
                other => return Err(bad(format!("its dtype is {}", other.kind()))),
            },
            // As torch: the dtype of the storage this reference names.
            Global::RebuildTensor => (storage.dtype, None),
            _ => (storage.dtype, a.get(6)),
        };
        if let Some(&meta) = meta {
            match &*self.obj(meta) {
                Object::None => {}
                Object::Dict(d) => {
                    for &(k, v) in &d.items {
                        let on = !matches!(&*self.obj(v), Object::Bool(false) | Object::None);
                        if let Some(k) = self.obj(k).as_str() {
                            if on && (k == "conj" || k == "neg") {
                                return Err(TensorProblem::LazyBit { bit: k.to_string() });
                            }
                        }
                    }
                }
                other => return Err(bad(format!("its metadata is {}", other.kind()))),
            }
        }
        Ok(RawTensor {
            storage,
            dtype,
            offset,
            shape,
            stride,
        })
    }

    fn newobj(&mut self, op: u8) -> R<()> {
        let (cls, args) = if op == 0x92 {
            let _kwargs = self.pop(op)?;
            let args = self.pop(op)?;
            (self.pop(op)?, args)
        } else {
            let args = self.pop(op)?;
            (self.pop(op)?, args)
        };
        let callee = match &*self.obj(cls) {
            Object::Global(g) => Some(*g),
            Object::Placeholder(_) => None,
            _ => return Err(self.wrong(op, "a class", cls)),
        };
        let id = match callee {
            Some(Global::ParameterClass) => {
                self.call_global(Global::ParameterClass, args, false)?
            }
            Some(g @ (Global::OrderedDict | Global::Set | Global::FrozenSet)) => {
                let empty = self.alloc(Object::Tuple(Box::new([])), 1)?;
                self.call_global(g, empty, false)?
            }
            Some(g) => {
                return Err(self.bad_call(g, "NEWOBJ of this class is not allowed"));
            }
            None => self.call_placeholder(cls, args)?,
        };
        self.push_id(id)
    }

    fn reduce(&mut self) -> R<()> {
        let op = b'R';
        let args = self.pop(op)?;
        let func = self.pop(op)?;
        let id = match &*self.obj(func) {
            Object::Global(g) => {
                let g = *g;
                self.call_global(g, args, false)?
            }
            Object::Placeholder(_) => self.call_placeholder(func, args)?,
            _ => return Err(self.wrong(op, "a callable", func)),
        };
        self.push_id(id)
    }

    fn build(&mut self) -> R<()> {
        let op = b'b';
        let state = self.pop(op)?;
        let inst = self.top(op)?;
        let state_kind = self.obj(state).kind();
        let state_ok_for_tensor = matches!(&*self.obj(state), Object::None)
            || matches!(&*self.obj(state), Object::Dict(_));
        let d = self.depth_of(state) + 1;
        if self.hollows(inst) {
            return Ok(());
        }
        let target = match self.obj_mut(inst) {
            Some(Object::Dict(dict)) if dict.ordered => {
                dict.state = Some(state);
                None
            }
            Some(Object::Placeholder(p)) if p.called => {
                p.state = Some(state);
                None
            }
            Some(Object::Tensor(_)) if state_ok_for_tensor => None,
            Some(Object::Tensor(_)) => Some(format!("a tensor with {state_kind} as state")),
            Some(other) => Some(other.kind().to_string()),
            None => Some("nothing".to_string()),
        };
        if let Some(target) = target {
            if let Object::Placeholder(p) = &*self.obj(inst) {
                if self.is_denied(&p.global) {
                    return Err(TorchError::Denied {
                        global: p.global.clone(),
                        called: true,
                    });
                }
            }
            return Err(self.err(PickleProblem::Build { target }));
        }
        self.raise_depth(inst, d)
    }

    fn raise_depth(&mut self, id: ObjId, d: u32) -> R<()> {
        self.check_depth(d)?;
        if let Some(slot) = self.depth.get_mut(id as usize) {
            *slot = (*slot).max(d);
        }
        Ok(())
    }

    fn append(&mut self, op: u8, items: Vec<ObjId>) -> R<()> {
        let target = self.top(op)?;
        if self.hollows(target) {
            return Ok(());
        }
        let d = items.iter().map(|&i| self.depth_of(i)).max().unwrap_or(0) + 1;
        self.charge_cells(items.len())?;
        match self.obj_mut(target) {
            Some(Object::List(l)) if l.is_empty() => **l = items,
            Some(Object::List(l)) => l.extend(items),
            Some(Object::Placeholder(p)) if p.called => p.items.extend(items),
            _ => return Err(self.wrong(op, "a list", target)),
        }
        self.raise_depth(target, d)
    }

    fn setitems(&mut self, op: u8, mut items: Vec<ObjId>) -> R<()> {
        let target = self.top(op)?;
        if self.hollows(target) {
            return Ok(());
        }
        if !items.len().is_multiple_of(2) {
            return Err(self.err(PickleProblem::WrongType {
                op: op_name(op),
                expected: "key-value pairs",
                found: "an odd number of items",
            }));
        }
        if self.pruning && matches!(self.arena(target), Some(Object::Dict(_))) {
            if let Some(parent) = self.parent_key(self.stack.len() - 1) {
                let objects = Objects(&self.objects);
                let storages = &mut *self.storages;
                let mut kept = Vec::with_capacity(items.len());
                for kv in items.chunks_exact(2) {
                    if storages.keeps_item(objects, parent, kv[0], kv[1]) {
                        kept.extend_from_slice(kv);
                    }
                }
                items = kept;
            }
        }
        let d = items.iter().map(|&i| self.depth_of(i)).max().unwrap_or(0) + 1;
        self.charge_cells(items.len())?;
        match self.obj_mut(target) {
            Some(Object::Dict(dict)) => dict
                .items
                .extend(items.chunks_exact(2).map(|kv| (kv[0], kv[1]))),
            Some(Object::Placeholder(p)) if p.called => p.items.extend(items),
            _ => return Err(self.wrong(op, "a dict", target)),
        }
        self.raise_depth(target, d)
    }

    fn additems(&mut self, op: u8, items: Vec<ObjId>) -> R<()> {
        let target = self.top(op)?;
        if self.hollows(target) {
            return Ok(());
        }
        let d = items.iter().map(|&i| self.depth_of(i)).max().unwrap_or(0) + 1;
        self.charge_cells(items.len())?;
        match self.obj_mut(target) {
            Some(Object::Set(s)) => s.extend(items),
            _ => return Err(self.wrong(op, "a set", target)),
        }
        self.raise_depth(target, d)
    }

    fn persid(&mut self) -> R<()> {
        let pid = self.pop(b'Q')?;
        let at = self.op_at as u64;
        let storage = self
            .storages
            .load(Objects(&self.objects), pid)
            .map_err(|e| match e {
                TorchError::Pickle { problem, .. } => TorchError::Pickle {
                    pickle: self.label,
                    at,
                    problem,
                },
                other => other,
            })?;
        self.push(Object::Storage(Box::new(storage)))
    }

    /// Reclaim the objects nothing reaches any more (such as a tensor's rebuild arguments,
    /// its persistent id and strings, once the tensor is made), as Python's reference counts
    /// would: mark from the stack, the memo, the shared constants and `root`, then compact
    /// the arena, renumbering every id. Called between opcodes only, where no id is held
    /// anywhere else. Returns `root`'s new id.
    fn collect(&mut self, root: Option<ObjId>) -> ObjId {
        let n = self.objects.len();
        // `NO_ENTRY` for an unreached object; its new id once reached.
        let mut new_id = vec![NO_ENTRY; n];
        // Ids still to visit: never an inline int (a list of 15 M ints pushes none).
        let mut todo: Vec<ObjId> = Vec::new();
        let roots = self.stack.iter().copied().chain(self.memo.ids());
        let roots = roots
            .chain(self.small.iter().flatten().copied())
            .chain(root);
        for id in roots {
            if id & INLINE == 0 {
                todo.push(id);
            }
            while let Some(id) = todo.pop() {
                let i = id as usize;
                if i >= n || new_id[i] != NO_ENTRY {
                    continue;
                }
                new_id[i] = 0;
                each_child(&self.objects[i], |c| {
                    if c & INLINE == 0 && new_id.get(c as usize) == Some(&NO_ENTRY) {
                        todo.push(c)
                    }
                });
            }
        }
        let mut kept = 0usize;
        for (i, slot) in new_id.iter_mut().enumerate() {
            if *slot != NO_ENTRY {
                *slot = kept as ObjId;
                self.objects.swap(kept, i);
                self.depth.swap(kept, i);
                self.flags.swap(kept, i);
                kept += 1;
            }
        }
        self.objects.truncate(kept);
        self.depth.truncate(kept);
        self.flags.truncate(kept);
        let map = |id: ObjId| match new_id.get(id as usize) {
            Some(&new) if id & INLINE == 0 => new,
            _ => id,
        };
        for o in self.objects.iter_mut() {
            remap_children(o, map);
        }
        for id in self.stack.iter_mut() {
            *id = map(*id);
        }
        self.memo.remap(map);
        for id in self.small.iter_mut().flatten() {
            *id = map(*id);
        }
        // Twice the survivors: the marking and moving stay linear over the whole run.
        self.next_collect = match min_collect() {
            0 => 0,
            min => (2 * kept).max(min),
        };
        root.map_or(0, map)
    }

    fn run(&mut self) -> R<ObjId> {
        loop {
            if self.pruning {
                self.track_slot();
            }
            if self.objects.len() >= self.next_collect {
                self.collect(None);
            }
            self.made_from = self.objects.len();
            if self.pos - self.released >= RELEASE_CHUNK {
                // The pickle behind us: its pages may go (a str borrowed from them is read
                // again from the file if ever needed).
                self.storages.release(&self.data[self.released..self.pos]);
                self.released = self.pos;
            }
            self.op_at = self.pos;
            let op = self.u8()?;
            match op {
                // PROTO
                0x80 => {
                    let p = self.u8()?;
                    if p > 5 {
                        return Err(self.err(PickleProblem::WrongType {
                            op: "PROTO",
                            expected: "protocol 0 to 5",
                            found: "a newer protocol",
                        }));
                    }
                }
                // FRAME: framing is advisory; the bytes follow in line.
                0x95 => {
                    let n = self.u64()?;
                    if n > (self.data.len() - self.pos) as u64 && !self.capped {
                        return Err(self.err(PickleProblem::Truncated));
                    }
                }
                b'.' => {
                    if let Some(global) = self.denied.take() {
                        return Err(TorchError::Denied {
                            global,
                            called: false,
                        });
                    }
                    return self.pop(op);
                }
                b'(' => {
                    if self.marks.len() >= self.limits.max_depth {
                        return Err(self.err(PickleProblem::TooDeep {
                            limit: self.limits.max_depth,
                        }));
                    }
                    self.marks.push(self.stack.len());
                }
                b'0' => {
                    self.pop(op)?;
                }
                b'1' => {
                    self.pop_mark(op)?;
                }
                b'2' => {
                    let t = self.top(op)?;
                    self.push_id(t)?;
                }
                b'N' => self.push(Object::None)?,
                0x88 => self.push(Object::Bool(true))?,
                0x89 => self.push(Object::Bool(false))?,
                b'I' => {
                    let line = self.line("INT")?.trim().to_string();
                    let obj = match line.as_str() {
                        "01" => Object::Bool(true),
                        "00" => Object::Bool(false),
                        s => match s.parse::<i64>() {
                            Ok(i) => Object::Int(i),
                            Err(_) => return Err(self.err(PickleProblem::BadText { op: "INT" })),
                        },
                    };
                    self.push(obj)?;
                }
                b'J' => {
                    let v = self.u32()? as i32;
                    self.push(Object::Int(i64::from(v)))?;
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Object::Int(i64::from(v)))?;
                }
                b'M' => {
                    let v = self.u16()?;
                    self.push(Object::Int(i64::from(v)))?;
                }
                b'L' => {
                    let line = self.line("LONG")?.to_string();
                    let s = line.trim().trim_end_matches('L');
                    self.check_long_len(s.len() as u64 / 2)?;
                    match s.parse::<i64>() {
                        Ok(i) => self.push(Object::Int(i))?,
                        Err(_) => {
                            return Err(self.err(PickleProblem::LongTooWide {
                                bytes: s.len() as u64 / 2,
                                limit: 8,
                            }))
                        }
                    }
                }
                0x8a => {
                    let n = self.u8()?;
                    let raw = self.take(usize::from(n))?;
                    self.push_long(raw)?;
                }
                0x8b => {
                    let n = self.u32()? as i32;
                    let n = u64::try_from(n).map_err(|_| {
                        self.err(PickleProblem::WrongType {
                            op: "LONG4",
                            expected: "a length",
                            found: "a negative one",
                        })
                    })?;
                    self.check_long_len(n)?;
                    let raw = self.take_len(n)?;
                    self.push_long(raw)?;
                }
                b'F' => {
                    let line = self.line("FLOAT")?;
                    let v = line
                        .trim()
                        .parse::<f64>()
                        .map_err(|_| self.err(PickleProblem::BadText { op: "FLOAT" }))?;
                    self.push(Object::Float(v))?;
                }
                b'G' => {
                    let b = self.take(8)?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    self.push(Object::Float(f64::from_be_bytes(a)))?;
                }
                b'S' => {
                    let line = self.line("STRING")?;
                    let raw = unquote(line.trim_end_matches('\r'))
                        .ok_or_else(|| self.err(PickleProblem::BadText { op: "STRING" }))?;
                    self.push_py2_str(raw)?;
                }
                b'T' => {
                    let n = self.u32()? as i32;
                    let n = u64::try_from(n).map_err(|_| self.short())?;
                    let raw = self.take_len(n)?;
                    self.push_py2_raw(raw)?;
                }
                b'U' => {
                    let n = self.u8()?;
                    let raw = self.take(usize::from(n))?;
                    self.push_py2_raw(raw)?;
                }
                b'V' => {
                    let line = self.line("UNICODE")?.to_string();
                    let s = raw_unicode_unescape(&line)
                        .ok_or_else(|| self.err(PickleProblem::BadText { op: "UNICODE" }))?;
                    self.charge_bytes(s.len())?;
                    self.push(Object::OwnedStr(s.into_boxed_str()))?;
                }
                b'X' => {
                    let n = self.u32()?;
                    let raw = self.take_len(u64::from(n))?;
                    self.push_str(raw, "BINUNICODE")?;
                }
                0x8c => {
                    let n = self.u8()?;
                    let raw = self.take(usize::from(n))?;
                    self.push_str(raw, "SHORT_BINUNICODE")?;
                }
                0x8d => {
                    let n = self.u64()?;
                    let raw = self.take_len(n)?;
                    self.push_str(raw, "BINUNICODE8")?;
                }
                b'B' => {
                    let n = self.u32()?;
                    let raw = self.take_len(u64::from(n))?;
                    self.push(Object::Bytes(raw))?;
                }
                b'C' => {
                    let n = self.u8()?;
                    let raw = self.take(usize::from(n))?;
                    self.push(Object::Bytes(raw))?;
                }
                0x8e | 0x96 => {
                    let n = self.u64()?;
                    let raw = self.take_len(n)?;
                    self.push(Object::Bytes(raw))?;
                }
                0x97 => return Err(self.err(PickleProblem::Forbidden { op: "NEXT_BUFFER" })),
                0x98 => {
                    return Err(self.err(PickleProblem::Forbidden {
                        op: "READONLY_BUFFER",
                    }))
                }
                b')' => self.push_container(Object::Tuple(Box::new([])), &[])?,
                b't' => {
                    let items = self.pop_mark(op)?;
                    self.push_items(items, |v| Object::Tuple(v.into_boxed_slice()))?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = vec![0; n];
                    for slot in items.iter_mut().rev() {
                        *slot = self.pop(op)?;
                    }
                    self.push_items(items, |v| Object::Tuple(v.into_boxed_slice()))?;
                }
                b']' => self.push_container(Object::List(Box::default()), &[])?,
                b'l' => {
                    let items = self.pop_mark(op)?;
                    self.push_items(items, |v| Object::List(Box::new(v)))?;
                }
                b'a' => {
                    let item = self.pop(op)?;
                    self.append(op, vec![item])?;
                }
                b'e' => {
                    let items = self.pop_mark(op)?;
                    self.append(op, items)?;
                }
                b'}' => {
                    let dict = Dict {
                        items: Vec::new(),
                        ordered: false,
                        state: None,
                    };
                    self.push_container(Object::Dict(Box::new(dict)), &[])?;
                }
                b'd' => {
                    let items = self.pop_mark(op)?;
                    let dict = Dict {
                        items: Vec::new(),
                        ordered: false,
                        state: None,
                    };
                    self.push_container(Object::Dict(Box::new(dict)), &[])?;
                    self.setitems(op, items)?;
                }
                b's' => {
                    let v = self.pop(op)?;
                    let k = self.pop(op)?;
                    self.setitems(op, vec![k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark(op)?;
                    self.setitems(op, items)?;
                }
                0x8f => self.push_container(Object::Set(Box::default()), &[])?,
                0x90 => {
                    let items = self.pop_mark(op)?;
                    self.additems(op, items)?;
                }
                0x91 => {
                    let items = self.pop_mark(op)?;
                    self.push_items(items, |v| Object::Set(Box::new(v)))?;
                }
                b'c' => {
                    let start = self.pos;
                    let module = self.line("GLOBAL")?;
                    let name = self.line("GLOBAL")?;
                    // An allowed global named again (a pickle without memo names one per
                    // tensor) is the same stub: no need to resolve and record it again.
                    let raw = &self.data[start..self.pos];
                    if let Some(&g) = self.allowed.get(raw) {
                        self.push(Object::Global(g))?;
                    } else {
                        self.global(module, name)?;
                        if let Some(&id) = self.stack.last() {
                            if let Object::Global(g) = *self.obj(id) {
                                self.allowed.insert(raw, g);
                            }
                        }
                    }
                }
                0x93 => {
                    let name = self.pop(op)?;
                    let module = self.pop(op)?;
                    let (Some(m), Some(n)) = (self.str_of(module), self.str_of(name)) else {
                        return Err(self.wrong(op, "two strs", name));
                    };
                    let (m, n) = (m.to_string(), n.to_string());
                    self.global(&m, &n)?;
                }
                b'R' => self.reduce()?,
                b'b' => self.build()?,
                0x81 | 0x92 => self.newobj(op)?,
                b'i' => return Err(self.err(PickleProblem::Forbidden { op: "INST" })),
                b'o' => return Err(self.err(PickleProblem::Forbidden { op: "OBJ" })),
                0x82 => return Err(self.err(PickleProblem::Forbidden { op: "EXT1" })),
                0x83 => return Err(self.err(PickleProblem::Forbidden { op: "EXT2" })),
                0x84 => return Err(self.err(PickleProblem::Forbidden { op: "EXT4" })),
                b'P' => return Err(self.err(PickleProblem::Forbidden { op: "PERSID" })),
                b'Q' => self.persid()?,
                b'g' => {
                    let line = self.line("GET")?;
                    let i = line
                        .trim()
                        .parse::<u64>()
                        .map_err(|_| self.err(PickleProblem::BadText { op: "GET" }))?;
                    self.memo_get(i)?;
                }
                b'h' => {
                    let i = self.u8()?;
                    self.memo_get(u64::from(i))?;
                }
                b'j' => {
                    let i = self.u32()?;
                    self.memo_get(u64::from(i))?;
                }
                b'p' => {
                    let line = self.line("PUT")?;
                    let i = line
                        .trim()
                        .parse::<u64>()
                        .map_err(|_| self.err(PickleProblem::BadText { op: "PUT" }))?;
                    self.memo_put(i, op)?;
                }
                b'q' => {
                    let i = self.u8()?;
                    self.memo_put(u64::from(i), op)?;
                }
                b'r' => {
                    let i = self.u32()?;
                    self.memo_put(u64::from(i), op)?;
                }
                0x94 => {
                    let i = self.memo.len() as u64;
                    self.memo_put(i, op)?;
                }
                other => return Err(self.err(PickleProblem::UnknownOpcode { op: other })),
            }
        }
    }
}

/// A LONG1/LONG4 payload (little-endian two's complement) as an int, or a big int.
fn long_from_le(raw: &[u8]) -> Object<'static> {
    if raw.is_empty() {
        return Object::Int(0);
    }
    let negative = raw[raw.len() - 1] & 0x80 != 0;
    let fill = if negative { 0xff } else { 0 };
    // Drop sign-extension bytes beyond the eighth.
    let mut n = raw.len();
    while n > 8 && raw[n - 1] == fill && (raw[n - 2] & 0x80 != 0) == negative {
        n -= 1;
    }
    if n <= 8 {
        let mut a = [fill; 8];
        a[..n].copy_from_slice(&raw[..n]);
        Object::Int(i64::from_le_bytes(a))
    } else {
        Object::BigInt(raw[..n].to_vec().into_boxed_slice())
    }
}

/// `_codecs.encode(s, encoding)` for the encodings protocol 2 uses.
fn encode(s: &str, encoding: &str) -> Option<Vec<u8>> {
    match encoding.to_ascii_lowercase().as_str() {
        "latin1" | "latin-1" | "iso-8859-1" | "iso8859-1" | "l1" => {
            s.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect()
        }
        "ascii" => s.is_ascii().then(|| s.as_bytes().to_vec()),
        "utf-8" | "utf8" => Some(s.as_bytes().to_vec()),
        _ => None,
    }
}

/// A protocol-0 STRING operand: a quoted Python 2 literal.
fn unquote(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if b.len() < 2 || b[0] != b[b.len() - 1] || !(b[0] == b'\'' || b[0] == b'"') {
        return None;
    }
    let inner = &b[1..b.len() - 1];
    let mut out = Vec::with_capacity(inner.len());
    let mut i = 0;
    while i < inner.len() {
        let c = inner[i];
        if c != b'\\' {
            out.push(c);
            i += 1;
            continue;
        }
        let e = *inner.get(i + 1)?;
        i += 2;
        match e {
            b'n' => out.push(b'\n'),
            b't' => out.push(b'\t'),
            b'r' => out.push(b'\r'),
            b'0' => out.push(0),
            b'\\' | b'\'' | b'"' => out.push(e),
            b'x' => {
                let h = inner.get(i..i + 2)?;
                let h = std::str::from_utf8(h).ok()?;
                out.push(u8::from_str_radix(h, 16).ok()?);
                i += 2;
            }
            _ => {
                out.push(b'\\');
                out.push(e);
            }
        }
    }
    Some(out)
}

/// A protocol-0 UNICODE operand (raw-unicode-escape).
fn raw_unicode_unescape(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let width = match chars.peek() {
                Some('u') => 4,
                Some('U') => 8,
                _ => {
                    out.push(c);
                    continue;
                }
            };
            chars.next();
            let hex: String = chars.by_ref().take(width).collect();
            if hex.len() != width {
                return None;
            }
            let v = u32::from_str_radix(&hex, 16).ok()?;
            out.push(char::from_u32(v)?);
        } else {
            out.push(c);
        }
    }
    Some(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::cell::Cell;
    use std::collections::HashSet;

    /// `{'a': 0, 'sd': {'drop': [1, 2, [5, 6]], 'keep': [3, 4]}}`, Python's protocol 4.
    const PRUNED: &[u8] = &[
        128, 4, 149, 58, 0, 0, 0, 0, 0, 0, 0, 125, 148, 40, 140, 1, 97, 148, 75, 0, 140, 2, 115,
        100, 148, 125, 148, 40, 140, 4, 100, 114, 111, 112, 148, 93, 148, 40, 75, 1, 75, 2, 93,
        148, 40, 75, 5, 75, 6, 101, 101, 140, 4, 107, 101, 101, 112, 148, 93, 148, 40, 75, 3, 75,
        4, 101, 117, 117, 46,
    ];

    /// The same, but the list inside 'drop' is `s` and 'keep' is `[3, s]` (a GET of it).
    const SHARED: &[u8] = &[
        128, 4, 149, 62, 0, 0, 0, 0, 0, 0, 0, 125, 148, 40, 140, 1, 97, 148, 75, 0, 140, 2, 115,
        100, 148, 125, 148, 40, 140, 4, 100, 114, 111, 112, 148, 93, 148, 40, 75, 1, 75, 2, 93,
        148, 40, 140, 1, 120, 148, 140, 1, 121, 148, 101, 101, 140, 4, 107, 101, 101, 112, 148, 93,
        148, 40, 75, 3, 104, 6, 101, 117, 117, 46,
    ];

    /// Hooks that skip and drop the item `drop` of the dict under `sd`.
    struct DropOne {
        skipped: usize,
    }

    impl Storages for DropOne {
        fn load(&mut self, o: Objects<'_, '_>, pid: ObjId) -> Result<StorageRef, TorchError> {
            NoStorages.load(o, pid)
        }
        fn prunes(&self) -> bool {
            true
        }
        fn skips_value(&mut self, o: Objects<'_, '_>, parent: ObjId, key: ObjId, _: ObjId) -> bool {
            let skip = o.str_of(parent) == Some("sd") && o.str_of(key) == Some("drop");
            self.skipped += usize::from(skip);
            skip
        }
        fn keeps_item(&mut self, o: Objects<'_, '_>, parent: ObjId, key: ObjId, _: ObjId) -> bool {
            !(o.str_of(parent) == Some("sd") && o.str_of(key) == Some("drop"))
        }
    }

    /// The keys of the dict under `sd`, and whether the pickle was pruned.
    fn sd_keys(data: &[u8]) -> (Vec<String>, bool) {
        let mut hooks = DropOne { skipped: 0 };
        let p = unpickle(data, "test", &Limits::default(), &mut hooks).unwrap();
        let root = p.dict_items(p.root).unwrap();
        let sd = root
            .iter()
            .find(|(k, _)| p.str_of(*k) == Some("sd"))
            .unwrap()
            .1;
        let keys = p.dict_items(sd).unwrap().iter();
        let keys = keys
            .map(|&(k, _)| p.str_of(k).unwrap().to_string())
            .collect();
        assert_eq!(hooks.skipped, 1);
        (keys, p.pruned)
    }

    #[test]
    fn pruning_drops_the_items_skipped() {
        COLLECT_AT.with(|c| c.set(0));
        assert_eq!(sd_keys(PRUNED), (vec!["keep".to_string()], true));
        let mut hooks = DropOne { skipped: 0 };
        let p = unpickle(PRUNED, "test", &Limits::default(), &mut hooks).unwrap();
        // Nothing of the value skipped is left: 'a', 0, 'sd', 'keep', [3, 4] and the dicts.
        assert!(p.objects.len() <= 6, "{:?}", p.objects);
    }

    #[test]
    fn pruning_reads_again_whole_when_a_skipped_object_is_reached_again() {
        COLLECT_AT.with(|c| c.set(0));
        // `s` was made inside 'drop' and is read into 'keep': the pass is read again whole,
        // and the tree is the one a plain read gives.
        let (keys, pruned) = sd_keys(SHARED);
        assert_eq!(keys, vec!["drop".to_string(), "keep".to_string()]);
        assert!(!pruned);
        let whole = unpickle(SHARED, "test", &Limits::default(), &mut NoStorages).unwrap();
        let mut hooks = DropOne { skipped: 0 };
        let again = unpickle(SHARED, "test", &Limits::default(), &mut hooks).unwrap();
        assert!(same_tree(&whole, whole.root, &again, again.root));
    }

    thread_local! {
        /// [`min_collect`] in tests: this thread's arena size that triggers reclaiming.
        pub(crate) static COLLECT_AT: Cell<usize> = const { Cell::new(MIN_COLLECT) };
    }

    /// Whether `x` of `a` and `y` of `b` are the same tree (ids may differ; cycles and shared
    /// objects must match).
    fn same_tree(a: &Pickle<'_>, x: ObjId, b: &Pickle<'_>, y: ObjId) -> bool {
        let mut seen = HashSet::new();
        let mut todo = vec![(x, y)];
        while let Some((x, y)) = todo.pop() {
            if !seen.insert((x, y)) {
                continue;
            }
            let (ox, oy) = (a.get(x), b.get(y));
            let (mut cx, mut cy) = (Vec::new(), Vec::new());
            each_child(&ox, |c| cx.push(c));
            each_child(&oy, |c| cy.push(c));
            let flat = |o: &Object<'_>| match o {
                Object::Tuple(_) | Object::List(_) | Object::Set(_) => o.kind().to_string(),
                Object::Dict(d) => format!("dict {} {:?}", d.ordered, d.state.is_some()),
                Object::Placeholder(p) => format!(
                    "{} {} {:?} {:?}",
                    p.global,
                    p.called,
                    p.args.is_some(),
                    p.state.is_some()
                ),
                other => format!("{other:?}"),
            };
            if flat(&ox) != flat(&oy) || cx.len() != cy.len() {
                return false;
            }
            todo.extend(cx.into_iter().zip(cy));
        }
        true
    }

    /// Unpickle `data` with reclaiming before every opcode, and never: the same tree.
    fn check_collect(data: &[u8]) -> bool {
        let run = |at: usize| {
            COLLECT_AT.with(|c| c.set(at));
            let r = unpickle(data, "test", &Limits::default(), &mut NoStorages);
            COLLECT_AT.with(|c| c.set(MIN_COLLECT));
            r
        };
        let (eager, never) = (run(0), run(usize::MAX));
        match (eager, never) {
            (Ok(e), Ok(n)) => {
                assert!(same_tree(&e, e.root, &n, n.root), "{data:?}");
                // Nothing the root does not reach is kept.
                assert!(e.objects.len() <= n.objects.len());
                true
            }
            (Err(e), Err(n)) => {
                assert_eq!(e.to_string(), n.to_string());
                false
            }
            (e, n) => panic!("{:?} vs {:?}", e.map(|p| p.root), n.map(|p| p.root)),
        }
    }

    #[test]
    fn reclaiming_keeps_the_tree() {
        // Shared (memoized) objects, a self-containing list, garbage between, a dict whose
        // keys and values are made and dropped around it, nested tuples, a placeholder with
        // state and items, sets, an OrderedDict rebuilt from a list of pairs.
        let cases: &[&[u8]] = &[
            b"\x80\x02]q\x00(h\x00K\x01X\x01\x00\x00\x00ae.",
            b"\x80\x02}(X\x01\x00\x00\x00aX\x01\x00\x00\x00bX\x01\x00\x00\x00z0X\x01\x00\x00\x00c]q\x01(K\x01K\x02eX\x01\x00\x00\x00dh\x01u.",
            b"\x80\x02((K\x01K\x02t(J\xff\xff\xff\xffNt\x88\x89\x87\x94h\x00h\x00\x86.",
            b"\x80\x02cfoo\nBar\n)\x81}X\x01\x00\x00\x00x]\x94sb(K\x01K\x02e.",
            b"\x80\x04\x8f(K\x01K\x02\x90(\x8c\x01a\x94\x91\x94h\x01\x86.",
            b"\x80\x02ccollections\nOrderedDict\n]X\x01\x00\x00\x00kK\x07\x86a\x85R}b.",
            b"\x80\x02]q\x00(h\x00h\x00e]q\x01h\x00a2\x86.",
        ];
        for c in cases {
            assert!(check_collect(c), "{c:?} does not unpickle");
        }
        // A long run of garbage, with a shared object kept across many reclaims.
        let mut big = b"\x80\x02]q\x00".to_vec();
        for i in 0..5000u32 {
            big.extend_from_slice(b"(X\x03\x00\x00\x00abcJ");
            big.extend_from_slice(&(i as i32 - 2500).to_le_bytes());
            big.extend_from_slice(b"t0h\x00(J\xfe\xff\xff\xff\x85e");
        }
        big.push(b'.');
        assert!(check_collect(&big));
    }

    #[test]
    fn long_strs_are_checked_in_chunks() {
        struct Released(usize);
        impl Storages for Released {
            fn load(&mut self, o: Objects<'_, '_>, p: ObjId) -> Result<StorageRef, TorchError> {
                NoStorages.load(o, p)
            }
            fn release(&mut self, bytes: &[u8]) {
                self.0 += bytes.len();
            }
        }
        let pickle = |text: &[u8]| {
            let mut p = b"\x80\x04\x8d".to_vec();
            p.extend_from_slice(&(text.len() as u64).to_le_bytes());
            p.extend_from_slice(text);
            p.push(b'.');
            p
        };
        // "é" (2 bytes) cut by the first chunk's end, and a 4-byte character at the very end.
        let mut text = vec![b'a'; RELEASE_CHUNK - 1];
        text.extend_from_slice("é".as_bytes());
        text.extend_from_slice(&vec![b'b'; RELEASE_CHUNK]);
        text.extend_from_slice("😀".as_bytes());
        let data = pickle(&text);
        let mut released = Released(0);
        let p = unpickle(&data, "test", &Limits::default(), &mut released).unwrap();
        assert_eq!(p.str_of(p.root).map(str::as_bytes), Some(&text[..]));
        // The str once checked, then the pickle behind STOP (opcode, length and str).
        assert_eq!(released.0, text.len() + (3 + 8 + text.len()));
        // A bad byte anywhere is refused, as in a short str; so is a cut character at the end.
        for at in [0, RELEASE_CHUNK - 1, RELEASE_CHUNK, text.len() - 1] {
            let mut bad = text.clone();
            bad[at] = 0xff;
            let bad = pickle(&bad);
            let e = unpickle(&bad, "test", &Limits::default(), &mut NoStorages);
            assert!(matches!(
                e,
                Err(TorchError::Pickle {
                    problem: PickleProblem::BadText { .. },
                    ..
                })
            ));
        }
        let cut = &text[..text.len() - 1];
        let cut = pickle(cut);
        let e = unpickle(&cut, "test", &Limits::default(), &mut NoStorages);
        assert!(e.is_err());
    }

    #[test]
    fn reclaiming_keeps_every_fixture() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch");
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name.ends_with(".json") || name.ends_with(".py") {
                continue;
            }
            let bytes = std::fs::read(&path).unwrap();
            let read = |at: usize| {
                COLLECT_AT.with(|c| c.set(at));
                let r = crate::torch::read(&bytes, &Limits::default());
                COLLECT_AT.with(|c| c.set(MIN_COLLECT));
                r
            };
            match (read(0), read(usize::MAX)) {
                (Ok(e), Ok(v)) => {
                    assert!(same_tree(
                        &e.pickle,
                        e.pickle.root,
                        &v.pickle,
                        v.pickle.root
                    ));
                    assert_eq!(e.tensors, v.tensors, "{name}");
                    let (se, sv) = (e.select(None), v.select(None));
                    assert_eq!(format!("{se:?}"), format!("{sv:?}"), "{name}");
                    n += 1;
                }
                (Err(e), Err(v)) => assert_eq!(e.to_string(), v.to_string(), "{name}"),
                (e, v) => panic!("{name}: {:?} vs {:?}", e.is_ok(), v.is_ok()),
            }
        }
        assert!(n >= 10, "{n} fixtures read");
    }

    #[test]
    fn objects_stay_small() {
        // 15 M ints outside the tensors cost this much each (plus 4 bytes of depth).
        assert!(std::mem::size_of::<Object>() <= 24);
    }

    #[test]
    fn longs() {
        assert_eq!(long_from_le(&[]), Object::Int(0));
        assert_eq!(long_from_le(&[0xff]), Object::Int(-1));
        assert_eq!(long_from_le(&[0x80, 0x00]), Object::Int(128));
        let magic = 0x1950a86a20f9469cfc6cu128.to_le_bytes();
        assert!(matches!(long_from_le(&magic[..10]), Object::BigInt(b) if b.len() == 10));
        let mut minus_one = vec![0xff; 20];
        assert_eq!(long_from_le(&minus_one), Object::Int(-1));
        minus_one[0] = 0xfe;
        assert_eq!(long_from_le(&minus_one), Object::Int(-2));
    }

    #[test]
    fn text_helpers() {
        assert_eq!(unquote("'a\\nb'").unwrap(), b"a\nb");
        assert_eq!(unquote("\"\\x41\"").unwrap(), b"A");
        assert!(unquote("'a").is_none());
        assert_eq!(raw_unicode_unescape("a\\u00e9").unwrap(), "aé");
        assert_eq!(encode("\u{ff}\u{0}", "latin1").unwrap(), vec![0xff, 0]);
        assert!(encode("\u{100}", "latin1").is_none());
    }

    #[test]
    fn resolution() {
        assert!(matches!(
            resolve("collections", "OrderedDict"),
            Resolved::Allowed(Global::OrderedDict)
        ));
        assert!(matches!(
            resolve("__builtin__", "set"),
            Resolved::Allowed(Global::Set)
        ));
        assert!(matches!(resolve("posix", "system"), Resolved::Denied(_)));
        assert!(matches!(resolve("os.path", "join"), Resolved::Denied(_)));
        assert!(matches!(resolve("builtins", "eval"), Resolved::Denied(_)));
        assert!(matches!(
            resolve("__builtin__", "getattr"),
            Resolved::Denied(_)
        ));
        assert!(matches!(
            resolve("numpy.core.multiarray", "_reconstruct"),
            Resolved::Placeholder(_)
        ));
        assert!(matches!(
            resolve("torch", "BFloat16Storage"),
            Resolved::Allowed(Global::StorageClass(t)) if t.name == "bfloat16"
        ));
        assert!(matches!(
            resolve("torch", "float8_e4m3fn"),
            Resolved::Allowed(Global::Dtype(t)) if t.name == "float8_e4m3fn"
        ));
        assert!(matches!(resolve("torch", "load"), Resolved::Placeholder(_)));
    }
}
