//! Checkpoints made by the test writers: formats, dtypes, views, selection, ZIP64.

use safetensors::Dtype;

use super::writer::*;
use crate::torch::*;

pub fn f32s(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn read_ok(bytes: &[u8]) -> Checkpoint<'_> {
    read(bytes, &Limits::default()).unwrap_or_else(|e| panic!("read failed: {e}"))
}

/// All of a tensor's elements, gathered in one go and also element by element.
pub fn gather_all(map: &[u8], t: &TensorDesc) -> Vec<u8> {
    let mut out = vec![0u8; t.nbytes() as usize];
    gather(map, t, 0, &mut out).unwrap();
    let es = t.elem_size() as usize;
    let mut one = vec![0u8; es];
    for i in 0..t.numel() {
        gather(map, t, i, &mut one).unwrap();
        assert_eq!(one, out[i as usize * es..(i as usize + 1) * es]);
    }
    out
}

fn by_name<'a>(sel: &'a Selection, name: &str) -> &'a TensorDesc {
    &sel.tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
        .desc
}

/// `[0, 1, 2, 3, 4, 5]` as float32 storage `0`, and three views of it.
fn views_checkpoint(prefix: &str) -> Vec<u8> {
    let sd = V::Ordered(
        vec![
            (s("a"), tensor("FloatStorage", "0", 6, 0, &[2, 3], &[3, 1])),
            (
                s("a_t"),
                tensor("FloatStorage", "0", 6, 0, &[3, 2], &[1, 3]),
            ),
            (s("slice"), tensor("FloatStorage", "0", 6, 1, &[2], &[2])),
            (s("scalar"), tensor("FloatStorage", "0", 6, 5, &[], &[])),
            (
                s("empty"),
                tensor("FloatStorage", "0", 6, 0, &[0, 3], &[3, 1]),
            ),
        ],
        None,
    );
    torch_zip(
        prefix,
        &pickle(&sd),
        &[("0", f32s(&[0., 1., 2., 3., 4., 5.]))],
        "little",
    )
}

#[test]
fn zip_views_share_one_storage() {
    for prefix in ["archive", "my.model"] {
        let bytes = views_checkpoint(prefix);
        assert_eq!(sniff(&bytes), Format::TorchZip);
        let ck = read_ok(&bytes);
        assert_eq!(ck.prefix.as_deref(), Some(prefix));
        assert_eq!(ck.storages.len(), 1);
        assert!(ck.storages[0].in_zip);
        assert_eq!(ck.storages[0].key, "0");
        let sel = ck.select(None).unwrap();
        assert_eq!(sel.key, "");
        let names: Vec<_> = sel.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "a_t", "slice", "scalar", "empty"]);
        assert!(sel.skipped.is_empty() && sel.placeholders.is_empty());

        let a = by_name(&sel, "a");
        assert_eq!((a.dtype, a.shape.as_slice()), (Dtype::F32, &[2u64, 3][..]));
        assert!(a.is_contiguous());
        let r = a.contiguous_range().unwrap();
        assert_eq!(
            &bytes[r.start as usize..r.end as usize],
            f32s(&[0., 1., 2., 3., 4., 5.])
        );
        assert_eq!(gather_all(&bytes, a), f32s(&[0., 1., 2., 3., 4., 5.]));

        let t = by_name(&sel, "a_t");
        assert!(!t.is_contiguous());
        assert_eq!(t.storage, a.storage);
        assert_eq!(gather_all(&bytes, t), f32s(&[0., 3., 1., 4., 2., 5.]));
        // A window in the middle.
        let mut w = vec![0u8; 12];
        gather(&bytes, t, 2, &mut w).unwrap();
        assert_eq!(w, f32s(&[1., 4., 2.]));

        let sl = by_name(&sel, "slice");
        assert_eq!(sl.storage_offset, 1);
        assert_eq!(gather_all(&bytes, sl), f32s(&[1., 3.]));

        let sc = by_name(&sel, "scalar");
        assert!(sc.shape.is_empty());
        assert_eq!(gather_all(&bytes, sc), f32s(&[5.]));

        let e = by_name(&sel, "empty");
        assert_eq!(e.numel(), 0);
        assert_eq!(gather_all(&bytes, e), Vec::<u8>::new());
    }
}

