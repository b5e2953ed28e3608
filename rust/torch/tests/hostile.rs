//! Hostile and broken inputs: each is refused with a clear error, and nothing is executed
//! (nothing can be: the reader has no way to call anything).

use super::generated::{f32s, read_ok};
use super::writer::*;
use crate::torch::*;

fn zipped(v: &V, storages: &[(&str, Vec<u8>)]) -> Vec<u8> {
    torch_zip("archive", &pickle(v), storages, "little")
}

fn read_err(bytes: &[u8]) -> TorchError {
    read(bytes, &Limits::default()).expect_err("read should fail")
}

fn select_err(bytes: &[u8]) -> TorchError {
    read_ok(bytes).select(None).expect_err("select should fail")
}

/// A pickle (raw bytes, PROTO 2 and STOP added) in a zip with one float storage.
fn raw_zip(ops: &[u8]) -> Vec<u8> {
    let mut p = vec![0x80, 2];
    p.extend_from_slice(ops);
    p.push(b'.');
    torch_zip("archive", &p, &[("0", f32s(&[1., 2.]))], "little")
}

fn w() -> V {
    tensor("FloatStorage", "0", 2, 0, &[2], &[1])
}

#[test]
fn system_calls_are_refused() {
    let v = V::Dict(vec![
        (s("w"), w()),
        (s("x"), call("posix", "system", vec![s("touch /tmp/pwned")])),
    ]);
    let err = read_err(&zipped(&v, &[("0", f32s(&[1., 2.]))]));
    assert_eq!(
        err.to_string(),
        "refusing to load: the pickle calls posix.system"
    );
    // Also when the call is tucked away somewhere no selection would look.
    let v = V::Dict(vec![
        (s("state_dict"), V::Dict(vec![(s("w"), w())])),
        (
            s("junk"),
            V::List(vec![call("os", "system", vec![s("id")])]),
        ),
    ]);
    assert_eq!(
        read_err(&zipped(&v, &[("0", f32s(&[1., 2.]))])).to_string(),
        "refusing to load: the pickle calls os.system"
    );
    // A mere reference is refused too.
    let v = V::Dict(vec![(s("f"), V::Global("subprocess", "Popen"))]);
    assert_eq!(
        read_err(&zipped(&v, &[])).to_string(),
        "refusing to load: the pickle refers to subprocess.Popen"
    );
    // Protocol-2 names are mapped first.
    let v = call("__builtin__", "eval", vec![s("__import__('os')")]);
    assert_eq!(
        read_err(&zipped(&v, &[])).to_string(),
        "refusing to load: the pickle calls builtins.eval"
    );
    let v = call("builtins", "exec", vec![s("1")]);
    assert!(matches!(
        read_err(&zipped(&v, &[])),
        TorchError::Denied { called: true, .. }
    ));
}

#[test]
fn getattr_chains_are_refused() {
    // getattr(torch._utils._rebuild_tensor_v2, "__globals__")["os"].system("id")
    let g = call(
        "builtins",
        "getattr",
        vec![
            V::Global("torch._utils", "_rebuild_tensor_v2"),
            s("__globals__"),
        ],
    );
    let v = V::Call(Box::new(g), vec![s("id")]);
    assert_eq!(
        read_err(&zipped(&v, &[])).to_string(),
        "refusing to load: the pickle calls builtins.getattr"
    );
    // STACK_GLOBAL spelling of the same.
    let mut ops = Vec::new();
    for x in ["builtins", "getattr"] {
        ops.push(0x8c);
        ops.push(x.len() as u8);
        ops.extend_from_slice(x.as_bytes());
    }
    ops.extend_from_slice(&[0x93, b'N', b'X', 1, 0, 0, 0, b'x', 0x86, b'R']);
    assert_eq!(
        read_err(&raw_zip(&ops)).to_string(),
        "refusing to load: the pickle calls builtins.getattr"
    );
}

