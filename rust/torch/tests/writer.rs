//! Test-only writers: a tiny pickler over a value tree, and zip / legacy file builders that
//! lay files out as torch does (stored entries, flag bit 3, zero sizes in local headers,
//! data descriptors, ZIP64 end records).

/// A value to pickle (protocol 2, as `torch.save` writes).
#[derive(Debug, Clone)]
pub enum V {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Tuple(Vec<V>),
    List(Vec<V>),
    Dict(Vec<(V, V)>),
    /// `collections.OrderedDict()` then SETITEMS, then BUILD with the given state.
    Ordered(Vec<(V, V)>, Option<Box<V>>),
    Global(&'static str, &'static str),
    Call(Box<V>, Vec<V>),
    /// A persistent id (BINPERSID) of the given tuple.
    Pid(Vec<V>),
    /// Memoize the value in slot n (BINPUT) after writing it.
    Put(u8, Box<V>),
}

pub fn s(x: &str) -> V {
    V::Str(x.to_string())
}

pub fn ints(xs: &[u64]) -> V {
    V::Tuple(xs.iter().map(|&x| V::Int(x as i64)).collect())
}

pub fn call(m: &'static str, n: &'static str, args: Vec<V>) -> V {
    V::Call(Box::new(V::Global(m, n)), args)
}

/// `_rebuild_tensor_v2(pid, offset, shape, stride, False, OrderedDict())` over a zip storage.
pub fn tensor(
    class: &'static str,
    key: &str,
    numel: u64,
    offset: u64,
    shape: &[u64],
    stride: &[u64],
) -> V {
    call(
        "torch._utils",
        "_rebuild_tensor_v2",
        vec![
            V::Pid(vec![
                s("storage"),
                V::Global("torch", class),
                s(key),
                s("cpu"),
                V::Int(numel as i64),
            ]),
            V::Int(offset as i64),
            ints(shape),
            ints(stride),
            V::Bool(false),
            call("collections", "OrderedDict", vec![]),
        ],
    )
}

/// `_rebuild_tensor_v3(pid(UntypedStorage), offset, shape, stride, False, OrderedDict(), dtype)`.
pub fn tensor_v3(dtype: &'static str, key: &str, nbytes: u64, shape: &[u64], stride: &[u64]) -> V {
    call(
        "torch._utils",
        "_rebuild_tensor_v3",
        vec![
            V::Pid(vec![
                s("storage"),
                V::Global("torch.storage", "UntypedStorage"),
                s(key),
                s("cpu"),
                V::Int(nbytes as i64),
            ]),
            V::Int(0),
            ints(shape),
            ints(stride),
            V::Bool(false),
            call("collections", "OrderedDict", vec![]),
            V::Global("torch", dtype),
        ],
    )
}

fn emit(v: &V, out: &mut Vec<u8>) {
    match v {
        V::None => out.push(b'N'),
        V::Bool(true) => out.push(0x88),
        V::Bool(false) => out.push(0x89),
        V::Int(i) => {
            if let Ok(x) = i32::try_from(*i) {
                out.push(b'J');
                out.extend_from_slice(&x.to_le_bytes());
            } else {
                out.push(0x8a);
                out.push(8);
                out.extend_from_slice(&i.to_le_bytes());
            }
        }
        V::Float(f) => {
            out.push(b'G');
            out.extend_from_slice(&f.to_be_bytes());
        }
        V::Str(x) => {
            out.push(b'X');
            out.extend_from_slice(&(x.len() as u32).to_le_bytes());
            out.extend_from_slice(x.as_bytes());
        }
        V::Tuple(items) => {
            out.push(b'(');
            for i in items {
                emit(i, out);
            }
            out.push(b't');
        }
        V::List(items) => {
            out.push(b']');
            if !items.is_empty() {
                out.push(b'(');
                for i in items {
                    emit(i, out);
                }
                out.push(b'e');
            }
        }
        V::Dict(items) => {
            out.push(b'}');
            setitems(items, out);
        }
        V::Ordered(items, state) => {
            emit(&call("collections", "OrderedDict", vec![]), out);
            setitems(items, out);
            if let Some(state) = state {
                emit(state, out);
                out.push(b'b');
            }
        }
        V::Global(m, n) => {
            out.push(b'c');
            out.extend_from_slice(m.as_bytes());
            out.push(b'\n');
            out.extend_from_slice(n.as_bytes());
            out.push(b'\n');
        }
        V::Call(f, args) => {
            emit(f, out);
            emit(&V::Tuple(args.clone()), out);
            out.push(b'R');
        }
        V::Pid(items) => {
            emit(&V::Tuple(items.clone()), out);
            out.push(b'Q');
        }
        V::Put(n, v) => {
            emit(v, out);
            out.push(b'q');
            out.push(*n);
        }
    }
}