#[test]
fn every_supported_dtype() {
    // (storage class or dtype, safetensors dtype, element size); typed classes use v2,
    // the others v3 over an untyped storage, as torch writes them.
    let typed: &[(&str, Dtype, u64)] = &[
        ("DoubleStorage", Dtype::F64, 8),
        ("FloatStorage", Dtype::F32, 4),
        ("HalfStorage", Dtype::F16, 2),
        ("BFloat16Storage", Dtype::BF16, 2),
        ("LongStorage", Dtype::I64, 8),
        ("IntStorage", Dtype::I32, 4),
        ("ShortStorage", Dtype::I16, 2),
        ("CharStorage", Dtype::I8, 1),
        ("ByteStorage", Dtype::U8, 1),
        ("BoolStorage", Dtype::BOOL, 1),
        ("ComplexFloatStorage", Dtype::C64, 8),
    ];
    let untyped: &[(&str, Dtype, u64)] = &[
        ("uint16", Dtype::U16, 2),
        ("uint32", Dtype::U32, 4),
        ("uint64", Dtype::U64, 8),
        ("float8_e4m3fn", Dtype::F8_E4M3, 1),
        ("float8_e5m2", Dtype::F8_E5M2, 1),
        ("float8_e8m0fnu", Dtype::F8_E8M0, 1),
        ("float8_e4m3fnuz", Dtype::F8_E4M3FNUZ, 1),
        ("float8_e5m2fnuz", Dtype::F8_E5M2FNUZ, 1),
    ];
    let mut items = Vec::new();
    let mut storages = Vec::new();
    let mut want = Vec::new();
    for (i, &(class, dt, es)) in typed.iter().chain(untyped).enumerate() {
        let key = i.to_string();
        let data: Vec<u8> = (0..3 * es)
            .map(|b| (b as u8).wrapping_mul(7).wrapping_add(i as u8))
            .collect();
        let t = if i < typed.len() {
            tensor(class, &key, 3, 0, &[3], &[1])
        } else {
            tensor_v3(class, &key, 3 * es, &[3], &[1])
        };
        items.push((s(&format!("t{i}")), t));
        want.push((format!("t{i}"), dt, data.clone()));
        storages.push((key, data));
    }
    let st: Vec<(&str, Vec<u8>)> = storages
        .iter()
        .map(|(k, d)| (k.as_str(), d.clone()))
        .collect();
    let bytes = torch_zip("archive", &pickle(&V::Dict(items)), &st, "little");
    let ck = read_ok(&bytes);
    let sel = ck.select(None).unwrap();
    for (name, dt, data) in want {
        let t = by_name(&sel, &name);
        assert_eq!(t.dtype, dt, "{name}");
        assert_eq!(gather_all(&bytes, t), data, "{name}");
    }
}

#[test]
fn unsupported_dtypes_are_named() {
    for (class, v3, dtype) in [
        ("ComplexDoubleStorage", false, "complex128"),
        ("QInt8Storage", false, "qint8"),
        ("complex32", true, "complex32"),
        ("bits8", true, "bits8"),
        ("float4_e2m1fn_x2", true, "float4_e2m1fn_x2"),
    ] {
        let t = if v3 {
            tensor_v3(class, "0", 64, &[2], &[1])
        } else {
            tensor(class, "0", 2, 0, &[2], &[1])
        };
        let sd = V::Dict(vec![(s("w"), t)]);
        let bytes = torch_zip("archive", &pickle(&sd), &[("0", vec![0; 64])], "little");
        let err = read_ok(&bytes).select(None).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("tensor `w`: dtype {dtype} has no safetensors equivalent")
        );
    }
}

