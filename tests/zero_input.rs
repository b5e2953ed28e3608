//! DeepSpeed ZeRO folders as engine sources (`Source::open_any`), without Python: the real
//! DeepSpeed 0.19.8 fixtures read back (whole, and in windows of any size) as zero_to_fp32
//! rebuilds them, and mutated ones (bytes flipped or cut in the model and optimizer states)
//! never panic the reader or the gather: each is read, or refused with a one-line error.
//! From a fixed, printed seed (`STCAST_PROPTEST_SEED` replays another).

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use stcast::input::InputOptions;
use stcast::Source;

#[path = "common/mutate.rs"]
mod mutate;

const REAL: [&str; 2] = ["stage2-3ranks", "stage3-3ranks"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/zero")
        .join(name)
}

/// A copy of the fixture's checkpoint (`latest`, `global_step1/`) in a fresh folder.
fn copy(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stcast-zero-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("global_step1")).unwrap();
    std::fs::copy(fixture(name).join("latest"), dir.join("latest")).unwrap();
    for e in std::fs::read_dir(fixture(name).join("global_step1")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join("global_step1").join(p.file_name().unwrap())).unwrap();
    }
    dir
}

#[test]
fn real_checkpoints_read_back_as_zero_to_fp32_rebuilds_them() {
    for name in REAL {
        let dir = copy(name, name);
        for src_dir in [dir.clone(), dir.join("global_step1")] {
            let src = Source::open_any(&src_dir, &InputOptions::default()).unwrap();
            let want_bytes =
                std::fs::read(fixture(name).join("expected-fp32.safetensors")).unwrap();
            let want = safetensors::SafeTensors::deserialize(&want_bytes).unwrap();
            assert_eq!(src.header.tensors.len(), want.len(), "{name}");
            for step in [1, 4, 1 << 20] {
                for (n, bytes) in mutate::read_all(&src, step).unwrap() {
                    let w = want.tensor(&n).unwrap();
                    assert_eq!(bytes, w.data(), "{name} `{n}`");
                    let t = src.header.tensors.iter().find(|t| t.name == n).unwrap();
                    assert_eq!(t.shape, w.shape(), "{name} `{n}`");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn mutated_checkpoints_never_panic() {
    let mut runner = mutate::runner("zero mutations", 0x2e50_5eed, 300);
    let case = (
        0..REAL.len(),
        proptest::collection::vec(mutate::mutation(6), 1..4),
    );
    let (read, refused) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    runner
        .run(&case, |(which, mutations)| {
            let dir = copy(REAL[which], "mutated");
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("global_step1"))
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            files.sort();
            mutate::apply(&files, &mutations);
            match Source::open_any(&dir, &InputOptions::default())
                .and_then(|s| mutate::read_all(&s, 5))
            {
                Ok(_) => read.set(read.get() + 1),
                Err(e) => {
                    let text = e.to_string();
                    prop_assert!(!text.contains('\n'), "{text}");
                    refused.set(refused.get() + 1);
                }
            }
            Ok(())
        })
        .unwrap();
    let _ = std::fs::remove_dir_all(
        std::env::temp_dir().join(format!("stcast-zero-{}-mutated", std::process::id())),
    );
    println!(
        "zero mutations: {} read, {} refused",
        read.get(),
        refused.get()
    );
    assert!(refused.get() > 0);
}