#[test]
fn reduce_ex_tricks_stay_inert() {
    // copyreg._reconstructor(cls, object, None), then BUILD with a __reduce_ex__ in its state:
    // an object of an unlisted class. Inert; refused when it stands among the tensors.
    let obj = call(
        "copy_reg",
        "_reconstructor",
        vec![
            V::Global("evil", "Thing"),
            V::Global("__builtin__", "object"),
            V::None,
        ],
    );
    let mut b = pickle(&V::Dict(vec![(s("w"), w()), (s("x"), obj)]));
    // Drop SETITEMS and STOP, and BUILD the object before SETITEMS.
    b.truncate(b.len() - 2);
    b.extend_from_slice(&pickle_fragment(&V::Dict(vec![(
        s("__reduce_ex__"),
        s("os.system"),
    )])));
    b.extend_from_slice(b"bu.");
    let bytes = torch_zip("archive", &b, &[("0", f32s(&[1., 2.]))], "little");
    let ck = read_ok(&bytes);
    assert_eq!(
        ck.placeholders,
        ["copyreg._reconstructor", "evil.Thing", "builtins.object"]
    );
    assert_eq!(
        ck.select(None).unwrap_err().to_string(),
        "refusing to load: entry `x` is built by copyreg._reconstructor, which is not on the allow-list"
    );
    // Calling something that is not callable.
    let v = V::Call(Box::new(s("os.system")), vec![]);
    assert!(read_err(&zipped(&v, &[]))
        .to_string()
        .contains("REDUCE expects a callable, found a str"));
}

/// The opcodes of `v` without PROTO and STOP.
fn pickle_fragment(v: &V) -> Vec<u8> {
    let p = pickle(v);
    p[2..p.len() - 1].to_vec()
}

#[test]
fn placeholders_that_build_tensors_are_refused() {
    let pid = V::Pid(vec![
        s("storage"),
        V::Global("torch", "FloatStorage"),
        s("0"),
        s("cpu"),
        V::Int(2),
    ]);
    let data = [("0", f32s(&[1., 2.]))];
    // An unlisted rebuild function.
    let v = V::Dict(vec![(s("w"), call("evil", "rebuild", vec![pid.clone()]))]);
    assert_eq!(
        select_err(&zipped(&v, &data)).to_string(),
        "tensor `w`: refusing to load: the pickle calls evil.rebuild to build it"
    );
    // An allowed rebuild function fed by an unlisted one.
    let v = V::Dict(vec![(
        s("w"),
        call(
            "torch._utils",
            "_rebuild_parameter",
            vec![call("evil", "make", vec![]), V::Bool(false), V::None],
        ),
    )]);
    assert_eq!(
        select_err(&zipped(&v, &data)).to_string(),
        "tensor `w`: refusing to load: the pickle calls evil.make to build it"
    );
    let v = V::Dict(vec![(
        s("w"),
        call(
            "torch._utils",
            "_rebuild_tensor_v2",
            vec![
                pid.clone(),
                V::Int(0),
                ints(&[2]),
                call("evil", "stride", vec![]),
                V::Bool(false),
                V::None,
            ],
        ),
    )]);
    assert_eq!(
        select_err(&zipped(&v, &data)).to_string(),
        "tensor `w`: refusing to load: the pickle calls evil.stride to build it"
    );
    // A tensor subclass.
    let v = V::Dict(vec![(
        s("w"),
        call(
            "torch._tensor",
            "_rebuild_from_type_v2",
            vec![
                V::Global("torch._utils", "_rebuild_tensor_v2"),
                V::Global("evil", "Tensor"),
                V::Tuple(vec![]),
                V::None,
            ],
        ),
    )]);
    assert_eq!(
        select_err(&zipped(&v, &data)).to_string(),
        "tensor `w`: refusing to load: it is an instance of the tensor subclass evil.Tensor"
    );
    // The conj bit: the bytes are not the values.
    let v = V::Dict(vec![(
        s("w"),
        call(
            "torch._utils",
            "_rebuild_tensor_v2",
            vec![
                pid,
                V::Int(0),
                ints(&[1]),
                ints(&[1]),
                V::Bool(false),
                V::None,
                V::Dict(vec![(s("conj"), V::Bool(true))]),
            ],
        ),
    )]);
    assert_eq!(
        select_err(&zipped(&v, &data)).to_string(),
        "tensor `w`: has the conj bit set, so its stored numbers are not its values"
    );
    // Unsupported tensor kinds, by their allowed rebuild functions.
    let v = V::Dict(vec![(
        s("w"),
        call("torch._utils", "_rebuild_sparse_tensor", vec![]),
    )]);
    assert_eq!(
        select_err(&zipped(&v, &data)).to_string(),
        "tensor `w`: is a sparse tensor, which safetensors cannot hold"
    );
}