#[test]
fn big_endian_zip_is_swapped() {
    let be: Vec<u8> = [1.5f32, -2.0, 3.25]
        .iter()
        .flat_map(|x| x.to_be_bytes())
        .collect();
    let sd = V::Dict(vec![
        (s("w"), tensor("FloatStorage", "0", 3, 0, &[3], &[1])),
        (s("rev"), tensor("FloatStorage", "0", 3, 0, &[2], &[2])),
    ]);
    let bytes = torch_zip("archive", &pickle(&sd), &[("0", be)], "big\n");
    let ck = read_ok(&bytes);
    assert!(ck.storages[0].big_endian);
    let sel = ck.select(None).unwrap();
    let w = by_name(&sel, "w");
    assert!(w.big_endian);
    assert_eq!(gather_all(&bytes, w), f32s(&[1.5, -2.0, 3.25]));
    assert_eq!(gather_all(&bytes, by_name(&sel, "rev")), f32s(&[1.5, 3.25]));
    let bad = torch_zip("archive", &pickle(&sd), &[("0", vec![0; 12])], "middle");
    assert_eq!(
        read(&bad, &Limits::default()).unwrap_err().to_string(),
        "zip entry `archive/byteorder` says byte order `middle`; expected `little` or `big`"
    );
}

fn small_sd() -> (V, Vec<u8>) {
    (
        V::Ordered(
            vec![
                (
                    s("layer.weight"),
                    tensor("FloatStorage", "0", 4, 0, &[2, 2], &[2, 1]),
                ),
                (
                    s("layer.bias"),
                    tensor("FloatStorage", "0", 4, 2, &[2], &[1]),
                ),
            ],
            None,
        ),
        f32s(&[1., 2., 3., 4.]),
    )
}

#[test]
fn nested_checkpoints_select_by_key() {
    let (model, data) = small_sd();
    let ema = V::Ordered(
        vec![(
            s("layer.weight"),
            tensor("FloatStorage", "1", 4, 0, &[4], &[1]),
        )],
        None,
    );
    let ck_v = V::Dict(vec![
        (s("epoch"), V::Int(3)),
        (s("model"), model),
        (s("ema"), ema),
        (s("optimizer"), V::Dict(vec![(s("lr"), V::Float(0.1))])),
    ]);
    let bytes = torch_zip(
        "archive",
        &pickle(&ck_v),
        &[("0", data), ("1", f32s(&[9., 8., 7., 6.]))],
        "little",
    );
    let ck = read_ok(&bytes);
    let dicts = ck.tensor_dicts().unwrap();
    let listed: Vec<_> = dicts
        .iter()
        .map(|d| (d.path.as_str(), d.direct, d.total))
        .collect();
    assert_eq!(listed, [("", 0, 3), ("model", 2, 2), ("ema", 1, 1)]);
    let err = ck.select(None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the checkpoint holds several dicts of tensors: `model` (2 tensors), `ema` (1 tensor); select one with the key option"
    );
    let sel = ck.select(Some("model")).unwrap();
    assert_eq!(sel.key, "model");
    assert_eq!(sel.tensors.len(), 2);
    assert_eq!(
        gather_all(&bytes, by_name(&sel, "layer.bias")),
        f32s(&[3., 4.])
    );
    let sel = ck.select(Some("ema")).unwrap();
    assert_eq!(
        gather_all(&bytes, by_name(&sel, "layer.weight")),
        f32s(&[9., 8., 7., 6.])
    );
    // The top level: everything, flattened, and the non-tensor entries named.
    let sel = ck.select(Some("")).unwrap();
    let names: Vec<_> = sel.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["model.layer.weight", "model.layer.bias", "ema.layer.weight"]
    );
    assert_eq!(sel.skipped, ["epoch", "optimizer.lr"]);
    let err = ck.select(Some("nope")).unwrap_err();
    assert!(matches!(err, TorchError::KeyNotFound { ref candidates, .. } if candidates.len() == 3));
    assert_eq!(
        ck.select(Some("epoch")).unwrap_err().to_string(),
        "key `epoch` names an int, not a dict of tensors"
    );
}

#[test]
fn one_dict_of_tensors_is_chosen_alone() {
    let (model, data) = small_sd();
    let v = V::Dict(vec![
        (s("epoch"), V::Int(1)),
        (
            s("wrapper"),
            V::Dict(vec![(s("state_dict"), model), (s("n"), V::Int(2))]),
        ),
    ]);
    let bytes = torch_zip("archive", &pickle(&v), &[("0", data)], "little");
    let sel = read_ok(&bytes).select(None).unwrap();
    assert_eq!(sel.key, "wrapper.state_dict");
    assert_eq!(sel.tensors.len(), 2);
}