fn setitems(items: &[(V, V)], out: &mut Vec<u8>) {
    if items.is_empty() {
        return;
    }
    out.push(b'(');
    for (k, v) in items {
        emit(k, out);
        emit(v, out);
    }
    out.push(b'u');
}

/// A whole protocol-2 pickle of `v`.
pub fn pickle(v: &V) -> Vec<u8> {
    let mut out = vec![0x80, 2];
    emit(v, &mut out);
    out.push(b'.');
    out
}

/// One zip entry to write.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub data: Vec<u8>,
    /// Compression method written into the headers (the data is stored as given).
    pub method: u16,
    /// Zero bytes left before the local header (to place it past 4 GiB in a sparse file).
    pub gap: u64,
    /// A header offset for the central directory to claim instead of the real one.
    pub claim: Option<u64>,
}

pub fn entry(name: &str, data: &[u8]) -> Entry {
    Entry {
        name: name.to_string(),
        data: data.to_vec(),
        method: 0,
        gap: 0,
        claim: None,
    }
}

/// A laid-out file: pieces at offsets, with zeros between them, `len` bytes in all.
pub struct Layout {
    pub pieces: Vec<(u64, Vec<u8>)>,
    pub len: u64,
}

impl Layout {
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len as usize];
        for (at, b) in &self.pieces {
            v[*at as usize..*at as usize + b.len()].copy_from_slice(b);
        }
        v
    }
}