#[test]
fn build_only_on_ordered_dicts_tensors_and_unlisted_objects() {
    let cases: &[(&[u8], &str)] = &[
        (b"}}b", "BUILD on a dict"),
        (b"]}b", "BUILD on a list"),
        (
            b"ctorch._utils\n_rebuild_tensor_v2\n}b",
            "BUILD on an allowed global",
        ),
        (b"cevil\nThing\n}b", "BUILD on an unlisted global"),
    ];
    for (ops, want) in cases {
        let err = read_err(&raw_zip(ops));
        assert!(err.to_string().contains(want), "{err}");
        assert!(matches!(
            err,
            TorchError::Pickle {
                problem: PickleProblem::Build { .. },
                ..
            }
        ));
    }
    // A tensor with a tuple state (legacy `set_`) would change its data: refused.
    let mut b = pickle(&w());
    b.pop();
    b.extend_from_slice(&pickle_fragment(&V::Tuple(vec![V::Int(1)])));
    b.extend_from_slice(b"b.");
    let err = read_err(&torch_zip(
        "archive",
        &b,
        &[("0", f32s(&[1., 2.]))],
        "little",
    ));
    assert!(
        err.to_string()
            .contains("BUILD on a tensor with a tuple as state"),
        "{err}"
    );
    // BUILD on a denied object is reported as the call it is.
    let err = read_err(&raw_zip(b"cposix\nsystem\n}b"));
    assert_eq!(
        err.to_string(),
        "refusing to load: the pickle calls posix.system"
    );
}

#[test]
fn forbidden_opcodes() {
    for (ops, name) in [
        (&b"(iposix\nsystem\n"[..], "INST"),
        (b"(cposix\nsystem\no", "OBJ"),
        (b"\x82\x01", "EXT1"),
        (b"\x83\x01\x00", "EXT2"),
        (b"\x84\x01\x00\x00\x00", "EXT4"),
        (b"P0\n", "PERSID"),
        (b"\x97", "NEXT_BUFFER"),
    ] {
        let err = read_err(&raw_zip(ops));
        assert!(
            matches!(&err, TorchError::Pickle { problem: PickleProblem::Forbidden { op }, .. } if *op == name),
            "{name}: {err}"
        );
        assert!(
            err.to_string()
                .ends_with(&format!("opcode {name} is not allowed")),
            "{err}"
        );
    }
}

#[test]
fn bad_persistent_ids() {
    let v = V::Dict(vec![(
        s("w"),
        tensor("FloatStorage", "5", 2, 0, &[2], &[1]),
    )]);
    assert_eq!(
        read_err(&zipped(&v, &[("0", f32s(&[1., 2.]))])).to_string(),
        "a tensor uses storage `5`, but the file has no entry `archive/data/5`"
    );
    let v = V::Dict(vec![(
        s("w"),
        tensor("FloatStorage", "0", 100, 0, &[2], &[1]),
    )]);
    assert_eq!(
        read_err(&zipped(&v, &[("0", f32s(&[1., 2.]))])).to_string(),
        "storage `0` needs 400 bytes but the file holds 8"
    );
    let v = V::Pid(vec![s("module"), s("os")]);
    let err = read_err(&zipped(&v, &[]));
    assert!(
        err.to_string()
            .contains("persistent id is not a storage: a tuple of 2 items"),
        "{err}"
    );
    let v = V::Pid(vec![s("module"), s("os"), s("x"), s("y"), V::Int(0)]);
    let err = read_err(&zipped(&v, &[]));
    assert!(
        err.to_string().contains("its first item is not `storage`"),
        "{err}"
    );
    let v = V::Pid(vec![
        s("storage"),
        V::Global("evil", "Storage"),
        s("0"),
        s("cpu"),
        V::Int(0),
    ]);
    let err = read_err(&zipped(&v, &[]));
    assert!(
        err.to_string()
            .contains("its storage type is an unlisted global"),
        "{err}"
    );
    let v = V::Pid(vec![V::Int(3)]);
    assert!(matches!(
        read_err(&zipped(&V::Dict(vec![(s("x"), v)]), &[])),
        TorchError::Pickle {
            problem: PickleProblem::PersistentId { .. },
            ..
        }
    ));
}

fn storage_entry(method: u16, name: &str) -> Vec<u8> {
    let pkl = pickle(&V::Dict(vec![(s("w"), w())]));
    let mut e = entry(name, &f32s(&[1., 2.]));
    e.method = method;
    zip(&[entry("archive/data.pkl", &pkl), e]).to_vec()
}