#[test]
fn top_level_state_dict_with_extras() {
    let v = V::Dict(vec![
        (s("w"), tensor("FloatStorage", "0", 2, 0, &[2], &[1])),
        (s("step"), V::Int(5)),
        (s("note"), s("hello")),
    ]);
    let bytes = torch_zip("archive", &pickle(&v), &[("0", f32s(&[1., 2.]))], "little");
    let sel = read_ok(&bytes).select(None).unwrap();
    assert_eq!(sel.key, "");
    assert_eq!(sel.tensors.len(), 1);
    assert_eq!(sel.skipped, ["step", "note"]);
}

#[test]
fn dotted_keys_exact_first_then_split() {
    let t = |_: &str| tensor("FloatStorage", "0", 2, 0, &[2], &[1]);
    let v = V::Dict(vec![
        (s("model.ema"), V::Dict(vec![(s("exact"), t("0"))])),
        (
            s("model"),
            V::Dict(vec![(s("ema"), V::Dict(vec![(s("split"), t("0"))]))]),
        ),
        (
            s("a"),
            V::Dict(vec![(s("b.c"), V::Dict(vec![(s("deep"), t("0"))]))]),
        ),
        (
            s("ints"),
            V::Dict(vec![(V::Int(0), V::Dict(vec![(s("x"), t("0"))]))]),
        ),
    ]);
    let bytes = torch_zip("archive", &pickle(&v), &[("0", f32s(&[1., 2.]))], "little");
    let ck = read_ok(&bytes);
    let names = |key: &str| -> Vec<String> {
        ck.select(Some(key))
            .unwrap()
            .tensors
            .into_iter()
            .map(|t| t.name)
            .collect()
    };
    assert_eq!(names("model.ema"), ["exact"]);
    assert_eq!(names("model"), ["ema.split"]);
    assert_eq!(names("a.b.c"), ["deep"]);
    assert_eq!(names("ints.0"), ["x"]);
}

/// A checkpoint in a file of its own, opened as any input is under `strip`.
fn open_stripped(bytes: &[u8], tag: &str, strip: &[&str]) -> crate::error::Result<Vec<String>> {
    let dir = std::env::temp_dir().join(format!("stcast-strip-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.pt");
    std::fs::write(&path, bytes).unwrap();
    let opts = crate::input::InputOptions {
        strip_prefix: strip.iter().map(|p| p.to_string()).collect(),
        ..Default::default()
    };
    let opened = crate::source::Source::open_any(&path, &opts);
    std::fs::remove_dir_all(&dir).unwrap();
    let source = opened?;
    let warnings = source.warnings().into_iter().map(|w| w.text);
    let names = source.header.tensors.into_iter().map(|t| t.name);
    Ok(names.chain(warnings).collect())
}

#[test]
fn prefixes_are_stripped_in_turn_and_collisions_named() {
    let t = || tensor("FloatStorage", "0", 2, 0, &[2], &[1]);
    let v = V::Dict(vec![
        (s("module._orig_mod.w"), t()),
        (s("_orig_mod.b"), t()),
        (s("c"), t()),
    ]);
    let bytes = torch_zip("archive", &pickle(&v), &[("0", f32s(&[1., 2.]))], "little");
    let names = read_ok(&bytes).select(None).unwrap().tensors;
    let names: Vec<_> = names.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["module._orig_mod.w", "_orig_mod.b", "c"]);
    assert_eq!(
        open_stripped(&bytes, "turn", &["module.", "_orig_mod."]).unwrap(),
        ["w", "b", "c"]
    );
    // The second is tried on what the first left, never before it; one no name starts
    // with (once those before are stripped) warns.
    assert_eq!(
        open_stripped(&bytes, "order", &["_orig_mod.", "module.", "x."]).unwrap(),
        [
            "_orig_mod.w",
            "b",
            "c",
            "{strip_prefix} `x.` matches no tensor name (once the prefixes before are \
             stripped): a typo, or another order?"
        ]
    );

    let v = V::Dict(vec![(s("module.w"), t()), (s("w"), t())]);
    let bytes = torch_zip("archive", &pickle(&v), &[("0", f32s(&[1., 2.]))], "little");
    let err = open_stripped(&bytes, "both", &["module."]).unwrap_err();
    assert!(
        err.to_string()
            .ends_with("tensors `module.w` and `w` would both be named `w`"),
        "{err}"
    );
}

