//! PyTorch checkpoints as engine sources (`Source::open_any`), without Python: every
//! real-torch fixture's tensors read back through `Source::read` (contiguous ranges and
//! gathered views, in windows) are the bytes torch saw, and the refused fixtures give the
//! reader's message.

use std::path::{Path, PathBuf};

use stcast::input::InputOptions;
use stcast::torch::Format;
use stcast::{ErrorKind, Source};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn options(doc: &serde_json::Value) -> InputOptions {
    InputOptions {
        key: doc["key"].as_str().map(str::to_string),
        strip_prefix: doc["strip"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
        ..InputOptions::default()
    }
}

#[test]
fn every_fixture_reads_back_as_torch_saw_it() {
    let mut seen = 0;
    for entry in std::fs::read_dir(fixtures()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let file = path.with_extension("");
        let opened = Source::open_any(&file, &options(&doc));
        if let Some(error) = doc["error"].as_str() {
            let e = opened.err().expect("refused");
            let text = e.to_string();
            let reader = error.split("; select one").next().unwrap();
            assert!(text.contains(reader), "{text}");
            assert!(matches!(
                e.kind(),
                ErrorKind::Refused | ErrorKind::InvalidInput
            ));
            continue;
        }
        let src = opened.unwrap();
        assert_ne!(src.format(), Format::Safetensors);
        assert!(src.changes_format());
        let want: Vec<(&str, &str)> = doc["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| (t["name"].as_str().unwrap(), t["hex"].as_str().unwrap()))
            .collect();
        assert_eq!(src.header.tensors.len(), want.len(), "{file:?}");
        let mut scratch = Vec::new();
        for t in &src.header.tensors {
            let (_, hexed) = want.iter().find(|(n, _)| *n == t.name).unwrap();
            // Whole, then one element at a time (a window of any size).
            let whole = src.read(t, 0, t.len(), &mut scratch).unwrap().to_vec();
            assert_eq!(hex(&whole), *hexed, "{file:?} `{}`", t.name);
            let es = (t.dtype.bitsize() / 8).max(1) as u64;
            let mut parts = Vec::new();
            for at in (0..t.len()).step_by(es as usize) {
                parts.extend_from_slice(src.read(t, at, es, &mut scratch).unwrap());
            }
            assert_eq!(parts, whole, "{file:?} `{}`", t.name);
        }
        assert_eq!(
            src.header.metadata,
            Some(vec![("format".to_string(), "pt".to_string())])
        );
        seen += 1;
    }
    assert!(seen >= 8, "{seen} fixtures");
}

#[test]
fn options_for_checkpoints_are_refused_for_safetensors() {
    let dir = std::env::temp_dir().join(format!("stcast-torch-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let h = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h);
    bytes.extend_from_slice(&1f32.to_le_bytes());
    let p = dir.join("a.safetensors");
    std::fs::write(&p, bytes).unwrap();
    let opts = InputOptions {
        key: Some("model".into()),
        ..InputOptions::default()
    };
    let e = Source::open_any(&p, &opts).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Usage);
    assert!(e
        .template()
        .contains("{key} applies to PyTorch checkpoints"));
    assert!(Source::open_any(&p, &InputOptions::default()).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}
