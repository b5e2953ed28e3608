//! One storage key referenced under several storage classes (issue 23, point A).
//!
//! Every expectation here is what torch 2.15.0 gave for the same file, built the same way
//! and loaded with `torch.load(weights_only=True)` and `weights_only=False` (zip and legacy
//! alike; `tests/fixtures/torch/probe_shared_storage.py` builds and loads them):
//! - each tensor gets the dtype of its own reference, over the same bytes, when the two
//!   references' byte sizes (`numel * element size`) agree: `IntStorage` of 64 then
//!   `FloatStorage` of 64 gives `xi` int32 and `x` float32, bit for bit the same bytes;
//!   `FloatStorage` of 64 then `HalfStorage` of 128 gives `h` float16 of 128 elements;
//! - when they disagree torch fails on a zip ("record size (256 bytes) does not match
//!   expected size (128 bytes ...)") and rebuilds a legacy tensor over uninitialised memory
//!   (its values differed from run to run), so stcast refuses that tensor, naming it;
//! - the same class again with another count gets the storage of the first reference;
//! - a legacy view's offset and size count elements of its own reference's class, and a
//!   view key seen before gives that first view (its range and dtype) again.

use super::generated::{f32s, gather_all, read_ok};
use super::writer::*;
use crate::torch::*;

fn data() -> Vec<u8> {
    f32s(&(0..64).map(|i| i as f32 + 0.5).collect::<Vec<_>>())
}