#[test]
fn names_safetensors_cannot_hold_are_refused() {
    let t = || tensor("FloatStorage", "0", 2, 0, &[2], &[1]);
    let err = |v: V| {
        let bytes = torch_zip("archive", &pickle(&v), &[("0", f32s(&[1., 2.]))], "little");
        read_ok(&bytes).select(None).unwrap_err().to_string()
    };
    // `__metadata__` is the header's metadata entry, never a tensor: as named, or once a
    // prefix is stripped.
    let reserved = "its name would be `__metadata__`, which a safetensors header reserves \
                    for the file's metadata";
    assert_eq!(
        err(V::Dict(vec![(s("__metadata__"), t()), (s("x"), t())])),
        format!("tensor `__metadata__`: {reserved}")
    );
    let bytes = torch_zip(
        "archive",
        &pickle(&V::Dict(vec![(s("module.__metadata__"), t())])),
        &[("0", f32s(&[1., 2.]))],
        "little",
    );
    let got = open_stripped(&bytes, "reserved", &["module."]).unwrap_err();
    assert!(
        got.to_string()
            .ends_with(&format!("tensor `module.__metadata__`: {reserved}")),
        "{got}"
    );
    // A key that is neither a str nor an int gives no name to write.
    assert_eq!(
        err(V::Dict(vec![(V::Tuple(vec![s("a")]), t())])),
        "tensor `<a tuple key>`: its dict key is a tuple, not a string: a safetensors file \
         names each tensor by a string"
    );
    assert_eq!(
        err(V::Dict(vec![
            (s("x"), t()),
            (
                s("m"),
                V::Dict(vec![(V::Float(1.5), V::Dict(vec![(s("w"), t())]))])
            )
        ]),),
        "tensor `m.<a float key>.w`: its dict key is a float, not a string: a safetensors \
         file names each tensor by a string"
    );
    // Such keys on entries that are not tensors stay left out, as other non-tensors are.
    let v = V::Dict(vec![(V::Float(1.5), V::Int(3)), (s("w"), t())]);
    let bytes = torch_zip("archive", &pickle(&v), &[("0", f32s(&[1., 2.]))], "little");
    let sel = read_ok(&bytes).select(None).unwrap();
    assert_eq!(sel.tensors.len(), 1);
    assert_eq!(sel.skipped, ["<a float key>"]);
}