fn u16le(v: &mut Vec<u8>, x: u16) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn u32le(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn u64le(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

/// Lay out a zip archive as torch does: data aligned to 64 bytes by an extra field, local
/// headers with zero sizes and a data descriptor, a central directory (with ZIP64 extra
/// fields where needed), a ZIP64 end record and locator, and the classic end record.
pub fn zip(entries: &[Entry]) -> Layout {
    let mut pieces = Vec::new();
    let mut pos = 0u64;
    let mut central = Vec::new();
    for e in entries {
        pos += e.gap;
        let header = pos;
        let mut local = Vec::new();
        u32le(&mut local, 0x0403_4b50);
        u16le(&mut local, 45);
        u16le(&mut local, 0x0808);
        u16le(&mut local, e.method);
        u32le(&mut local, 0); // time, date
        u32le(&mut local, 0); // crc
        u32le(&mut local, 0); // sizes (flag bit 3)
        u32le(&mut local, 0);
        u16le(&mut local, e.name.len() as u16);
        // Pad the data to 64 bytes with an "FB" extra field, as torch does.
        let unpadded = header + 30 + e.name.len() as u64 + 4;
        let pad = ((64 - unpadded % 64) % 64) as u16;
        u16le(&mut local, 4 + pad);
        local.extend_from_slice(e.name.as_bytes());
        u16le(&mut local, 0x4246);
        u16le(&mut local, pad);
        local.extend(std::iter::repeat_n(b'Z', pad as usize));
        local.extend_from_slice(&e.data);
        // Data descriptor (zip64 form).
        u32le(&mut local, 0x0807_4b50);
        u32le(&mut local, 0);
        u64le(&mut local, e.data.len() as u64);
        u64le(&mut local, e.data.len() as u64);
        pos += local.len() as u64;
        pieces.push((header, local));

        let size = e.data.len() as u64;
        let header = e.claim.unwrap_or(header);
        let big = header >= 0xffff_ffff || size >= 0xffff_ffff;
        let mut c = Vec::new();
        u32le(&mut c, 0x0201_4b50);
        u16le(&mut c, 0x031e);
        u16le(&mut c, 45);
        u16le(&mut c, 0x0808);
        u16le(&mut c, e.method);
        u32le(&mut c, 0);
        u32le(&mut c, 0);
        let small = |x: u64| if big { 0xffff_ffff } else { x as u32 };
        u32le(&mut c, small(size));
        u32le(&mut c, small(size));
        u16le(&mut c, e.name.len() as u16);
        u16le(&mut c, if big { 28 } else { 0 });
        u16le(&mut c, 0); // comment
        u16le(&mut c, 0); // disk
        u16le(&mut c, 0); // internal attributes
        u32le(&mut c, 0); // external attributes
        u32le(&mut c, small(header));
        c.extend_from_slice(e.name.as_bytes());
        if big {
            u16le(&mut c, 1);
            u16le(&mut c, 24);
            u64le(&mut c, size);
            u64le(&mut c, size);
            u64le(&mut c, header);
        }
        central.extend_from_slice(&c);
    }
    let cd_offset = pos;
    let cd_size = central.len() as u64;
    let n = entries.len() as u64;
    let mut tail = central;
    let z64 = cd_offset + cd_size;
    u32le(&mut tail, 0x0606_4b50);
    u64le(&mut tail, 44);
    u16le(&mut tail, 0x031e);
    u16le(&mut tail, 45);
    u32le(&mut tail, 0);
    u32le(&mut tail, 0);
    u64le(&mut tail, n);
    u64le(&mut tail, n);
    u64le(&mut tail, cd_size);
    u64le(&mut tail, cd_offset);
    u32le(&mut tail, 0x0706_4b50);
    u32le(&mut tail, 0);
    u64le(&mut tail, z64);
    u32le(&mut tail, 1);
    u32le(&mut tail, 0x0605_4b50);
    u16le(&mut tail, 0);
    u16le(&mut tail, 0);
    let cap16 = |x: u64| x.min(0xffff) as u16;
    let cap32 = |x: u64| x.min(0xffff_ffff) as u32;
    u16le(&mut tail, cap16(n));
    u16le(&mut tail, cap16(n));
    u32le(&mut tail, cap32(cd_size));
    u32le(&mut tail, cap32(cd_offset));
    u16le(&mut tail, 0);
    let len = cd_offset + tail.len() as u64;
    pieces.push((cd_offset, tail));
    Layout { pieces, len }
}

/// A torch zip checkpoint: `PREFIX/data.pkl`, `PREFIX/byteorder`, `PREFIX/data/KEY`...
pub fn torch_zip(
    prefix: &str,
    pkl: &[u8],
    storages: &[(&str, Vec<u8>)],
    byteorder: &str,
) -> Vec<u8> {
    let mut entries = vec![
        entry(&format!("{prefix}/data.pkl"), pkl),
        entry(&format!("{prefix}/byteorder"), byteorder.as_bytes()),
    ];
    for (key, data) in storages {
        entries.push(entry(&format!("{prefix}/data/{key}"), data));
    }
    entries.push(entry(&format!("{prefix}/version"), b"3\n"));
    zip(&entries).to_vec()
}

/// A legacy checkpoint: the five pickles, then each storage's count and bytes.
/// `storages`: (key, element count, bytes) in the order written.
pub fn legacy(main: &[u8], storages: &[(&str, u64, Vec<u8>)], little_endian: bool) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&[0x80, 2, 0x8a, 10]);
    out.extend_from_slice(&crate::torch::legacy::MAGIC);
    out.push(b'.');
    out.extend_from_slice(&pickle(&V::Int(1001)));
    out.extend_from_slice(&pickle(&V::Dict(vec![
        (s("protocol_version"), V::Int(1001)),
        (s("little_endian"), V::Bool(little_endian)),
        (
            s("type_sizes"),
            V::Dict(vec![
                (s("short"), V::Int(2)),
                (s("int"), V::Int(4)),
                (s("long"), V::Int(4)),
            ]),
        ),
    ])));
    out.extend_from_slice(main);
    out.extend_from_slice(&pickle(&V::List(
        storages.iter().map(|(k, _, _)| s(k)).collect(),
    )));
    for (_, count, data) in storages {
        if little_endian {
            out.extend_from_slice(&count.to_le_bytes());
        } else {
            out.extend_from_slice(&count.to_be_bytes());
        }
        out.extend_from_slice(data);
    }
    out
}

/// A legacy persistent id tensor: `_rebuild_tensor_v2(('storage', cls, key, 'cpu', numel,
/// view), offset, shape, stride, False, OrderedDict())`.
pub fn legacy_tensor(
    class: &'static str,
    key: &str,
    numel: u64,
    view: Option<(&str, u64, u64)>,
    offset: u64,
    shape: &[u64],
    stride: &[u64],
) -> V {
    let view = match view {
        None => V::None,
        Some((k, o, n)) => V::Tuple(vec![s(k), V::Int(o as i64), V::Int(n as i64)]),
    };
    call(
        "torch._utils",
        "_rebuild_tensor_v2",
        vec![
            V::Pid(vec![
                s("storage"),
                V::Global("torch", class),
                s(key),
                s("cpu"),
                V::Int(numel as i64),
                view,
            ]),
            V::Int(offset as i64),
            ints(shape),
            ints(stride),
            V::Bool(false),
            call("collections", "OrderedDict", vec![]),
        ],
    )
}