#[test]
fn torchscript_archives_are_named() {
    // torch.jit.save: data.pkl beside constants.pkl and deflated code/ entries.
    let pkl = pickle(&V::Dict(vec![(s("w"), w())]));
    let mut code = entry("m/code/__torch__/m.py", b"class M: ...");
    code.method = 8;
    let bytes = zip(&[
        entry("m/data.pkl", &pkl),
        code,
        entry("m/constants.pkl", &pickle(&V::Tuple(vec![]))),
        entry("m/data/0", &f32s(&[1., 2.])),
    ])
    .to_vec();
    assert_eq!(sniff(&bytes), Format::TorchScript);
    assert_eq!(
        read_err(&bytes).to_string(),
        "this is a TorchScript archive (torch.jit.save: get a state dict with \
         `torch.save(torch.jit.load(path).state_dict(), 'model.pt')`), not a PyTorch checkpoint"
    );
}

#[test]
fn integers_wider_than_64_bits_are_too_large() {
    // 2**100 as LONG1: 13 bytes, little-endian.
    let mut big = vec![0u8; 13];
    big[12] = 0x10;
    let mut ops = Vec::new();
    ops.extend_from_slice(b"}X\x01\x00\x00\x00w");
    ops.extend_from_slice(b"ctorch._utils\n_rebuild_tensor_v2\n(");
    ops.extend_from_slice(b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQ");
    ops.extend_from_slice(&[0x8a, 13]);
    ops.extend_from_slice(&big);
    ops.extend_from_slice(b"(K\x02t(K\x01t\x89NtRs");
    let err = select_err(&raw_zip(&ops)).to_string();
    assert_eq!(
        err,
        "tensor `w`: malformed call to torch._utils._rebuild_tensor_v2: its offset is too \
         large: an integer wider than 64 bits"
    );
}

#[test]
fn zip_bombs_slips_and_duplicates() {
    assert_eq!(
        read_err(&storage_entry(8, "archive/data/0")).to_string(),
        "zip entry `archive/data/0` is compressed (method 8); its data is read in place, so \
         it must be stored, as torch.save writes it"
    );
    // Entries the reader never maps may be compressed (a re-zipped `.format_version`, a
    // TorchScript archive's `code/`); data.pkl and byteorder may not.
    let pkl = pickle(&V::Dict(vec![(s("w"), w())]));
    let mut fv = entry("archive/.format_version", b"1");
    fv.method = 8;
    let ok = zip(&[
        entry("archive/data.pkl", &pkl),
        fv,
        entry("archive/data/0", &f32s(&[1., 2.])),
    ])
    .to_vec();
    assert_eq!(read_ok(&ok).select(None).unwrap().tensors.len(), 1);
    for name in ["archive/data.pkl", "archive/byteorder"] {
        let mut entries = vec![
            entry("archive/data.pkl", &pkl),
            entry("archive/byteorder", b"little"),
            entry("archive/data/0", &f32s(&[1., 2.])),
        ];
        entries.iter_mut().find(|e| e.name == name).unwrap().method = 8;
        let err = read_err(&zip(&entries).to_vec()).to_string();
        assert!(
            err.starts_with(&format!("zip entry `{name}` is compressed (method 8)")),
            "{err}"
        );
    }
    for name in ["archive/../../etc/passwd", "/etc/passwd", "..", "C:\\x"] {
        assert_eq!(
            read_err(&storage_entry(0, name)),
            TorchError::ZipUnsafeName { entry: name.into() }
        );
    }
    let pkl = pickle(&V::Dict(vec![]));
    let dup = zip(&[
        entry("archive/data.pkl", &pkl),
        entry("archive/x", b"1"),
        entry("archive/x", b"2"),
    ])
    .to_vec();
    assert_eq!(
        read_err(&dup).to_string(),
        "zip entry `archive/x` appears more than once"
    );
    let two = zip(&[entry("a/data.pkl", &pkl), entry("b/data.pkl", &pkl)]).to_vec();
    assert_eq!(
        read_err(&two).to_string(),
        "the zip archive has two pickles, `a/data.pkl` and `b/data.pkl`; expected one"
    );
}

#[test]
fn overlapping_entries() {
    // Entry `a`'s data holds a whole local header and data for entry `b`, which the central
    // directory points at: two entries sharing bytes.
    let mut inner = Vec::new();
    inner.extend_from_slice(b"PK\x03\x04");
    inner.extend_from_slice(&[0; 22]);
    inner.extend_from_slice(&(1u16).to_le_bytes());
    inner.extend_from_slice(&0u16.to_le_bytes());
    inner.push(b'b');
    inner.extend_from_slice(b"data");
    let pkl = pickle(&V::Dict(vec![]));
    let mut b = entry("b", b"data");
    b.claim = Some(64); // the first entry's data starts at 64
    let bytes = zip(&[entry("a", &inner), b, entry("archive/data.pkl", &pkl)]).to_vec();
    assert_eq!(
        read_err(&bytes).to_string(),
        "zip entry `b` overlaps entry `a`"
    );
}

/// Rewrite the end records' entry count and directory size (classic fields to the ZIP64
/// sentinels, ZIP64 fields to the values).
fn patch_end(bytes: &mut [u8], entries: Option<u64>, cd_size: Option<u64>) {
    let z = bytes.windows(4).rposition(|w| w == b"PK\x06\x06").unwrap();
    let e = bytes.windows(4).rposition(|w| w == b"PK\x05\x06").unwrap();
    if let Some(n) = entries {
        bytes[z + 24..z + 32].copy_from_slice(&n.to_le_bytes());
        bytes[z + 32..z + 40].copy_from_slice(&n.to_le_bytes());
        bytes[e + 8..e + 12].copy_from_slice(&[0xff; 4]);
    }
    if let Some(n) = cd_size {
        bytes[z + 40..z + 48].copy_from_slice(&n.to_le_bytes());
        bytes[e + 12..e + 16].copy_from_slice(&[0xff; 4]);
    }
}

#[test]
fn directories_that_do_not_fit() {
    let good = zipped(&V::Dict(vec![]), &[]);
    let mut b = good.clone();
    patch_end(&mut b, Some(1 << 40), None);
    assert!(read_err(&b)
        .to_string()
        .contains("1099511627776 entries cannot fit in"));
    let mut b = good.clone();
    patch_end(&mut b, None, Some(u64::MAX - 4));
    assert!(read_err(&b)
        .to_string()
        .contains("do not fit before the end record"));
    let mut b = good.clone();
    patch_end(&mut b, Some(4), None);
    assert!(
        read_err(&b).to_string().contains("entry 3"),
        "{}",
        read_err(&b)
    );
    // Disagreeing classic and ZIP64 counts.
    let mut b = good.clone();
    let e = b.windows(4).rposition(|w| w == b"PK\x05\x06").unwrap();
    b[e + 10] ^= 1;
    assert!(read_err(&b).to_string().contains("disagree"));
    // Truncated archives.
    assert_eq!(read_err(&good[..good.len() - 1]), TorchError::ZipNoEnd);
    for cut in [10, 100, good.len() / 2] {
        let mut t = good[..cut].to_vec();
        t.extend_from_slice(&good[good.len() - 22..]);
        let _ = read(&t, &Limits::default()).unwrap_err();
    }
}

#[test]
fn views_that_reach_past_their_storage() {
    let data = [("0", f32s(&[0.; 6]))];
    let cases: &[(&[u64], &[u64], u64, &str)] = &[
        (
            &[10],
            &[1],
            0,
            "tensor `w`: its last element is element 9 of a storage that holds 6",
        ),
        (
            &[2, 2],
            &[5, 1],
            0,
            "tensor `w`: its last element is element 6 of a storage that holds 6",
        ),
        (
            &[3],
            &[1],
            4,
            "tensor `w`: its last element is element 6 of a storage that holds 6",
        ),
        (
            &[2],
            &[u64::MAX / 2],
            0,
            "tensor `w`: its last element is element 9223372036854775807 of a storage that holds 6",
        ),
        (
            &[4],
            &[u64::MAX / 2],
            0,
            "tensor `w`: its shape, stride or offset overflows 64 bits",
        ),
        (
            &[1 << 33, 1 << 33],
            &[0, 0],
            0,
            "tensor `w`: its shape, stride or offset overflows 64 bits",
        ),
    ];
    for &(shape, stride, offset, want) in cases {
        let v = V::Dict(vec![(
            s("w"),
            tensor("FloatStorage", "0", 6, offset, shape, stride),
        )]);
        assert_eq!(
            select_err(&zipped(&v, &data)).to_string(),
            want,
            "{shape:?} {stride:?}"
        );
    }
    // A broadcast view with a huge shape but stride 0 is fine (it is valid in torch).
    let v = V::Dict(vec![(
        s("w"),
        tensor("FloatStorage", "0", 6, 0, &[1 << 20, 6], &[0, 1]),
    )]);
    let sel = read_ok(&zipped(&v, &data)).select(None).unwrap();
    assert_eq!(sel.tensors[0].desc.numel(), 6 << 20);
    // Negative numbers and too many dimensions.
    let neg = call(
        "torch._utils",
        "_rebuild_tensor_v2",
        vec![
            V::Pid(vec![
                s("storage"),
                V::Global("torch", "FloatStorage"),
                s("0"),
                s("cpu"),
                V::Int(6),
            ]),
            V::Int(-1),
            ints(&[1]),
            ints(&[1]),
            V::Bool(false),
            V::None,
        ],
    );
    let err = select_err(&zipped(&V::Dict(vec![(s("w"), neg)]), &data));
    assert!(err.to_string().contains("offset -1"), "{err}");
    let many = vec![1u64; 65];
    let v = V::Dict(vec![(
        s("w"),
        tensor("FloatStorage", "0", 6, 0, &many, &many),
    )]);
    assert_eq!(
        select_err(&zipped(&v, &data)).to_string(),
        "tensor `w`: has 65 dimensions, more than the limit of 64"
    );
}

#[test]
fn size_limits() {
    let v = V::Dict(vec![(s("w"), w()), (s("pad"), s(&"x".repeat(200)))]);
    let small = Limits {
        max_pickle_bytes: 100,
        ..Limits::default()
    };
    let err = read(&zipped(&v, &[("0", f32s(&[1., 2.]))]), &small).unwrap_err();
    assert_eq!(
        err.to_string(),
        "data.pkl, byte 0: the pickle is larger than the limit of 100 bytes"
    );
    let bytes = legacy(&pickle(&v), &[], true);
    let err = read(&bytes, &small).unwrap_err();
    assert!(
        err.to_string()
            .contains("larger than the limit of 100 bytes"),
        "{err}"
    );
    // Objects.
    let few = Limits {
        max_objects: 50,
        ..Limits::default()
    };
    let err = read(&raw_zip(&[b']'; 60]), &few).unwrap_err();
    assert!(
        err.to_string()
            .contains("more objects than the limit of 50"),
        "{err}"
    );
    // Integers.
    let mut ops = vec![0x8b];
    ops.extend_from_slice(&100_000u32.to_le_bytes());
    ops.extend(std::iter::repeat_n(1u8, 100_000));
    let err = read_err(&raw_zip(&ops));
    assert!(
        err.to_string()
            .contains("an integer of 100000 bytes is wider than the limit of 1024"),
        "{err}"
    );
    // Strings claiming more bytes than there are.
    let err = read_err(&raw_zip(&[b'X', 0xff, 0xff, 0xff, 0x7f]));
    assert!(
        err.to_string().ends_with("the stream ends before STOP"),
        "{err}"
    );
    // Bytes amplified through the memo: `_codecs.encode` of one memoized string, many times.
    let mut ops = b"X\x00\x00\x10\x00".to_vec();
    ops.extend(std::iter::repeat_n(b'a', 0x10_0000));
    ops.extend_from_slice(b"q\x000c_codecs\nencode\nq\x010");
    for _ in 0..600 {
        ops.extend_from_slice(b"h\x01h\x00X\x06\x00\x00\x00latin1\x86R0");
    }
    ops.push(b'N');
    let limits = Limits {
        max_pickle_bytes: 2 << 20,
        ..Limits::default()
    };
    let err = read(&raw_zip(&ops), &limits).unwrap_err();
    assert!(
        err.to_string()
            .contains("more bytes of strings than the limit"),
        "{err}"
    );
}

#[test]
fn deep_nesting_does_not_overflow_the_stack() {
    const N: usize = 100_000;
    // Nested tuples, one byte a level.
    let mut ops = vec![b'N'];
    ops.extend(std::iter::repeat_n(0x85u8, N));
    let err = read_err(&raw_zip(&ops));
    assert!(
        err.to_string()
            .contains("containers nest deeper than the limit of 1000"),
        "{err}"
    );
    // Nested lists through the memo: the stack stays two deep.
    let mut ops = b"]q\x00".to_vec();
    for _ in 0..N {
        ops.extend_from_slice(b"0]h\x00aq\x00");
    }
    let err = read_err(&raw_zip(&ops));
    assert!(
        err.to_string()
            .contains("containers nest deeper than the limit of 1000"),
        "{err}"
    );
    // Nested dicts, the same way.
    let mut ops = b"}q\x00".to_vec();
    for _ in 0..N {
        ops.extend_from_slice(b"0}X\x01\x00\x00\x00kh\x00sq\x00");
    }
    let err = read_err(&raw_zip(&ops));
    assert!(
        err.to_string()
            .contains("containers nest deeper than the limit of 1000"),
        "{err}"
    );
    // MARKs.
    let err = read_err(&raw_zip(&[b'('; N]));
    assert!(
        err.to_string().contains("deeper than the limit of 1000"),
        "{err}"
    );
    // Nesting made after the fact (a list filled after it was put in another) is not
    // caught while unpickling, but walks are iterative and bounded.
    let mut ops = b"}q\x00".to_vec(); // d0
    for i in 1..=200u8 {
        // d_i = {}; d_{i-1}["k"] = d_i  (each new dict goes into the previous one)
        ops.extend_from_slice(&[
            b'}',
            b'q',
            i,
            b'h',
            i - 1,
            b'X',
            1,
            0,
            0,
            0,
            b'k',
            b'h',
            i,
            b's',
            b'0',
            b'0',
        ]);
    }
    let zip = raw_zip(&ops);
    let ck = read(
        &zip,
        &Limits {
            max_depth: 50,
            ..Limits::default()
        },
    )
    .unwrap();
    assert!(matches!(
        ck.select(Some("")),
        Err(TorchError::WalkTooLarge { .. })
    ));
}

#[test]
fn cycles_and_shared_dicts_are_bounded() {
    // d = {"w": tensor}; d["self"] = d
    let mut b = pickle(&V::Put(0, Box::new(V::Dict(vec![(s("w"), w())]))));
    b.pop();
    b.extend_from_slice(b"X\x04\x00\x00\x00selfh\x00s.");
    let bytes = torch_zip("archive", &b, &[("0", f32s(&[1., 2.]))], "little");
    let ck = read_ok(&bytes);
    assert!(matches!(
        ck.select(None),
        Err(TorchError::WalkTooLarge { .. })
    ));
    assert!(matches!(
        ck.tensor_dicts(),
        Err(TorchError::WalkTooLarge { .. })
    ));
    // d_k = {"a": d_{k-1}, "b": d_{k-1}}: 2^60 paths; the visit budget stops the walk.
    let mut ops = b"}q\x00".to_vec();
    for i in 1..=60u8 {
        ops.extend_from_slice(&[
            b'0',
            b'}',
            b'(',
            b'X',
            1,
            0,
            0,
            0,
            b'a',
            b'h',
            i - 1,
            b'X',
            1,
            0,
            0,
            0,
            b'b',
            b'h',
            i - 1,
            b'u',
            b'q',
            i,
        ]);
    }
    let limits = Limits {
        max_objects: 100_000,
        ..Limits::default()
    };
    let zip = raw_zip(&ops);
    let ck = read(&zip, &limits).unwrap();
    assert!(matches!(
        ck.select(Some("")),
        Err(TorchError::WalkTooLarge { .. })
    ));
    assert!(matches!(
        ck.select(None),
        Err(TorchError::WalkTooLarge { .. })
    ));
}

#[test]
fn malformed_streams() {
    let cases: &[(&[u8], &str)] = &[
        (b"h\x05", "memo slot 5 is read but was never written"),
        (b"R", "REDUCE on a stack too short"),
        (b"(N)R", "REDUCE expects a callable, found None"),
        (b"t", "TUPLE without a MARK"),
        (b"Na", "APPEND on a stack too short"),
        (b"NNa", "APPEND expects a list, found None"),
        (b"(Nu", "SETITEMS on a stack too short"),
        (b"}(Nu", "key-value pairs"),
        (b"\xff", "unknown opcode 0xff"),
        (
            b"X\x02\x00\x00\x00\xff\xfe",
            "BINUNICODE holds text that is not valid",
        ),
        (b"\x80\x06", "protocol 0 to 5"),
        (
            b"ctorch\nfloat32\n)R",
            "call of torch.float32: this reader does not evaluate it",
        ),
        (
            b"ccollections\nOrderedDict\nK\x01\x85R",
            "call of collections.OrderedDict: its argument is an int",
        ),
    ];
    for (ops, want) in cases {
        let err = read_err(&raw_zip(ops));
        assert!(err.to_string().contains(want), "{ops:?}: {err}");
    }
    // No STOP at all.
    let p = [0x80, 2, b'N'];
    let err = read_err(&torch_zip("archive", &p, &[], "little"));
    assert!(
        err.to_string().ends_with("the stream ends before STOP"),
        "{err}"
    );
    // Not a dict at the top.
    let v = call("mymodel", "Net", vec![]);
    assert_eq!(
        select_err(&zipped(&v, &[])).to_string(),
        "the checkpoint's top level is an object of the unlisted class mymodel.Net, not a dict of tensors"
    );
    assert_eq!(
        select_err(&zipped(&V::Dict(vec![]), &[])),
        TorchError::NoTensors
    );
}

#[test]
fn legacy_files_that_lie() {
    let main = pickle(&V::Dict(vec![(
        s("w"),
        legacy_tensor("FloatStorage", "1", 2, None, 0, &[2], &[1]),
    )]));
    let good = legacy(&main, &[("1", 2, f32s(&[1., 2.]))], true);
    read_ok(&good);
    // The count disagrees with the pickle.
    let bad = legacy(&main, &[("1", 3, f32s(&[1., 2., 3.]))], true);
    assert_eq!(
        read_err(&bad).to_string(),
        "legacy storage `1` is recorded with 3 elements, but the pickle says 2"
    );
    // Truncated data.
    assert_eq!(
        read_err(&good[..good.len() - 1]).to_string(),
        "legacy storage `1` needs 8 bytes but only 7 remain in the file"
    );
    // The key list names a storage no tensor uses; or misses one.
    let bad = legacy(&main, &[("1", 2, f32s(&[1., 2.])), ("9", 0, vec![])], true);
    assert!(read_err(&bad)
        .to_string()
        .contains("storage `9`, which no persistent id names"));
    let bad = legacy(&main, &[], true);
    assert!(read_err(&bad)
        .to_string()
        .contains("storage `1` is used by the pickle but not stored"));
    // A view past its storage.
    let v = pickle(&V::Dict(vec![(
        s("w"),
        legacy_tensor("FloatStorage", "1", 2, Some(("2", 1, 2)), 0, &[2], &[1]),
    )]));
    assert_eq!(
        read_err(&legacy(&v, &[("1", 2, f32s(&[1., 2.]))], true)).to_string(),
        "a view of storage `1` ends at byte 12, past its 8 bytes"
    );
    // The header.
    let mut bad = good.clone();
    bad[13] ^= 1;
    assert_eq!(sniff(&bad), Format::Pickle);
    let mut bad = good.clone();
    let at = bad
        .windows(5)
        .position(|w| w == b"J\xe9\x03\x00\x00")
        .unwrap();
    bad[at + 1] = 0xea;
    assert_eq!(
        read_err(&bad).to_string(),
        "legacy torch file header: protocol version 1002, expected 1001"
    );
}

#[test]
fn python2_strings_and_other_opcodes() {
    // SHORT_BINSTRING keys (Python 2 `str`), BININT1/BININT2, protocol-0 INT and the
    // protocol 4 opcodes (FRAME, SHORT_BINUNICODE, STACK_GLOBAL, MEMOIZE).
    let mut p = vec![0x80, 4, 0x95];
    let body_at = p.len();
    p.extend_from_slice(&[0; 8]);
    p.extend_from_slice(b"}\x94(U\x01w");
    let t = pickle_fragment(&w());
    p.extend_from_slice(&t);
    p.extend_from_slice(b"U\x01nK\x07U\x01mM\x00\x01U\x01bI01\n");
    p.extend_from_slice(b"U\x01o\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94");
    p.extend_from_slice(b"u.");
    let n = (p.len() - body_at - 8) as u64;
    p[body_at..body_at + 8].copy_from_slice(&n.to_le_bytes());
    let bytes = torch_zip("archive", &p, &[("0", f32s(&[1., 2.]))], "little");
    let ck = read_ok(&bytes);
    let sel = ck.select(None).unwrap();
    assert_eq!(sel.tensors[0].name, "w");
    assert_eq!(sel.skipped, ["n", "m", "b"]);
}