#[test]
fn ordered_dict_metadata_parameters_and_helpers() {
    let meta = V::Dict(vec![(
        s("_metadata"),
        V::Ordered(
            vec![(s(""), V::Dict(vec![(s("version"), V::Int(1))]))],
            None,
        ),
    )]);
    let w = tensor("FloatStorage", "0", 2, 0, &[2], &[1]);
    let v = V::Ordered(
        vec![
            (
                s("param"),
                call(
                    "torch._utils",
                    "_rebuild_parameter",
                    vec![w.clone(), V::Bool(true), V::Ordered(vec![], None)],
                ),
            ),
            (
                s("with_state"),
                call(
                    "torch._utils",
                    "_rebuild_parameter_with_state",
                    vec![
                        w.clone(),
                        V::Bool(true),
                        V::Ordered(vec![], None),
                        V::Dict(vec![]),
                    ],
                ),
            ),
            (
                s("subclass_plain"),
                call(
                    "torch._tensor",
                    "_rebuild_from_type_v2",
                    vec![
                        V::Global("torch._utils", "_rebuild_tensor_v2"),
                        V::Global("torch", "Tensor"),
                        V::Tuple(match &w {
                            V::Call(_, a) => a.clone(),
                            _ => unreachable!(),
                        }),
                        V::Dict(vec![]),
                    ],
                ),
            ),
            (s("size"), call("torch", "Size", vec![ints(&[2, 3])])),
            (
                s("set"),
                call("__builtin__", "set", vec![V::List(vec![V::Int(1)])]),
            ),
            (
                s("bytes"),
                call("_codecs", "encode", vec![s("\u{ff}ab"), s("latin1")]),
            ),
            (
                s("complex"),
                call("__builtin__", "complex", vec![V::Float(1.0), V::Float(2.0)]),
            ),
            (
                s("rng"),
                call(
                    "numpy.core.multiarray",
                    "_reconstruct",
                    vec![V::Global("numpy", "ndarray")],
                ),
            ),
        ],
        Some(Box::new(meta)),
    );
    let bytes = torch_zip(
        "archive",
        &pickle(&V::Dict(vec![(s("sd"), v), (s("epoch"), V::Int(1))])),
        &[("0", f32s(&[1., 2.]))],
        "little",
    );
    let ck = read_ok(&bytes);
    assert_eq!(
        ck.placeholders,
        ["numpy.core.multiarray._reconstruct", "numpy.ndarray"]
    );
    // The placeholder is a value of the selected dict: refused, naming it.
    let err = ck.select(None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "refusing to load: entry `rng` is built by numpy.core.multiarray._reconstruct, which is not on the allow-list"
    );
}

#[test]
fn placeholders_elsewhere_are_listed() {
    let (model, data) = small_sd();
    let v = V::Dict(vec![
        (s("state_dict"), model),
        (s("hyper_parameters"), call("argparse", "Namespace", vec![])),
        (
            s("loops"),
            V::List(vec![V::Global("lightning.fabric", "Thing")]),
        ),
    ]);
    let bytes = torch_zip("archive", &pickle(&v), &[("0", data)], "little");
    let sel = read_ok(&bytes).select(None).unwrap();
    assert_eq!(sel.key, "state_dict");
    assert_eq!(
        sel.placeholders,
        ["argparse.Namespace", "lightning.fabric.Thing"]
    );
}

