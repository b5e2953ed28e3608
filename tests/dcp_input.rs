//! DCP folders as engine sources (`Source::open_any`), without Python: the real torch
//! fixtures read back (whole, and in windows of any size) as torch consolidates them, and
//! mutated ones (bytes flipped or cut in `.metadata` and in the rank files) never panic the
//! reader or the gather: each is read, or refused with an error. From a fixed, printed seed
//! (`STCAST_PROPTEST_SEED` replays another).

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use stcast::input::InputOptions;
use stcast::Source;

#[path = "common/mutate.rs"]
mod mutate;

const REAL: [&str; 3] = ["fsdp2-1d-3ranks", "hsdp-2x2", "fsdp-tp-2x2"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/dcp")
        .join(name)
}

fn model() -> InputOptions {
    InputOptions {
        key: Some("model".into()),
        ..InputOptions::default()
    }
}

/// A copy of the fixture's checkpoint files (`.metadata`, `*.distcp`) in a fresh folder.
fn copy(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stcast-dcp-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        let n = p.file_name().unwrap().to_str().unwrap().to_string();
        if n == ".metadata" || n.ends_with(".distcp") {
            std::fs::copy(&p, dir.join(&n)).unwrap();
        }
    }
    dir
}

#[test]
fn real_checkpoints_read_back_as_torch_consolidates_them() {
    for name in REAL {
        let dir = copy(name, name);
        let src = Source::open_any(&dir, &model()).unwrap();
        let want_bytes =
            std::fs::read(fixture(name).join("expected-model-fp32.safetensors")).unwrap();
        let want = safetensors::SafeTensors::deserialize(&want_bytes).unwrap();
        assert_eq!(src.header.tensors.len(), want.len(), "{name}");
        for step in [1, 3, 1 << 20] {
            for (n, bytes) in mutate::read_all(&src, step).unwrap() {
                let w = want.tensor(&n).unwrap();
                assert_eq!(bytes, w.data(), "{name} `{n}`");
                let t = src.header.tensors.iter().find(|t| t.name == n).unwrap();
                assert_eq!(t.shape, w.shape(), "{name} `{n}`");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn mutated_checkpoints_never_panic() {
    let mut runner = mutate::runner("dcp mutations", 0x0dc9_5eed, 300);
    let case = (
        0..REAL.len(),
        proptest::collection::vec(mutate::mutation(5), 1..4),
    );
    let (read, refused) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    runner
        .run(&case, |(which, mutations)| {
            let dir = copy(REAL[which], "mutated");
            let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            files.sort();
            mutate::apply(&files, &mutations);
            for opts in [model(), InputOptions::default()] {
                match Source::open_any(&dir, &opts).and_then(|s| mutate::read_all(&s, 7)) {
                    Ok(_) => read.set(read.get() + 1),
                    Err(e) => {
                        let text = e.to_string();
                        prop_assert!(!text.contains('\n'), "{text}");
                        refused.set(refused.get() + 1);
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    println!(
        "dcp mutations: {} read, {} refused",
        read.get(),
        refused.get()
    );
    assert!(refused.get() > 0);
}
