//! Files written by real torch (`tests/fixtures/torch/make_fixtures.py`), checked against the
//! JSON written beside each from torch's own reading of it. No torch needed here.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::torch::*;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch")
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// Check one fixture; returns the checkpoint when it is expected to load.
fn check(json: &Path) -> Option<(&'static [u8], Checkpoint<'static>, Selection)> {
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let file = dir().join(doc["file"].as_str().unwrap());
    // The checkpoint borrows the file's bytes (as a mapping): kept for the test's life.
    let bytes: &'static [u8] = Box::leak(std::fs::read(&file).unwrap().into_boxed_slice());
    let name = file.display();
    let want_format = match doc["format"].as_str().unwrap() {
        "zip" => Format::TorchZip,
        "torchscript" => Format::TorchScript,
        _ => Format::TorchLegacy,
    };
    assert_eq!(sniff(bytes), want_format, "{name}");
    let key = doc["key"].as_str();
    let strip = strs(&doc["strip"]);
    let result = read(bytes, &Limits::default()).and_then(|ck| {
        let sel = ck.select(key)?;
        Ok((ck, sel))
    });
    if let Some(err) = doc["error"].as_str() {
        let got = result.unwrap_err().to_string();
        assert!(got.contains(err), "{name}: {got}");
        return None;
    }
    let (ck, sel) = result.unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(ck.format, want_format, "{name}");
    assert_eq!(ck.prefix.as_deref(), doc["prefix"].as_str(), "{name}");
    if doc.get("placeholders").is_some() {
        assert_eq!(ck.placeholders, strs(&doc["placeholders"]), "{name}");
    }
    if let Some(dicts) = doc["tensor_dicts"].as_array() {
        let got: Vec<(String, u64, u64)> = ck
            .tensor_dicts()
            .unwrap()
            .into_iter()
            .map(|d| (d.path, d.direct as u64, d.total as u64))
            .collect();
        let want: Vec<(String, u64, u64)> = dicts
            .iter()
            .map(|d| {
                (
                    d[0].as_str().unwrap().to_string(),
                    d[1].as_u64().unwrap(),
                    d[2].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(got, want, "{name}");
    }
    assert_eq!(sel.key, doc["select"].as_str().unwrap(), "{name}");
    assert_eq!(sel.skipped, strs(&doc["skipped"]), "{name}");
    let want = doc["tensors"].as_array().unwrap();
    assert_eq!(sel.tensors.len(), want.len(), "{name}");
    for (t, w) in sel.tensors.iter().zip(want) {
        let tn = format!("{name}: {}", t.name);
        // The names as every input's are stripped (`input::strip_prefixes`).
        let stripped = crate::naming::strip_prefixes(&t.name, &strip);
        assert_eq!(stripped, w["name"].as_str().unwrap(), "{tn}");
        assert_eq!(
            format!("{:?}", t.desc.dtype),
            w["dtype"].as_str().unwrap(),
            "{tn}"
        );
        let shape: Vec<u64> = w["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(t.desc.shape, shape, "{tn}");
        assert_eq!(
            t.desc.is_contiguous(),
            w["contiguous"].as_bool().unwrap(),
            "{tn}"
        );
        let expected = unhex(w["hex"].as_str().unwrap());
        let mut out = vec![0u8; t.desc.nbytes() as usize];
        gather(bytes, &t.desc, 0, &mut out).unwrap();
        assert_eq!(out, expected, "{tn}");
        // Window by window, three elements at a time.
        let es = t.desc.elem_size() as usize;
        for (i, chunk) in expected.chunks(3 * es).enumerate() {
            let mut w = vec![0u8; chunk.len()];
            gather(bytes, &t.desc, (i * 3) as u64, &mut w).unwrap();
            assert_eq!(w, chunk, "{tn} window {i}");
        }
        // Contiguous little-endian tensors can be copied from the file as they are.
        if let (Some(r), false) = (t.desc.contiguous_range(), t.desc.big_endian) {
            assert_eq!(
                bytes[r.start as usize..r.end as usize],
                expected[..],
                "{tn}"
            );
        }
    }
    Some((bytes, ck, sel))
}

#[test]
fn every_fixture_matches_torch() {
    let mut jsons: Vec<PathBuf> = std::fs::read_dir(dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    jsons.sort();
    assert!(jsons.len() >= 12, "fixtures missing: {jsons:?}");
    for json in &jsons {
        check(json);
    }
}

fn fixture(name: &str) -> (&'static [u8], Checkpoint<'static>, Selection) {
    check(&dir().join(format!("{name}.json"))).unwrap()
}

fn tensor<'a>(sel: &'a Selection, name: &str) -> &'a TensorDesc {
    &sel.tensors.iter().find(|t| t.name == name).unwrap().desc
}

#[test]
fn views_share_storages_and_offsets() {
    for file in ["views.pt", "legacy.pth", "big_endian.pt"] {
        let (_, ck, sel) = fixture(file);
        let (e, h) = (tensor(&sel, "embed.weight"), tensor(&sel, "lm_head.weight"));
        assert_eq!(e.storage, h.storage, "{file}: tied");
        assert_eq!(tensor(&sel, "sliced").storage_offset, 8, "{file}");
        assert_eq!(tensor(&sel, "row").storage_offset, 12, "{file}");
        assert_eq!(tensor(&sel, "broadcast").stride, [0, 1], "{file}");
        assert_eq!(
            tensor(&sel, "transposed").storage,
            tensor(&sel, "sliced").storage,
            "{file}"
        );
        assert_eq!(ck.format == Format::TorchLegacy, file == "legacy.pth");
        assert_eq!(tensor(&sel, "row").big_endian, file == "big_endian.pt");
    }
    // torch writes legacy storages unaligned (in the committed file, float storages at
    // offsets that are not multiples of 4), and the gather above did not mind.
    let (_, ck, _) = fixture("legacy.pth");
    assert!(ck.storages.iter().any(|s| s.offset % 4 != 0));
    // Zip storages are aligned to 64 bytes.
    let (_, ck, _) = fixture("views.pt");
    assert!(ck.storages.iter().all(|s| s.offset % 64 == 0));
    assert_eq!(ck.prefix.as_deref(), Some("views"));
    let (_, ck, _) = fixture("dtypes.pt");
    assert_eq!(ck.prefix.as_deref(), Some("archive"));
}

#[test]
fn nested_fixture_selects_each_dict() {
    let (bytes, ck, _) = fixture("nested.pt");
    let ema = ck.select(Some("ema")).unwrap();
    assert_eq!(ema.tensors.len(), 2);
    let opt = ck.select(Some("optimizer.state.0")).unwrap();
    let names: Vec<_> = opt.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["step", "exp_avg", "exp_avg_sq"]);
    let all = ck.select(Some("optimizer")).unwrap();
    assert_eq!(all.tensors.len(), 6);
    assert!(all.skipped.iter().any(|s| s == "param_groups"));
    for t in &all.tensors {
        let mut out = vec![0u8; t.desc.nbytes() as usize];
        gather(bytes, &t.desc, 0, &mut out).unwrap();
    }
}