fn zip_of(refs: &[(&str, &'static str, u64, u64)]) -> Vec<u8> {
    let items = refs
        .iter()
        .map(|&(name, class, numel, len)| (s(name), tensor(class, "0", numel, 0, &[len], &[1])))
        .collect();
    torch_zip(
        "archive",
        &pickle(&V::Ordered(items, None)),
        &[("0", data())],
        "little",
    )
}

fn legacy_of(refs: &[(&str, &'static str, u64, u64)], count: u64) -> Vec<u8> {
    let items = refs
        .iter()
        .map(|&(name, class, numel, len)| {
            (
                s(name),
                legacy_tensor(class, "0", numel, None, 0, &[len], &[1]),
            )
        })
        .collect();
    legacy(
        &pickle(&V::Ordered(items, None)),
        &[("0", count, data())],
        true,
    )
}

/// (name, torch dtype, bytes gathered) of each selected tensor.
fn loaded(bytes: &[u8]) -> Vec<(String, &'static str, Vec<u8>)> {
    let ckpt = read_ok(bytes);
    let sel = ckpt
        .select(None)
        .unwrap_or_else(|e| panic!("select failed: {e}"));
    sel.tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.desc.torch_dtype,
                gather_all(bytes, &t.desc),
            )
        })
        .collect()
}

fn refused(bytes: &[u8]) -> String {
    read_ok(bytes)
        .select(None)
        .expect_err("select should fail")
        .to_string()
}

#[test]
fn each_reference_has_its_own_dtype() {
    let refs = [("xi", "IntStorage", 64, 64), ("x", "FloatStorage", 64, 64)];
    for bytes in [zip_of(&refs), legacy_of(&refs, 64)] {
        let got = loaded(&bytes);
        assert_eq!(got[0].0, "xi");
        assert_eq!(got[0].1, "int32");
        assert_eq!(got[1].0, "x");
        assert_eq!(got[1].1, "float32");
        assert_eq!(got[0].2, data());
        assert_eq!(got[1].2, data());
    }
    // The other order, and a class of another element size over the same bytes.
    let refs = [
        ("x", "FloatStorage", 64, 64),
        ("h", "HalfStorage", 128, 128),
        ("l", "LongStorage", 32, 32),
    ];
    for bytes in [zip_of(&refs), legacy_of(&refs, 64)] {
        let got = loaded(&bytes);
        let dtypes: Vec<_> = got.iter().map(|g| g.1).collect();
        assert_eq!(dtypes, ["float32", "float16", "int64"]);
        for g in &got {
            assert_eq!(g.2, data(), "{}", g.0);
        }
    }
    let refs = [
        ("h", "HalfStorage", 128, 128),
        ("x", "FloatStorage", 64, 64),
    ];
    let got = loaded(&legacy_of(&refs, 128));
    assert_eq!((got[0].1, got[1].1), ("float16", "float32"));
}

#[test]
fn references_of_another_size_are_refused_by_name() {
    let refs = [("x", "FloatStorage", 64, 64), ("h", "HalfStorage", 64, 64)];
    assert_eq!(
        refused(&zip_of(&refs)),
        "tensor `h`: its reference to storage `0` says float16 of 128 bytes, but the \
         storage's first reference says float32 of 256 bytes; torch.load refuses such a file \
         (the record's size must match)"
    );
    assert_eq!(
        refused(&legacy_of(&refs, 64)),
        "tensor `h`: its reference to storage `0` says float16 of 128 bytes, but the \
         storage's first reference says float32 of 256 bytes; torch.load rebuilds such a \
         tensor over uninitialised memory"
    );
    // Unselected, it is no obstacle: the other tensor reads as before.
    let zip = zip_of(&refs);
    let ckpt = read_ok(&zip);
    assert!(matches!(ckpt.tensors[0], Ok(ref t) if t.torch_dtype == "float32"));
    assert!(matches!(
        ckpt.tensors[1],
        Err(TensorProblem::StorageConflict { .. })
    ));
}

#[test]
fn the_same_class_again_gets_the_first_storage() {
    // torch returns the cached storage: the first reference's 64 floats.
    let refs = [("x", "FloatStorage", 64, 64), ("y", "FloatStorage", 16, 64)];
    let got = loaded(&zip_of(&refs));
    assert_eq!(got[1].2, data());
}

#[test]
fn big_endian_zip_with_another_element_size_is_refused() {
    let items = vec![
        (s("x"), tensor("FloatStorage", "0", 64, 0, &[64], &[1])),
        (s("xi"), tensor("IntStorage", "0", 64, 0, &[64], &[1])),
        (s("h"), tensor("HalfStorage", "0", 128, 0, &[128], &[1])),
    ];
    let bytes = torch_zip(
        "archive",
        &pickle(&V::Ordered(items, None)),
        &[("0", data())],
        "big",
    );
    let ckpt = read_ok(&bytes);
    // Same element size: both swap alike.
    assert!(matches!(ckpt.tensors[1], Ok(ref t) if t.torch_dtype == "int32"));
    let err = ckpt.tensors[2].clone().unwrap_err().to_string();
    assert!(err.contains("big-endian"), "{err}");
}

#[test]
fn legacy_views_count_their_own_elements() {
    let v = V::Ordered(
        vec![
            (
                s("x"),
                legacy_tensor("FloatStorage", "0", 64, None, 0, &[64], &[1]),
            ),
            (
                s("v"),
                legacy_tensor("FloatStorage", "0", 64, Some(("v", 8, 16)), 0, &[16], &[1]),
            ),
            (
                s("vh"),
                legacy_tensor("HalfStorage", "0", 128, Some(("vh", 8, 16)), 0, &[16], &[1]),
            ),
            // A view key seen before: the first view, as float32, whatever this one says.
            (
                s("again"),
                legacy_tensor("HalfStorage", "0", 128, Some(("v", 0, 4)), 0, &[16], &[1]),
            ),
        ],
        None,
    );
    let bytes = legacy(&pickle(&v), &[("0", 64, data())], true);
    let got = loaded(&bytes);
    let d = data();
    assert_eq!((got[1].1, &got[1].2[..]), ("float32", &d[32..96]));
    assert_eq!((got[2].1, &got[2].2[..]), ("float16", &d[16..48]));
    assert_eq!((got[3].1, &got[3].2[..]), ("float32", &d[32..96]));
}