#[test]
fn legacy_files_with_views_and_odd_offsets() {
    // Two storages; the second is read through a legacy view (offset 1, size 2).
    let main = V::Dict(vec![
        (
            s("w"),
            legacy_tensor("FloatStorage", "140", 3, None, 0, &[3], &[1]),
        ),
        (
            s("t"),
            legacy_tensor("FloatStorage", "140", 3, None, 0, &[1, 3], &[1, 1]),
        ),
        (
            s("v"),
            legacy_tensor("ShortStorage", "7", 4, Some(("8", 1, 2)), 0, &[2], &[1]),
        ),
    ]);
    let shorts: Vec<u8> = [10i16, 20, 30, 40]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    for little in [true, false] {
        let bytes = legacy(
            &pickle(&main),
            &[("140", 3, f32s(&[1., 2., 3.])), ("7", 4, shorts.clone())],
            little,
        );
        assert_eq!(sniff(&bytes), Format::TorchLegacy);
        let ck = read_ok(&bytes);
        assert_eq!(ck.format, Format::TorchLegacy);
        let sel = ck.select(None).unwrap();
        assert!(!by_name(&sel, "w").big_endian);
        assert_eq!(gather_all(&bytes, by_name(&sel, "w")), f32s(&[1., 2., 3.]));
        assert_eq!(gather_all(&bytes, by_name(&sel, "t")), f32s(&[1., 2., 3.]));
        let v = by_name(&sel, "v");
        assert_eq!(v.data_len, 4);
        assert_eq!(
            gather_all(&bytes, v),
            [20i16, 30]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn zip64_offsets_past_4_gib_in_a_sparse_file() {
    use std::os::unix::fs::FileExt;
    let sd = V::Dict(vec![(
        s("w"),
        tensor("FloatStorage", "0", 3, 0, &[3], &[1]),
    )]);
    let pkl = pickle(&sd);
    let mut entries = vec![
        entry("archive/data.pkl", &pkl),
        entry("archive/byteorder", b"little"),
    ];
    let mut far = entry("archive/data/0", &f32s(&[7., 8., 9.]));
    far.gap = (9u64 << 29) + 3; // 4.5 GiB and an odd offset
    entries.push(far);
    let layout = zip(&entries);
    assert!(layout.len > 1 << 32);
    let dir = std::env::temp_dir().join(format!("stcast-zip64-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("big.pt");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(layout.len).unwrap();
    for (at, b) in &layout.pieces {
        file.write_all_at(b, *at).unwrap();
    }
    drop(file);
    let file = std::fs::File::open(&path).unwrap();
    // SAFETY: the file is ours, in a private folder, and nothing changes it while mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    let result = std::panic::catch_unwind(|| {
        let ck = read_ok(&map);
        let sel = ck.select(None).unwrap();
        let w = by_name(&sel, "w");
        assert!(w.data_start > 1 << 32);
        assert_eq!(gather_all(&map, w), f32s(&[7., 8., 9.]));
    });
    drop(map);
    std::fs::remove_dir_all(&dir).unwrap();
    result.unwrap();
}

#[test]
fn zip64_offsets_checked_against_the_length() {
    // In memory: the central directory claims, in a ZIP64 extra field, that the storage's
    // header lies at 5 GiB, in a file of a few kilobytes.
    let sd = V::Dict(vec![(
        s("w"),
        tensor("FloatStorage", "0", 1, 0, &[1], &[1]),
    )]);
    let pkl = pickle(&sd);
    let mut far = entry("archive/data/0", &f32s(&[1.]));
    far.claim = Some(5 << 30);
    let bytes = zip(&[entry("archive/data.pkl", &pkl), far]).to_vec();
    let err = read(&bytes, &Limits::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "zip entry `archive/data/0`: its local header at 5368709120 lies outside the file's data"
    );
}

#[test]
fn sniffing() {
    assert_eq!(sniff(b"GGUF\x03\x00\x00\x00"), Format::Gguf);
    assert_eq!(sniff(b"\x93NUMPY\x01\x00"), Format::Npy);
    assert_eq!(sniff(b"  \n<!DOCTYPE html><html>"), Format::Html);
    assert_eq!(sniff(b"<HTML><body>"), Format::Html);
    assert_eq!(sniff(b"\x80\x04\x95"), Format::Pickle);
    assert_eq!(sniff(b""), Format::Empty);
    assert_eq!(sniff(b"hello"), Format::Text);
    assert_eq!(sniff(b"# Model card\n\nWeights in bf16.\n"), Format::Text);
    assert_eq!(
        sniff("\u{feff}  {\"weight_map\": {}}".as_bytes()),
        Format::Json
    );
    assert_eq!(sniff(b"[1, 2]"), Format::Json);
    assert_eq!(sniff(b"  \n\t "), Format::Unknown);
    assert_eq!(sniff(b"ab\x00cdefgh"), Format::Unknown);
    assert_eq!(sniff(b"abc\xff"), Format::Unknown);
    // A character cut at the 1 KiB mark is still text.
    let mut long = vec![b'a'; 1023];
    long.extend_from_slice("\u{e9}\u{e9}".as_bytes());
    assert_eq!(sniff(&long), Format::Text);
    let mut st = 2u64.to_le_bytes().to_vec();
    st.extend_from_slice(b"{}");
    assert_eq!(sniff(&st), Format::Safetensors);
    let npz = zip(&[entry("a.npy", b"\x93NUMPY"), entry("b.npy", b"\x93NUMPY")]).to_vec();
    assert_eq!(sniff(&npz), Format::Npz);
    let other = zip(&[entry("readme.txt", b"hi")]).to_vec();
    assert_eq!(sniff(&other), Format::Zip);
    assert_eq!(
        read(&other, &Limits::default()).unwrap_err(),
        TorchError::ZipNoPickle
    );
    assert_eq!(
        read(b"GGUF\x03\x00\x00\x00", &Limits::default())
            .unwrap_err()
            .to_string(),
        "this is a GGUF file (llama.cpp), not a PyTorch checkpoint"
    );
}
